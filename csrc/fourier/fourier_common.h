// What the LFF and encoding CPU drivers share: storage dtypes, padding, the instruction set,
// output allocation and one parallel region per call with work handed out in order; and
// every header their per-instruction-set kernels need (per_isa.h includes nothing itself).
#pragma once

// GCC 12 reports its own AVX-512 intrinsic headers' deliberately undefined temporaries
// (masked loads, roundscale) as maybe-uninitialized once inlined into the kernels: noise.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#if defined(__linux__)
#include <sys/mman.h>
#endif
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

#include "../floater/cpu_vec.h"
#include "../floater/floater_cpu.h"

namespace posenc_fast {
namespace fourier {

// Storage dtype of a row of values (computation is float32 throughout).
enum class DT { F32, BF16, F16 };

inline DT dt_of(at::ScalarType t) {
  return t == at::kBFloat16 ? DT::BF16 : (t == at::kHalf ? DT::F16 : DT::F32);
}

// Kernel-table entries of simd.h's shared helpers (one per instruction set): the frequency
// turns of wr^T (prepare_turns) and the ordered sum of per-block partials (sum_partials).
using PrepareTurnsFn = void (*)(const float* wr, int64_t F2, int64_t M, int64_t ldw, int64_t ldt, float* thi,
                                float* tlo);
using SumPartialsFn = void (*)(const float* parts, int64_t nparts, int64_t stride, int64_t rows, int64_t cols,
                               int64_t ld, int64_t row0, int64_t row1, void* out, DT dt, int64_t ds_row,
                               int64_t ds_col);

// Leading dimensions are multiples of 16 floats (one AVX-512 vector, two AVX2, four SSE)
// so that every instruction set reads whole vectors of them.
constexpr int64_t kPad = 16;
inline int64_t round_up(int64_t n, int64_t m = kPad) { return (n + m - 1) / m * m; }

// The instruction set of the kernels: FLOATER's choice (POSENC_FAST_CPU_ISA, set_cpu_isa).
inline int isa_level() { return floater::cpu::isa_level(); }

// A new tensor for a kernel's output. One of 32 MiB or more is a fresh mapping of its own
// (glibc serves such sizes with mmap, and torch's CPU allocator does not cache them), whose
// every 4 KiB page faults on first touch: ~45 ms for 50 MB on a 2-core VM, several times the
// kernel's work. Advising it as a transparent-huge-page candidate before the first touch
// (a hint; ignored where THP is off, the default "madvise" mode honours it) makes those
// faults 2 MiB each. The memory is still torch's allocation, accounted and freed as usual.
inline at::Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor t = at::empty(sizes, options);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const uintptr_t bytes = static_cast<uintptr_t>(t.numel()) * t.element_size();
  if (bytes >= (uintptr_t{32} << 20)) {
    const uintptr_t huge = uintptr_t{2} << 20, p = reinterpret_cast<uintptr_t>(t.data_ptr());
    const uintptr_t a = (p + huge - 1) & ~(huge - 1), b = (p + bytes) & ~(huge - 1);
    if (b > a) madvise(reinterpret_cast<void*>(a), b - a, MADV_HUGEPAGE);  // failure: no harm
  }
#endif
  return t;
}

// Copies src ([rows, cols] or [cols]; float32, bfloat16 or float16; any strides) as
// float32 into dst with row stride ld; transposed: dst[c * ld + r] = src[r, c]. Element by
// element on this thread (weights are small; an ATen copy would open a parallel region).
inline void copy_f32(const at::Tensor& src, float* dst, int64_t ld, bool transposed) {
  const bool two = src.dim() == 2;
  const int64_t rows = two ? src.size(0) : 1, cols = src.size(-1);
  const int64_t sr = two ? src.stride(0) : 0, sc = src.stride(-1);
  const at::ScalarType t = src.scalar_type();
  const char* base = static_cast<const char*>(src.data_ptr());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t i = r * sr + c * sc;
      float v;
      if (t == at::kFloat)
        v = reinterpret_cast<const float*>(base)[i];
      else if (t == at::kBFloat16)
        v = static_cast<float>(reinterpret_cast<const c10::BFloat16*>(base)[i]);
      else
        v = static_cast<float>(reinterpret_cast<const c10::Half*>(base)[i]);
      (transposed ? dst[c * ld + r] : dst[r * ld + c]) = v;
    }
}

// Zero-filled float32 scratch, filled by this thread: an ATen fill of this size would be a
// parallel region of its own (slow when a core is busy elsewhere, see below).
inline at::Tensor zeroed_floats(int64_t n) {
  at::Tensor t = at::empty({n}, at::kFloat);
  std::memset(t.data_ptr<float>(), 0, sizeof(float) * static_cast<size_t>(n));
  return t;
}

// Whether a kernel writes the [rows, width] output `out` with streaming stores: outputs of
// 16 MiB or more (half this kind of machine's L3: they leave the caches anyway), whose rows
// start 64-byte aligned (every whole vector store is then aligned).
inline bool use_streaming(const at::Tensor& out) {
  const int64_t row_bytes = out.stride(0) * static_cast<int64_t>(out.element_size());
  return out.numel() * static_cast<int64_t>(out.element_size()) >= (int64_t{16} << 20) &&
         reinterpret_cast<uintptr_t>(out.data_ptr()) % 64 == 0 && row_bytes % 64 == 0;
}

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

// When another process keeps a core busy, a team thread on that core runs in the
// scheduler's time slices (milliseconds): the region waits for it at the barrier and at
// its end, and a call takes several times its single-thread time. A region in which the
// threads reach a synchronisation point more than kLateNs and more than a quarter of the
// region's duration apart marks the machine contended; calls then run on one thread (the
// results are the same bits for any thread count) for kSoloNs, after which a call tries
// the team again. POSENC_FAST_CPU_ALWAYS_TEAM=1 turns this off (the tests of thread-count
// independence must really run teams, on a CI machine that may be busy).
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

// Earliest and latest arrival of the threads at one synchronisation point.
struct Arrivals {
  std::atomic<int64_t> first{INT64_MAX}, last{INT64_MIN};
  void note(int64_t t) {
    int64_t v = first.load(std::memory_order_relaxed);
    while (t < v && !first.compare_exchange_weak(v, t, std::memory_order_relaxed)) {
    }
    v = last.load(std::memory_order_relaxed);
    while (t > v && !last.compare_exchange_weak(v, t, std::memory_order_relaxed)) {
    }
  }
  int64_t spread() const { return last.load() - first.load(); }
};
inline Arrivals*& barrier_arrivals() {  // the current region's barrier, per thread
  static thread_local Arrivals* a = nullptr;
  return a;
}

// Threads for `items` work items of about `item_cost` multiply-adds each: at most ATen's
// thread count, one inside another parallel region, one for tiny problems (a fork and
// join costs a few microseconds) and one while the machine looks contended (above).
inline int team_threads(int64_t items, double item_cost) {
  if (at::in_parallel_region() || items <= 1 || static_cast<double>(items) * item_cost < 2.0e5) return 1;
  if (now_ns() < solo_until_ns().load(std::memory_order_relaxed) && !std::getenv("POSENC_FAST_CPU_ALWAYS_TEAM"))
    return 1;
  return static_cast<int>(std::min<int64_t>(at::get_num_threads(), items));
}

// Runs body(rank, size) on `threads` threads: one OpenMP parallel region (fewer threads if
// OpenMP grants fewer; work is shared through WorkQueue, so the split adapts). body must
// not throw: allocate before.
template <typename F>
void parallel_region(int threads, const F& body) {
#ifdef _OPENMP
  if (threads > 1) {
    const int64_t begin = now_ns();
    Arrivals barrier, end;
#pragma omp parallel num_threads(threads)
    {
      barrier_arrivals() = &barrier;
      body(omp_get_thread_num(), omp_get_num_threads());
      barrier_arrivals() = nullptr;
      end.note(now_ns());
    }
    const int64_t late = std::max(barrier.spread(), end.spread()), took = now_ns() - begin;
    if (late > kLateNs && 4 * late > took) solo_until_ns().store(now_ns() + kSoloNs, std::memory_order_relaxed);
    return;
  }
#endif
  body(0, 1);
}

// All threads of the region wait here (nothing without OpenMP: one thread).
inline void region_barrier() {
#ifdef _OPENMP
  if (Arrivals* a = barrier_arrivals()) a->note(now_ns());
#pragma omp barrier
#endif
}

}  // namespace fourier
}  // namespace posenc_fast
