// Rotary embeddings on grids on the CPU: the cos / sin table and the fused application to
// q and k, forward and backward (the Triton kernels: triton_kernels/rotary.py).
//
// Shapes: rotary_cpu.h (W: its freqs [G, F2, M]; q may be a slice of a fused qkv tensor,
// channel stride 3, as LightGlue's); the table [2, Bx, G, N, F], F = 2 F2 <= D.
//
// Design
// - Work items are runs of kRun positions of one batch row of x (rotary_kernels.h; shared
//   positions: of a chunk of q's batch rows): per group the run's cos / sin are computed
//   once (float32, cpu/phase.h's error-free reduction) into the thread's scratch, then
//   every head of the group in q and k is rotated, read once and written once: no table
//   in memory. A batch row's first item also copies its prefix tokens.
// - Backward: the same runs recompute cos / sin, write dq / dk and sum the phase gradient
//   over heads (and batch rows); dx = sum_g dphase_g W[g] per position, dW[g]^T = x^T
//   dphase_g per block of items (at most 16, fixed by the item count, summed in block
//   order: cpu/parallel.h's run_blocks): the same bits for any thread count and ISA.
// - One OpenMP region per call, items handed out by a shared counter; float32 arithmetic
//   for float32 / bfloat16 / float16 storage. Bytes per token: benchmarks/NOTES.md.
#include "rotary/rotary_cpu.h"

#include <algorithm>
#include <vector>

#include "cpu/runtime.h"

namespace posenc_fast {
namespace rotary {
namespace {

using namespace ::posenc_fast::cpu;

// Positions per work item: runs of one head's q rows ("bhnd") long enough for the hardware
// prefetcher, with a scratch that stays in L1/L2.
constexpr int64_t kRun = 64;

// A [B, H, N, D] view: element (b, h, n, c) at p + b sb + h sh + n sn + c sd (elements).
// A plane of the table [2, Bx, G, N, F] is one too (sh: the group stride).
struct T4 {
  void* p;
  int64_t sb, sh, sn, sd;
};

struct RotCall {
  int64_t B, Bx, N, M, F2, ldk, D, G, hq, hk;  // N: positions per batch row of x (N')
  int64_t runs;                                // runs of kRun positions per batch row of x
  int64_t bsplit;                              // items per run: chunks of q's batch rows (Bx = 1)
  int64_t prefix;                              // tokens before x's (copied)
  bool half;                                   // pairs (k, k + F2), else (2k, 2k + 1)
  const void* x;                               // positions: (b, n, m) at x + b sxb + n sxn + m sxm
  DT xdt;
  int64_t sxb, sxn, sxm;
  const float *thi, *tlo, *wrt;  // [G, M, ldk]: W[g]^T / (2 pi) as float32 pairs, and W[g]^T
  DT dt;                         // q, k, their gradients, the outputs / the table
  T4 q, k, oq, ok, gq, gk, dq, dk;
  T4 tab;             // the table or its gradient: sb batch, sh group, sn row, sd channel
  int64_t tab_plane;  // and the stride from the cos plane to the sin plane
  bool need_q, need_k, need_x, need_w;
  void* dx;  // [Bx, N, M] contiguous
  DT dxdt;
};

// One thread's buffers: xs [kRun, M], cs / sn / cross / dot / dphi [kRun, ldk], dxs [kRun, M].
struct RotScratch {
  float *xs, *cs, *sn, *cross, *dot, *dphi, *dxs;
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

// W [G, F2, M] (any strides; float32, bfloat16 or float16) as float32 [G, F2, M], contiguous.
// Element by element on this thread (frequencies are small; an ATen copy would open a
// parallel region of its own).
void freqs_f32(const at::Tensor& w, float* dst) {
  const int64_t G = w.size(0), F2 = w.size(1), M = w.size(2);
  const int64_t sg = w.stride(0), sk = w.stride(1), sm = w.stride(2);
  const DT dt = dt_of(w.scalar_type());
  for (int64_t g = 0; g < G; ++g)
    for (int64_t k = 0; k < F2; ++k)
      for (int64_t m = 0; m < M; ++m) {
        const int64_t i = g * sg + k * sk + m * sm;
        float v;
        if (dt == DT::F32)
          v = static_cast<const float*>(w.data_ptr())[i];
        else if (dt == DT::BF16)
          v = static_cast<float>(static_cast<const c10::BFloat16*>(w.data_ptr())[i]);
        else
          v = static_cast<float>(static_cast<const c10::Half*>(w.data_ptr())[i]);
        dst[(g * F2 + k) * M + m] = v;
      }
}

// The call's positions x3 [Bx, N, M] and frequency tables of W [G, F2, M] (storage owned by
// `store`).
RotCall make_call(const at::Tensor& x3, const at::Tensor& freqs, bool half, int64_t B, at::Tensor& store) {
  RotCall c{};
  c.B = B;
  c.Bx = x3.size(0);
  c.N = x3.size(1);
  c.M = x3.size(2);
  c.G = freqs.size(0);
  c.F2 = freqs.size(1);
  c.ldk = round_up(c.F2);
  c.runs = c.N ? (c.N + kRun - 1) / kRun : 1;  // N = 0 (all tokens prefix): one empty run
  c.bsplit = 1;
  c.half = half;
  c.x = x3.data_ptr();
  c.xdt = dt_of(x3.scalar_type());
  c.sxb = x3.stride(0);
  c.sxn = x3.stride(1);
  c.sxm = x3.stride(2);
  // per group: thi, tlo, W^T [M, ldk]; and W itself [G, F2, M] as float32: a few KB, on this thread
  const int64_t table = c.M * c.ldk;
  store = zeroed_floats(3 * c.G * table + c.G * c.F2 * c.M);
  float* thi = store.data_ptr<float>();
  float *tlo = thi + c.G * table, *wrt = tlo + c.G * table, *wp = wrt + c.G * table;
  freqs_f32(freqs, wp);
  for (int64_t g = 0; g < c.G; ++g) {
    const float* w = wp + g * c.F2 * c.M;
    for (int64_t k = 0; k < c.F2; ++k)
      for (int64_t m = 0; m < c.M; ++m) wrt[g * table + m * c.ldk + k] = w[k * c.M + m];
    rot_kernels().prepare_turns(w, c.F2, c.M, c.M, c.ldk, thi + g * table, tlo + g * table);
  }
  c.thi = thi;
  c.tlo = tlo;
  c.wrt = wrt;
  return c;
}

// make_call for the fused application: q [B, Hq, N, D] and k [B, Hk, N, D] (heads-first).
RotCall apply_call(const Apply& in, at::Tensor& store) {
  RotCall c = make_call(in.x3, in.freqs, in.half, in.q.size(0), store);
  c.prefix = in.prefix;
  c.D = in.q.size(3);
  c.hq = in.q.size(1) / c.G;
  c.hk = in.k.size(1) / c.G;
  c.dt = dt_of(in.q.scalar_type());
  c.q = view4(in.q), c.k = view4(in.k);
  return c;
}

// Runs fn over the call's Bx * runs items on one parallel region. With dw defined, the
// items form at most 16 blocks (fixed by the item count) with a partial of every group's
// W[g]^T each, summed in block order into dw [G, F2, M] at the end (cpu/parallel.h:
// run_blocks).
void run_items(const RotCall& c, ItemFn fn, double item_cost, at::Tensor* dw) {
  const int64_t items = c.Bx * c.runs * c.bsplit;
  const int64_t per_scratch = 2 * round_up(kRun * c.M) + 5 * kRun * c.ldk;
  const int64_t block_items = dw ? (items + std::min<int64_t>(16, items) - 1) / std::min<int64_t>(16, items) : 1;
  const int64_t nblocks = (items + block_items - 1) / block_items;
  const int threads = team_threads(nblocks, item_cost * static_cast<double>(block_items));
  const at::Tensor scratch = zeroed_floats(threads * per_scratch);
  const RotKernels& kern = rot_kernels();
  const int64_t table = c.M * c.ldk;
  std::vector<PartialSum> sums;
  if (dw)  // dW[g] [F2, M] from the partial's W[g]^T [M, ldk]
    for (int64_t g = 0; g < c.G; ++g) {
      void* out = static_cast<char*>(dw->data_ptr()) + g * c.F2 * c.M * dw->element_size();
      sums.push_back({g * table, c.M, c.F2, c.ldk, out, dt_of(dw->scalar_type()), 1, c.M});
    }
  run_blocks(threads, nblocks, c.G * table, sums, kern.sum_partials, [&](int rank, int64_t b, float* part) {
    float* base = scratch.data_ptr<float>() + rank * per_scratch;
    const int64_t rows = kRun * c.ldk;
    float* xs = base;
    base += round_up(kRun * c.M);
    float* dxs = base;
    base += round_up(kRun * c.M);
    const RotScratch s{xs, base, base + rows, base + 2 * rows, base + 3 * rows, base + 4 * rows, dxs};
    const int64_t i1 = std::min(items, (b + 1) * block_items);
    for (int64_t i = b * block_items; i < i1; ++i) fn(c, i, s, part, i == b * block_items);
  });
}

// Multiply-adds per position (a rough cost, to decide how many threads are worth a fork).
double position_cost(const RotCall& c, int64_t rows) {
  return static_cast<double>(c.G * c.F2) * (30 + 2 * c.M) + static_cast<double>(rows) * 4 * c.D;
}

// Shared positions on a small grid make few runs (196 tokens: 4): each run is split over
// chunks of q's batch rows (cos / sin recomputed per chunk), where items are independent
// (the backward's dx / dW sums keep one item per run: their fixed order).
void split_batch(RotCall& c) {
  const int64_t want = 4 * at::get_num_threads();
  if (c.Bx == 1 && c.B > 1 && c.runs < want) c.bsplit = std::min(c.B, (want + c.runs - 1) / c.runs);
}

int64_t item_rows(const RotCall& c) {  // q and k rows an item rotates (for its cost)
  return (c.Bx == 1 ? (c.B + c.bsplit - 1) / c.bsplit : 1) * (c.hq + c.hk);
}

}  // namespace

void apply_forward_cpu(const Apply& in, at::Tensor& oq, at::Tensor& ok) {
  if (in.q.size(0) * in.q.size(2) == 0) return;
  at::Tensor store;
  RotCall c = apply_call(in, store);
  c.oq = view4(oq), c.ok = view4(ok);
  split_batch(c);
  run_items(c, rot_kernels().apply_forward, kRun * position_cost(c, item_rows(c)), nullptr);
}

void apply_backward_cpu(const at::Tensor& gq, const at::Tensor& gk, const Apply& in, ApplyGrads& g) {
  const bool rotated = in.q.size(0) * in.x3.size(1) != 0;  // any token rotated
  if (!rotated) {  // dx is empty; dW = 0
    if (g.dx.defined()) g.dx.zero_();
    if (g.dfreqs.defined()) g.dfreqs.zero_();
  }
  if (in.q.size(0) * in.q.size(2) == 0) return;
  at::Tensor store;
  RotCall c = apply_call(in, store);
  c.gq = view4(gq), c.gk = view4(gk), c.dq = view4(g.dq), c.dk = view4(g.dk);
  c.need_q = g.dq.defined(), c.need_k = g.dk.defined();
  c.need_x = rotated && g.dx.defined(), c.need_w = rotated && g.dfreqs.defined();
  if (!(c.need_q || c.need_k || c.need_x || c.need_w)) return;
  if (c.need_x) {
    c.dx = g.dx.data_ptr();
    c.dxdt = dt_of(g.dx.scalar_type());
  }
  if (!(c.need_x || c.need_w)) split_batch(c);
  run_items(c, rot_kernels().apply_backward, kRun * position_cost(c, 2 * item_rows(c)),
            c.need_w ? &g.dfreqs : nullptr);
}

namespace {

// make_call for a table [2, Bx, G, N, F] (or its gradient) t.
RotCall table_call(const at::Tensor& x3, const at::Tensor& freqs, bool half, const at::Tensor& t, at::Tensor& store) {
  RotCall c = make_call(x3, freqs, half, x3.size(0), store);
  c.D = 2 * c.F2;
  c.dt = dt_of(t.scalar_type());
  c.tab = T4{const_cast<void*>(t.data_ptr()), t.stride(1), t.stride(2), t.stride(3), t.stride(4)};
  c.tab_plane = t.stride(0);
  return c;
}

}  // namespace

void table_forward_cpu(const at::Tensor& x3, const at::Tensor& freqs, bool half, at::Tensor& out) {
  if (x3.size(0) * x3.size(1) == 0) return;
  at::Tensor store;
  RotCall c = table_call(x3, freqs, half, out, store);
  run_items(c, rot_kernels().table_forward, kRun * position_cost(c, 1), nullptr);
}

void table_backward_cpu(const at::Tensor& grad, const at::Tensor& x3, const at::Tensor& freqs, bool half,
                        at::Tensor& dx, at::Tensor& dfreqs) {
  if (x3.size(0) * x3.size(1) == 0) {
    if (dfreqs.defined()) dfreqs.zero_();
    return;
  }
  at::Tensor store;
  RotCall c = table_call(x3, freqs, half, grad, store);
  c.need_x = dx.defined(), c.need_w = dfreqs.defined();
  if (c.need_x) {
    c.dx = dx.data_ptr();
    c.dxdt = dt_of(dx.scalar_type());
  }
  run_items(c, rot_kernels().table_backward, kRun * position_cost(c, 2 * c.G), c.need_w ? &dfreqs : nullptr);
}

}  // namespace rotary
}  // namespace posenc_fast
