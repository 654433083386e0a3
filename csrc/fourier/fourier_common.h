// What the LFF and encoding CPU drivers share: storage dtypes, padding, the instruction set,
// and one parallel region per call with work handed out in order.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "../floater/floater_cpu.h"

namespace posenc_fast {
namespace fourier {

// Storage dtype of a row of values (computation is float32 throughout).
enum class DT { F32, BF16, F16 };

inline DT dt_of(at::ScalarType t) {
  return t == at::kBFloat16 ? DT::BF16 : (t == at::kHalf ? DT::F16 : DT::F32);
}

// Leading dimensions are multiples of 16 floats (one AVX-512 vector, two AVX2, four SSE)
// so that every instruction set reads whole vectors of them.
constexpr int64_t kPad = 16;
inline int64_t round_up(int64_t n, int64_t m = kPad) { return (n + m - 1) / m * m; }

// The instruction set of the kernels: FLOATER's choice (POSENC_FAST_CPU_ISA, set_cpu_isa).
inline int isa_level() { return floater::cpu::isa_level(); }

// Hands out work items 0, 1, 2, ... to whichever thread asks first: a thread slowed by
// another process on its core simply takes fewer items. Which thread computes an item
// never changes its result (every item's arithmetic is fixed by the shapes alone).
struct WorkQueue {
  explicit WorkQueue(int64_t n) : n(n) {}
  bool take(int64_t& item) {
    item = next.fetch_add(1, std::memory_order_relaxed);
    return item < n;
  }
  std::atomic<int64_t> next{0};
  const int64_t n;
};

// Threads for `items` work items of about `item_cost` multiply-adds each: at most ATen's
// thread count, one inside another parallel region, and one for tiny problems (a fork and
// join costs a few microseconds).
inline int team_threads(int64_t items, double item_cost) {
  if (at::in_parallel_region() || items <= 1 || static_cast<double>(items) * item_cost < 2.0e5) return 1;
  return static_cast<int>(std::min<int64_t>(at::get_num_threads(), items));
}

// Runs body(rank, size) on `threads` threads: one OpenMP parallel region (fewer threads if
// OpenMP grants fewer; work is shared through WorkQueue, so the split adapts). body must
// not throw: allocate before.
template <typename F>
void parallel_region(int threads, const F& body) {
#ifdef _OPENMP
  if (threads > 1) {
#pragma omp parallel num_threads(threads)
    body(omp_get_thread_num(), omp_get_num_threads());
    return;
  }
#endif
  body(0, 1);
}

// All threads of the region wait here (nothing without OpenMP: one thread).
inline void region_barrier() {
#ifdef _OPENMP
#pragma omp barrier
#endif
}

}  // namespace fourier
}  // namespace posenc_fast
