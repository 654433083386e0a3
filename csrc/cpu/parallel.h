// The parallel region of every C++ CPU kernel (FLOATER, LFF, encodings, rotary): one OpenMP
// region per call, work items handed out in order by a shared counter, barriers, and the
// contention fallback (below). Which thread computes an item never changes a result: every
// item's arithmetic is fixed by the shapes alone, so results are the same bits for any
// thread count.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "cpu/tensors.h"

namespace posenc_fast {
namespace cpu {

// Hands out work items 0, 1, 2, ... to whichever thread asks first: a thread slowed by
// another process on its core simply takes fewer items.
struct WorkQueue {
  explicit WorkQueue(int64_t n) : n(n) {}
  bool take(int64_t& item) {
    item = next.fetch_add(1, std::memory_order_relaxed);
    return item < n;
  }
  std::atomic<int64_t> next{0};
  const int64_t n;
};

// Contention fallback. A team thread on a core busy with another process runs in the
// scheduler's time slices: the others wait for it at every barrier and at the region's end.
// A region marks the machine contended when one of two signs exceeds kLateNs and a share
// of the region's duration:
// - waits at barriers (teams that advance in lockstep, FLOATER's), over half of it: a team
//   of two whose slower member runs at a fraction s of full speed takes W / (2 s) for work
//   W and waits 1 - s of it, so the team is the faster while the waits stay under half.
// - threads reaching its end apart (work-queue regions, LFF's), over a quarter of it: the
//   late thread held at most one item, so the spread is time added to one thread's time.
// Why these bounds: benchmarks/NOTES.md, "FLOATER integrator on the CPU", 3.
// Calls then run on one thread (the same bits) for kSoloNs, then try the team again.
// always_team() turns this off (for tests of thread-count independence on a busy machine).
constexpr int64_t kLateNs = 1'000'000;
constexpr int64_t kSoloNs = 250'000'000;

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
inline std::atomic<int64_t>& solo_until_ns() {
  static std::atomic<int64_t> until{0};
  return until;
}
// For tests: teams whatever the machine looks like (the fallback off).
inline std::atomic<bool>& always_team() {
  static std::atomic<bool> on{false};
  return on;
}
// Whether calls run on one thread for now (the machine looked contended).
inline bool contended() {
  return now_ns() < solo_until_ns().load(std::memory_order_relaxed) && !always_team().load(std::memory_order_relaxed);
}

// For tests (module.cpp: judge_regions_contended): the next n team regions are judged
// contended whatever their clocks say, so that the fallback's paths run on demand; n = 0
// also ends the current one-thread period.
inline std::atomic<int64_t>& forced_contended_regions() {
  static std::atomic<int64_t> n{0};
  return n;
}
inline bool take_forced_contention() {
  int64_t n = forced_contended_regions().load(std::memory_order_relaxed);
  while (n > 0 && !forced_contended_regions().compare_exchange_weak(n, n - 1, std::memory_order_relaxed)) {
  }
  return n > 0;
}
inline void judge_regions_contended(int64_t n) {
  TORCH_CHECK_VALUE(n >= 0, "judge_regions_contended: the number of regions must be >= 0, got ", n);
  forced_contended_regions().store(n);
  if (n == 0) solo_until_ns().store(0);
}

// What a region measures: the longest time one thread spent waiting at its barriers, and
// the earliest and latest arrival at its end.
struct RegionClock {
  std::atomic<int64_t> waited{0}, first_end{INT64_MAX}, last_end{INT64_MIN};
  static void max_into(std::atomic<int64_t>& a, int64_t t) {
    int64_t v = a.load(std::memory_order_relaxed);
    while (t > v && !a.compare_exchange_weak(v, t, std::memory_order_relaxed)) {
    }
  }
  static void min_into(std::atomic<int64_t>& a, int64_t t) {
    int64_t v = a.load(std::memory_order_relaxed);
    while (t < v && !a.compare_exchange_weak(v, t, std::memory_order_relaxed)) {
    }
  }
};
struct ThreadClock {  // the calling thread's region and its barrier waits so far
  RegionClock* region = nullptr;
  int64_t waited = 0;
};
inline ThreadClock& thread_clock() {
  static thread_local ThreadClock c;
  return c;
}

// Threads for `items` work items of about `item_cost` multiply-adds each: at most ATen's
// thread count, one inside another parallel region, one for tiny problems (a fork and
// join costs a few microseconds) and one while the machine looks contended (above).
inline int team_threads(int64_t items, double item_cost) {
  if (at::in_parallel_region() || items <= 1 || static_cast<double>(items) * item_cost < 2.0e5) return 1;
  if (contended()) return 1;
  return static_cast<int>(std::min<int64_t>(at::get_num_threads(), items));
}

// How n units of work (rows, positions) are cut into items: `size` units each, fewer when
// that would leave fewer than 4 items per thread (a whole multiple of `quantum`, at least
// one), and the threads for them (team_threads, at most one per item). The cut never
// changes the numbers: every unit is computed on its own.
struct WorkSplit {
  int threads;
  int64_t size, items;
};
inline WorkSplit split_work(int64_t n, int64_t size, int64_t quantum, double unit_cost) {
  WorkSplit w{team_threads((n + size - 1) / size, unit_cost * static_cast<double>(size)), size, 0};
  const int64_t want = 4 * static_cast<int64_t>(w.threads);
  if (w.threads > 1 && (n + size - 1) / size < want)
    w.size = std::min(size, std::max(quantum, round_up((n + want - 1) / want, quantum)));
  w.items = (n + w.size - 1) / w.size;
  w.threads = static_cast<int>(std::min<int64_t>(w.threads, w.items));
  return w;
}

// Runs body(rank, size) on `threads` threads: one OpenMP parallel region (fewer threads if
// OpenMP grants fewer; work is shared through WorkQueue or split by the actual size, so
// the split adapts). body must not throw: allocate before. watch_end = false: the threads'
// arrivals at the end do not count as lateness (a few items of unequal size, FLOATER's
// chunks: their ends are apart by design); barrier waits always count.
template <typename F>
void parallel_region(int threads, const F& body, bool watch_end = true) {
#ifdef _OPENMP
  if (threads > 1) {
    const int64_t begin = now_ns();
    RegionClock clock;
#pragma omp parallel num_threads(threads)
    {
      ThreadClock& tc = thread_clock();
      const ThreadClock outer = tc;
      tc = ThreadClock{&clock, 0};
      body(omp_get_thread_num(), omp_get_num_threads());
      const int64_t end = now_ns();
      RegionClock::max_into(clock.waited, tc.waited);
      RegionClock::min_into(clock.first_end, end);
      RegionClock::max_into(clock.last_end, end);
      tc = outer;
    }
    const int64_t end_spread = watch_end ? clock.last_end.load() - clock.first_end.load() : 0;
    const int64_t waited = clock.waited.load();
    const int64_t took = now_ns() - begin;
    const bool lockstep_late = waited > kLateNs && 2 * waited > took;
    const bool end_late = end_spread > kLateNs && 4 * end_spread > took;
    if (lockstep_late || end_late || take_forced_contention())
      solo_until_ns().store(now_ns() + kSoloNs, std::memory_order_relaxed);
    return;
  }
#endif
  body(0, 1);
}

// All threads of the region wait here (nothing without OpenMP: one thread).
inline void region_barrier() {
#ifdef _OPENMP
  ThreadClock& tc = thread_clock();
  const int64_t t0 = tc.region ? now_ns() : 0;
#pragma omp barrier
  if (tc.region) tc.waited += now_ns() - t0;
#endif
}

// fn(rank, item) for items 0 .. n-1 on `threads` threads, handed out in order.
template <typename F>
void for_each_item(int threads, int64_t n, const F& fn, bool watch_end = true) {
  WorkQueue queue(n);
  parallel_region(
      threads,
      [&](int rank, int) {
        int64_t i;
        while (queue.take(i)) fn(rank, i);
      },
      watch_end);
}

// Deterministic weight gradients: work is cut into blocks fixed by the shapes alone, each
// block adds its items into its own partial sums (in item order), and after a barrier the
// partials are added in block order into the outputs, their rows split over the threads.
//
// One output of the partials: rows x cols floats at offset `off` of a block's partial (row
// stride ld), added over the blocks and rounded to dt into out (element (i, j) at
// out + i * ds_row + j * ds_col, in elements).
struct PartialSum {
  int64_t off, rows, cols, ld;
  void* out;
  DT dt;
  int64_t ds_row, ds_col;
};
// Kernel-table entry of cpu/simd.h (one per instruction set): rows [row0, row1) of s.
using SumPartialsFn = void (*)(const float* parts, int64_t nparts, int64_t stride, const PartialSum& s, int64_t row0,
                               int64_t row1);

// work(rank, block, partial) for blocks 0 .. nblocks-1 (partials of `per` floats each), then
// every sum of `sums`. Without sums, no partials are kept (per is ignored).
template <typename F>
void run_blocks(int threads, int64_t nblocks, int64_t per, const std::vector<PartialSum>& sums,
                SumPartialsFn sum_partials, const F& work) {
  if (sums.empty()) per = 0;
  const at::Tensor parts = at::empty({std::max<int64_t>(1, nblocks * per)}, at::kFloat);
  float* base = parts.data_ptr<float>();
  WorkQueue queue(nblocks);
  parallel_region(threads, [&](int rank, int size) {
    int64_t b;
    while (queue.take(b)) work(rank, b, base + b * per);
    if (sums.empty()) return;
    region_barrier();  // every block's partial is complete
    for (const PartialSum& s : sums)
      sum_partials(base + s.off, nblocks, per, s, s.rows * rank / size, s.rows * (rank + 1) / size);
  });
}

}  // namespace cpu
}  // namespace posenc_fast
