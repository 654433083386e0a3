// Teams of the CUDA FLOATER kernels (floater_cuda.cu): the C thread blocks that integrate
// one group of states together, how they wait for each other and how they exchange vectors.
//
// A team's exchange buffers are written with push (to one block: a reduce-scatter's
// partial sums for their owner) or broadcast (to every block: a slice of a full vector),
// then, after a team barrier, read with xload by the blocks they were written to. Where
// the buffers live:
//   SoloTeam     (one block)          shared memory; the barrier is __syncthreads
//   ClusterTeam  (a thread-block      every block's own shared memory, written through
//                 cluster, sm_90+)    distributed shared memory (st.shared::cluster at the
//                                     same offset in the target block); cluster barrier
//   GridTeam     (cooperative grid)   global memory (one copy per team, read through L2:
//                                     ld.global.cg); grid barrier
// So a vector is read from local shared memory in the first two, and pushes and broadcasts
// are fire-and-forget stores. The cluster barrier is split (arrive, then wait), so that
// work which touches no exchange buffer (stores to the tape, prefetches) can sit between.
//
// Every exchange access runs the hook FLOATER_CUDA_ACCESS first (floater_cuda_hooks.h).
#pragma once

#include <cooperative_groups.h>

#include "floater_cuda_hooks.h"

namespace posenc_fast {
namespace floater {
namespace cuda {

namespace cg = cooperative_groups;

enum Mode { kSolo = 0, kCluster = 1, kGrid = 2 };

// Loads and stores of exchange buffers. G: global memory written by other blocks (read
// and written through L2 only: another SM's L1 may hold stale lines).
template <bool G, typename T>
__device__ __forceinline__ T xload(const T* p) {
  FLOATER_CUDA_ACCESS(p, sizeof(T), false);
  if constexpr (G) {
    return __ldcg(p);
  } else {
    return *p;
  }
}

template <bool G, typename T>
__device__ __forceinline__ void xstore(T* p, T v) {
  FLOATER_CUDA_ACCESS(p, sizeof(T), true);
  if constexpr (G) {
    __stcg(p, v);
  } else {
    *p = v;
  }
}

// A store into block `rank` of this cluster, at the offset of p in this block's shared
// memory (p: a shared-memory address of this block).
template <typename T>
__device__ __forceinline__ void dsmem_store(T* p, unsigned rank, T v) {
#if defined(FLOATER_CUDA_NO_INLINE_PTX)
  T* remote = cg::this_cluster().map_shared_rank(p, rank);
  FLOATER_CUDA_ACCESS(remote, sizeof(T), true);
  *remote = v;
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(p));
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  if constexpr (sizeof(T) == 8) {
    asm volatile("st.shared::cluster.f64 [%0], %1;" ::"r"(remote), "d"(static_cast<double>(v)) : "memory");
  } else {
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(remote), "f"(static_cast<float>(v)) : "memory");
  }
#else
  (void)p;
  (void)rank;
  (void)v;
  __trap();  // never launched below sm_90 (choose_layout() checks the device)
#endif
}

struct SoloTeam {
  static constexpr int kMode = kSolo;
  static constexpr bool kGlobal = false;  // exchange buffers in global memory
  __device__ static int team(int) { return blockIdx.x; }
  __device__ static int rank(int) { return 0; }
  __device__ static void arrive() {}
  __device__ static void wait() { __syncthreads(); }
  template <typename T>
  __device__ static void broadcast(T* p, int, T v) {
    xstore<false>(p, v);
  }
  // p: the element in the owner's part of the buffer, as addressed by the owner
  template <typename T>
  __device__ static void push(T* p, int, long, T v) {
    xstore<false>(p, v);
  }
};

struct ClusterTeam {
  static constexpr int kMode = kCluster;
  static constexpr bool kGlobal = false;
  __device__ static int team(int C) { return blockIdx.x / C; }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __device__ static int rank(int) { return static_cast<int>(cg::this_cluster().block_rank()); }
  // barrier.cluster.arrive.release / wait.acquire: this block's stores (shared::cluster
  // included) before the arrival are visible to every block of the cluster after its wait
  __device__ static void arrive() { cg::this_cluster().barrier_arrive(); }
  __device__ static void wait() { cg::this_cluster().barrier_wait(); }
#else
  __device__ static int rank(int C) { return blockIdx.x % C; }
  __device__ static void arrive() { __trap(); }
  __device__ static void wait() { __trap(); }
#endif
  // p: this block's copy of the element; every block of the cluster gets v at that offset
  template <typename T>
  __device__ static void broadcast(T* p, int C, T v) {
    for (int r = 0; r < C; ++r) dsmem_store(p, static_cast<unsigned>(r), v);
  }
  // the buffers are at the same offset in every block: p addresses the element in this
  // block's copy, which the owner reads in its own
  template <typename T>
  __device__ static void push(T* p, int owner, long, T v) {
    dsmem_store(p, static_cast<unsigned>(owner), v);
  }
};

struct GridTeam {
  static constexpr int kMode = kGrid;
  static constexpr bool kGlobal = true;
  __device__ static int team(int C) { return blockIdx.x / C; }
  __device__ static int rank(int C) { return blockIdx.x % C; }
  __device__ static void arrive() {}
  __device__ static void wait() { cg::this_grid().sync(); }
  template <typename T>
  __device__ static void broadcast(T* p, int, T v) {  // one copy per team
    xstore<true>(p, v);
  }
  // the owners' parts lie one after the other, `stride` elements apart: p addresses the
  // element in owner 0's part
  template <typename T>
  __device__ static void push(T* p, int owner, long stride, T v) {
    xstore<true>(p + owner * stride, v);
  }
};

}  // namespace cuda
}  // namespace floater
}  // namespace posenc_fast
