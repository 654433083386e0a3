// Learnable Fourier rotary embeddings (LightGlue's layout) on the CPU: the cos / sin table
// and its fused application to q and k, forward and backward (formulas:
// posenc_fast/reference/rotary.py; the Triton kernels: triton_kernels/rotary.py).
//
// Shapes: x [Bx, N, M] positions (Bx = B, or 1 when shared by the batch; the table's rows
// are [1, R, M]), wr [F2, M]; q [B, Hq, N, D], k [B, Hk, N, D] heads-first views with any
// strides (LightGlue's q is a slice of a fused qkv tensor, channel stride 3); outputs and
// dq / dk [B, H, N, D] views with unit channel stride; the table [2, R, F], F = 2 F2 <= D.
//
// Design
// - Work items are runs of kRun positions of one batch row of x (rotary_kernels.h): the
//   run's cos / sin are computed once (float32, the error-free reduction of
//   triton_kernels/_phase.py via simd.h's position_sincos) into the thread's scratch, then
//   every head of q and k (of every batch row, for shared positions) is rotated position by
//   position, read once and written once: the [B, N, F] table never exists in memory.
// - Backward: the same runs recompute cos / sin, write dq / dk, and sum the phase gradient
//   over the heads (and batch rows) in the scratch; dx = dphase wr per position, dwr^T =
//   x^T dphase accumulated per block of items. Blocks are fixed by the item count alone (at
//   most 16), a block's items add in item order, blocks are summed in block order after a
//   barrier: the same bits for any thread count, and on every instruction set (per_isa.h).
// - One OpenMP region per call, items (or blocks) handed out by a shared counter
//   (fourier_common.h); float32 arithmetic for float32 / bfloat16 / float16 storage.
#include <vector>

#include "fourier_common.h"
#include "fourier_cpu.h"

namespace posenc_fast {
namespace fourier {
namespace {

// Positions per work item: 16 KB of one head's float32 q rows at head_dim 64 ("bhnd"),
// long enough for the hardware prefetcher; the scratch is then ~40 KB at F = 64.
constexpr int64_t kRun = 64;

// A [B, H, N, D] view: element (b, h, n, c) at p + b sb + h sh + n sn + c sd (elements).
// The table [2, R, F] is one too: sh the plane stride, sn the row stride.
struct T4 {
  void* p;
  int64_t sb, sh, sn, sd;
};

struct RotCall {
  int64_t B, Bx, N, M, F2, ldk, D, Hq, Hk;
  int64_t run, runs;  // positions per item; items per batch row of x
  const void* x;      // positions: (b, n, m) at x + b sxb + n sxn + m sxm
  DT xdt;
  int64_t sxb, sxn, sxm;
  const float *thi, *tlo, *wrt;  // [M, ldk]: wr^T / (2 pi) as float32 pairs, and wr^T
  DT dt;                         // q, k, their gradients, the outputs / the table
  T4 q, k, oq, ok, gq, gk, dq, dk;
  T4 tab;  // the table or its gradient
  bool need_q, need_k, need_x, need_wr;
  void* dx;  // [Bx, N, M] contiguous
  DT dxdt;
};

// One thread's buffers: xs [kRun, M], cs / sn / cross / dot / dphi [kRun, ldk].
struct RotScratch {
  float *xs, *cs, *sn, *cross, *dot, *dphi;
};

using ItemFn = void (*)(const RotCall& c, int64_t item, const RotScratch& s, float* part, bool first);
struct RotKernels {
  ItemFn apply_forward, apply_backward, table_forward, table_backward;
  PrepareTurnsFn prepare_turns;
  SumPartialsFn sum_partials;
};

}  // namespace

#define PF_ISA_KERNELS "rotary_kernels.h"
#include "per_isa.h"
#undef PF_ISA_KERNELS

namespace {

const RotKernels& rot_kernels() { return PF_ISA_TABLE(kRotKernels); }

T4 view4(const at::Tensor& t) {
  if (!t.defined()) return T4{nullptr, 0, 0, 0, 0};
  return T4{t.data_ptr(), t.stride(0), t.stride(1), t.stride(2), t.stride(3)};
}

// The call's positions and frequency tables (storage owned by `store`).
RotCall make_call(const at::Tensor& x3, const at::Tensor& wr, int64_t B, at::Tensor& store) {
  RotCall c{};
  c.B = B;
  c.Bx = x3.size(0);
  c.N = x3.size(1);
  c.M = x3.size(2);
  c.F2 = wr.size(0);
  c.ldk = round_up(c.F2);
  c.run = kRun;
  c.runs = (c.N + kRun - 1) / kRun;
  c.x = x3.data_ptr();
  c.xdt = dt_of(x3.scalar_type());
  c.sxb = x3.stride(0);
  c.sxn = x3.stride(1);
  c.sxm = x3.stride(2);
  // thi, tlo, wr^T [M, ldk] and wr itself [F2, M] as float32, a few KB, on this thread
  store = zeroed_floats(3 * c.M * c.ldk + c.F2 * c.M);
  float* thi = store.data_ptr<float>();
  float *tlo = thi + c.M * c.ldk, *wrt = tlo + c.M * c.ldk, *wp = wrt + c.M * c.ldk;
  copy_f32(wr, wp, c.M, false);
  copy_f32(wr, wrt, c.ldk, true);
  rot_kernels().prepare_turns(wp, c.F2, c.M, c.M, c.ldk, thi, tlo);
  c.thi = thi;
  c.tlo = tlo;
  c.wrt = wrt;
  return c;
}

// make_call for q [B, Hq, N, D] and k [B, Hk, N, D] (heads-first views).
RotCall apply_call(const at::Tensor& x3, const at::Tensor& wr, const at::Tensor& q, const at::Tensor& k,
                   at::Tensor& store) {
  RotCall c = make_call(x3, wr, q.size(0), store);
  c.D = q.size(3);
  c.Hq = q.size(1);
  c.Hk = k.size(1);
  c.dt = dt_of(q.scalar_type());
  c.q = view4(q), c.k = view4(k);
  return c;
}

// Runs fn over the call's Bx * runs items on one parallel region. With dwr defined, the
// items form at most 16 blocks (fixed by the item count) with a dwr^T partial each, summed
// in block order into dwr at the end.
void run_items(const RotCall& c, ItemFn fn, double item_cost, at::Tensor* dwr) {
  const int64_t items = c.Bx * c.runs;
  const int64_t per = c.M * c.ldk;
  const int64_t per_scratch = round_up(kRun * c.M) + 5 * kRun * c.ldk;
  const bool blocks = dwr != nullptr;
  const int64_t nblocks0 = std::min<int64_t>(16, items);
  const int64_t block_items = blocks ? (items + nblocks0 - 1) / nblocks0 : 1;
  const int64_t nblocks = (items + block_items - 1) / block_items;
  const int threads = team_threads(nblocks, item_cost * static_cast<double>(block_items));
  const at::Tensor scratch = zeroed_floats(threads * per_scratch);
  const at::Tensor parts = at::empty({blocks ? nblocks * per : 1}, at::kFloat);
  float* pbase = parts.data_ptr<float>();
  const RotKernels& kern = rot_kernels();
  WorkQueue queue(nblocks);
  parallel_region(threads, [&](int rank, int size) {
    float* base = scratch.data_ptr<float>() + rank * per_scratch;
    const int64_t rows = kRun * c.ldk;
    float* xs = base;
    base += round_up(kRun * c.M);
    const RotScratch s{xs, base, base + rows, base + 2 * rows, base + 3 * rows, base + 4 * rows};
    int64_t b;
    while (queue.take(b)) {
      const int64_t i1 = std::min(items, (b + 1) * block_items);
      for (int64_t i = b * block_items; i < i1; ++i) fn(c, i, s, pbase + b * per, i == b * block_items);
    }
    if (!blocks) return;
    region_barrier();  // every block's partial is complete
    const int64_t m0 = c.M * rank / size, m1 = c.M * (rank + 1) / size;
    kern.sum_partials(pbase, nblocks, per, c.M, c.F2, c.ldk, m0, m1, dwr->data_ptr(), dt_of(dwr->scalar_type()), 1,
                      c.M);
  });
}

// Multiply-adds per position (a rough cost, to decide how many threads are worth a fork).
double position_cost(const RotCall& c, int64_t rows) {
  return static_cast<double>(c.F2) * (30 + 2 * c.M) + static_cast<double>(rows) * 4 * c.D;
}

}  // namespace

namespace cpu {

void rotary_apply_forward(const at::Tensor& x3, const at::Tensor& wr, const at::Tensor& q, const at::Tensor& k,
                          at::Tensor& oq, at::Tensor& ok) {
  if (q.size(0) * q.size(2) == 0) return;
  at::Tensor store;
  RotCall c = apply_call(x3, wr, q, k, store);
  c.oq = view4(oq), c.ok = view4(ok);
  const int64_t B = c.B;
  const int64_t rows = (c.Bx == 1 ? B : 1) * (c.Hq + c.Hk);
  run_items(c, rot_kernels().apply_forward, kRun * position_cost(c, rows), nullptr);
}

void rotary_apply_backward(const at::Tensor& gq, const at::Tensor& gk, const at::Tensor& q, const at::Tensor& k,
                           const at::Tensor& x3, const at::Tensor& wr, at::Tensor& dq, at::Tensor& dk, at::Tensor& dx,
                           at::Tensor& dwr) {
  if (q.size(0) * q.size(2) == 0) {
    if (dx.defined()) dx.zero_();
    if (dwr.defined()) dwr.zero_();
    return;
  }
  at::Tensor store;
  RotCall c = apply_call(x3, wr, q, k, store);
  c.gq = view4(gq), c.gk = view4(gk), c.dq = view4(dq), c.dk = view4(dk);
  const int64_t B = c.B;
  c.need_q = dq.defined(), c.need_k = dk.defined(), c.need_x = dx.defined(), c.need_wr = dwr.defined();
  if (c.need_x) {
    c.dx = dx.data_ptr();
    c.dxdt = dt_of(dx.scalar_type());
  }
  const int64_t rows = (c.Bx == 1 ? B : 1) * (c.Hq + c.Hk) * 2;
  run_items(c, rot_kernels().apply_backward, kRun * position_cost(c, rows), c.need_wr ? &dwr : nullptr);
}

void rotary_table_forward(const at::Tensor& rows, const at::Tensor& wr, at::Tensor& out) {
  if (rows.size(0) == 0) return;
  at::Tensor store;
  const at::Tensor x3 = rows.unsqueeze(0);
  RotCall c = make_call(x3, wr, 1, store);
  c.D = 2 * c.F2;
  c.dt = dt_of(out.scalar_type());
  c.tab = T4{out.data_ptr(), 0, out.stride(0), out.stride(1), out.stride(2)};
  run_items(c, rot_kernels().table_forward, kRun * position_cost(c, 1), nullptr);
}

void rotary_table_backward(const at::Tensor& grad, const at::Tensor& rows, const at::Tensor& wr, at::Tensor& dx,
                           at::Tensor& dwr) {
  if (rows.size(0) == 0) {
    if (dwr.defined()) dwr.zero_();
    return;
  }
  at::Tensor store;
  const at::Tensor x3 = rows.unsqueeze(0);
  RotCall c = make_call(x3, wr, 1, store);
  c.D = 2 * c.F2;
  c.dt = dt_of(grad.scalar_type());
  c.tab = T4{const_cast<void*>(grad.data_ptr()), 0, grad.stride(0), grad.stride(1), grad.stride(2)};
  c.need_x = dx.defined(), c.need_wr = dwr.defined();
  if (c.need_x) {
    c.dx = dx.data_ptr();
    c.dxdt = dt_of(dx.scalar_type());
  }
  run_items(c, rot_kernels().table_backward, kRun * position_cost(c, 2), c.need_wr ? &dwr : nullptr);
}

}  // namespace cpu
}  // namespace fourier
}  // namespace posenc_fast
