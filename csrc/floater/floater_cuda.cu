// FLOATER integrator on CUDA: the forward (the whole integration, S states x L sample
// times x substeps x stages, in one persistent launch) and the discrete-adjoint backward
// (per chunk of intervals: the adjoint chain in one persistent launch, then the weight
// gradients as a few large GEMMs over the chunk's stage values).
//
// Shapes (floater_common.h): p0 [S, d], w1 [d+1, H], b1 [H], w2 [H+1, d], b2 [d],
// times [L], out / grad [S, L, d]. All contiguous, one dtype (float or double).
//
// Layout of the work
// - The S states are split into G teams of Sg states. A team is C thread blocks that
//   split the dynamics between them: block b owns the H-slice hs_b (columns of w1: z and
//   a [:, hs_b]) and the d-slice ds_b (columns of w2: the slopes, the state and the
//   adjoint [:, ds_b]). Its weight slices live in shared memory ("resident", odd row
//   strides: both the row and the column walks are free of bank conflicts); rows beyond
//   what the team's shared memory holds are read from L2 instead.
// - Teams (floater_cuda_team.cuh): one block ("solo"); a thread-block cluster of up to 16
//   blocks on sm_90+ ("cluster": every block holds the full vectors it reads in its own
//   shared memory, written by their owners through distributed shared memory, cluster
//   barriers only); a cooperative grid ("grid": the vectors in global memory, read
//   through L2; the path of GPUs without clusters when one block cannot hold the weights).
// - Forward stage = two phases, each ended by a team barrier:
//     A: every block multiplies the full stage input Y [Sg, d] by its w1 slice, z and
//        a = act(z) for its H-slice, and broadcasts its slice of a to the team
//     B: every block multiplies the full A [Sg, H] by its w2 slice: its slice of the
//        slope, the Runge-Kutta combination of its state slice, and broadcasts the next
//        stage input's slice.
//   One buffer per vector suffices: a buffer is rewritten one phase after it was read,
//   past a barrier every block has waited on.
// - The tape: the forward can keep every stage's input Y_i [S, d] and pre-activation
//   Z_i [S, H] (the CPU tape's layout) for its first intervals, each block storing its own
//   slices (global stores that no one waits for).
// - Backward, per chunk of intervals, last first (backward()): intervals beyond the tape
//   are integrated again onto a chunk tape (the forward's kernel and layout: bitwise its
//   values); the adjoint kernel walks the chunk's stages in reverse, two transposed
//   products per stage as reduce-scatters (each block's partial sums pushed to the owner of
//   each output slice, which adds the C partials in block order), writing dLoss/dz_i and
//   dLoss/dk_i; the weight gradients are then GEMMs over the chunk (GradSink): X^T G with X
//   the tape's Y (layer 1) or act(Z) (layer 2). A gradient of the times needs the slopes
//   k_i: it re-tapes every chunk with them and accumulates dLoss/dh per block.
// - choose_layout() picks the layout from the shapes and the device's properties with a cost model
//   (stage_cost); set_forced_layout forces one.
// - Determinism: every sum runs in an order fixed by the shapes and the layout; no float
//   atomics: results are bitwise reproducible for a fixed layout on one GPU.
// - Testing without a GPU: tools/cuda_emulation runs this file on the CPU with a race
//   checker, through the hooks of floater_cuda_hooks.h.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "floater_common.h"
#include "floater_cuda.h"
#include "floater_cuda_hooks.h"
#include "floater_cuda_products.cuh"
#include "floater_cuda_team.cuh"

namespace posenc_fast {
namespace floater {
namespace cuda {

namespace {

constexpr int kMaxCluster = 16;  // the non-portable cluster size of sm_90

__host__ __device__ inline int odd_at_least(int n) { return n % 2 == 0 ? n + 1 : n; }
__host__ __device__ inline int round_up(int n, int m) { return (n + m - 1) / m * m; }

// --- Sizes shared by host (choose_layout) and device ------------------------------------------
struct Dims {
  int d, H, C, Sg, stages;
  int nh_max, nd_max;  // largest slices
  int ld1, ld2;        // row strides of the resident weight slices (odd)
  int ldy, lda;        // full vectors [Sg][d], [Sg][H] (multiples of kVec: 16-byte rows)
  int ldk, ldz;        // own slices [Sg][nd], [Sg][nh]
};
__host__ __device__ inline Dims dims_of(int d, int H, int C, int Sg, int stages, int vec) {
  Dims D{};
  D.d = d;
  D.H = H;
  D.C = C;
  D.Sg = Sg;
  D.stages = stages;
  D.nh_max = (H + C - 1) / C;
  D.nd_max = (d + C - 1) / C;
  D.ld1 = odd_at_least(D.nh_max);
  D.ld2 = odd_at_least(D.nd_max);
  D.ldy = round_up(d, vec);
  D.lda = round_up(H, vec);
  D.ldk = round_up(D.nd_max, vec);
  D.ldz = round_up(D.nh_max, vec);
  return D;
}

// Shared-memory carve-up (elements of T), the same on host (sizing) and device.
//   forward: weights, Y and A (solo/cluster: the exchange; grid: staging copies when
//            stage_x), the state P and the slopes K (own slices)
//   adjoint: weights, the reduce-scatter receive buffers part1 [C][Sg][nh_max] and part2
//            [C][Sg][nd_max] (solo/cluster), lam, gK [stages], Ks (slopes, times' gradient),
//            dLoss/dz of the stage (gzl) and its z (zs)
struct SmemLayout {
  long w1, w2, y, a, P, K, part1, part2, lam, gK, Ks, gzl, zs, red, scratch, total;
};
__host__ __device__ inline SmemLayout smem_layout(const Dims& D, int kr1, int kr2, int mode, bool stage_x, bool adj,
                                                  bool need_t, int tsize) {
  SmemLayout s{};
  long o = 0;
  const int per16 = 16 / tsize;  // elements per 16 bytes: every buffer starts 16-byte aligned
  auto take = [&o, per16](long n) {
    const long at = o;
    o += (n + per16 - 1) / per16 * per16;
    return at;
  };
  const bool smem_x = mode != kGrid;
  const long Sg = D.Sg;
  s.w1 = take(static_cast<long>(kr1) * D.ld1);
  s.w2 = take(static_cast<long>(kr2) * D.ld2);
  if (!adj) {
    s.y = take(smem_x || stage_x ? Sg * D.ldy : 0);
    s.a = take(smem_x || stage_x ? Sg * D.lda : 0);
    s.P = take(Sg * D.ldk);
    s.K = take(static_cast<long>(D.stages) * Sg * D.ldk);
  } else {
    s.part1 = take(smem_x ? static_cast<long>(D.C) * Sg * D.nh_max : 0);
    s.part2 = take(smem_x ? static_cast<long>(D.C) * Sg * D.nd_max : 0);
    s.lam = take(Sg * D.ldk);
    s.gK = take(static_cast<long>(D.stages) * Sg * D.ldk);
    s.Ks = take(need_t ? static_cast<long>(D.stages) * Sg * D.ldk : 0);
    s.gzl = take(Sg * D.ldz);
    s.zs = take(Sg * D.ldz);
  }
  s.red = take(kRedElems);
  s.scratch = take((kThreads / 32) * 8 / tsize);  // block_sum's doubles
  s.total = o;
  return s;
}

// Global exchange buffers of one grid team (elements): forward Y [Sg][ldy], A [Sg][lda];
// adjoint part1 [owner C][slot C][Sg][nh_max], part2 [C][C][Sg][nd_max].
__host__ __device__ inline long grid_team_elems(const Dims& D, bool adj) {
  if (!adj) return static_cast<long>(D.Sg) * (D.ldy + D.lda);
  return static_cast<long>(D.C) * D.C * D.Sg * (D.nh_max + D.nd_max);
}

// --- Kernel parameters and per-block views -----------------------------------------------
template <typename T>
struct Params {
  const T *w1, *b1, *w2, *b2, *times;
  int S, d, H, L, n;  // n = substeps
  int act;
  Tableau tab;
  int C, G, Sg, kr1, kr2;
  bool stage_x;
  int j0, j1;  // intervals [j0, j1)
  // forward
  const T* start;  // the states entering interval j0: state s at start[s * start_ld]
  long start_ld;
  T* out;          // [S, L, d] or null
  T *tape_y, *tape_z, *tape_k;  // interval j's stage values at row ((j - j0) n + k) s + i
  int tape_j1;                  // intervals [j0, tape_j1) go on the tape
  // adjoint
  const T* grad;
  T* lam;          // [S, d]: the adjoint entering interval j1 - 1 (in) / leaving j0 (out)
  bool lam_zero;   // the first chunk: lam starts at zero (lam is not read)
  T* dp0;          // lam at the end, when this is the last chunk (else null)
  T *gz, *gk;      // [stage rows][S][H], [stage rows][S][d] (null: not needed)
  T* taus;         // [stage rows]
  T *dt_end, *dt_start;  // [G * C][L]: per-block dLoss/dtimes[j] via interval j's end / start
  bool need_t;
  // grid teams' exchange buffers (global), grid_team_elems each
  T* xg;
};

template <typename T>
struct Blk {
  int team, rank, C, s0, M, Sg;
  int hb0, nh, db0, nd;
  Dims D;
  Slice<T> w1, w2;
  T* sm;
  SmemLayout L;
  T* xg;  // this team's global exchange buffers (grid)
  T* red;
  double* scratch;
};

template <typename T, class Team>
__device__ Blk<T> setup(const Params<T>& p, unsigned char* smem_raw, bool adj) {
  Blk<T> b;
  b.C = p.C;
  b.team = Team::team(p.C);
  b.rank = Team::rank(p.C);
  b.Sg = p.Sg;
  b.s0 = b.team * p.Sg;
  b.M = min(p.Sg, p.S - b.s0);
  b.hb0 = static_cast<int>(static_cast<long>(p.H) * b.rank / p.C);
  b.nh = static_cast<int>(static_cast<long>(p.H) * (b.rank + 1) / p.C) - b.hb0;
  b.db0 = static_cast<int>(static_cast<long>(p.d) * b.rank / p.C);
  b.nd = static_cast<int>(static_cast<long>(p.d) * (b.rank + 1) / p.C) - b.db0;
  b.D = dims_of(p.d, p.H, p.C, p.Sg, p.tab.stages, kVec<T>);
  b.L = smem_layout(b.D, p.kr1, p.kr2, Team::kMode, p.stage_x, adj, p.need_t, static_cast<int>(sizeof(T)));
  b.sm = reinterpret_cast<T*>(smem_raw);
  T* w1s = b.sm + b.L.w1;
  T* w2s = b.sm + b.L.w2;
  for (long e = threadIdx.x; e < static_cast<long>(p.kr1) * b.nh; e += kThreads) {
    const long r = e / b.nh, c = e % b.nh;
    w1s[r * b.D.ld1 + c] = p.w1[r * p.H + b.hb0 + c];
  }
  for (long e = threadIdx.x; e < static_cast<long>(p.kr2) * b.nd; e += kThreads) {
    const long r = e / b.nd, c = e % b.nd;
    w2s[r * b.D.ld2 + c] = p.w2[r * p.d + b.db0 + c];
  }
  b.w1 = Slice<T>{w1s, b.D.ld1, p.w1 + b.hb0, p.H, p.kr1};
  b.w2 = Slice<T>{w2s, b.D.ld2, p.w2 + b.db0, p.d, p.kr2};
  b.xg = p.xg ? p.xg + static_cast<long>(b.team) * grid_team_elems(b.D, adj) : nullptr;
  b.red = b.sm + b.L.red;
  b.scratch = reinterpret_cast<double*>(b.sm + b.L.scratch);
  __syncthreads();
  return b;
}

// The owner (block rank) of element c of a dimension of n split over C blocks
// (block r owns [n r / C, n (r + 1) / C)).
__device__ __forceinline__ int owner_of(int c, int n, int C) {
  return static_cast<int>((static_cast<long>(c + 1) * C - 1) / n);
}
__device__ __forceinline__ int slice_start(int r, int n, int C) { return static_cast<int>(static_cast<long>(n) * r / C); }

// --- Forward kernel: intervals [j0, j1) from p.start, writing out and the tape -----------
template <typename T, class Team>
__global__ void __launch_bounds__(kThreads) floater_fwd_kernel(const Params<T> p) {
  FLOATER_CUDA_DYNAMIC_SMEM(smem_raw);
  constexpr bool XG = Team::kGlobal;
  Blk<T> b = setup<T, Team>(p, smem_raw, false);
  const Dims& D = b.D;
  const Tableau& tb = p.tab;
  const int d = p.d, H = p.H, M = b.M, nd = b.nd, nh = b.nh, C = b.C, S = p.S;
  T* P = b.sm + b.L.P;
  T* Kb = b.sm + b.L.K;
  // exchange buffers: the full Y and A (shared memory; grid: global, staged into shared
  // memory before the products when stage_x)
  T* Yx = XG ? b.xg : b.sm + b.L.y;
  T* Ax = XG ? b.xg + static_cast<long>(b.Sg) * D.ldy : b.sm + b.L.a;
  T* Ys = b.sm + b.L.y;
  T* As = b.sm + b.L.a;
  for (int e = threadIdx.x; e < M * nd; e += kThreads) {
    const int m = e / nd, c = e % nd;
    const T v = p.start[static_cast<long>(b.s0 + m) * p.start_ld + b.db0 + c];
    P[m * D.ldk + c] = v;
    Team::broadcast(Yx + static_cast<long>(m) * D.ldy + b.db0 + c, C, v);
  }
  Team::arrive();
  Team::wait();
  const T nT = static_cast<T>(p.n);
  for (int j = p.j0; j < p.j1; ++j) {
    const T tp = j == 0 ? T(0) : p.times[j - 1];
    const T h = (p.times[j] - tp) / nT;
    const bool taped = p.tape_y != nullptr && j < p.tape_j1;
    for (int k = 0; k < p.n; ++k) {
      const T t = tp + static_cast<T>(k) * h;
      const long q0 = (static_cast<long>(j - p.j0) * p.n + k) * tb.stages;  // tape row of stage 0
      if (taped) {  // Y_0: the state entering the step
        for (int e = threadIdx.x; e < M * nd; e += kThreads) {
          const int m = e / nd, c = e % nd;
          p.tape_y[(q0 * S + b.s0 + m) * d + b.db0 + c] = P[m * D.ldk + c];
        }
      }
      for (int i = 0; i < tb.stages; ++i) {
        const T tau = t + static_cast<T>(tb.c[i]) * h;
        const long q = q0 + i;
        // Phase A: z = Y_i w1[:d, hs] + tau w1[d, hs] + b1[hs]; a = act(z) -> A[:, hs]
        {
          const T* X = XG ? Yx : Ys;
          if (XG && p.stage_x) {
            for (int e = threadIdx.x; e < M * d; e += kThreads) {
              const int m = e / d, c = e % d;
              Ys[m * D.ldy + c] = xload<XG>(Yx + static_cast<long>(m) * D.ldy + c);
            }
            __syncthreads();
            X = Ys;
          }
          auto epi = [&](int m, int n, T v) {
            const T z = v + (p.b1[b.hb0 + n] + tau * b.w1.at(d, n));
            if (taped) p.tape_z[(q * S + b.s0 + m) * H + b.hb0 + n] = z;
            Team::broadcast(Ax + static_cast<long>(m) * D.lda + b.hb0 + n, C, act_fwd(p.act, z));
          };
          if (XG && !p.stage_x)
            block_gemm<T, true>(M, nh, d, X, D.ldy, Cols<T>{b.w1}, b.red, epi);
          else
            block_gemm<T, false>(M, nh, d, X, D.ldy, Cols<T>{b.w1}, b.red, epi);
        }
        Team::arrive();
        Team::wait();
        // Phase B: k_i = A_i w2[:H, ds] + tau w2[H, ds] + b2[ds]; then the combination
        {
          const T* X = XG ? Ax : As;
          if (XG && p.stage_x) {
            for (int e = threadIdx.x; e < M * H; e += kThreads) {
              const int m = e / H, c = e % H;
              As[m * D.lda + c] = xload<XG>(Ax + static_cast<long>(m) * D.lda + c);
            }
            __syncthreads();
            X = As;
          }
          const bool last = i + 1 == tb.stages;
          const bool out_now = last && k + 1 == p.n && p.out != nullptr;
          const long SgK = static_cast<long>(b.Sg) * D.ldk;
          auto epi = [&](int m, int n, T v) {
            const T kv = v + (p.b2[b.db0 + n] + tau * b.w2.at(H, n));
            const long own = static_cast<long>(m) * D.ldk + n;
            Kb[i * SgK + own] = kv;
            if (taped && p.tape_k) p.tape_k[(q * S + b.s0 + m) * d + b.db0 + n] = kv;
            T s = T(0);
            bool any = false;
            for (int jj = 0; jj <= i; ++jj) {
              const double c = last ? tb.b[jj] : tb.a[i + 1][jj];
              if (c == 0.0) continue;
              const T kj = jj == i ? kv : Kb[jj * SgK + own];
              s = any ? s + static_cast<T>(c) * kj : static_cast<T>(c) * kj;
              any = true;
            }
            const T y = P[own] + h * s;
            if (last) {
              P[own] = y;
              if (out_now) p.out[(static_cast<long>(b.s0 + m) * p.L + j) * d + b.db0 + n] = y;
            } else if (taped) {
              p.tape_y[((q + 1) * S + b.s0 + m) * d + b.db0 + n] = y;
            }
            Team::broadcast(Yx + static_cast<long>(m) * D.ldy + b.db0 + n, C, y);
          };
          if (XG && !p.stage_x)
            block_gemm<T, true>(M, nd, H, X, D.lda, Cols<T>{b.w2}, b.red, epi);
          else
            block_gemm<T, false>(M, nd, H, X, D.lda, Cols<T>{b.w2}, b.red, epi);
        }
        Team::arrive();
        Team::wait();
      }
    }
  }
}

// --- Adjoint kernel: intervals [j0, j1) in reverse, from the chunk's tape ----------------
//
// Per step (u_i = dLoss/dk_i, gK_i = h u_i in the code), stages in reverse:
//   gK_i = h b_i lam + sum_{m > i} h a_mi gy_m      (final when stage i is reached)
//   ga_i = gK_i w2[:H]^T           (T2: reduce-scatter over the d-slices)
//   gz_i = ga_i * act'(z_i)
//   gy_i = gz_i w1[:d]^T           (T1: reduce-scatter over the H-slices)
//   lam += gy_i; gK_m += h a_im gy_i for m < i
// writing gz_i and gK_i (the layers' output gradients: GradSink's G) for every stage.
template <typename T, class Team>
__global__ void __launch_bounds__(kThreads) floater_adj_kernel(const Params<T> p) {
  FLOATER_CUDA_DYNAMIC_SMEM(smem_raw);
  constexpr bool XG = Team::kGlobal;
  Blk<T> b = setup<T, Team>(p, smem_raw, true);
  const Dims& D = b.D;
  const Tableau& tb = p.tab;
  const int d = p.d, H = p.H, M = b.M, nd = b.nd, nh = b.nh, C = b.C, S = p.S, S_ = tb.stages;
  const long SgK = static_cast<long>(b.Sg) * D.ldk;
  T* lam = b.sm + b.L.lam;
  T* gK = b.sm + b.L.gK;
  T* Ks = b.sm + b.L.Ks;
  T* gzl = b.sm + b.L.gzl;
  T* zs = b.sm + b.L.zs;
  // reduce-scatter buffers: written by every block at its slot, read by their owner
  const long stride1 = static_cast<long>(C) * b.Sg * D.nh_max, stride2 = static_cast<long>(C) * b.Sg * D.nd_max;
  T* part1 = XG ? b.xg : b.sm + b.L.part1;
  T* part2 = XG ? b.xg + static_cast<long>(C) * stride1 : b.sm + b.L.part2;
  const T* own1 = part1 + (XG ? b.rank * stride1 : 0);  // this block's received partials
  const T* own2 = part2 + (XG ? b.rank * stride2 : 0);
  const bool dt = p.need_t;
  const int blk = b.team * C + b.rank;
  for (int e = threadIdx.x; e < M * nd; e += kThreads) {
    const int m = e / nd, c = e % nd;
    lam[m * D.ldk + c] = p.lam_zero ? T(0) : p.lam[static_cast<long>(b.s0 + m) * d + b.db0 + c];
  }
  const T nT = static_cast<T>(p.n);
  for (int j = p.j1 - 1; j >= p.j0; --j) {
    for (int e = threadIdx.x; e < M * nd; e += kThreads) {
      const int m = e / nd, c = e % nd;
      lam[m * D.ldk + c] += p.grad[(static_cast<long>(b.s0 + m) * p.L + j) * d + b.db0 + c];
    }
    const T tp = j == 0 ? T(0) : p.times[j - 1];
    const T h = (p.times[j] - tp) / nT;
    double dT = 0.0, dTprev = 0.0;  // this block's dLoss/dtimes[j] and dLoss/dt_prev
    for (int k = p.n - 1; k >= 0; --k) {
      const T t = tp + static_cast<T>(k) * h;
      const long q0 = (static_cast<long>(j - p.j0) * p.n + k) * S_;
      if (b.team == 0 && b.rank == 0 && static_cast<int>(threadIdx.x) < S_)
        p.taus[q0 + threadIdx.x] = t + static_cast<T>(tb.c[threadIdx.x]) * h;
      double dt_acc = 0.0, dh_acc = 0.0;  // this thread's share of the block's time partials
      if (dt) {  // the step's slopes (own slices), read by the same threads below
        for (int e = threadIdx.x; e < M * nd; e += kThreads) {
          const int m = e / nd, c = e % nd;
          for (int i = 0; i < S_; ++i)
            async_copy(Ks + i * SgK + m * D.ldk + c, p.tape_k + ((q0 + i) * S + b.s0 + m) * d + b.db0 + c);
        }
        async_wait();
      }
      __syncthreads();  // lam (and the previous stage's gK) complete
      for (int e = threadIdx.x; e < M * nd; e += kThreads) {
        const int m = e / nd, c = e % nd;
        const long own = static_cast<long>(m) * D.ldk + c;
        const T l = lam[own];
        for (int i = 0; i < S_; ++i) {
          gK[i * SgK + own] = h * static_cast<T>(tb.b[i]) * l;
          if (dt && tb.b[i] != 0.0) dh_acc += tb.b[i] * static_cast<double>(l) * static_cast<double>(Ks[i * SgK + own]);
        }
      }
      __syncthreads();
      for (int i = S_ - 1; i >= 0; --i) {
        const long q = q0 + i;
        const double ci = tb.c[i];
        T* gKi = gK + i * SgK;
        // z_i of the own H-slice, needed after the first exchange: fetched meanwhile
        for (int e = threadIdx.x; e < M * nh; e += kThreads) {
          const int m = e / nh, c = e % nh;
          async_copy(zs + m * D.ldz + c, p.tape_z + (q * S + b.s0 + m) * H + b.hb0 + c);
        }
        if (p.gk) {  // gK_i is final: the layer-2 output gradient of this stage
          for (int e = threadIdx.x; e < M * nd; e += kThreads) {
            const int m = e / nd, c = e % nd;
            p.gk[(q * S + b.s0 + m) * d + b.db0 + c] = gKi[m * D.ldk + c];
          }
        }
        // T2: ga partials over the own d-slice, sum_{c in ds} gK_i[m][c] w2[h][c], h < H
        // (h == H: the time row, a time-gradient term), pushed to each h's owner
        block_gemm<T, false>(M, H + (dt ? 1 : 0), nd, gKi, D.ldk, Rows<T>{b.w2}, b.red, [&](int m, int hh, T v) {
          if (hh == H) {
            dt_acc += static_cast<double>(v);
            dh_acc += ci * static_cast<double>(v);
            return;
          }
          const int o = owner_of(hh, H, C);
          Team::push(part1 + (static_cast<long>(b.rank) * b.Sg + m) * D.nh_max + hh - slice_start(o, H, C), o, stride1,
                     v);
        });
        Team::arrive();
        Team::wait();
        async_wait();
        // own H-slice: ga = sum of the C partials in block order; gz = ga act'(z)
        for (int e = threadIdx.x; e < M * nh; e += kThreads) {
          const int m = e / nh, c = e % nh;
          T ga = T(0);
          for (int bb = 0; bb < C; ++bb) ga += xload<XG>(own1 + (static_cast<long>(bb) * b.Sg + m) * D.nh_max + c);
          const T z = zs[m * D.ldz + c];
          const T gz = act_bwd(p.act, z, act_fwd(p.act, z), ga);
          gzl[m * D.ldz + c] = gz;
          if (p.gz) p.gz[(q * S + b.s0 + m) * H + b.hb0 + c] = gz;
        }
        __syncthreads();
        // T1: gy partials over the own H-slice, sum_{h in hs} gz[m][h] w1[c][h], c < d
        // (c == d: the time row), pushed to each c's owner
        block_gemm<T, false>(M, d + (dt ? 1 : 0), nh, gzl, D.ldz, Rows<T>{b.w1}, b.red, [&](int m, int cc, T v) {
          if (cc == d) {
            dt_acc += static_cast<double>(v);
            dh_acc += ci * static_cast<double>(v);
            return;
          }
          const int o = owner_of(cc, d, C);
          Team::push(part2 + (static_cast<long>(b.rank) * b.Sg + m) * D.nd_max + cc - slice_start(o, d, C), o, stride2,
                     v);
        });
        Team::arrive();
        Team::wait();
        // own d-slice: gy = sum of the C partials in block order; lam += gy; gK_m += h a_im gy
        for (int e = threadIdx.x; e < M * nd; e += kThreads) {
          const int m = e / nd, c = e % nd;
          T gy = T(0);
          for (int bb = 0; bb < C; ++bb) gy += xload<XG>(own2 + (static_cast<long>(bb) * b.Sg + m) * D.nd_max + c);
          const long own = static_cast<long>(m) * D.ldk + c;
          lam[own] += gy;
          for (int jj = 0; jj < i; ++jj) {
            const double a = tb.a[i][jj];
            if (a == 0.0) continue;
            gK[jj * SgK + own] += h * static_cast<T>(a) * gy;
            if (dt) dh_acc += a * static_cast<double>(gy) * static_cast<double>(Ks[jj * SgK + own]);
          }
        }
        __syncthreads();
      }
      if (dt) {  // step k at t_k = tp + k h, h = (times[j] - tp) / n
        const double dt_sum = block_sum(dt_acc, b.scratch);
        const double dh_sum = block_sum(dh_acc, b.scratch);
        const double kn = static_cast<double>(k) / p.n;
        dT += dt_sum * kn + dh_sum / p.n;
        dTprev += dt_sum * (1.0 - kn) - dh_sum / p.n;
      }
    }
    if (dt && threadIdx.x == 0) {
      p.dt_end[static_cast<long>(blk) * p.L + j] = static_cast<T>(dT);
      p.dt_start[static_cast<long>(blk) * p.L + j] = static_cast<T>(dTprev);
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < M * nd; e += kThreads) {
    const int m = e / nd, c = e % nd;
    const long g = static_cast<long>(b.s0 + m) * d + b.db0 + c;
    p.lam[g] = lam[m * D.ldk + c];
    if (p.dp0) p.dp0[g] = lam[m * D.ldk + c];
  }
}

// dtimes[j] = sum_b end[b][j] + sum_b start[b][j + 1], added in the order of b
template <typename T>
__global__ void dtimes_reduce(const T* __restrict__ end, const T* __restrict__ start, int nb, int L,
                              T* __restrict__ out) {
  for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < L; j += gridDim.x * blockDim.x) {
    double v = 0.0;
    for (int b = 0; b < nb; ++b) v += static_cast<double>(end[static_cast<long>(b) * L + j]);
    if (j + 1 < L)
      for (int b = 0; b < nb; ++b) v += static_cast<double>(start[static_cast<long>(b) * L + j + 1]);
    out[j] = static_cast<T>(v);
  }
}

// --- Host side: kernels, launches --------------------------------------------------------
template <typename T>
using KernelFn = void (*)(const Params<T>);

template <typename T, class Team>
KernelFn<T> kernel_fn(bool adj) {
  return adj ? &floater_adj_kernel<T, Team> : &floater_fwd_kernel<T, Team>;
}

template <typename T>
KernelFn<T> pick_kernel_t(int mode, bool adj) {
  if (mode == kSolo) return kernel_fn<T, SoloTeam>(adj);
  if (mode == kCluster) return kernel_fn<T, ClusterTeam>(adj);
  return kernel_fn<T, GridTeam>(adj);
}

const void* pick_kernel(int dtype_size, int mode, bool adj) {
  return dtype_size == 4 ? reinterpret_cast<const void*>(pick_kernel_t<float>(mode, adj))
                         : reinterpret_cast<const void*>(pick_kernel_t<double>(mode, adj));
}

// A launch of `kernel` in clusters of C blocks ({C, 1, 1}): fills cfg (whose attribute
// list is attr), after allowing the kernel a non-portable cluster size when C > 8.
cudaError_t cluster_config(const void* kernel, int C, dim3 grid, size_t smem, cudaStream_t stream,
                           cudaLaunchConfig_t* cfg, cudaLaunchAttribute* attr) {
  if (C > 8) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    if (err != cudaSuccess) return err;
  }
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = C;
  attr->val.clusterDim.y = 1;
  attr->val.clusterDim.z = 1;
  *cfg = cudaLaunchConfig_t{};
  cfg->gridDim = grid;
  cfg->blockDim = dim3(kThreads, 1, 1);
  cfg->dynamicSmemBytes = smem;
  cfg->stream = stream;
  cfg->attrs = attr;
  cfg->numAttrs = 1;
  return cudaSuccess;
}

// The three ways of launching a persistent kernel.
template <typename T>
cudaError_t launch_persistent(const Layout& pl, bool adj, cudaStream_t stream, Params<T>& p) {
  KernelFn<T> kernel = pick_kernel_t<T>(pl.mode, adj);
  const dim3 grid(pl.G * pl.C);
  if (p.xg) FLOATER_CUDA_EXCHANGE_BUFFER(p.xg, pl.workspace_bytes);
  const void* fn = reinterpret_cast<const void*>(kernel);
  cudaError_t err = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(pl.smem_bytes));
  if (err != cudaSuccess) return err;
  void* args[] = {&p};
  const dim3 block(kThreads);
  // (the typed overloads of the runtime's launch calls: the same launches)
  if (pl.mode == kSolo) return cudaLaunchKernel(kernel, grid, block, args, pl.smem_bytes, stream);
  if (pl.mode == kGrid) return cudaLaunchCooperativeKernel(kernel, grid, block, args, pl.smem_bytes, stream);
  cudaLaunchConfig_t cfg{};
  cudaLaunchAttribute attr{};
  err = cluster_config(fn, pl.C, grid, pl.smem_bytes, stream, &cfg, &attr);
  if (err != cudaSuccess) return err;
  return cudaLaunchKernelEx(&cfg, kernel, p);
}

// Fill the parameters every launch shares.
template <typename T>
Params<T> base_params(const Problem& pr, const Layout& pl, const Pointers& ptr) {
  Params<T> p{};
  p.w1 = static_cast<const T*>(ptr.w1);
  p.b1 = static_cast<const T*>(ptr.b1);
  p.w2 = static_cast<const T*>(ptr.w2);
  p.b2 = static_cast<const T*>(ptr.b2);
  p.times = static_cast<const T*>(ptr.times);
  p.S = static_cast<int>(pr.S);
  p.d = static_cast<int>(pr.d);
  p.H = static_cast<int>(pr.H);
  p.L = static_cast<int>(pr.L);
  p.n = static_cast<int>(pr.substeps);
  p.act = pr.activation;
  p.tab = tableau(static_cast<Method>(pr.method));
  p.C = pl.C;
  p.G = pl.G;
  p.Sg = pl.Sg;
  p.kr1 = pl.kr1;
  p.kr2 = pl.kr2;
  p.stage_x = pl.stage_x;
  return p;
}

int stages_of(const Problem& pr) { return tableau(static_cast<Method>(pr.method)).stages; }

Dims dims_for(const Problem& pr, int C, int Sg) {
  return dims_of(static_cast<int>(pr.d), static_cast<int>(pr.H), C, Sg, stages_of(pr), 16 / pr.dtype_size);
}

size_t smem_bytes_for(const Problem& pr, int mode, int C, int Sg, int kr1, int kr2, bool stage_x) {
  const SmemLayout L = smem_layout(dims_for(pr, C, Sg), kr1, kr2, mode, stage_x, pr.backward, pr.needs[5],
                                   pr.dtype_size);
  return static_cast<size_t>(L.total) * pr.dtype_size + 64;
}

size_t kernel_workspace_bytes(const Problem& pr, int mode, int C, int Sg, int G) {
  if (mode != kGrid) return 0;
  return static_cast<size_t>(G) * grid_team_elems(dims_for(pr, C, Sg), pr.backward) * pr.dtype_size + 256;
}

// --- Host side: choosing the layout --------------------------------------------------------------
struct DeviceInfo {
  int sms, cc_major;
  size_t smem_optin;
  bool coop, cluster;
};

cudaError_t device_info(int device, DeviceInfo* info) {
  cudaDeviceProp prop;
  cudaError_t err = cudaGetDeviceProperties(&prop, device);
  if (err != cudaSuccess) return err;
  info->sms = prop.multiProcessorCount;
  info->cc_major = prop.major;
  info->smem_optin = static_cast<size_t>(prop.sharedMemPerBlockOptin);
  info->coop = prop.cooperativeLaunch != 0;
  info->cluster = prop.major >= 9;
  return cudaSuccess;
}

// Blocks of `kernel` that fit on one SM with `smem` bytes of dynamic shared memory.
int blocks_per_sm(const void* kernel, size_t smem) {
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)) !=
      cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, smem) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

// Clusters of C blocks of `kernel` co-resident with `smem` bytes each (0: none).
int active_clusters(const void* kernel, int C, size_t smem) {
  cudaLaunchConfig_t cfg{};
  cudaLaunchAttribute attr{};
  if (cluster_config(kernel, C, dim3(C, 1, 1), smem, nullptr, &cfg, &attr) != cudaSuccess ||
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)) !=
          cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return clusters;
}

// choose_layout's cost model: predicted nanoseconds of one stage (the forward's two phases,
// or the adjoint's two reduce-scatters) of one team, the slowest block's. Its constants
// are estimates (benchmarks/NOTES.md, "FLOATER on the GPU at the paper's cost"), to be
// replaced by what a GPU measures; they only rank layouts, never change results.
constexpr double kFmaPerNs = 80.0;        // per SM, float (double: half): LDS-bound products
constexpr double kL2BytesPerNs = 25.0;    // per SM, weight rows streamed from L2
constexpr double kDsmemStoresPerNs = 16.0;  // per SM, 4-byte stores into other blocks
constexpr double kBarrierNs[3] = {40.0, 600.0, 3000.0};  // solo, cluster (+25 ns per block), grid
constexpr double kClusterBarrierPerBlockNs = 25.0;
constexpr double kL2VectorNs = 800.0;     // grid: a phase's vector read back from L2 (latency)

// per_sm: blocks sharing one SM (they share its arithmetic and its path to L2).
double stage_cost(const Problem& pr, int mode, int C, int Sg, int kr1, int kr2, bool stage_x, double per_sm = 1.0) {
  const Dims D = dims_for(pr, C, Sg);
  const double sz = pr.dtype_size;
  const double fma = static_cast<double>(Sg) * (static_cast<double>(pr.d) * D.nh_max + static_cast<double>(pr.H) * D.nd_max);
  double ns = per_sm * fma / (kFmaPerNs * 4.0 / sz);
  // weight rows from L2: each product streams the non-resident rows of its slice
  ns += per_sm * ((pr.d + 1.0 - kr1) * D.nh_max + (pr.H + 1.0 - kr2) * D.nd_max) * sz / kL2BytesPerNs;
  ns += 2.0 * (kBarrierNs[mode] + (mode == kCluster ? kClusterBarrierPerBlockNs * C : 0.0));
  if (mode == kCluster) {
    // forward: every element of a and y to all C blocks; adjoint: every partial to one owner
    const double stores = pr.backward ? Sg * (pr.d + pr.H + 0.0) : static_cast<double>(Sg) * (D.nh_max + D.nd_max) * C;
    ns += stores * (sz / 4.0) / kDsmemStoresPerNs;
  }
  if (mode == kGrid) ns += 2.0 * kL2VectorNs * (stage_x ? 1.0 : 1.5);
  return ns;
}

// The rows of a block's weight slices that fit in `budget` bytes of shared memory
// (w1's first, in proportion to the rows of each).
void resident_rows(const Problem& pr, const Dims& D, size_t budget, int* kr1, int* kr2) {
  const long full = (pr.d + 1) * static_cast<long>(D.ld1) + (pr.H + 1) * static_cast<long>(D.ld2);
  const long fits = static_cast<long>(budget / pr.dtype_size);
  if (fits >= full) {
    *kr1 = static_cast<int>(pr.d + 1);
    *kr2 = static_cast<int>(pr.H + 1);
    return;
  }
  const double f = static_cast<double>(std::max(0L, fits)) / full;
  *kr1 = std::max(0, static_cast<int>((pr.d + 1) * f) - 1);
  *kr2 = std::max(0, static_cast<int>((pr.H + 1) * f) - 1);
}

struct Candidate {
  int mode = -1, C = 0, Sg = 0, kr1 = 0, kr2 = 0;
  bool stage_x = true;
  double ns = 0.0;
  bool better_than(const Candidate& o) const {
    if (o.mode < 0) return true;
    if (ns != o.ns) return ns < o.ns;
    return C < o.C;  // fewer SMs for the same time
  }
};

}  // namespace

int64_t tape_numel(int64_t S, int64_t d, int64_t H, int64_t intervals, int64_t substeps, int method) {
  return intervals * substeps * tableau(static_cast<Method>(method)).stages * S * (d + H);
}

cudaError_t choose_layout(const Problem& pr, int device, Layout* out) {
  DeviceInfo dev{};
  cudaError_t err = device_info(device, &dev);
  if (err != cudaSuccess) return err;
  const long S = std::max<long>(pr.S, 1);
  const size_t limit = dev.smem_optin;
  Candidate best;
  auto consider = [&](Candidate c) {  // the teams run side by side: one team's stage time
    const double blocks = static_cast<double>((S + c.Sg - 1) / c.Sg) * c.C;
    c.ns = stage_cost(pr, c.mode, c.C, c.Sg, c.kr1, c.kr2, c.stage_x, std::max(1.0, std::ceil(blocks / dev.sms)));
    if (c.better_than(best)) best = c;
  };
  // 1. solo: one block holds all the weights; teams are independent blocks.
  {
    const void* k = pick_kernel(pr.dtype_size, kSolo, pr.backward);
    for (long Sg = (S + dev.sms - 1) / dev.sms; Sg <= S; Sg = std::max(Sg + 1, Sg * 2)) {
      const int full1 = static_cast<int>(pr.d + 1), full2 = static_cast<int>(pr.H + 1);
      const size_t smem = smem_bytes_for(pr, kSolo, 1, static_cast<int>(Sg), full1, full2, true);
      if (smem > limit) break;
      const long capacity = static_cast<long>(blocks_per_sm(k, smem)) * dev.sms;
      if (capacity >= (S + Sg - 1) / Sg) {
        consider(Candidate{kSolo, 1, static_cast<int>(Sg), full1, full2, true});
        break;
      }
    }
  }
  // 2. cluster (sm_90+): C = 2..16 blocks (above 8: the non-portable size, where the device
  //    allows it), all G = ceil(S / Sg) clusters co-resident (a cluster's blocks share a
  //    GPC: fewer clusters than SMs / C run at once); weights resident as far as the
  //    cluster's shared memory holds them beside the vectors.
  if (dev.cluster) {
    const void* k = pick_kernel(pr.dtype_size, kCluster, pr.backward);
    const int cmax = static_cast<int>(std::min<long>({kMaxCluster, pr.d, pr.H}));
    for (int C = 2; C <= cmax; ++C) {
      long Sg = std::max<long>(1, (S + dev.sms / C - 1) / std::max(1, dev.sms / C));
      for (int attempt = 0; attempt < 8 && Sg <= S; ++attempt) {
        const Dims D = dims_for(pr, C, static_cast<int>(Sg));
        const size_t without = smem_bytes_for(pr, kCluster, C, static_cast<int>(Sg), 0, 0, true);
        if (without > limit) break;
        int kr1 = 0, kr2 = 0;
        resident_rows(pr, D, limit - without, &kr1, &kr2);
        const size_t smem = smem_bytes_for(pr, kCluster, C, static_cast<int>(Sg), kr1, kr2, true);
        const int active = active_clusters(k, C, smem);
        if (active < 1) break;  // this size does not launch here
        const long G = (S + Sg - 1) / Sg;
        if (G <= active) {
          consider(Candidate{kCluster, C, static_cast<int>(Sg), kr1, kr2, true});
          break;
        }
        Sg = (S + active - 1) / active;  // fewer, fuller teams
      }
    }
  }
  // 3. cooperative grid: any architecture; the weights spread over C blocks (resident as
  //    far as they fit), the vectors staged in shared memory where they fit.
  if (dev.coop) {
    const void* k = pick_kernel(pr.dtype_size, kGrid, pr.backward);
    const long cmax = std::min<long>({8L * dev.sms, pr.d, pr.H});
    for (long C = 2; C <= cmax; C = C < 16 ? C + 1 : C + C / 4) {
      for (int staged = 1; staged >= 0; --staged) {
        long Sg = std::max<long>(1, (S * C + 8L * dev.sms - 1) / (8L * dev.sms));
        for (; Sg <= S; Sg = std::max(Sg + 1, Sg * 2)) {
          const Dims D = dims_for(pr, static_cast<int>(C), static_cast<int>(Sg));
          const size_t without = smem_bytes_for(pr, kGrid, static_cast<int>(C), static_cast<int>(Sg), 0, 0, staged);
          if (without > limit) break;
          int kr1 = 0, kr2 = 0;
          resident_rows(pr, D, limit - without, &kr1, &kr2);
          const size_t smem = smem_bytes_for(pr, kGrid, static_cast<int>(C), static_cast<int>(Sg), kr1, kr2, staged);
          const long capacity = static_cast<long>(blocks_per_sm(k, smem)) * dev.sms;
          if (capacity >= (S + Sg - 1) / Sg * C) {
            consider(Candidate{kGrid, static_cast<int>(C), static_cast<int>(Sg), kr1, kr2, staged != 0});
            break;
          }
        }
      }
    }
  }
  if (best.mode < 0) return cudaErrorInvalidConfiguration;
  Layout pl{};
  err = layout_for(pr, best.mode, best.C, best.Sg, 1.0, &pl, best.stage_x);
  if (err != cudaSuccess) return err;
  // the candidate's resident rows (layout_for above made them all resident)
  pl.kr1 = best.kr1;
  pl.kr2 = best.kr2;
  pl.smem_bytes = smem_bytes_for(pr, pl.mode, pl.C, pl.Sg, pl.kr1, pl.kr2, pl.stage_x);
  pl.stage_ns = best.ns;
  const char* mode = pl.mode == kSolo ? "solo" : (pl.mode == kCluster ? "cluster" : "grid");
  std::snprintf(pl.why, sizeof(pl.why),
                "%s: %d team(s) of %d block(s), %d state(s) each, weight rows resident %d/%ld + %d/%ld%s, %zu B "
                "smem, predicted %.2f us/stage",
                mode, pl.G, pl.C, pl.Sg, pl.kr1, static_cast<long>(pr.d + 1), pl.kr2, static_cast<long>(pr.H + 1),
                pl.mode == kGrid && !pl.stage_x ? ", vectors from L2" : "", pl.smem_bytes, pl.stage_ns / 1e3);
  *out = pl;
  return cudaSuccess;
}

cudaError_t layout_for(const Problem& pr, int mode, int C, int Sg, double resident, Layout* out, bool stage_x) {
  if (mode < kSolo || mode > kGrid || C < 1 || Sg < 1 || (mode == kSolo && C != 1) || (mode != kSolo && C < 2) ||
      (mode == kCluster && C > kMaxCluster) || !(resident >= 0.0 && resident <= 1.0))
    return cudaErrorInvalidValue;
  if (C > pr.d || C > pr.H) return cudaErrorInvalidValue;  // every block owns part of d and H
  const long S = pr.S;
  Layout pl{};
  pl.mode = mode;
  pl.C = C;
  pl.Sg = static_cast<int>(std::min<long>(Sg, std::max<long>(S, 1)));
  pl.kr1 = static_cast<int>((pr.d + 1) * resident);
  pl.kr2 = static_cast<int>((pr.H + 1) * resident);
  pl.stage_x = stage_x || mode != kGrid;
  pl.G = static_cast<int>(std::max<long>(1, (S + pl.Sg - 1) / pl.Sg));
  pl.smem_bytes = smem_bytes_for(pr, mode, C, pl.Sg, pl.kr1, pl.kr2, pl.stage_x);
  pl.workspace_bytes = kernel_workspace_bytes(pr, mode, C, pl.Sg, pl.G);
  pl.stage_ns = stage_cost(pr, mode, C, pl.Sg, pl.kr1, pl.kr2, pl.stage_x);
  std::snprintf(pl.why, sizeof(pl.why), "%s: %d team(s) of %d block(s), %d state(s) each, weight rows resident %d/%ld + %d/%ld%s, %zu B smem (forced)",
                mode == kSolo ? "solo" : (mode == kCluster ? "cluster" : "grid"), pl.G, pl.C, pl.Sg, pl.kr1,
                static_cast<long>(pr.d + 1), pl.kr2, static_cast<long>(pr.H + 1),
                pl.mode == kGrid && !pl.stage_x ? ", vectors from L2" : "", pl.smem_bytes);
  *out = pl;
  return cudaSuccess;
}

// --- Host side: forward and backward -----------------------------------------------------
namespace {

constexpr size_t kChunkBytes = size_t{64} << 20;  // the backward's chunk buffers, at most

long align64(long n) { return (n + 63) / 64 * 64; }

// The backward's workspace (elements of T): lam, the time partials, the grid exchange,
// stage times, dLoss/dz and dLoss/dk of a chunk, and the chunk tape for intervals beyond
// the forward's tape.
struct BwdWorkspace {
  long chunk;  // intervals per chunk
  long lam, dt_end, dt_start, xg, taus, gz, gk, retape, total;
  bool need_gz, need_gk, need_t, retape_k;
};

BwdWorkspace bwd_workspace(const Problem& pr, const Layout& fp, const Layout& ap, TapeRef tape) {
  BwdWorkspace w{};
  const long S = pr.S, d = pr.d, H = pr.H, L = pr.L, n = pr.substeps, s = stages_of(pr);
  w.need_t = pr.needs[5];
  w.need_gz = pr.needs[1] || pr.needs[2];
  w.need_gk = pr.needs[3] || pr.needs[4];
  w.retape_k = w.need_t;
  const long taped = w.need_t || tape.data == nullptr ? 0 : tape.intervals;
  const long rows = n * s * S;  // stage rows of one interval
  const long per = rows * ((w.need_gz ? H : 0) + (w.need_gk ? d : 0) + (taped < L ? d + H + (w.retape_k ? d : 0) : 0));
  w.chunk = pr.chunk_intervals > 0 ? pr.chunk_intervals
                                   : std::max<long>(1, static_cast<long>(kChunkBytes / pr.dtype_size) / std::max(1L, per));
  w.chunk = std::max<long>(1, std::min(w.chunk, L));
  long o = 0;
  auto take = [&o](long elems) {
    const long at = o;
    o += align64(elems);
    return at;
  };
  w.lam = take(S * d);
  const long nb = static_cast<long>(ap.G) * ap.C;
  w.dt_end = take(w.need_t ? nb * L : 0);
  w.dt_start = take(w.need_t ? nb * L : 0);
  w.xg = take(static_cast<long>(std::max(fp.workspace_bytes, ap.workspace_bytes) / pr.dtype_size + 1));
  w.taus = take(w.chunk * n * s);
  w.gz = take(w.need_gz ? w.chunk * rows * H : 0);
  w.gk = take(w.need_gk ? w.chunk * rows * d : 0);
  w.retape = take(taped < L ? w.chunk * rows * (d + H + (w.retape_k ? d : 0)) : 0);
  w.total = o;
  return w;
}

template <typename T>
cudaError_t forward_typed(const Problem& pr, const Layout& pl, const Pointers& ptr, TapeRef tape, cudaStream_t stream) {
  Params<T> p = base_params<T>(pr, pl, ptr);
  p.j0 = 0;
  p.j1 = p.L;
  p.start = static_cast<const T*>(ptr.p0);
  p.start_ld = pr.d;
  p.out = static_cast<T*>(ptr.out);
  if (tape.data != nullptr && tape.intervals > 0) {
    p.tape_y = static_cast<T*>(tape.data);
    p.tape_z = p.tape_y + tape.intervals * pr.substeps * stages_of(pr) * pr.S * pr.d;
    p.tape_j1 = static_cast<int>(tape.intervals);
  }
  p.xg = pl.mode == kGrid ? static_cast<T*>(ptr.workspace) : nullptr;
  return launch_persistent<T>(pl, false, stream, p);
}

template <typename T>
cudaError_t launch_dtimes(const T* end, const T* start, int nb, int L, T* out, cudaStream_t stream) {
  const int threads = 128, blocks = std::min((L + threads - 1) / threads, 1024);
  void* args[] = {&end, &start, &nb, &L, &out};
  return cudaLaunchKernel(&dtimes_reduce<T>, dim3(blocks), dim3(threads), args, 0, stream);
}

template <typename T>
cudaError_t backward_typed(const Problem& pr, const Layout& fp, const Layout& ap, const Pointers& ptr, TapeRef tape,
                           GradSink& sink, cudaStream_t stream) {
  const BwdWorkspace w = bwd_workspace(pr, fp, ap, tape);
  T* ws = static_cast<T*>(ptr.workspace);
  const long S = pr.S, d = pr.d, H = pr.H, L = pr.L, n = pr.substeps, s = stages_of(pr);
  const long rows = n * s * S;
  const long taped = w.need_t || tape.data == nullptr ? 0 : tape.intervals;
  Problem fpr = pr;
  fpr.backward = false;
  bool first = true;
  for (long j1 = L; j1 > 0;) {
    const long j0 = j1 > taped ? std::max(taped, j1 - w.chunk) : std::max(0L, j1 - w.chunk);
    const long stages = (j1 - j0) * n * s;
    const T *Y, *Z;
    T* K = nullptr;
    cudaError_t err;
    if (j0 >= taped) {  // integrate the chunk again, from the state entering it, onto the chunk tape
      Params<T> p = base_params<T>(fpr, fp, ptr);
      p.j0 = static_cast<int>(j0);
      p.j1 = static_cast<int>(j1);
      p.start = j0 == 0 ? static_cast<const T*>(ptr.p0) : static_cast<const T*>(ptr.out_saved) + (j0 - 1) * d;
      p.start_ld = j0 == 0 ? d : L * d;
      p.tape_y = ws + w.retape;
      p.tape_z = p.tape_y + stages * S * d;
      if (w.retape_k) p.tape_k = p.tape_z + stages * S * H;
      p.tape_j1 = static_cast<int>(j1);
      p.xg = fp.mode == kGrid ? ws + w.xg : nullptr;
      err = launch_persistent<T>(fp, false, stream, p);
      if (err != cudaSuccess) return err;
      Y = p.tape_y;
      Z = p.tape_z;
      K = p.tape_k;
    } else {  // the forward's tape: interval j0 onwards
      const T* base = static_cast<const T*>(tape.data);
      Y = base + j0 * rows * d;
      Z = base + taped * rows * d + j0 * rows * H;
    }
    Params<T> p = base_params<T>(pr, ap, ptr);
    p.j0 = static_cast<int>(j0);
    p.j1 = static_cast<int>(j1);
    p.tape_y = const_cast<T*>(Y);
    p.tape_z = const_cast<T*>(Z);
    p.tape_k = K;
    p.grad = static_cast<const T*>(ptr.grad);
    p.lam = ws + w.lam;
    p.lam_zero = first;
    p.dp0 = j0 == 0 ? static_cast<T*>(ptr.dp0) : nullptr;
    p.gz = w.need_gz ? ws + w.gz : nullptr;
    p.gk = w.need_gk ? ws + w.gk : nullptr;
    p.taus = ws + w.taus;
    p.need_t = w.need_t;
    p.dt_end = w.need_t ? ws + w.dt_end : nullptr;
    p.dt_start = w.need_t ? ws + w.dt_start : nullptr;
    p.xg = ap.mode == kGrid ? ws + w.xg : nullptr;
    err = launch_persistent<T>(ap, true, stream, p);
    if (err != cudaSuccess) return err;
    if (w.need_gz) {
      err = sink.layer(1, Y, p.gz, p.taus, stages, d, H);
      if (err != cudaSuccess) return err;
    }
    if (w.need_gk) {
      err = sink.layer(2, Z, p.gk, p.taus, stages, H, d);
      if (err != cudaSuccess) return err;
    }
    first = false;
    j1 = j0;
  }
  if (w.need_t && ptr.dtimes != nullptr)
    return launch_dtimes<T>(ws + w.dt_end, ws + w.dt_start, ap.G * ap.C, static_cast<int>(L), static_cast<T*>(ptr.dtimes),
                            stream);
  return cudaSuccess;
}

}  // namespace

size_t forward_workspace_bytes(const Problem&, const Layout& layout) { return layout.workspace_bytes; }

cudaError_t forward(const Problem& pr, const Layout& layout, const Pointers& ptr, TapeRef tape, cudaStream_t stream) {
  if (pr.S == 0 || pr.L == 0 || pr.d == 0) return cudaSuccess;  // nothing to integrate
  return pr.dtype_size == 4 ? forward_typed<float>(pr, layout, ptr, tape, stream)
                            : forward_typed<double>(pr, layout, ptr, tape, stream);
}

size_t backward_workspace_bytes(const Problem& pr, const Layout& flayout, const Layout& alayout, TapeRef tape) {
  if (pr.S == 0 || pr.L == 0 || pr.d == 0) return 0;
  return static_cast<size_t>(bwd_workspace(pr, flayout, alayout, tape).total) * pr.dtype_size + 256;
}

cudaError_t backward(const Problem& pr, const Layout& flayout, const Layout& alayout, const Pointers& ptr, TapeRef tape,
                     GradSink& sink, cudaStream_t stream) {
  if (pr.S == 0 || pr.L == 0 || pr.d == 0) return cudaSuccess;
  return pr.dtype_size == 4 ? backward_typed<float>(pr, flayout, alayout, ptr, tape, sink, stream)
                            : backward_typed<double>(pr, flayout, alayout, ptr, tape, sink, stream);
}

int compiled_version() { return CUDART_VERSION; }

}  // namespace cuda
}  // namespace floater
}  // namespace posenc_fast
