// Learnable Fourier features + MLP on the CPU: forward and backward, fused per tile of rows.
//
// Shapes: rows [R, M] (R = N * G: every group of every position is a row), wr [F2, M],
// w1 [F, H], b1 [H], w2 [H, D], b2 [D] (F = 2 F2), out / grad [R, D] ([R, F] without MLP).
//
// Design
// - Per tile of up to kTileRows rows (lff_kernels.h): positions -> phases (float32,
//   error-free reduction) -> cos | sin / sqrt(F) -> a = b1 + feats w1 -> h = act(a) ->
//   y = b2 + h w2, stored once in the output dtype. Features, hidden layer and activation
//   stay in the thread's scratch: memory traffic is x in and y out. All arithmetic is
//   float32 (bfloat16 / float16 are storage types only).
// - The products are register-blocked micro-kernels of our own (lff_gemm.h), not BLAS per
//   tile: a library call pays packing and dispatch at every tile (benchmarks/NOTES.md, "C++
//   LFF and encoding kernels", 1), and ours fix the summation order (determinism below).
// - Backward: the tile recomputes features, a and h from x, reads dY once (as float32
//   rows), and computes gh = dY w2^T, ga = gh act'(a), gr = ga w1^T (dLoss/dfeats), the
//   phase gradient and dx = gphase wr; weight gradients are products over the tile's rows
//   ([h | 1]^T dY gives dw2 and db2, [feats | 1]^T ga gives dw1 and db1, x^T gphase gives
//   dwr^T) accumulated into the partial sums of the tile's block.
// - Determinism: blocks are runs of rows fixed by R alone; a block's tiles add into its
//   partial in row order, partials are added in block order (cpu/parallel.h: run_blocks).
//   Every output element is one fixed chain of float32 operations: the same bits for any
//   thread count and instruction set (cpu/per_isa.h: explicit FMAs, no contraction).
// - Parallelism: one OpenMP region per call (cpu/parallel.h); threads take tiles (forward)
//   or blocks (backward) from a shared counter.
#include "lff/lff_cpu.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/runtime.h"

namespace posenc_fast {
namespace lff {
namespace {

using namespace ::posenc_fast::cpu;
using Act = Activation;

// Rows per tile: a multiple of every register tile's row count (12, 6, 4, 2); the scratch of
// a tile stays within a core's L2 next to the weights.
constexpr int64_t kTileRows = 48;

struct LffDims {
  int64_t R, M, F2, F, H, D;
  bool mlp;
  Act act;
  // padded leading dimensions (multiples of kPad floats)
  int64_t ldk;  // F2 frequencies: turn tables [M, ldk], phase gradient [rows, ldk]
  int64_t Fp;   // F padded
  int64_t ldf;  // features / feature gradient [rows, ldf] >= F + 1 (column F: ones)
  int64_t Hp;   // H padded: a, h, ga columns computed
  int64_t ldh;  // [rows, ldh] >= H + 1 (column H: ones)
  int64_t Dp;   // D padded
  int64_t ldd;  // dY as float32 [rows, ldd]
  int64_t ldm;  // M padded: dx [rows, ldm], wr [F2, ldm]
};

// float32 copies of the weights in the layouts the kernels read, zero-padded.
struct LffWeights {
  const float *thi, *tlo;  // [M, ldk] wr^T / (2 pi), float32 pair
  const float* wr;         // [F2, ldm]
  const float *w1, *b1;    // [F, Hp], [Hp]
  const float *w2, *b2;    // [H, Dp], [Dp]
  const float *w1t, *w2t;  // [H, Fp], [D, Hp] (backward)
  float inv_sqrt_f;
};

struct LffIO {
  const void* x;  // rows: element (r, m) at x + r * sxr + m * sxm
  DT xdt;
  int64_t sxr, sxm;
  void* out;  // forward [R, D or F], row stride ldo
  DT odt;
  int64_t ldo;
  bool stream;  // whole output vectors by streaming stores (cpu/tensors.h: use_streaming)
  const void* grad;  // backward [R, D or F], row stride ldg
  DT gdt;
  int64_t ldg;
  void* dx;  // backward [R, M] contiguous
  DT dxdt;
};

struct LffNeeds {
  bool x, wr, w1, b1, w2, b2;
};

struct LffCall {
  LffDims d;
  LffWeights w;
  LffIO io;
  LffNeeds needs;
};

// One thread's buffers (lff_kernels.h header comment).
struct LffScratch {
  float *xs, *feats, *a, *h, *dy, *ga, *gr, *gph, *dxs;
};

// One block's weight-gradient partial sums: dwr^T [M, ldk], [dw1; db1] [F+1, Hp],
// [dw2; db2] [H+1, Dp]. first: this tile starts them (no earlier tile of the block).
struct LffPartials {
  float *dwrt, *dw1, *dw2;
  bool first;
};

struct LffKernels {
  PrepareTurnsFn prepare_turns;
  void (*forward_tile)(const LffCall& c, int64_t r0, int64_t nr, const LffScratch& s);
  void (*backward_tile)(const LffCall& c, int64_t r0, int64_t nr, const LffScratch& s, const LffPartials& p);
  SumPartialsFn sum_partials;
};

}  // namespace

#define PF_ISA_KERNELS "lff/lff_kernels.h"
#include "cpu/per_isa.h"
#undef PF_ISA_KERNELS

namespace {

const LffKernels& lff_kernels() { return PF_ISA_TABLE(kLffKernels); }

LffDims make_dims(const at::Tensor& rows, const at::Tensor& wr, const Mlp& mlp, Act act) {
  LffDims d{};
  d.R = rows.size(0);
  d.M = rows.size(1);
  d.F2 = wr.size(0);
  d.F = 2 * d.F2;
  d.mlp = mlp.w1.defined();
  d.H = d.mlp ? mlp.w1.size(1) : 0;
  d.D = d.mlp ? mlp.w2.size(1) : 0;
  d.act = act;
  d.ldk = round_up(d.F2);
  d.Fp = round_up(d.F);
  d.ldf = round_up(d.F + 1);
  d.Hp = round_up(d.H);
  d.ldh = round_up(d.H + 1);
  d.Dp = round_up(d.D);
  d.ldd = d.mlp ? d.Dp : round_up(d.F);
  d.ldm = round_up(d.M);
  return d;
}

// Whether w ([rows, cols] or [cols]) already is float32 rows of stride ld with no padding:
// the kernels then read it in place (a call on a few rows would otherwise spend most of its
// time copying the weights).
bool readable_in_place(const at::Tensor& w, int64_t ld) {
  return w.scalar_type() == at::kFloat && w.size(-1) == ld && w.stride(-1) == 1 &&
         (w.dim() == 1 || w.stride(0) == ld);
}

// The float32 weights of one call: the MLP's own storage where readable_in_place, else
// zero-padded copies owned by `store`.
LffWeights prepare_weights(const LffDims& d, const at::Tensor& wr, const Mlp& mlp, bool backward,
                           const LffKernels& kern, at::Tensor& store) {
  const at::Tensor* src[4] = {&mlp.w1, &mlp.b1, &mlp.w2, &mlp.b2};
  const int64_t lds[4] = {d.Hp, 0, d.Dp, 0};
  bool in_place[4] = {};
  for (int i = 0; i < 4 && d.mlp; ++i) in_place[i] = readable_in_place(*src[i], i % 2 ? src[i]->size(0) : lds[i]);
  in_place[1] = in_place[1] && d.H == d.Hp;
  in_place[3] = in_place[3] && d.D == d.Dp;
  const int64_t sizes[] = {
      2 * d.M * d.ldk,
      d.F2 * d.ldm,
      in_place[0] ? 0 : d.F * d.Hp,
      in_place[1] ? 0 : d.Hp,
      in_place[2] ? 0 : d.H * d.Dp,
      in_place[3] ? 0 : d.Dp,
      backward ? d.H * d.Fp : 0,
      backward ? d.D * d.Hp : 0,
  };
  int64_t total = 0;
  for (int64_t s : sizes) total += s;
  store = zeroed_floats(total);
  float* base = store.data_ptr<float>();
  float* ptr[8];
  for (int i = 0; i < 8; ++i) {
    ptr[i] = base;
    base += sizes[i];
  }
  copy_f32(wr, ptr[1], d.ldm, false);
  kern.prepare_turns(ptr[1], d.F2, d.M, d.ldm, d.ldk, ptr[0], ptr[0] + d.M * d.ldk);
  const float* mlp_ptr[4] = {};
  if (d.mlp) {
    for (int i = 0; i < 4; ++i) {
      if (in_place[i]) {
        mlp_ptr[i] = src[i]->data_ptr<float>();
      } else {
        copy_f32(*src[i], ptr[2 + i], lds[i], false);
        mlp_ptr[i] = ptr[2 + i];
      }
    }
    if (backward) {
      copy_f32(mlp.w1, ptr[6], d.Fp, true);
      copy_f32(mlp.w2, ptr[7], d.Hp, true);
    }
  }
  LffWeights w{};
  w.thi = ptr[0];
  w.tlo = ptr[0] + d.M * d.ldk;
  w.wr = ptr[1];
  w.w1 = mlp_ptr[0];
  w.b1 = mlp_ptr[1];
  w.w2 = mlp_ptr[2];
  w.b2 = mlp_ptr[3];
  w.w1t = ptr[6];
  w.w2t = ptr[7];
  w.inv_sqrt_f = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d.F)));
  return w;
}

// Per-thread scratch, zero-filled once (padding columns are read as zeros), allocated before
// the parallel region (nothing may throw inside it).
struct ScratchArena {
  at::Tensor store;
  int64_t per = 0;
  int64_t sizes[9] = {};

  ScratchArena(const LffDims& d, int64_t rows, bool backward, int threads) {
    const int64_t s[9] = {
        rows * d.M,                      // xs
        rows * d.ldf,                    // feats
        rows * d.ldh,                    // a
        rows * d.ldh,                    // h
        backward ? rows * d.ldd : 0,     // dy
        backward ? rows * d.ldh : 0,     // ga
        backward ? rows * d.ldf : 0,     // gr
        backward ? rows * d.ldk : 0,     // gph
        backward ? rows * d.ldm : 0,     // dxs
    };
    for (int i = 0; i < 9; ++i) {
      sizes[i] = round_up(s[i]);  // every buffer starts on a 64-byte boundary
      per += sizes[i];
    }
    store = zeroed_floats(threads * per + kPad);
  }

  LffScratch of(int rank) const {
    float* base = store.data_ptr<float>() + rank * per;
    const uintptr_t mis = reinterpret_cast<uintptr_t>(base) % 64;
    if (mis) base += (64 - mis) / sizeof(float);
    float* p[9];
    for (int i = 0; i < 9; ++i) {
      p[i] = base;
      base += sizes[i];
    }
    return LffScratch{p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], p[8]};
  }
};

LffIO rows_io(const at::Tensor& rows) {
  LffIO io{};
  io.x = rows.data_ptr();
  io.xdt = dt_of(rows.scalar_type());
  io.sxr = rows.stride(0);
  io.sxm = rows.stride(1);
  return io;
}

// Multiply-adds per row (a rough cost, to decide how many threads are worth a fork).
double row_cost(const LffDims& d) { return static_cast<double>(d.F2) * (24 + 2 * d.M) + d.F * d.H + d.H * d.D; }

}  // namespace

at::Tensor forward_cpu(const at::Tensor& rows, const at::Tensor& wr, const Mlp& mlp, Activation act,
                       at::ScalarType out_dtype) {
  const LffDims d = make_dims(rows, wr, mlp, act);
  at::Tensor out = new_output({d.R, d.mlp ? d.D : d.F}, rows.options().dtype(out_dtype));
  if (d.R == 0 || out.numel() == 0) return out;
  const LffKernels& kern = lff_kernels();
  at::Tensor wstore;
  LffCall c{d, prepare_weights(d, wr, mlp, false, kern, wstore), rows_io(rows), LffNeeds{}};
  c.io.out = out.data_ptr();
  c.io.odt = dt_of(out_dtype);
  c.io.ldo = out.stride(0);
  c.io.stream = use_streaming(out);
  // Tiles of kTileRows rows, or fewer (multiples of 12) when that leaves a thread idle.
  const WorkSplit w = split_work(d.R, kTileRows, 12, row_cost(d));
  const ScratchArena arena(d, w.size, false, w.threads);
  for_each_item(w.threads, w.items, [&](int rank, int64_t t) {
    kern.forward_tile(c, t * w.size, std::min(w.size, d.R - t * w.size), arena.of(rank));
  });
  return out;
}

std::vector<at::Tensor> backward_cpu(const at::Tensor& grad, const at::Tensor& rows, const at::Tensor& wr,
                                     const Mlp& mlp, Activation act, const std::array<bool, 6>& needs) {
  const LffDims d = make_dims(rows, wr, mlp, act);
  LffNeeds nd{needs[0], needs[1], d.mlp && needs[2], d.mlp && needs[3], d.mlp && needs[4], d.mlp && needs[5]};
  std::vector<at::Tensor> res(6);
  const at::Tensor* refs[6] = {&rows, &wr, &mlp.w1, &mlp.b1, &mlp.w2, &mlp.b2};
  const bool want[6] = {nd.x, nd.wr, nd.w1, nd.b1, nd.w2, nd.b2};
  for (int i = 0; i < 6; ++i)
    if (want[i]) res[i] = d.R == 0 && i > 0 ? at::zeros_like(*refs[i]) : at::empty(refs[i]->sizes(), refs[i]->options());
  if (d.R == 0 || !(nd.x || nd.wr || nd.w1 || nd.b1 || nd.w2 || nd.b2)) return res;

  const LffKernels& kern = lff_kernels();
  at::Tensor wstore;
  LffCall c{d, prepare_weights(d, wr, mlp, true, kern, wstore), rows_io(rows), nd};
  c.io.grad = grad.data_ptr();
  c.io.gdt = dt_of(grad.scalar_type());
  c.io.ldg = grad.stride(0);
  if (nd.x) {
    c.io.dx = res[0].data_ptr();
    c.io.dxdt = dt_of(res[0].scalar_type());
  }

  // Blocks of rows, a function of the shapes only: at least 96 rows (the partial sums cost
  // little next to the block's work), at most 16 blocks and 64 MiB of partials.
  const int64_t off_w1 = d.M * d.ldk, off_w2 = off_w1 + (d.F + 1) * d.Hp;
  const int64_t per = off_w2 + (d.H + 1) * d.Dp;
  const int64_t max_blocks = std::max<int64_t>(1, std::min<int64_t>(16, (int64_t{64} << 20) / (4 * per)));
  const int64_t block_rows = std::max<int64_t>(96, (d.R + max_blocks - 1) / max_blocks);
  const int64_t nblocks = (d.R + block_rows - 1) / block_rows;
  const int threads = team_threads(nblocks, 3.0 * row_cost(d) * block_rows);
  const ScratchArena arena(d, kTileRows, true, threads);

  // The needed weight gradients in a block's partial: dwr^T [M, ldk] (written transposed),
  // [dw1; db1] [F + 1, Hp], [dw2; db2] [H + 1, Dp].
  std::vector<PartialSum> sums;
  auto sum = [&](int64_t off, int64_t rows_, int64_t cols, int64_t ld, int i, int64_t ds_row, int64_t ds_col) {
    sums.push_back({off, rows_, cols, ld, res[i].data_ptr(), dt_of(res[i].scalar_type()), ds_row, ds_col});
  };
  if (nd.wr) sum(0, d.M, d.F2, d.ldk, 1, 1, d.M);
  if (nd.w1) sum(off_w1, d.F, d.H, d.Hp, 2, d.H, 1);
  if (nd.b1) sum(off_w1 + d.F * d.Hp, 1, d.H, d.Hp, 3, d.H, 1);
  if (nd.w2) sum(off_w2, d.H, d.D, d.Dp, 4, d.D, 1);
  if (nd.b2) sum(off_w2 + d.H * d.Dp, 1, d.D, d.Dp, 5, d.D, 1);

  run_blocks(threads, nblocks, per, sums, kern.sum_partials, [&](int rank, int64_t b, float* pb) {
    const LffScratch s = arena.of(rank);
    const int64_t r_end = std::min(d.R, (b + 1) * block_rows);
    for (int64_t r0 = b * block_rows; r0 < r_end; r0 += kTileRows) {
      const LffPartials p{pb, pb + off_w1, pb + off_w2, r0 == b * block_rows};
      kern.backward_tile(c, r0, std::min(kTileRows, r_end - r0), s, p);
    }
  });
  return res;
}

}  // namespace lff
}  // namespace posenc_fast
