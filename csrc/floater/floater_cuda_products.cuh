// Block-level arithmetic of the CUDA FLOATER kernels (floater_cuda.cu): activations, the
// small products of every stage, a deterministic block sum, asynchronous copies into shared
// memory. All of it depends on the shapes only: bitwise reproducible for a fixed layout.
#pragma once

#include <cuda_pipeline.h>

#include "floater_common.h"
#include "floater_cuda_hooks.h"
#include "floater_cuda_team.cuh"

namespace posenc_fast {
namespace floater {
namespace cuda {

// Threads per block (a multiple of 32; FLOATER_CUDA_THREADS: the CPU emulation uses fewer).
constexpr int kThreads = FLOATER_CUDA_THREADS;
constexpr int kMaxRows = 4;                    // states per thread item in block_gemm
constexpr int kRedElems = kMaxRows * kThreads;  // K-split scratch of block_gemm
constexpr int kMaxSplit = 32;                  // K-split parts, at most

// --- Activations (accurate libdevice functions: no fast-math intrinsics) -----------------
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

// --- Weight sources. A block holds slices of the two layers: layer 1's columns hs (all d+1
// rows), layer 2's columns ds (all H+1 rows). The first `kr` rows of a slice are resident
// in shared memory (row stride lds, odd: column and row walks are both free of bank
// conflicts), the others are read from global memory (L2) where the shared memory of the
// team cannot hold them all.
template <typename T>
struct Slice {
  const T* s;  // resident rows: element (r, c) at s[r * lds + c]
  int lds;
  const T* g;  // the same slice in global memory: (r, c) at g[r * ldg + c]
  long ldg;
  int kr;      // rows [0, kr) resident
  __device__ __forceinline__ T at(int r, int c) const {
    return r < kr ? s[static_cast<long>(r) * lds + c] : g[static_cast<long>(r) * ldg + c];
  }
};

// The reduction of block_gemm walks the slice's rows for a fixed column n ("Cols": the
// forward, v(m, n) = sum_k X[m][k] W[k][n]) or a row's columns ("Rows": the transposed
// products of the adjoint, v(m, n) = sum_k X[m][k] W[n][k]). segments() calls
// f(pointer to element k = 0, stride between consecutive k, ka, kb) for the pieces of
// [k0, k1) that lie in one memory.
template <typename T>
struct Cols {
  Slice<T> w;
  template <class F>
  __device__ __forceinline__ void segments(int n, int k0, int k1, F&& f) const {
    if (k0 < w.kr) f(w.s + n, static_cast<long>(w.lds), k0, min(k1, w.kr));
    if (k1 > w.kr) f(w.g + n, w.ldg, max(k0, w.kr), k1);
  }
};
template <typename T>
struct Rows {
  Slice<T> w;
  template <class F>
  __device__ __forceinline__ void segments(int n, int k0, int k1, F&& f) const {
    if (n < w.kr)
      f(w.s + static_cast<long>(n) * w.lds, 1L, k0, k1);
    else
      f(w.g + static_cast<long>(n) * w.ldg, 1L, k0, k1);
  }
};

// Elements per 16-byte vector.
template <typename T>
constexpr int kVec = 16 / static_cast<int>(sizeof(T));

// One 16-byte vector of X (p 16-byte aligned): from shared memory, or (XG) from an
// exchange buffer in global memory that other blocks write.
template <bool XG, typename T>
__device__ __forceinline__ void load_vec(const T* p, T (&v)[kVec<T>]) {
  FLOATER_CUDA_ACCESS(p, 16, false);
  if constexpr (sizeof(T) == 4) {
    const float4 q = XG ? __ldcg(reinterpret_cast<const float4*>(p)) : *reinterpret_cast<const float4*>(p);
    v[0] = q.x;
    v[1] = q.y;
    v[2] = q.z;
    v[3] = q.w;
  } else {
    const double2 q = XG ? __ldcg(reinterpret_cast<const double2*>(p)) : *reinterpret_cast<const double2*>(p);
    v[0] = q.x;
    v[1] = q.y;
  }
}

// acc[r] += sum_{k in [ka, kb)} X[r][k] * w[k * stride], r < RT, in the order of k (rows of X
// past the last valid one repeat it: rows[r] points at a valid row). X rows 16-byte aligned.
template <int RT, bool XG, typename T>
__device__ __forceinline__ void dot_rows(T (&acc)[RT], const T* (&rows)[RT], const T* w, long stride, int ka,
                                         int kb) {
  constexpr int V = kVec<T>;
  int k = ka;
  for (; k < kb && k % V != 0; ++k) {
    const T wk = w[k * stride];
#pragma unroll
    for (int r = 0; r < RT; ++r) acc[r] += xload<XG>(rows[r] + k) * wk;
  }
  for (; k + V <= kb; k += V) {
    T wk[V];
#pragma unroll
    for (int u = 0; u < V; ++u) wk[u] = w[(k + u) * stride];
#pragma unroll
    for (int r = 0; r < RT; ++r) {
      T x[V];
      load_vec<XG>(rows[r] + k, x);
#pragma unroll
      for (int u = 0; u < V; ++u) acc[r] += x[u] * wk[u];
    }
  }
  for (; k < kb; ++k) {
    const T wk = w[k * stride];
#pragma unroll
    for (int r = 0; r < RT; ++r) acc[r] += xload<XG>(rows[r] + k) * wk;
  }
}

// --- block_gemm: v(m, n) = sum_{k<K} X[m*ldx + k] * W(k, n), m < M, n < N; then epi(m, n, v).
// X: shared memory (or, XG, an exchange buffer in global memory read through L2), rows
// 16-byte aligned (ldx a multiple of kVec). W: a weight source (Cols or Rows).
// Threads own items of RT states x 1 column; when the items are too few to occupy the
// block, the reduction is split into P contiguous parts (bounds on multiples of kVec) whose
// sums are added in part order. Every thread's sum runs in the order of k. Ends with a
// __syncthreads (red and X may be reused).
template <typename T, int RT, bool XG, class W, typename Epi>
__device__ void block_gemm_rt(int M, int N, int K, const T* X, int ldx, const W& w, T* red, Epi&& epi) {
  const int MG = (M + RT - 1) / RT;
  const int items = MG * N;
  int P = 1;  // a function of the shapes only
  while (P < kMaxSplit && items * P < kThreads && 2 * P * kVec<T> <= K) P *= 2;
  auto bound = [&](int p) { return p == P ? K : static_cast<int>(static_cast<long>(K) * p / P) / kVec<T> * kVec<T>; };
  for (int it = threadIdx.x; it < items * P; it += kThreads) {
    const int n = it % N, rest = it / N;
    const int m0 = (rest % MG) * RT, p = rest / MG;
    T acc[RT];
    const T* rows[RT];
#pragma unroll
    for (int r = 0; r < RT; ++r) {
      acc[r] = T(0);
      rows[r] = X + static_cast<long>(min(m0 + r, M - 1)) * ldx;
    }
    w.segments(n, bound(p), bound(p + 1),
               [&](const T* wp, long stride, int ka, int kb) { dot_rows<RT, XG>(acc, rows, wp, stride, ka, kb); });
    if (P == 1) {
#pragma unroll
      for (int r = 0; r < RT; ++r)
        if (m0 + r < M) epi(m0 + r, n, acc[r]);
    } else {
#pragma unroll
      for (int r = 0; r < RT; ++r)
        if (m0 + r < M) red[(static_cast<long>(p) * M + m0 + r) * N + n] = acc[r];
    }
  }
  __syncthreads();
  if (P == 1) return;
  for (int it = threadIdx.x; it < M * N; it += kThreads) {
    const int m = it / N, n = it % N;
    T v = red[m * N + n];
    for (int p = 1; p < P; ++p) v += red[(static_cast<long>(p) * M + m) * N + n];
    epi(m, n, v);
  }
  __syncthreads();
}

// block_gemm with as many states per item as M needs (1, 2 or 4): no redundant rows for the
// small teams the clusters give (1-3 states).
template <typename T, bool XG, class W, typename Epi>
__device__ void block_gemm(int M, int N, int K, const T* X, int ldx, const W& w, T* red, Epi&& epi) {
  if (M <= 1)
    block_gemm_rt<T, 1, XG>(M, N, K, X, ldx, w, red, epi);
  else if (M == 2)
    block_gemm_rt<T, 2, XG>(M, N, K, X, ldx, w, red, epi);
  else
    block_gemm_rt<T, kMaxRows, XG>(M, N, K, X, ldx, w, red, epi);
}

// Deterministic block-wide sum (fixed shuffle tree, then warps in order); result in thread 0.
__device__ __forceinline__ double block_sum(double v, double* scratch) {
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

// Asynchronous copy of one element from global to shared memory (cp.async): issue, then
// async_wait() before this thread reads it (only the issuing thread may, without a
// __syncthreads).
template <typename T>
__device__ __forceinline__ void async_copy(T* dst_smem, const T* src) {
  __pipeline_memcpy_async(dst_smem, src, sizeof(T));
}
__device__ __forceinline__ void async_wait() {
  __pipeline_commit();
  __pipeline_wait_prior(0);
}

}  // namespace cuda
}  // namespace floater
}  // namespace posenc_fast
