// FLOATER integrator on CUDA: the whole integration (S states x L sample times x substeps
// x stages) in one persistent launch, and the discrete-adjoint backward in one more
// (plus a small deterministic reduction launch when several blocks hold partial sums).
//
// Shapes (floater_common.h): p0 [S, d], w1 [d+1, H], b1 [H], w2 [H+1, d], b2 [d],
// times [L], out / grad [S, L, d]. All contiguous, one dtype (float or double).
//
// Layout of the work
// - The S states are split into G "teams" of Sg states. A team is C thread blocks that
//   split the dynamics between them: block b owns the H-slice hs_b (columns of w1, so
//   z[:, hs_b] and a[:, hs_b]) and the d-slice ds_b (columns of w2, so the slopes and the
//   state p[:, ds_b]). Its weight slices live in shared memory ("resident"), padded to odd
//   row strides so that both the row and the column walks are free of bank conflicts;
//   beyond what the team's shared memory holds they are read from L2 instead.
// - One stage = two phases separated by team-wide barriers:
//     A: every block reads the full stage input Y [Sg, d] and computes its z, a slices
//     B: every block reads the full activation A [Sg, H] and computes its slope slice,
//        then the Runge-Kutta combination of its state slice (the next Y slice).
//   The vectors go through an exchange buffer: shared memory when the team is one block
//   ("solo"), else global memory read with ld.global.cg (L2; the L1 of another SM may hold
//   stale lines), with a thread-block-cluster barrier (sm_90, C <= 16: "cluster") or a
//   cooperative grid barrier ("grid", any arch, C beyond a cluster). The full vectors are
//   staged in shared memory before each product, unless the weight slices need that room
//   (d = H = 1024: then the products read them from L2 directly).
// - plan() picks the layout from the shapes and the device's properties: solo if one
//   block's shared memory holds everything, else the smallest cluster, else the smallest
//   cooperative team; POSENC_FAST_CUDA_PLAN forces one (floater_cuda_ops.cpp).
// - Testing without a GPU: tools/cuda_emulation compiles this file as host C++ with one
//   std::thread per CUDA thread (tests/test_extension_cuda_emulation.py).
// - Backward (per team): intervals in reverse; each interval's sub-steps are recomputed
//   from its stored starting state (out[:, j-1] or p0); each step is recomputed once more
//   keeping its stage values, then differentiated stage by stage. Transposed products
//   (dLoss/da, dLoss/dy) are reduce-scatters: every block writes its partial sums over its
//   own slice, and the owner of each output slice adds the C partials in block order.
//   Weight gradients: each element is owned by one block (the one that holds that weight)
//   and updated once per step with a sum over (stage, state) in a fixed order; per-team
//   partials (and per-block time-gradient partials) are added in team order by a second,
//   tiny launch. No float atomics anywhere: runs are bitwise reproducible on one GPU.
// - Inside a block, every small product goes through block_gemm: threads own output
//   elements (4 states x 1 column each), the reduction dimension is split into a fixed
//   number of contiguous parts when the output is too small to occupy the block, and the
//   parts are added in order. Everything depends on the shapes only (determinism).
#if defined(POSENC_FAST_CUDA_EMULATION)
// tools/cuda_emulation: the kernels compiled as host C++ with one std::thread per CUDA
// thread, so their logic can be tested on machines without a GPU.
#include "cuda_emulation.h"
#else
#include <cooperative_groups.h>
#include <cuda_runtime.h>
#define PF_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "floater_common.h"
#include "floater_cuda.h"

namespace cg = cooperative_groups;

namespace posenc_fast {
namespace floater {
namespace cuda {

namespace {

#ifndef POSENC_FAST_CUDA_THREADS
#define POSENC_FAST_CUDA_THREADS 256
#endif
// Threads per block (a multiple of 32). The CPU emulation builds with fewer to spawn fewer
// host threads; nothing else depends on the value.
constexpr int kThreads = POSENC_FAST_CUDA_THREADS;
constexpr int kRT = 4;                          // states per thread in block_gemm
constexpr int kRedElems = 2 * kThreads * kRT;   // K-split scratch of block_gemm
constexpr int kMaxCluster = 16;                 // non-portable cluster size on sm_90

enum Mode { kSolo = 0, kCluster = 1, kGrid = 2 };

// ------------------------------------------------------------------------------------
// Team barriers
// ------------------------------------------------------------------------------------
struct SoloTeam {
  static constexpr bool kSmemExchange = true;
  __device__ static void sync() { __syncthreads(); }
  __device__ static int team(int) { return blockIdx.x; }
  __device__ static int rank(int) { return 0; }
};

struct ClusterTeam {
  static constexpr bool kSmemExchange = false;
  __device__ static void sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    cg::this_cluster().sync();  // barrier.cluster arrive.release / wait.acquire
#else
    __trap();  // never launched below sm_90 (plan() checks the device)
#endif
  }
  __device__ static int team(int C) { return blockIdx.x / C; }
  __device__ static int rank(int C) { return blockIdx.x % C; }  // == cluster block rank for {C,1,1}
};

struct GridTeam {
  static constexpr bool kSmemExchange = false;
  __device__ static void sync() { cg::this_grid().sync(); }
  __device__ static int team(int C) { return blockIdx.x / C; }
  __device__ static int rank(int C) { return blockIdx.x % C; }
};

// Loads of memory that other blocks write (XG: a global exchange buffer): through L2 only
// (the L1 of this SM may hold stale lines).
template <bool XG, typename T>
__device__ __forceinline__ T ld_x(const T* p) {
  if constexpr (XG) {
    return __ldcg(p);
  } else {
    return *p;
  }
}

// Loads of a team's exchange buffers: shared memory (solo) or global memory.
template <class Team, typename T>
__device__ __forceinline__ T xload(const T* p) {
  return ld_x<!Team::kSmemExchange>(p);
}

// ------------------------------------------------------------------------------------
// Activations (accurate libdevice functions: no fast-math intrinsics)
// ------------------------------------------------------------------------------------
__device__ __forceinline__ float dev_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double dev_tanh(double x) { return tanh(x); }
__device__ __forceinline__ float dev_cdf(float z) { return 0.5f * erfcf(-z * 0.70710678118654752f); }
__device__ __forceinline__ double dev_cdf(double z) { return 0.5 * erfc(-z * 0.70710678118654752440); }
__device__ __forceinline__ float dev_pdf(float z) { return expf(-0.5f * z * z) * 0.3989422804014327f; }
__device__ __forceinline__ double dev_pdf(double z) { return exp(-0.5 * z * z) * 0.39894228040143267794; }

template <typename T>
__device__ __forceinline__ T act_fwd(int act, T z) {
  switch (act) {
    case static_cast<int>(Activation::ReLU):
      return z < T(0) ? T(0) : z;
    case static_cast<int>(Activation::Tanh):
      return dev_tanh(z);
    case static_cast<int>(Activation::GELU):
      return z * dev_cdf(z);
    default:
      return z;
  }
}

// dLoss/dz from dLoss/da, given z and a = act(z)
template <typename T>
__device__ __forceinline__ T act_bwd(int act, T z, T a, T ga) {
  switch (act) {
    case static_cast<int>(Activation::ReLU):
      return z > T(0) ? ga : T(0);
    case static_cast<int>(Activation::Tanh):
      return ga * (T(1) - a * a);
    case static_cast<int>(Activation::GELU):
      return ga * (dev_cdf(z) + z * dev_pdf(z));
    default:
      return ga;
  }
}

// ------------------------------------------------------------------------------------
// block_gemm: v(m, n) = sum_{k<K} X[m*ldx + k] * W[k*sk + n*sn], m < M, n < N; epi(m, n, v)
// X in shared memory (or, XG, in another block's global exchange buffer, read through L2);
// W in shared or global memory (generic pointer).
// ------------------------------------------------------------------------------------
template <typename T, bool XG = false, typename Epi>
__device__ void block_gemm(int M, int N, int K, const T* __restrict__ X, int ldx, const T* W, long sk,
                           long sn, T* red, Epi epi) {
  const int MG = (M + kRT - 1) / kRT;
  const int items = MG * N;
  int P = 1;  // K-split: a function of the shapes only
  while (P < 32 && items * P < kThreads && 2 * P <= K) P *= 2;
  if (P == 1) {
    for (int it = threadIdx.x; it < items; it += kThreads) {
      const int n = it % N, m0 = (it / N) * kRT;
      T acc[kRT];
#pragma unroll
      for (int r = 0; r < kRT; ++r) acc[r] = T(0);
      const T* w = W + n * sn;
      for (int k = 0; k < K; ++k) {
        const T wk = w[k * sk];
#pragma unroll
        for (int r = 0; r < kRT; ++r) acc[r] += ld_x<XG>(X + min(m0 + r, M - 1) * ldx + k) * wk;
      }
#pragma unroll
      for (int r = 0; r < kRT; ++r)
        if (m0 + r < M) epi(m0 + r, n, acc[r]);
    }
    __syncthreads();
    return;
  }
  for (int it = threadIdx.x; it < items * P; it += kThreads) {
    const int n = it % N, rest = it / N;
    const int m0 = (rest % MG) * kRT, p = rest / MG;
    const int k0 = static_cast<int>(static_cast<long>(K) * p / P);
    const int k1 = static_cast<int>(static_cast<long>(K) * (p + 1) / P);
    T acc[kRT];
#pragma unroll
    for (int r = 0; r < kRT; ++r) acc[r] = T(0);
    const T* w = W + n * sn;
    for (int k = k0; k < k1; ++k) {
      const T wk = w[k * sk];
#pragma unroll
      for (int r = 0; r < kRT; ++r) acc[r] += ld_x<XG>(X + min(m0 + r, M - 1) * ldx + k) * wk;
    }
#pragma unroll
    for (int r = 0; r < kRT; ++r)
      if (m0 + r < M) red[(p * M + m0 + r) * N + n] = acc[r];
  }
  __syncthreads();
  for (int it = threadIdx.x; it < M * N; it += kThreads) {
    const int m = it / N, n = it % N;
    T v = red[m * N + n];
    for (int p = 1; p < P; ++p) v += red[(p * M + m) * N + n];
    epi(m, n, v);
  }
  __syncthreads();
}

// Deterministic block-wide sum (fixed shuffle tree, then warps in order); result in thread 0.
__device__ double block_sum(double v, double* scratch) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  double s = 0.0;
  if (threadIdx.x == 0)
    for (int w = 0; w < kThreads / 32; ++w) s += scratch[w];
  __syncthreads();
  return s;
}

// Offsets inside one team's global workspace.
struct TeamWs {
  long yx, ax, part1, part2, starts, total;
};
__host__ __device__ inline TeamWs team_ws_layout(int stages, int Sg, int d, int H, int C, int n, bool bwd,
                                                 bool smem_exchange) {
  TeamWs w{};
  long o = 0;
  if (!smem_exchange) {
    w.yx = o;
    o += static_cast<long>(stages) * Sg * d;
    w.ax = o;
    o += static_cast<long>(stages) * Sg * H;
    if (bwd) {
      w.part1 = o;
      o += static_cast<long>(C) * Sg * (H + 1);
      w.part2 = o;
      o += static_cast<long>(C) * Sg * (d + 1);
    }
  }
  if (bwd) {
    w.starts = o;
    o += static_cast<long>(n) * Sg * d;
  }
  w.total = o;
  return w;
}

// The whole global workspace (elements of T): the G teams' regions, then (backward) the
// per-team weight-gradient partials (only when G > 1) and the per-block time-gradient
// partials. A weight-gradient partial holds dw1, db1, dw2, db2 at the offsets below.
struct WsLayout {
  TeamWs team;               // one team's region
  long team_total;           // the G teams' regions, at offset 0
  long dw1, db1, dw2, db2;   // offsets inside a weight-gradient partial
  long nW;                   // elements of a partial: (d+1)H + H + (H+1)d + d
  long dW_part;              // [G][nW] (backward, G > 1)
  long dt_part;              // [G*C][L] (backward)
  long total;
};
__host__ __device__ inline WsLayout ws_layout(int stages, int Sg, int d, int H, int C, int G, int n, int L, bool bwd,
                                              bool smem_exchange) {
  WsLayout w{};
  w.team = team_ws_layout(stages, Sg, d, H, C, n, bwd, smem_exchange);
  w.team_total = static_cast<long>(G) * w.team.total;
  w.dw1 = 0;
  w.db1 = w.dw1 + static_cast<long>(d + 1) * H;
  w.dw2 = w.db1 + H;
  w.db2 = w.dw2 + static_cast<long>(H + 1) * d;
  w.nW = w.db2 + d;
  long o = w.team_total;
  if (bwd) {
    w.dW_part = o;
    if (G > 1) o += static_cast<long>(G) * w.nW;
    w.dt_part = o;
    o += static_cast<long>(G) * C * L;
  }
  w.total = o;
  return w;
}

// ------------------------------------------------------------------------------------
// Kernel parameters and per-block views
// ------------------------------------------------------------------------------------
template <typename T>
struct Params {
  const T *p0, *w1, *b1, *w2, *b2, *times;
  T* out;
  const T *grad, *out_saved;
  T *dp0, *dw1, *db1, *dw2, *db2, *dtimes;
  int S, d, H, L, n;  // n = substeps
  int act;
  Tableau tab;
  int C, G, Sg;
  bool resident;
  bool stage_x;  // copy the exchanged vectors into shared memory before each product
  int ld1, ld2;
  bool need_w1, need_b1, need_w2, need_b2, need_t, need_p0;
  // global workspace (ws_layout)
  T* ws;
  WsLayout wl;
  T* dW_part;       // ws + wl.dW_part (backward, G > 1), else null
  T* dt_part;       // ws + wl.dt_part (backward), else null
};

// Shared-memory carve-up (elements of T), the same on host (sizing) and device.
struct SmemLayout {
  long w1, w2, yx, ax, part1, part2, stage, P, K, lam, gK, Z, GZ, red, total;
};
__host__ __device__ inline SmemLayout smem_layout(int stages, int Sg, int d, int H, int nh, int nd, int ld1,
                                                  int ld2, bool resident, bool smem_exchange, bool stage_x,
                                                  bool bwd) {
  SmemLayout s{};
  long o = 0;
  auto take = [&o](long n) {
    const long at = o;
    o += (n + 1) / 2 * 2;  // keep 16-byte alignment for doubles
    return at;
  };
  s.w1 = take(resident ? static_cast<long>(d + 1) * ld1 : 0);
  s.w2 = take(resident ? static_cast<long>(H + 1) * ld2 : 0);
  if (smem_exchange) {
    s.yx = take(static_cast<long>(stages) * Sg * d);
    s.ax = take(static_cast<long>(stages) * Sg * H);
    s.part1 = take(bwd ? static_cast<long>(Sg) * (H + 1) : 0);
    s.part2 = take(bwd ? static_cast<long>(Sg) * (d + 1) : 0);
    s.stage = take(0);
  } else {
    s.yx = s.ax = s.part1 = s.part2 = take(0);
    s.stage = take(stage_x ? static_cast<long>(Sg) * (d > H ? d : H) : 0);
  }
  s.P = take(static_cast<long>(Sg) * nd);
  s.K = take(static_cast<long>(stages) * Sg * nd);
  s.lam = take(bwd ? static_cast<long>(Sg) * nd : 0);
  s.gK = take(bwd ? static_cast<long>(stages) * Sg * nd : 0);
  s.Z = take(bwd ? static_cast<long>(stages) * Sg * nh : 0);
  s.GZ = take(bwd ? static_cast<long>(stages) * Sg * nh : 0);
  s.red = take(kRedElems + 2 * (kThreads / 32));  // + block_sum scratch (as doubles)
  s.total = o;
  return s;
}

template <typename T, class Team>
struct Block {
  // geometry
  int team, rank, C, s0, M;  // M: states of this team
  int hb0, nh, db0, nd;      // slices
  int d, H, stages;
  // weights (shared or global): element (k, n) of the slice at W1[k*ld1 + n], W2[k*ld2 + n]
  const T* W1;
  const T* W2;
  int ld1, ld2;
  const T* b1;  // global, full
  const T* b2;
  // exchange: Yx[i] [Sg][d], Ax[i] [Sg][H] (full vectors; shared or global)
  T* yx;
  T* ax;
  T* part1;  // [C][Sg][H+1]
  T* part2;  // [C][Sg][d+1]
  T* stage;  // staging copy of a full vector block (global exchange only)
  int Sg;
  // own slices (shared): P [Sg][nd], K [stages][Sg][nd], lam, gK, Z [stages][Sg][nh], GZ
  T *P, *K, *lam, *gK, *Z, *GZ, *red;
  double* dscratch;
  T* starts;  // global [n][Sg][d] (owner-written slices)

  __device__ T* Y(int i) { return yx + static_cast<long>(i) * Sg * d; }
  __device__ T* A(int i) { return ax + static_cast<long>(i) * Sg * H; }

  // Full [M][K] block of an exchange buffer as a shared-memory operand.
  __device__ const T* operand(const T* src, int K) {
    if constexpr (Team::kSmemExchange) {
      return src;
    } else {
      for (int e = threadIdx.x; e < M * K; e += kThreads) stage[e] = __ldcg(src + e);
      __syncthreads();
      return stage;
    }
  }

  // block_gemm over the team's M states with X = a full [M][K] block of an exchange
  // buffer: staged into shared memory first (operand), or (stage_x false, global exchange)
  // read from L2 by the product itself. v(m, n) = sum_k X[m][k] W[k*ldw + n], n < N.
  template <typename Epi>
  __device__ void gemm_exchanged(bool stage_x, const T* X, int K, int N, const T* W, int ldw, Epi epi) {
    if (Team::kSmemExchange || stage_x)
      block_gemm<T, false>(M, N, K, operand(X, K), K, W, ldw, 1, red, epi);
    else
      block_gemm<T, true>(M, N, K, X, K, W, ldw, 1, red, epi);
  }
};

template <typename T, class Team>
__device__ Block<T, Team> make_block(const Params<T>& p, unsigned char* smem_raw, bool bwd) {
  Block<T, Team> b;
  b.C = p.C;
  b.team = Team::team(p.C);
  b.rank = Team::rank(p.C);
  b.s0 = b.team * p.Sg;
  b.M = min(p.Sg, p.S - b.s0);
  b.Sg = p.Sg;
  b.d = p.d;
  b.H = p.H;
  b.stages = p.tab.stages;
  b.hb0 = static_cast<int>(static_cast<long>(p.H) * b.rank / p.C);
  b.nh = static_cast<int>(static_cast<long>(p.H) * (b.rank + 1) / p.C) - b.hb0;
  b.db0 = static_cast<int>(static_cast<long>(p.d) * b.rank / p.C);
  b.nd = static_cast<int>(static_cast<long>(p.d) * (b.rank + 1) / p.C) - b.db0;
  const int nh_max = (p.H + p.C - 1) / p.C, nd_max = (p.d + p.C - 1) / p.C;
  const SmemLayout L = smem_layout(p.tab.stages, p.Sg, p.d, p.H, nh_max, nd_max, p.ld1, p.ld2, p.resident,
                                   Team::kSmemExchange, p.stage_x, bwd);
  T* sm = reinterpret_cast<T*>(smem_raw);
  if (p.resident) {
    T* w1s = sm + L.w1;
    T* w2s = sm + L.w2;
    for (long e = threadIdx.x; e < static_cast<long>(p.d + 1) * b.nh; e += kThreads) {
      const long k = e / b.nh, c = e % b.nh;
      w1s[k * p.ld1 + c] = p.w1[k * p.H + b.hb0 + c];
    }
    for (long e = threadIdx.x; e < static_cast<long>(p.H + 1) * b.nd; e += kThreads) {
      const long k = e / b.nd, c = e % b.nd;
      w2s[k * p.ld2 + c] = p.w2[k * p.d + b.db0 + c];
    }
    b.W1 = w1s;
    b.W2 = w2s;
    b.ld1 = p.ld1;
    b.ld2 = p.ld2;
  } else {
    b.W1 = p.w1 + b.hb0;
    b.W2 = p.w2 + b.db0;
    b.ld1 = p.H;
    b.ld2 = p.d;
  }
  b.b1 = p.b1;
  b.b2 = p.b2;
  const TeamWs& tw = p.wl.team;
  T* gws = p.ws + static_cast<long>(b.team) * tw.total;
  if constexpr (Team::kSmemExchange) {
    b.yx = sm + L.yx;
    b.ax = sm + L.ax;
    b.part1 = sm + L.part1;
    b.part2 = sm + L.part2;
  } else {
    b.yx = gws + tw.yx;
    b.ax = gws + tw.ax;
    b.part1 = gws + tw.part1;
    b.part2 = gws + tw.part2;
  }
  b.stage = sm + L.stage;
  b.P = sm + L.P;
  b.K = sm + L.K;
  b.lam = sm + L.lam;
  b.gK = sm + L.gK;
  b.Z = sm + L.Z;
  b.GZ = sm + L.GZ;
  b.red = sm + L.red;
  b.dscratch = reinterpret_cast<double*>(sm + L.red + kRedElems);
  b.starts = gws + tw.starts;
  __syncthreads();
  return b;
}

// ------------------------------------------------------------------------------------
// One Runge-Kutta step of the team's states from the state slices in b.P (and the full
// stage-0 input already in Y(0)), at time t with step h.
//   keep_z:      store z in b.Z (backward)
//   write_next:  after the step, write the new state into Y(0) (the next step's input)
//   out_j >= 0:  write the new state to out[:, out_j]
//   starts_dst:  write the new state slice there too ([Sg][d] global, own columns)
// Ends after a team barrier: the new Y(0) is visible to the whole team.
// ------------------------------------------------------------------------------------
template <typename T, class Team>
__device__ void rk_step(Block<T, Team>& b, const Params<T>& p, T t, T h, bool keep_z, bool write_next, int out_j,
                        T* starts_dst) {
  const Tableau& tb = p.tab;
  const int d = b.d, H = b.H;
  for (int i = 0; i < tb.stages; ++i) {
    const T tau = t + static_cast<T>(tb.c[i]) * h;
    // Phase A: z = Y_i @ w1[:d, hs] + tau w1[d, hs] + b1[hs]; a = act(z) -> A_i[:, hs]
    {
      T* Ai = b.A(i);
      T* Zi = b.Z + static_cast<long>(i) * b.Sg * b.nh;
      const T* W1 = b.W1;
      const int ld1 = b.ld1, hb0 = b.hb0, nh = b.nh;
      const T* b1 = b.b1;
      const int act = p.act;
      auto epi = [&](int m, int n, T v) {
        const T z = v + (b1[hb0 + n] + tau * W1[static_cast<long>(d) * ld1 + n]);
        Ai[static_cast<long>(m) * H + hb0 + n] = act_fwd(act, z);
        if (keep_z) Zi[m * nh + n] = z;
      };
      b.gemm_exchanged(p.stage_x, b.Y(i), d, nh, W1, ld1, epi);
    }
    Team::sync();
    // Phase B: k_i = A_i @ w2[:H, ds] + tau w2[H, ds] + b2[ds]; then the combination
    {
      const T* W2 = b.W2;
      const int ld2 = b.ld2, db0 = b.db0, nd = b.nd, Sg = b.Sg;
      const T* b2 = b.b2;
      T* Kb = b.K;
      T* P = b.P;
      const bool last = i + 1 == tb.stages;
      T* Ynext = last ? (write_next ? b.Y(0) : nullptr) : b.Y(i + 1);
      T* out = p.out;
      const int L = p.L;
      auto epi = [&](int m, int n, T v) {
        const T k = v + (b2[db0 + n] + tau * W2[static_cast<long>(H) * ld2 + n]);
        const long own = static_cast<long>(m) * nd + n;
        Kb[static_cast<long>(i) * Sg * nd + own] = k;
        T s = T(0);
        bool any = false;
        for (int j = 0; j <= i; ++j) {
          const double c = last ? tb.b[j] : tb.a[i + 1][j];
          if (c == 0.0) continue;
          const T kj = j == i ? k : Kb[static_cast<long>(j) * Sg * nd + own];
          s = any ? s + static_cast<T>(c) * kj : static_cast<T>(c) * kj;
          any = true;
        }
        const T y = P[own] + h * s;
        if (last) {
          P[own] = y;
          if (out_j >= 0) out[(static_cast<long>(b.s0 + m) * L + out_j) * d + db0 + n] = y;
          if (starts_dst) starts_dst[static_cast<long>(m) * d + db0 + n] = y;
        }
        if (Ynext) Ynext[static_cast<long>(m) * d + db0 + n] = y;
      };
      b.gemm_exchanged(p.stage_x, b.A(i), H, nd, W2, ld2, epi);
    }
    Team::sync();
  }
}

// Publish the state slice b.P as the stage-0 input Y(0) (then a team barrier).
template <typename T, class Team>
__device__ void publish_state(Block<T, Team>& b) {
  T* Y0 = b.Y(0);
  for (int e = threadIdx.x; e < b.M * b.nd; e += kThreads) {
    const int m = e / b.nd, n = e % b.nd;
    Y0[static_cast<long>(m) * b.d + b.db0 + n] = b.P[e];
  }
  Team::sync();
}

// ------------------------------------------------------------------------------------
// Forward kernel
// ------------------------------------------------------------------------------------
template <typename T, class Team>
__global__ void __launch_bounds__(kThreads) floater_fwd_kernel(const Params<T> p) {
  PF_DYNAMIC_SMEM(smem_raw);
  Block<T, Team> b = make_block<T, Team>(p, smem_raw, false);
  for (int e = threadIdx.x; e < b.M * b.nd; e += kThreads) {
    const int m = e / b.nd, n = e % b.nd;
    b.P[e] = p.p0[static_cast<long>(b.s0 + m) * p.d + b.db0 + n];
  }
  __syncthreads();
  publish_state(b);
  const T nT = static_cast<T>(p.n);
  for (int j = 0; j < p.L; ++j) {
    const T tp = j == 0 ? T(0) : p.times[j - 1];
    const T h = (p.times[j] - tp) / nT;
    for (int k = 0; k < p.n; ++k)
      rk_step(b, p, tp + static_cast<T>(k) * h, h, false, true, k + 1 == p.n ? j : -1, static_cast<T*>(nullptr));
  }
}

// ------------------------------------------------------------------------------------
// Backward kernel
// ------------------------------------------------------------------------------------
template <typename T, class Team>
__device__ void load_start(Block<T, Team>& b, const Params<T>& p, int j) {
  for (int e = threadIdx.x; e < b.M * b.nd; e += kThreads) {
    const int m = e / b.nd, n = e % b.nd;
    const long s = b.s0 + m;
    b.P[e] = j == 0 ? p.p0[s * p.d + b.db0 + n] : p.out_saved[(s * p.L + (j - 1)) * p.d + b.db0 + n];
    b.starts[static_cast<long>(m) * p.d + b.db0 + n] = b.P[e];
  }
  __syncthreads();
}

// Weight gradients of one step, over a block's own columns [c0, c0 + N) of a layer whose
// weights are dw [K+1][ldw] (row K: the time row) and bias db: for k < K, n < N,
//   dw[k][c0 + n] += sum_i sum_m X_i[m][k] G_i[m][n],
//   dw[K][c0 + n] += sum_i tau_i sum_m G_i[m][n],   db[c0 + n] += sum_i sum_m G_i[m][n],
// X_i = X + i * x_stage ([M][K], an exchange buffer), G_i = G + i * g_stage ([M][N], shared),
// summed over the rows r = i * M + m in order (determinism), then added to dw.
//
// Why this shape (the first H200 run: this loop was ~61% of the backward). The previous
// version gave each thread one element at a time and walked (i, m) reading X_i[m][k] from
// the global exchange buffer (ld.global.cg, L2) with one FMA after each load, then a
// load-add-store of dw: with R = stages x M rows, R + 1 dependent L2 round trips per
// element (at Sg = 2 the loop was not even unrolled): S=12 d=H=512 rk38 on 11-block
// clusters is 94 elements per thread per call, ~850 dependent round trips (~0.24 us each).
// Now, per call:
//   1. X's rows are staged in shared memory in chunks of kc columns (the block's block_gemm
//      scratch `red`, free between products: kc = kRedElems / R, 256 columns at R = 8),
//      each thread's share loaded in batches of kStageBatch independent loads (one round
//      trip per batch: for that case, 1 per chunk, 2 chunks). Solo teams skip this: their
//      exchange buffers are shared memory already.
//   2. A thread owns a column n and kWgU consecutive rows k: the kWgU old dw values are
//      loaded together (one round trip per kWgU elements, 4 floats: 24 instead of 94 here),
//      the sums read only shared memory (G_i[m][n] once per row r for kWgU FMAs; X broadcast
//      across the warp), and dw is stored once.
// So ~26 instead of ~850 dependent L2 round trips per thread per call for that case; the
// summation order within a chunk of rows is the old one, and rows are only split into
// several chunks (each added to dw in turn) when R exceeds the scratch (R > 2048).
// Accumulating dw over an interval's substeps on chip was not done: one block's share of
// one layer (K x N: 512 x 47 floats = 94 KB here) does not fit beside its resident weights.
// elements (consecutive rows k) per thread and pass: 4 floats, 2 doubles (old and acc are
// live across the sums; the solo backward kernels sit at 128 registers and spill already)
template <typename T>
constexpr int kWgU = sizeof(T) >= 8 ? 2 : 4;
constexpr int kStageBatch = 8;   // independent loads per thread when staging X
template <typename T, class Team>
__device__ void add_weight_grads(const Tableau& tb, T t, T h, int M, const T* X, long x_stage, int K, const T* G,
                                 long g_stage, int N, int c0, T* dw, long ldw, T* db, bool need_w, bool need_b,
                                 T* scratch) {
  if (!need_w && !need_b) return;
  const int S_ = tb.stages;
  if (need_w && M > 0 && N > 0) {
    const int R = S_ * M;
    constexpr bool direct = Team::kSmemExchange;  // X is in shared memory already
    const int rc = direct ? R : min(R, kRedElems);
    for (int r0 = 0; r0 < R; r0 += rc) {
      const int nr = min(rc, R - r0);
      const int kc = direct ? K : kRedElems / nr;  // >= 1: nr <= kRedElems
      for (int k0 = 0; k0 < K; k0 += kc) {
        const int nk = min(kc, K - k0);
        if constexpr (!direct) {
          // stage rows r0 .. r0+nr, columns k0 .. k0+nk of X: scratch[(r - r0) * nk + kk]
          const int total = nr * nk;
          for (int e0 = threadIdx.x; e0 < total; e0 += kStageBatch * kThreads) {
            T v[kStageBatch];
#pragma unroll
            for (int u = 0; u < kStageBatch; ++u) {
              // past the end: a valid address (the last element) instead of a branch, so
              // that the loads are issued back to back
              const int e = min(e0 + u * kThreads, total - 1);
              const int r = r0 + e / nk, kk = e % nk;
              v[u] = __ldcg(X + (r / M) * x_stage + static_cast<long>(r % M) * K + k0 + kk);
            }
#pragma unroll
            for (int u = 0; u < kStageBatch; ++u) {
              const int e = e0 + u * kThreads;
              if (e < total) scratch[e] = v[u];
            }
          }
          __syncthreads();
        }
        // a thread item: column n, rows kg .. kg + kWgU - 1 of dw
        const int groups = (nk + kWgU<T> - 1) / kWgU<T>;
        for (int it = threadIdx.x; it < groups * N; it += kThreads) {
          const int n = it % N, kg = k0 + (it / N) * kWgU<T>;
          const int nu = min(kWgU<T>, k0 + nk - kg);  // valid rows k of this group
          T* dst = dw + static_cast<long>(kg) * ldw + c0 + n;
          T old[kWgU<T>], acc[kWgU<T>];
#pragma unroll
          for (int u = 0; u < kWgU<T>; ++u) {
            old[u] = dst[min(u, nu - 1) * ldw];  // (nu >= 1) unconditional: loads back to back
            acc[u] = T(0);
          }
          int i = r0 / M, m = r0 % M;  // row r = i * M + m
          for (int r = r0; r < r0 + nr; ++r) {
            const T* xr = direct ? X + i * x_stage + static_cast<long>(m) * K + kg
                                 : scratch + static_cast<long>(r - r0) * nk + (kg - k0);
            const T g = G[i * g_stage + m * N + n];
#pragma unroll
            for (int u = 0; u < kWgU<T>; ++u) acc[u] += xr[u < nu ? u : 0] * g;
            if (++m == M) {
              m = 0;
              ++i;
            }
          }
#pragma unroll
          for (int u = 0; u < kWgU<T>; ++u)
            if (u < nu) dst[u * ldw] = old[u] + acc[u];
        }
        if constexpr (!direct) __syncthreads();  // the scratch is restaged next
      }
    }
  }
  for (int n = threadIdx.x; n < N; n += kThreads) {
    T vt = T(0), vb = T(0);
    for (int i = 0; i < S_; ++i) {
      const T tau = t + static_cast<T>(tb.c[i]) * h;
      T s = T(0);
      for (int m = 0; m < M; ++m) s += G[i * g_stage + m * N + n];
      vt += tau * s;
      vb += s;
    }
    if (need_w) dw[static_cast<long>(K) * ldw + c0 + n] += vt;
    if (need_b) db[c0 + n] += vb;
  }
}

template <typename T, class Team>
__global__ void __launch_bounds__(kThreads) floater_bwd_kernel(const Params<T> p) {
  PF_DYNAMIC_SMEM(smem_raw);
  Block<T, Team> b = make_block<T, Team>(p, smem_raw, true);
  const Tableau& tb = p.tab;
  const int d = p.d, H = p.H, M = b.M, Sg = b.Sg, nd = b.nd, nh = b.nh, S_ = tb.stages;
  const long SgNd = static_cast<long>(Sg) * nd, SgNh = static_cast<long>(Sg) * nh;
  for (int e = threadIdx.x; e < M * nd; e += kThreads) b.lam[e] = T(0);
  // weight-gradient destination of this team (partials when several teams)
  T* dW = p.dW_part ? p.dW_part + static_cast<long>(b.team) * p.wl.nW : nullptr;
  T* dw1 = dW ? dW + p.wl.dw1 : p.dw1;
  T* db1 = dW ? dW + p.wl.db1 : p.db1;
  T* dw2 = dW ? dW + p.wl.dw2 : p.dw2;
  T* db2 = dW ? dW + p.wl.db2 : p.db2;
  T* dtp = p.dt_part + static_cast<long>(b.team * p.C + b.rank) * p.L;
  const T nT = static_cast<T>(p.n);
  double carry = 0.0;  // this block's dLoss/dtimes[j] from interval j+1 (via t_prev)
  for (int j = p.L - 1; j >= 0; --j) {
    for (int e = threadIdx.x; e < M * nd; e += kThreads) {
      const int m = e / nd, n = e % nd;
      b.lam[e] += p.grad[(static_cast<long>(b.s0 + m) * p.L + j) * d + b.db0 + n];
    }
    const T tp = j == 0 ? T(0) : p.times[j - 1];
    const T h = (p.times[j] - tp) / nT;
    // starting states of the sub-steps (starts[k] = state entering sub-step k)
    load_start(b, p, j);
    publish_state(b);
    for (int k = 0; k + 1 < p.n; ++k)
      rk_step(b, p, tp + static_cast<T>(k) * h, h, false, true, -1, b.starts + static_cast<long>(k + 1) * Sg * d);
    double dT = 0.0, dTprev = 0.0;
    for (int k = p.n - 1; k >= 0; --k) {
      const T t = tp + static_cast<T>(k) * h;
      // recompute step k keeping the stage values (Y_i, A_i in the exchange, z, k own)
      const T* st = b.starts + static_cast<long>(k) * Sg * d;
      for (int e = threadIdx.x; e < M * nd; e += kThreads) {
        const int m = e / nd, n = e % nd;
        b.P[e] = st[static_cast<long>(m) * d + b.db0 + n];
      }
      __syncthreads();
      publish_state(b);
      rk_step(b, p, t, h, true, false, -1, static_cast<T*>(nullptr));
      // ---- differentiate the step ----
      double dt_acc = 0.0, dh_acc = 0.0;  // this thread's share of the block's partials
      for (int e = threadIdx.x; e < M * nd; e += kThreads) {
        const T l = b.lam[e];
        for (int i = 0; i < S_; ++i) {
          b.gK[i * SgNd + e] = h * static_cast<T>(tb.b[i]) * l;
          if (tb.b[i] != 0.0) dh_acc += tb.b[i] * static_cast<double>(l) * static_cast<double>(b.K[i * SgNd + e]);
        }
      }
      __syncthreads();
      for (int i = S_ - 1; i >= 0; --i) {
        const double ci = tb.c[i];
        T* gKi = b.gK + i * SgNd;
        T* GZi = b.GZ + i * SgNh;
        const T* Zi = b.Z + i * SgNh;
        // Transposed products as reduce-scatters. scatter: this block's partial sums over its
        // own slice of the reduction, part[rank][m][n] = sum_k X[m][k] W[n*ldw + k] for n <= N
        // (n == N: the time row, through which tau enters the layer: also a time gradient).
        auto scatter = [&](T* part, int N, const T* X, int K, const T* W, int ldw) {
          T* mine = part + static_cast<long>(b.rank) * Sg * (N + 1);
          block_gemm<T>(M, N + 1, K, X, K, W, 1, ldw, b.red, [&](int m, int n, T v) {
            mine[static_cast<long>(m) * (N + 1) + n] = v;
            if (n == N) {
              dt_acc += static_cast<double>(v);
              dh_acc += ci * static_cast<double>(v);
            }
          });
        };
        // gather: the sum of the C partials (in block order) of element [m][c0 + n]
        auto gather = [&](const T* part, int N, int c0, int m, int n) {
          T v = T(0);
          for (int bb = 0; bb < b.C; ++bb)
            v += xload<Team>(part + (static_cast<long>(bb) * Sg + m) * (N + 1) + c0 + n);
          return v;
        };
        // step 1 (own d-slice): part1[rank][m][h] = sum_{c in ds} gK_i[m][c] w2[h][c], h <= H
        scatter(b.part1, H, gKi, nd, b.W2, b.ld2);
        Team::sync();
        // step 2 (own H-slice): ga = sum_b part1[b]; gz = ga * act'(z) -> GZ_i
        for (int e = threadIdx.x; e < M * nh; e += kThreads) {
          const int m = e / nh, n = e % nh;
          const T ga = gather(b.part1, H, b.hb0, m, n);
          const T a = xload<Team>(b.A(i) + static_cast<long>(m) * H + b.hb0 + n);
          GZi[e] = act_bwd(p.act, Zi[e], a, ga);
        }
        __syncthreads();
        //   part2[rank][m][c] = sum_{h in hs} gz[m][h] w1[c][h], c <= d
        scatter(b.part2, d, GZi, nh, b.W1, b.ld1);
        Team::sync();
        // step 3 (own d-slice): gy = sum_b part2[b]; lam += gy; gK_j += h a_ij gy
        for (int e = threadIdx.x; e < M * nd; e += kThreads) {
          const int m = e / nd, n = e % nd;
          const T gy = gather(b.part2, d, b.db0, m, n);
          b.lam[e] += gy;
          for (int jj = 0; jj < i; ++jj) {
            const double a = tb.a[i][jj];
            if (a == 0.0) continue;
            b.gK[jj * SgNd + e] += h * static_cast<T>(a) * gy;
            dh_acc += a * static_cast<double>(gy) * static_cast<double>(b.K[jj * SgNd + e]);
          }
        }
        __syncthreads();
      }
      // ---- weight gradients of step k: own elements, sums over (stage, state) in order ----
      // w1 (own columns hs): rows c < d: sum_i sum_m Y_i[m][c] gz_i[m][h]
      add_weight_grads<T, Team>(tb, t, h, M, b.yx, static_cast<long>(Sg) * d, d, b.GZ, SgNh, nh, b.hb0, dw1, H, db1,
                                p.need_w1, p.need_b1, b.red);
      // w2 (own columns ds): rows h < H: sum_i sum_m A_i[m][h] gk_i[m][c]
      add_weight_grads<T, Team>(tb, t, h, M, b.ax, static_cast<long>(Sg) * H, H, b.gK, SgNd, nd, b.db0, dw2, d, db2,
                                p.need_w2, p.need_b2, b.red);
      // time gradients of step k: t_k = tp + k h, h = (times[j] - tp) / n
      const double dt_sum = block_sum(dt_acc, b.dscratch);
      const double dh_sum = block_sum(dh_acc, b.dscratch);
      const double kn = static_cast<double>(k) / p.n;
      dT += dt_sum * kn + dh_sum / p.n;
      dTprev += dt_sum * (1.0 - kn) - dh_sum / p.n;
      // the exchange buffers (Y_i, A_i) are rewritten by the next recomputation
      Team::sync();
    }
    if (p.need_t && threadIdx.x == 0) {
      dtp[j] = static_cast<T>(dT + carry);
      carry = dTprev;
    }
  }
  if (p.need_p0) {
    for (int e = threadIdx.x; e < M * nd; e += kThreads) {
      const int m = e / nd, n = e % nd;
      p.dp0[static_cast<long>(b.s0 + m) * d + b.db0 + n] = b.lam[e];
    }
  }
}

// out[e] = sum_{g<G} part[g * stride + e] for e < n, added in the order of g
template <typename T>
__global__ void reduce_strided(const T* __restrict__ part, int G, long stride, long n, T* __restrict__ out) {
  for (long e = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<long>(gridDim.x) * blockDim.x) {
    T v = part[e];
    for (int g = 1; g < G; ++g) v += part[static_cast<long>(g) * stride + e];
    out[e] = v;
  }
}

// ------------------------------------------------------------------------------------
// Host side
// ------------------------------------------------------------------------------------
template <typename T>
using KernelFn = void (*)(const Params<T>);

template <typename T, class Team>
KernelFn<T> kernel_fn(bool bwd) {
  return bwd ? &floater_bwd_kernel<T, Team> : &floater_fwd_kernel<T, Team>;
}

template <typename T>
KernelFn<T> pick_kernel_t(int mode, bool bwd) {
  if (mode == kSolo) return kernel_fn<T, SoloTeam>(bwd);
  if (mode == kCluster) return kernel_fn<T, ClusterTeam>(bwd);
  return kernel_fn<T, GridTeam>(bwd);
}

const void* pick_kernel(int dtype_size, int mode, bool bwd) {
  return dtype_size == 4 ? reinterpret_cast<const void*>(pick_kernel_t<float>(mode, bwd))
                         : reinterpret_cast<const void*>(pick_kernel_t<double>(mode, bwd));
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

// The three ways of launching the persistent kernel.
template <typename T>
cudaError_t launch_persistent(int mode, KernelFn<T> kernel, int C, dim3 grid, size_t smem, cudaStream_t stream,
                              Params<T>& p) {
#if defined(POSENC_FAST_CUDA_EMULATION)
  return emu::launch(kernel, mode, C, grid, dim3(kThreads), smem, p);
#else
  void* args[] = {&p};
  const void* fn = reinterpret_cast<const void*>(kernel);
  const dim3 block(kThreads);
  if (mode == kSolo) return cudaLaunchKernel(fn, grid, block, args, smem, stream);
  if (mode == kGrid) return cudaLaunchCooperativeKernel(fn, grid, block, args, smem, stream);
  cudaLaunchConfig_t cfg{};
  cudaLaunchAttribute attr{};
  const cudaError_t err = cluster_config(fn, C, grid, smem, stream, &cfg, &attr);
  if (err != cudaSuccess) return err;
  return cudaLaunchKernelExC(&cfg, fn, args);
#endif
}

template <typename T>
cudaError_t launch_reduce(const T* part, int G, long stride, long n, T* out, cudaStream_t stream) {
  const int rb = 256;
  const long blocks = std::min<long>((n + rb - 1) / rb, 4096);
#if defined(POSENC_FAST_CUDA_EMULATION)
  return emu::launch_simple(&reduce_strided<T>, dim3(static_cast<unsigned>(blocks)), dim3(rb), part, G, stride, n, out);
#else
  reduce_strided<T><<<static_cast<unsigned>(blocks), rb, 0, stream>>>(part, G, stride, n, out);
  return cudaGetLastError();
#endif
}

int odd_at_least(int n) { return n % 2 == 0 ? n + 1 : n; }

size_t smem_bytes_for(const Problem& pr, int stages, int C, int Sg, bool resident, bool smem_exchange,
                      bool stage_x = true) {
  const int nh = static_cast<int>((pr.H + C - 1) / C), nd = static_cast<int>((pr.d + C - 1) / C);
  const SmemLayout L = smem_layout(stages, Sg, static_cast<int>(pr.d), static_cast<int>(pr.H), nh, nd,
                                   odd_at_least(nh), odd_at_least(nd), resident, smem_exchange, stage_x,
                                   pr.backward);
  return static_cast<size_t>(L.total) * pr.dtype_size + 64;
}

struct DeviceInfo {
  int sms, cc_major, smem_optin;
  bool coop, cluster;
};

cudaError_t device_info(int device, DeviceInfo* info) {
  cudaDeviceProp prop;
  cudaError_t err = cudaGetDeviceProperties(&prop, device);
  if (err != cudaSuccess) return err;
  info->sms = prop.multiProcessorCount;
  info->cc_major = prop.major;
  info->smem_optin = static_cast<int>(prop.sharedMemPerBlockOptin);
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

}  // namespace

cudaError_t plan(const Problem& pr, int device, Plan* out) {
  Plan pl{};
  DeviceInfo dev{};
  cudaError_t err = device_info(device, &dev);
  if (err != cudaSuccess) return err;
  const int stages = tableau(static_cast<Method>(pr.method)).stages;
  const long S = pr.S;
  const size_t limit = static_cast<size_t>(dev.smem_optin);
  bool found = false;
  // 1. solo: one block holds all the weights; teams are independent blocks (any count).
  {
    const int Sg = static_cast<int>(std::max<long>(1, (S + dev.sms - 1) / dev.sms));
    const size_t smem = smem_bytes_for(pr, stages, 1, Sg, true, true);
    if (smem <= limit) {
      pl.mode = kSolo;
      pl.C = 1;
      pl.Sg = Sg;
      pl.resident = true;
      pl.stage_x = true;
      found = true;
    }
  }
  // 2. cluster (sm_90): the smallest cluster whose shared memory holds the weights
  //    (with the exchanged vectors staged in shared memory, else read from L2), with all
  //    G = ceil(S / Sg) clusters co-resident. A cluster's blocks share one GPC, so fewer
  //    clusters than SMs / C may run at once (8 of 10 blocks on the H200); teams beyond
  //    that would run in a second wave: the first H200 run (2026-11-27, S=12, d=H=512)
  //    launched 12 clusters of 10 where 8 fit, twice the time. Then each team takes more
  //    states (Sg = ceil(S / active clusters)) if its shared memory still fits, else the
  //    next cluster size is tried. If no size runs in one wave, the first that fits runs
  //    in waves (as before) rather than falling to the cooperative grid.
  bool no_clusters = !dev.cluster, waves = false;  // waves: pl holds the first plan in waves
  auto take_cluster = [&pl](int C, int Sg, bool stage_x) {
    pl.mode = kCluster;
    pl.C = C;
    pl.Sg = Sg;
    pl.resident = true;
    pl.stage_x = stage_x;
  };
  for (int stage = 1; stage >= 0 && !found && !no_clusters; --stage) {
    for (int C = 2; C <= std::min<long>({kMaxCluster, pr.d, pr.H}) && !found && !no_clusters; ++C) {
      const int teams = std::max(1, dev.sms / C);
      int Sg = static_cast<int>(std::max<long>(1, (S + teams - 1) / teams));
      for (int attempt = 0; attempt < 2 && !found; ++attempt) {
        const size_t smem = smem_bytes_for(pr, stages, C, Sg, true, false, stage != 0);
        if (smem > limit) break;  // more states per team need more
        const void* k = pick_kernel(pr.dtype_size, kCluster, pr.backward);
        cudaLaunchConfig_t cfg{};
        cudaLaunchAttribute attr{};
        if (cluster_config(k, C, dim3(C, 1, 1), smem, nullptr, &cfg, &attr) != cudaSuccess) {
          cudaGetLastError();
          no_clusters = true;  // this device or driver launches no clusters: the grid below
          break;
        }
        if (cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)) !=
            cudaSuccess) {
          cudaGetLastError();
          break;
        }
        int clusters = 0;
        if (cudaOccupancyMaxActiveClusters(&clusters, k, &cfg) != cudaSuccess || clusters < 1) {
          cudaGetLastError();
          break;
        }
        const long G = (S + Sg - 1) / Sg;
        if (G > clusters) {  // a second wave: fewer, fuller teams, if they fit
          if (!waves) {
            waves = true;
            take_cluster(C, Sg, stage != 0);
          }
          const int fuller = static_cast<int>((S + clusters - 1) / clusters);
          if (fuller <= Sg) break;
          Sg = fuller;
          continue;
        }
        take_cluster(C, Sg, stage != 0);
        found = true;
      }
    }
  }
  found = found || waves;  // no plan in one wave: the first one in waves, already in pl
  // 3. cooperative grid: the weights spread over as many co-resident blocks as needed,
  //    or, when even the whole GPU's shared memory cannot hold them, read from L2.
  //    Preference: resident weights, staged vectors, fewest states per team (the most
  //    teams working in parallel).
  if (!found) {
    if (!dev.coop) return cudaErrorNotSupported;
    const void* k = pick_kernel(pr.dtype_size, kGrid, pr.backward);
    for (int variant = 0; variant < 4 && !found; ++variant) {
      const bool resident = variant < 2, stage = variant % 2 == 0;
      for (long Sg = 1; !found; Sg = std::min<long>(S, 2 * Sg)) {
        const long G = (S + Sg - 1) / Sg;
        if (resident) {
          // the smallest team that holds the weights, G teams co-resident
          for (int C = 2; C <= std::min<long>({8L * dev.sms, pr.d, pr.H}) && !found; ++C) {
            const size_t smem = smem_bytes_for(pr, stages, C, static_cast<int>(Sg), true, false, stage);
            if (smem > limit) continue;
            const long capacity = static_cast<long>(blocks_per_sm(k, smem)) * dev.sms;
            if (capacity < G * C) break;  // larger teams need even more blocks
            pl.mode = kGrid;
            pl.C = C;
            pl.Sg = static_cast<int>(Sg);
            pl.resident = true;
            pl.stage_x = stage;
            found = true;
          }
        } else {
          // every co-resident block works: G teams of capacity / G blocks
          const size_t smem = smem_bytes_for(pr, stages, dev.sms, static_cast<int>(Sg), false, false, stage);
          const long capacity = smem <= limit ? static_cast<long>(blocks_per_sm(k, smem)) * dev.sms : 0;
          const long C = std::min<long>({capacity / G, pr.d, pr.H});
          if (C >= 2) {
            const size_t smem_c = smem_bytes_for(pr, stages, static_cast<int>(C), static_cast<int>(Sg), false, false,
                                                 stage);
            if (smem_c <= limit && static_cast<long>(blocks_per_sm(k, smem_c)) * dev.sms >= G * C) {
              pl.mode = kGrid;
              pl.C = static_cast<int>(C);
              pl.Sg = static_cast<int>(Sg);
              pl.resident = false;
              pl.stage_x = stage;
              found = true;
            }
          }
        }
        if (Sg >= S) break;
      }
    }
  }
  if (!found) return cudaErrorInvalidConfiguration;
  return plan_with(pr, pl.mode, pl.C, pl.Sg, pl.resident, out, pl.stage_x);
}

cudaError_t plan_with(const Problem& pr, int mode, int C, int Sg, bool resident, Plan* out, bool stage_x) {
  if (mode < kSolo || mode > kGrid || C < 1 || Sg < 1 || (mode == kSolo && C != 1) || (mode != kSolo && C < 2))
    return cudaErrorInvalidValue;
  if (C > pr.d || C > pr.H) return cudaErrorInvalidValue;  // every block owns part of d and H
  const int stages = tableau(static_cast<Method>(pr.method)).stages;
  const long S = pr.S;
  Plan pl{};
  pl.mode = mode;
  pl.C = C;
  pl.Sg = static_cast<int>(std::min<long>(Sg, std::max<long>(S, 1)));
  pl.resident = resident;
  pl.stage_x = stage_x || mode == kSolo;
  pl.smem_bytes = smem_bytes_for(pr, stages, C, pl.Sg, resident, mode == kSolo, pl.stage_x);
  pl.G = static_cast<int>(std::max<long>(1, (S + pl.Sg - 1) / pl.Sg));
  const int nh = static_cast<int>((pr.H + pl.C - 1) / pl.C), nd = static_cast<int>((pr.d + pl.C - 1) / pl.C);
  pl.ld1 = odd_at_least(nh);
  pl.ld2 = odd_at_least(nd);
  const WsLayout wl = ws_layout(stages, pl.Sg, static_cast<int>(pr.d), static_cast<int>(pr.H), pl.C, pl.G,
                                static_cast<int>(pr.substeps), static_cast<int>(pr.L), pr.backward, pl.mode == kSolo);
  pl.workspace_bytes = static_cast<size_t>(wl.total) * pr.dtype_size + 256;
  std::snprintf(pl.why, sizeof(pl.why), "%s: %d team(s) of %d block(s), %d state(s) each, weights %s%s, %zu B smem",
                pl.mode == kSolo ? "solo" : (pl.mode == kCluster ? "cluster" : "grid"), pl.G, pl.C, pl.Sg,
                pl.resident ? "in shared memory" : "from L2", pl.stage_x ? "" : ", vectors from L2",
                pl.smem_bytes);
  *out = pl;
  return cudaSuccess;
}

namespace {

template <typename T>
cudaError_t launch_typed(const Problem& pr, const Plan& pl, const Pointers& ptr, cudaStream_t stream) {
  Params<T> p{};
  p.p0 = static_cast<const T*>(ptr.p0);
  p.w1 = static_cast<const T*>(ptr.w1);
  p.b1 = static_cast<const T*>(ptr.b1);
  p.w2 = static_cast<const T*>(ptr.w2);
  p.b2 = static_cast<const T*>(ptr.b2);
  p.times = static_cast<const T*>(ptr.times);
  p.out = static_cast<T*>(ptr.out);
  p.grad = static_cast<const T*>(ptr.grad);
  p.out_saved = static_cast<const T*>(ptr.out_saved);
  p.dp0 = static_cast<T*>(ptr.dp0);
  p.dw1 = static_cast<T*>(ptr.dw1);
  p.db1 = static_cast<T*>(ptr.db1);
  p.dw2 = static_cast<T*>(ptr.dw2);
  p.db2 = static_cast<T*>(ptr.db2);
  p.dtimes = static_cast<T*>(ptr.dtimes);
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
  p.resident = pl.resident;
  p.stage_x = pl.stage_x;
  p.ld1 = pl.ld1;
  p.ld2 = pl.ld2;
  p.need_p0 = pr.needs[0];
  p.need_w1 = pr.needs[1];
  p.need_b1 = pr.needs[2];
  p.need_w2 = pr.needs[3];
  p.need_b2 = pr.needs[4];
  p.need_t = pr.needs[5];
  p.wl = ws_layout(p.tab.stages, pl.Sg, p.d, p.H, pl.C, pl.G, p.n, p.L, pr.backward, pl.mode == kSolo);
  const WsLayout& wl = p.wl;
  T* ws = static_cast<T*>(ptr.workspace);
  p.ws = ws;
  if (pr.backward) {
    p.dW_part = pl.G > 1 ? ws + wl.dW_part : nullptr;
    p.dt_part = ws + wl.dt_part;
  }
  KernelFn<T> kernel = pick_kernel_t<T>(pl.mode, pr.backward);
  cudaError_t err = cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(pl.smem_bytes));
  if (err != cudaSuccess) return err;
  err = launch_persistent<T>(pl.mode, kernel, pl.C, dim3(pl.G * pl.C), pl.smem_bytes, stream, p);
  if (err != cudaSuccess) return err;
  if (!pr.backward) return cudaSuccess;
  // deterministic cross-team / cross-block reductions
  if (pl.G > 1) {
    struct Part {
      bool need;
      long off, n;
      T* dst;
    } parts[4] = {{p.need_w1, wl.dw1, wl.db1 - wl.dw1, p.dw1},
                  {p.need_b1, wl.db1, wl.dw2 - wl.db1, p.db1},
                  {p.need_w2, wl.dw2, wl.db2 - wl.dw2, p.dw2},
                  {p.need_b2, wl.db2, wl.nW - wl.db2, p.db2}};
    for (const Part& q : parts) {
      if (!q.need || q.n == 0) continue;
      // team g's partial of this array starts at dW_part + g * nW + off
      err = launch_reduce<T>(p.dW_part + q.off, pl.G, wl.nW, q.n, q.dst, stream);
      if (err != cudaSuccess) return err;
    }
  }
  if (p.need_t && p.L > 0) err = launch_reduce<T>(p.dt_part, pl.G * pl.C, p.L, p.L, p.dtimes, stream);
  return err;
}

}  // namespace

cudaError_t launch(const Problem& pr, const Plan& plan, const Pointers& ptr, cudaStream_t stream) {
  if (pr.S == 0 || pr.L == 0 || pr.d == 0) return cudaSuccess;  // nothing to integrate
  return pr.dtype_size == 4 ? launch_typed<float>(pr, plan, ptr, stream)
                            : launch_typed<double>(pr, plan, ptr, stream);
}

int compiled_version() { return CUDART_VERSION; }

}  // namespace cuda
}  // namespace floater
}  // namespace posenc_fast
