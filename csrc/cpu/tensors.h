// Host-side helpers of the float32 CPU kernels (LFF, encodings, rotary): storage dtypes,
// padded leading dimensions, output allocation, float32 copies of small weights, scratch.
// Nothing here opens a parallel region (see cpu/parallel.h for why that matters).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace posenc_fast {
namespace cpu {

// Storage dtype of a row of values (computation is float32 throughout).
enum class DT { F32, BF16, F16 };

inline DT dt_of(at::ScalarType t) {
  return t == at::kBFloat16 ? DT::BF16 : (t == at::kHalf ? DT::F16 : DT::F32);
}

// Leading dimensions are multiples of 16 floats (one AVX-512 vector, two AVX2, four SSE)
// so that every instruction set reads whole vectors of them.
constexpr int64_t kPad = 16;
inline int64_t round_up(int64_t n, int64_t m = kPad) { return (n + m - 1) / m * m; }

// A new tensor for a kernel's output. One of 32 MiB or more is a fresh mmap (torch's CPU
// allocator does not cache it) whose 4 KiB pages fault on first touch, costing more than the
// kernel's work (benchmarks/NOTES.md, "C++ LFF and encoding kernels", 2): it is advised as a
// transparent-huge-page candidate before the first touch (a hint; ignored where THP is off).
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
// parallel region of its own (slow when a core is busy elsewhere, see cpu/parallel.h).
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

// Kernel-table entry of cpu/phase.h (one per instruction set): the frequency turns of wr^T.
using PrepareTurnsFn = void (*)(const float* wr, int64_t F2, int64_t M, int64_t ldw, int64_t ldt, float* thi,
                                float* tlo);

}  // namespace cpu
}  // namespace posenc_fast
