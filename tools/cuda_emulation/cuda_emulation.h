// A tiny CUDA emulator for testing the logic of csrc/floater/floater_cuda.cu on machines
// without a GPU: the kernels compile as host C++ and every CUDA thread becomes a
// std::thread. __syncthreads, warp shuffles, cluster and grid barriers are std::barrier
// waits, so the phase structure, indexing, reductions and partitioning run exactly as
// written. What it cannot check: the GPU memory model (ld.global.cg, L1 staleness),
// timing, occupancy, register or shared-memory limits. Used by
// tests/floater/test_extension_cuda_emulation.py through emulate_floater.cpp.
#pragma once

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#ifndef __CUDA_ARCH__
#define __CUDA_ARCH__ 900
#endif
#define CUDART_VERSION 13000

struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

typedef int cudaError_t;
enum : int {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorNotSupported = 801,
};
typedef void* cudaStream_t;
inline const char* cudaGetErrorString(cudaError_t e) { return e == 0 ? "no error" : "emulated CUDA error"; }
inline cudaError_t cudaGetLastError() { return cudaSuccess; }

enum cudaFuncAttribute {
  cudaFuncAttributeMaxDynamicSharedMemorySize,
  cudaFuncAttributeNonPortableClusterSizeAllowed
};
inline cudaError_t cudaFuncSetAttribute(const void*, cudaFuncAttribute, int) { return cudaSuccess; }

// An H100/H200-like device for plan().
struct cudaDeviceProp {
  int multiProcessorCount = 132;
  int major = 9, minor = 0;
  size_t sharedMemPerBlockOptin = 232448;
  int cooperativeLaunch = 1;
};
inline cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int) {
  *p = cudaDeviceProp{};
  return cudaSuccess;
}
enum cudaLaunchAttributeID { cudaLaunchAttributeClusterDimension };
struct cudaLaunchAttribute {
  cudaLaunchAttributeID id;
  struct {
    struct {
      unsigned x, y, z;
    } clusterDim;
  } val;
};
struct cudaLaunchConfig_t {
  dim3 gridDim, blockDim;
  size_t dynamicSmemBytes;
  cudaStream_t stream;
  cudaLaunchAttribute* attrs;
  unsigned numAttrs;
};
inline cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* n, const void*, int, size_t smem) {
  *n = smem <= 232448 ? 1 : 0;
  return cudaSuccess;
}
inline cudaError_t cudaOccupancyMaxActiveClusters(int* n, const void*, const cudaLaunchConfig_t*) {
  *n = 8;
  return cudaSuccess;
}

namespace emu {

struct uint3_ {
  unsigned x, y, z;
};

struct Ctx {
  uint3_ tid{0, 0, 0};
  std::barrier<>* block = nullptr;
  std::barrier<>* warp = nullptr;
  double* warp_slots = nullptr;  // 32 per warp
  std::barrier<>* team = nullptr;
  std::barrier<>* grid = nullptr;
  unsigned char* smem = nullptr;
};
inline Ctx& ctx() {
  static thread_local Ctx c;
  return c;
}

}  // namespace emu

// The built-in variables, per emulated thread.
inline thread_local emu::uint3_ threadIdx{0, 0, 0};
inline thread_local emu::uint3_ blockIdx{0, 0, 0};
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;
#define PF_DYNAMIC_SMEM(name) unsigned char* name = ::emu::ctx().smem

inline void __syncthreads() { emu::ctx().block->arrive_and_wait(); }
inline void __trap() { std::abort(); }
template <typename T>
inline T __ldcg(const T* p) {
  return *p;
}
inline int min(int a, int b) { return a < b ? a : b; }

// All 32 lanes of a warp call it together (as on the GPU).
inline double __shfl_down_sync(unsigned, double v, int offset) {
  emu::Ctx& c = emu::ctx();
  const int lane = c.tid.x % 32;
  c.warp_slots[lane] = v;
  c.warp->arrive_and_wait();
  const double r = lane + offset < 32 ? c.warp_slots[lane + offset] : v;
  c.warp->arrive_and_wait();
  return r;
}

namespace cooperative_groups {
struct grid_group {
  void sync() { emu::ctx().grid->arrive_and_wait(); }
};
struct cluster_group {
  void sync() { emu::ctx().team->arrive_and_wait(); }
};
inline grid_group this_grid() { return {}; }
inline cluster_group this_cluster() { return {}; }
}  // namespace cooperative_groups

namespace emu {

// Run a persistent kernel: one std::thread per CUDA thread; mode 1 (cluster) gives each
// group of C consecutive blocks its own team barrier, mode 2 (grid) one barrier for all.
template <typename P>
cudaError_t launch(void (*kernel)(const P), int mode, int C, dim3 grid, dim3 block, size_t smem, P& p) {
  const unsigned nb = grid.x, nt = block.x;
  if (nt % 32 != 0 || (mode == 1 && nb % C != 0)) return cudaErrorInvalidConfiguration;
  std::vector<std::unique_ptr<std::barrier<>>> blocks, warps, teams;
  for (unsigned b = 0; b < nb; ++b) blocks.emplace_back(new std::barrier<>(nt));
  for (unsigned w = 0; w < nb * nt / 32; ++w) warps.emplace_back(new std::barrier<>(32));
  const unsigned team_size = mode == 1 ? C : nb;
  for (unsigned t = 0; t < nb / team_size; ++t) teams.emplace_back(new std::barrier<>(team_size * nt));
  std::barrier<> grid_bar(nb * nt);
  std::vector<double> slots(static_cast<size_t>(nb) * nt);
  std::vector<std::vector<uint64_t>> shared(nb, std::vector<uint64_t>((smem + 7) / 8 + 1));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(nb) * nt);
  for (unsigned b = 0; b < nb; ++b) {
    for (unsigned t = 0; t < nt; ++t) {
      threads.emplace_back([&, b, t] {
        Ctx& c = ctx();
        c.tid = threadIdx = {t, 0, 0};
        blockIdx = {b, 0, 0};
        blockDim = block;
        gridDim = grid;
        c.block = blocks[b].get();
        c.warp = warps[(b * nt + t) / 32].get();
        c.warp_slots = slots.data() + (static_cast<size_t>(b) * nt + t) / 32 * 32;
        c.team = teams[b / team_size].get();
        c.grid = &grid_bar;
        c.smem = reinterpret_cast<unsigned char*>(shared[b].data());
        kernel(p);
      });
    }
  }
  for (auto& th : threads) th.join();
  return cudaSuccess;
}

// A kernel without barriers: run every thread in turn.
template <typename... A, typename... B>
cudaError_t launch_simple(void (*kernel)(A...), dim3 grid, dim3 block, B... args) {
  for (unsigned b = 0; b < grid.x; ++b) {
    for (unsigned t = 0; t < block.x; ++t) {
      threadIdx = {t, 0, 0};
      blockIdx = {b, 0, 0};
      blockDim = block;
      gridDim = grid;
      kernel(args...);
    }
  }
  return cudaSuccess;
}

}  // namespace emu
