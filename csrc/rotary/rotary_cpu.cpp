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
//   triton_kernels/_phase.py via cpu/phase.h's position_sincos) into the thread's scratch, then
//   every head of q and k (of every batch row, for shared positions) is rotated position by
//   position, read once and written once: the [B, N, F] table never exists in memory.
// - Backward: the same runs recompute cos / sin, write dq / dk, and sum the phase gradient
//   over the heads (and batch rows) in the scratch; dx = dphase wr per position, dwr^T =
//   x^T dphase accumulated per block of items. Blocks are fixed by the item count alone (at
//   most 16), a block's items add in item order, blocks are summed in block order after a
//   barrier (cpu/parallel.h: run_blocks): the same bits for any thread count, and on every
//   instruction set (cpu/per_isa.h).
// - One OpenMP region per call, items (or blocks) handed out by a shared counter
//   (cpu/parallel.h); float32 arithmetic for float32 / bfloat16 / float16 storage.
#include "rotary/rotary_cpu.h"

#include <algorithm>
#include <vector>

#include "cpu/runtime.h"

namespace posenc_fast {
namespace rotary {
namespace {

using namespace ::posenc_fast::cpu;

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
  int64_t runs;       // items (runs of kRun positions) per batch row of x
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

#define PF_ISA_KERNELS "rotary/rotary_kernels.h"
#include "cpu/per_isa.h"
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

// make_call for the fused application: q [B, Hq, N, D] and k [B, Hk, N, D] (heads-first).
RotCall apply_call(const Apply& in, at::Tensor& store) {
  RotCall c = make_call(in.x3, in.wr, in.q.size(0), store);
  c.D = in.q.size(3);
  c.Hq = in.q.size(1);
  c.Hk = in.k.size(1);
  c.dt = dt_of(in.q.scalar_type());
  c.q = view4(in.q), c.k = view4(in.k);
  return c;
}

// Runs fn over the call's Bx * runs items on one parallel region. With dwr defined, the
// items form at most 16 blocks (fixed by the item count) with a dwr^T partial each, summed
// in block order into dwr at the end (cpu/parallel.h: run_blocks).
void run_items(const RotCall& c, ItemFn fn, double item_cost, at::Tensor* dwr) {
  const int64_t items = c.Bx * c.runs;
  const int64_t per_scratch = round_up(kRun * c.M) + 5 * kRun * c.ldk;
  const int64_t block_items = dwr ? (items + std::min<int64_t>(16, items) - 1) / std::min<int64_t>(16, items) : 1;
  const int64_t nblocks = (items + block_items - 1) / block_items;
  const int threads = team_threads(nblocks, item_cost * static_cast<double>(block_items));
  const at::Tensor scratch = zeroed_floats(threads * per_scratch);
  const RotKernels& kern = rot_kernels();
  std::vector<PartialSum> sums;
  if (dwr) sums.push_back({0, c.M, c.F2, c.ldk, dwr->data_ptr(), dt_of(dwr->scalar_type()), 1, c.M});
  run_blocks(threads, nblocks, c.M * c.ldk, sums, kern.sum_partials, [&](int rank, int64_t b, float* part) {
    float* base = scratch.data_ptr<float>() + rank * per_scratch;
    const int64_t rows = kRun * c.ldk;
    float* xs = base;
    base += round_up(kRun * c.M);
    const RotScratch s{xs, base, base + rows, base + 2 * rows, base + 3 * rows, base + 4 * rows};
    const int64_t i1 = std::min(items, (b + 1) * block_items);
    for (int64_t i = b * block_items; i < i1; ++i) fn(c, i, s, part, i == b * block_items);
  });
}

// Multiply-adds per position (a rough cost, to decide how many threads are worth a fork).
double position_cost(const RotCall& c, int64_t rows) {
  return static_cast<double>(c.F2) * (30 + 2 * c.M) + static_cast<double>(rows) * 4 * c.D;
}

}  // namespace

void apply_forward_cpu(const Apply& in, at::Tensor& oq, at::Tensor& ok) {
  if (in.q.size(0) * in.q.size(2) == 0) return;
  at::Tensor store;
  RotCall c = apply_call(in, store);
  c.oq = view4(oq), c.ok = view4(ok);
  const int64_t rows = (c.Bx == 1 ? c.B : 1) * (c.Hq + c.Hk);
  run_items(c, rot_kernels().apply_forward, kRun * position_cost(c, rows), nullptr);
}

void apply_backward_cpu(const at::Tensor& gq, const at::Tensor& gk, const Apply& in, ApplyGrads& g) {
  if (in.q.size(0) * in.q.size(2) == 0) {
    if (g.dx.defined()) g.dx.zero_();
    if (g.dwr.defined()) g.dwr.zero_();
    return;
  }
  at::Tensor store;
  RotCall c = apply_call(in, store);
  c.gq = view4(gq), c.gk = view4(gk), c.dq = view4(g.dq), c.dk = view4(g.dk);
  c.need_q = g.dq.defined(), c.need_k = g.dk.defined(), c.need_x = g.dx.defined(), c.need_wr = g.dwr.defined();
  if (c.need_x) {
    c.dx = g.dx.data_ptr();
    c.dxdt = dt_of(g.dx.scalar_type());
  }
  const int64_t rows = (c.Bx == 1 ? c.B : 1) * (c.Hq + c.Hk) * 2;
  run_items(c, rot_kernels().apply_backward, kRun * position_cost(c, rows), c.need_wr ? &g.dwr : nullptr);
}

void table_forward_cpu(const at::Tensor& rows, const at::Tensor& wr, at::Tensor& out) {
  if (rows.size(0) == 0) return;
  at::Tensor store;
  const at::Tensor x3 = rows.unsqueeze(0);
  RotCall c = make_call(x3, wr, 1, store);
  c.D = 2 * c.F2;
  c.dt = dt_of(out.scalar_type());
  c.tab = T4{out.data_ptr(), 0, out.stride(0), out.stride(1), out.stride(2)};
  run_items(c, rot_kernels().table_forward, kRun * position_cost(c, 1), nullptr);
}

void table_backward_cpu(const at::Tensor& grad, const at::Tensor& rows, const at::Tensor& wr, at::Tensor& dx,
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

}  // namespace rotary
}  // namespace posenc_fast
