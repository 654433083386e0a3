// A tiny CUDA emulator for testing the logic of csrc/floater/floater_cuda.cu on machines
// without a GPU: the kernels compile as host C++ and every CUDA thread becomes a
// std::thread. __syncthreads, warp shuffles, cluster barriers (whole or split into arrive
// and wait) and grid barriers are std::barrier waits, so the phase structure, indexing,
// reductions and partitioning run exactly as written.
//
// Thread-block clusters: blocks c*C .. c*C+C-1 form cluster c (a {C,1,1} cluster launch);
// cluster_group::block_rank() and map_shared_rank() (distributed shared memory: the same
// offset in another block's shared memory) behave as on sm_90.
//
// How it reaches the kernels: it is force-included before csrc/floater/floater_cuda.cu
// (-include cuda_emulation.h), defines the hooks of csrc/floater/floater_cuda_hooks.h and
// stands in for the CUDA headers (include/: cuda_runtime.h, cooperative_groups.h and
// cuda_pipeline.h, which find everything here): the runtime's launch calls start the
// emulated threads, __ldcg / __stcg / cp.async are plain copies.
//
// Race checker. Every access the kernels announce through the hook FLOATER_CUDA_ACCESS
// (the exchange buffers: floater_cuda_team.cuh) is checked against the happens-before
// order the barriers give: a shadow record per 4-byte word keeps its last write (thread,
// block, and the writer's arrival counts at block and team level) and the reads since.
// A read of a word written by another thread needs a barrier between them that the writer
// arrived at after writing and the reader waited on before reading: a __syncthreads or
// team barrier within one block, a team barrier (cluster or grid) across blocks; a write
// needs the same after every earlier read by another thread. A violation prints what
// raced and aborts the process, so a missing or misplaced barrier fails the tests even
// when the threads happen to run in a harmless order. POSENC_FAST_EMU_SKIP_TEAM_BARRIER=N
// skips the N-th team barrier of every thread (fault injection: the tests check that the
// checker notices).
//
// What it cannot check: the GPU memory model beyond barrier order (ld.global.cg, L1
// staleness), accesses not announced through the hook, timing, occupancy,
// register or shared-memory limits. Used by tests/floater/test_extension_cuda_emulation.py
// through emulate_floater.cpp.
#pragma once

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

// The hooks of csrc/floater/floater_cuda_hooks.h (FLOATER_CUDA_THREADS: the build sets it).
#define FLOATER_CUDA_DYNAMIC_SMEM(name) unsigned char* name = ::emu::ctx().smem
#define FLOATER_CUDA_ACCESS(p, bytes, write) ::emu::check(p, bytes, write)
#define FLOATER_CUDA_EXCHANGE_BUFFER(p, bytes) ::emu::track(p, bytes)
#define FLOATER_CUDA_NO_INLINE_PTX 1

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

// An H100/H200-like device for choose_layout(): 132 SMs in 8 GPCs (two of 18 SMs, six of 16),
// 227 KiB of shared memory per block, 228 KiB per SM.
namespace emu {
constexpr int kGpcSms[8] = {18, 18, 16, 16, 16, 16, 16, 16};
constexpr size_t kSmemPerSm = 233472;
constexpr size_t kSmemPerBlockOptin = 232448;
// POSENC_FAST_EMU_DEVICE=a100: an A100-like device instead (108 SMs, no clusters, 163 KiB
// per block): choose_layout's path for GPUs without clusters.
inline bool a100() {
  const char* e = std::getenv("POSENC_FAST_EMU_DEVICE");
  return e != nullptr && std::strcmp(e, "a100") == 0;
}
}  // namespace emu

struct cudaDeviceProp {
  int multiProcessorCount = 132;
  int major = 9, minor = 0;
  size_t sharedMemPerBlockOptin = emu::kSmemPerBlockOptin;
  size_t sharedMemPerMultiprocessor = emu::kSmemPerSm;
  int cooperativeLaunch = 1;
};
inline cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int) {
  *p = cudaDeviceProp{};
  if (emu::a100()) {
    p->multiProcessorCount = 108;
    p->major = 8;
    p->sharedMemPerBlockOptin = 166912;
    p->sharedMemPerMultiprocessor = 167936;
  }
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
// Blocks per SM: limited by shared memory (1 KiB reserved per block) and 2048 threads.
inline cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* n, const void*, int threads, size_t smem) {
  cudaDeviceProp p;
  cudaGetDeviceProperties(&p, 0);
  if (smem > p.sharedMemPerBlockOptin) {
    *n = 0;
    return cudaSuccess;
  }
  const int by_smem = static_cast<int>(p.sharedMemPerMultiprocessor / (smem + 1024));
  *n = std::min(by_smem, 2048 / std::max(threads, 1));
  return cudaSuccess;
}
// A cluster's blocks run in one GPC: clusters of C co-resident = sum over GPCs of
// floor(SMs x blocks per SM / C) (8 for C = 9..16 as on the H200, where the first run
// found 8 clusters of 10 blocks co-resident).
inline cudaError_t cudaOccupancyMaxActiveClusters(int* n, const void* k, const cudaLaunchConfig_t* cfg) {
  if (emu::a100()) return cudaErrorNotSupported;
  const unsigned C = cfg->numAttrs ? cfg->attrs[0].val.clusterDim.x : 1;
  if (C > 16) {
    *n = 0;
    return cudaErrorInvalidValue;
  }
  int per_sm = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, cfg->blockDim.x, cfg->dynamicSmemBytes);
  int total = 0;
  for (int sms : emu::kGpcSms) total += sms * per_sm / static_cast<int>(C);
  *n = total;
  return cudaSuccess;
}

namespace emu {

struct uint3_ {
  unsigned x, y, z;
};

// Per emulated thread: its barriers, and how many it has arrived at and waited on (block
// level: __syncthreads and team barriers; team level: cluster or grid barriers), which
// order its checked accesses.
struct Ctx {
  uint3_ tid{0, 0, 0};
  unsigned block_id = 0, cluster_size = 1, gid = 0;
  std::barrier<>* block = nullptr;
  std::barrier<>* warp = nullptr;
  double* warp_slots = nullptr;  // 32 per warp
  std::barrier<>* team = nullptr;
  unsigned char* smem = nullptr;
  std::vector<unsigned char*>* smem_of = nullptr;  // every block's shared memory
  uint32_t bA = 0, bW = 0, tA = 0, tW = 0;
  uint32_t team_calls = 0, skip_team = 0;  // fault injection (POSENC_FAST_EMU_SKIP_TEAM_BARRIER)
  bool skipping = false;
  std::optional<std::barrier<>::arrival_token> token;
};
inline Ctx& ctx() {
  static thread_local Ctx c;
  return c;
}

// ---------------------------------------------------------------------------- race checker
struct Access {
  int tid;              // global thread id
  int blk;              // block
  uint32_t bA, tA;      // the thread's arrival counts at the time of the access
};
struct Shadow {
  bool written = false;
  Access w{};
  std::vector<Access> reads;  // since the last write (one per thread at most)
};
struct Region {
  uintptr_t begin = 0, end = 0;
  std::vector<Shadow> words;
  std::unique_ptr<std::mutex[]> locks;
};
struct Checker {
  std::mutex regions_lock;
  std::vector<std::unique_ptr<Region>> regions;
  static constexpr size_t kLocks = 64;
};
inline Checker& checker() {
  static Checker c;
  return c;
}
// Track [p, p + bytes): shadow records from now on (fresh: nothing written), until the
// launch ends.
inline void track(const void* p, size_t bytes) {
  if (p == nullptr || bytes == 0) return;
  auto r = std::make_unique<Region>();
  r->begin = reinterpret_cast<uintptr_t>(p);
  r->end = r->begin + bytes;
  r->words.resize((bytes + 3) / 4);
  r->locks.reset(new std::mutex[Checker::kLocks]);
  std::lock_guard<std::mutex> g(checker().regions_lock);
  checker().regions.push_back(std::move(r));
}
inline void untrack_all() {
  std::lock_guard<std::mutex> g(checker().regions_lock);
  checker().regions.clear();
}
inline Region* region_of(uintptr_t a) {
  // regions are added before a launch and removed after it: no lock needed while it runs
  for (auto& r : checker().regions)
    if (a >= r->begin && a < r->end) return r.get();
  return nullptr;
}
[[noreturn]] inline void race(const char* kind, const Region& r, uintptr_t a, const Access& first,
                              const Access& second) {
  std::fprintf(stderr,
               "emulated device: race (%s) at byte %lu of a region of %lu bytes: thread %d of block %d "
               "(barrier arrivals: block %u, team %u) then thread %d of block %d (waited: block %u, team %u) "
               "without a barrier between them\n",
               kind, static_cast<unsigned long>(a - r.begin), static_cast<unsigned long>(r.end - r.begin), first.tid,
               first.blk, first.bA, first.tA, second.tid, second.blk, ctx().bW, ctx().tW);
  std::fflush(stderr);
  std::abort();
}
// Whether the access `earlier` (by another thread) happens before the current thread's
// access: a barrier the earlier thread arrived at after it, which this thread waited on.
inline bool ordered(const Access& earlier) {
  const Ctx& c = ctx();
  if (earlier.tid == static_cast<int>(c.gid)) return true;
  if (earlier.blk == static_cast<int>(c.block_id)) return c.bW > earlier.bA;
  return c.tW > earlier.tA;
}
inline void check(const void* p, size_t bytes, bool write) {
  const uintptr_t a0 = reinterpret_cast<uintptr_t>(p);
  Region* r = region_of(a0);
  if (r == nullptr) return;
  const Ctx& c = ctx();
  const Access me{static_cast<int>(c.gid), static_cast<int>(c.block_id), c.bA, c.tA};
  for (uintptr_t a = a0; a < a0 + bytes; a += 4) {
    const size_t w = (a - r->begin) / 4;
    std::lock_guard<std::mutex> g(r->locks[w % Checker::kLocks]);
    Shadow& s = r->words[w];
    if (s.written && !ordered(s.w)) race(write ? "write after write" : "read after write", *r, a, s.w, me);
    if (write) {
      for (const Access& rd : s.reads)
        if (!ordered(rd)) race("write after read", *r, a, rd, me);
      s.written = true;
      s.w = me;
      s.reads.clear();
    } else {
      bool found = false;
      for (Access& rd : s.reads)
        if (rd.tid == me.tid) {
          rd = me;
          found = true;
        }
      if (!found) s.reads.push_back(me);
    }
  }
}

// ---------------------------------------------------------------------------- barriers
inline void block_barrier() {
  Ctx& c = ctx();
  c.block->arrive_and_wait();
  ++c.bA;
  ++c.bW;
}
// Team barriers (cluster or grid): arrive, later wait; skipped as a whole when injected.
inline void team_arrive() {
  Ctx& c = ctx();
  ++c.team_calls;
  c.skipping = c.skip_team != 0 && c.team_calls == c.skip_team;
  if (c.skipping) return;
  c.token.emplace(c.team->arrive());
  ++c.bA;
  ++c.tA;
}
inline void team_wait() {
  Ctx& c = ctx();
  if (c.skipping) {
    c.skipping = false;
    return;
  }
  c.team->wait(std::move(*c.token));
  c.token.reset();
  ++c.bW;
  ++c.tW;
}

}  // namespace emu

// The built-in variables, per emulated thread.
inline thread_local emu::uint3_ threadIdx{0, 0, 0};
inline thread_local emu::uint3_ blockIdx{0, 0, 0};
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;

inline void __syncthreads() { emu::block_barrier(); }
inline void __trap() { std::abort(); }
template <typename T>
inline T __ldcg(const T* p) {
  return *p;
}
template <typename T>
inline void __stcg(T* p, T v) {
  *p = v;
}
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(16) double2 {
  double x, y;
};
// cp.async: a plain copy, complete at once
inline void __pipeline_memcpy_async(void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); }
inline void __pipeline_commit() {}
inline void __pipeline_wait_prior(size_t) {}
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

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
  void sync() {
    emu::team_arrive();
    emu::team_wait();
  }
};
struct cluster_group {
  void sync() {
    emu::team_arrive();
    emu::team_wait();
  }
  void barrier_arrive() { emu::team_arrive(); }
  void barrier_wait() { emu::team_wait(); }
  unsigned block_rank() const { return emu::ctx().block_id % emu::ctx().cluster_size; }
  unsigned num_blocks() const { return emu::ctx().cluster_size; }
  // The address of *p (in this block's shared memory) in block `rank` of the cluster.
  template <typename T>
  T* map_shared_rank(T* p, unsigned rank) const {
    const emu::Ctx& c = emu::ctx();
    if (rank >= c.cluster_size) {
      std::fprintf(stderr, "emulated device: map_shared_rank(%u) in a cluster of %u\n", rank, c.cluster_size);
      std::abort();
    }
    const unsigned target = c.block_id - c.block_id % c.cluster_size + rank;
    const auto off = reinterpret_cast<unsigned char*>(p) - c.smem;
    return reinterpret_cast<T*>((*c.smem_of)[target] + off);
  }
};
inline grid_group this_grid() { return {}; }
inline cluster_group this_cluster() { return {}; }
}  // namespace cooperative_groups

namespace emu {

// Run a kernel: one std::thread per CUDA thread, each calling run(); mode 1 (cluster)
// gives each group of C consecutive blocks its own team barrier and a cluster of C, mode 2
// (grid) one barrier for all. Every block's shared memory is tracked by the race checker
// (besides the regions track() registered), and starts poisoned.
template <typename Run>
cudaError_t launch(const Run& run, int mode, int C, dim3 grid, dim3 block, size_t smem) {
  const unsigned nb = grid.x, nt = block.x;
  if (nb == 0 || nt % 32 != 0 || (mode == 1 && nb % C != 0)) {
    untrack_all();
    return cudaErrorInvalidConfiguration;
  }
  std::vector<std::unique_ptr<std::barrier<>>> blocks, warps, teams;
  for (unsigned b = 0; b < nb; ++b) blocks.emplace_back(new std::barrier<>(nt));
  for (unsigned w = 0; w < nb * nt / 32; ++w) warps.emplace_back(new std::barrier<>(32));
  const unsigned team_size = mode == 1 ? C : (mode == 2 ? nb : 1);
  for (unsigned t = 0; t < nb / team_size; ++t) teams.emplace_back(new std::barrier<>(team_size * nt));
  std::vector<double> slots(static_cast<size_t>(nb) * nt);
  const size_t words = (smem + 7) / 8 + 1;
  std::vector<std::vector<uint64_t>> shared(nb, std::vector<uint64_t>(words, 0x7ff4dead7ff4deadull));
  std::vector<unsigned char*> bases(nb);
  for (unsigned b = 0; b < nb; ++b) {
    bases[b] = reinterpret_cast<unsigned char*>(shared[b].data());
    track(bases[b], words * 8);
  }
  const char* skip = std::getenv("POSENC_FAST_EMU_SKIP_TEAM_BARRIER");
  const uint32_t skip_team = skip ? static_cast<uint32_t>(std::atoi(skip)) : 0;
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(nb) * nt);
  for (unsigned b = 0; b < nb; ++b) {
    for (unsigned t = 0; t < nt; ++t) {
      threads.emplace_back([&, b, t] {
        Ctx& c = ctx();
        c = Ctx{};
        c.tid = threadIdx = {t, 0, 0};
        c.block_id = b;
        c.gid = b * nt + t;
        c.cluster_size = mode == 1 ? C : 1;
        blockIdx = {b, 0, 0};
        blockDim = block;
        gridDim = grid;
        c.block = blocks[b].get();
        c.warp = warps[(b * nt + t) / 32].get();
        c.warp_slots = slots.data() + (static_cast<size_t>(b) * nt + t) / 32 * 32;
        c.team = teams[b / team_size].get();
        c.smem = bases[b];
        c.smem_of = &bases;
        c.skip_team = skip_team;
        run();
      });
    }
  }
  for (auto& th : threads) th.join();
  untrack_all();
  return cudaSuccess;
}

// kernel(*args[0], *args[1], ...): the arguments as the runtime's launch calls take them.
template <typename... A, size_t... I>
void call_with(void (*kernel)(A...), void** args, std::index_sequence<I...>) {
  kernel(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(args[I])...);
}

}  // namespace emu

// The runtime's typed launch calls (what floater_cuda.cu calls): blocks on their own (a
// plain launch), a cooperative grid (one team), clusters of the configuration's size.
template <typename... A>
cudaError_t cudaLaunchKernel(void (*kernel)(A...), dim3 grid, dim3 block, void** args, size_t smem = 0,
                             cudaStream_t = nullptr) {
  return emu::launch([&] { emu::call_with(kernel, args, std::index_sequence_for<A...>{}); }, 0, 1, grid, block,
                     smem);
}
template <typename... A>
cudaError_t cudaLaunchCooperativeKernel(void (*kernel)(A...), dim3 grid, dim3 block, void** args, size_t smem = 0,
                                        cudaStream_t = nullptr) {
  return emu::launch([&] { emu::call_with(kernel, args, std::index_sequence_for<A...>{}); }, 2, 1, grid, block,
                     smem);
}
template <typename... E, typename... Act>
cudaError_t cudaLaunchKernelEx(const cudaLaunchConfig_t* cfg, void (*kernel)(E...), Act&&... args) {
  const int C = cfg->numAttrs ? static_cast<int>(cfg->attrs[0].val.clusterDim.x) : 1;
  return emu::launch([&] { kernel(args...); }, 1, C, cfg->gridDim, cfg->blockDim, cfg->dynamicSmemBytes);
}
