// One spare block of memory for a large buffer that every training step allocates and
// frees again (the FLOATER tape, made by each forward, freed by its backward). Why: an
// allocation that large comes fresh from mmap and pays a page fault per 4 KiB page when
// first written, which cost the taped forward more than the tape saves (benchmarks/NOTES.md,
// "FLOATER integrator on the CPU", 2).
// A buffer made here keeps its memory when freed, as the spare; the next request that the
// spare can hold takes it (no page faults), a larger one frees it first. At most one block
// is kept (the largest freed since); release_spare() returns it to the system.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <mutex>

namespace posenc_fast {
namespace cpu {

namespace spare_detail {

struct Spare {
  std::mutex mu;
  void* block = nullptr;
  size_t bytes = 0;
};

inline Spare& spare() {
  static Spare s;  // inline function: one instance in the whole extension
  return s;
}

// The deleter of a buffer: keep its block as the spare unless a larger one is kept.
inline void give_back(void* block, size_t bytes) {
  Spare& s = spare();
  void* drop = block;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (bytes > s.bytes) {
      drop = s.block;
      s.block = block;
      s.bytes = bytes;
    }
  }
  if (drop) std::free(drop);
}

}  // namespace spare_detail

// An uninitialised contiguous 1-D CPU tensor of `numel` elements of options' dtype, whose
// memory comes from (and returns to) the spare block.
inline at::Tensor spare_empty(int64_t numel, const at::TensorOptions& options) {
  const size_t bytes = static_cast<size_t>(std::max<int64_t>(numel, 1)) * options.dtype().itemsize();
  spare_detail::Spare& s = spare_detail::spare();
  void* block = nullptr;
  size_t have = 0;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.block && s.bytes >= bytes) {
      block = s.block;
      have = s.bytes;
      s.block = nullptr;
      s.bytes = 0;
    }
  }
  if (!block) {
    have = (bytes + 63) / 64 * 64;  // aligned_alloc: a multiple of the alignment
    block = std::aligned_alloc(64, have);
    TORCH_CHECK(block != nullptr, "posenc_fast: out of memory allocating ", have, " bytes");
  }
  return at::from_blob(
      block, {numel}, [have](void* p) { spare_detail::give_back(p, have); }, options.device(at::kCPU));
}

// Frees the spare block (if any); returns its size in bytes.
inline int64_t release_spare() {
  spare_detail::Spare& s = spare_detail::spare();
  void* block = nullptr;
  size_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    block = s.block;
    bytes = s.bytes;
    s.block = nullptr;
    s.bytes = 0;
  }
  if (block) std::free(block);
  return static_cast<int64_t>(bytes);
}

}  // namespace cpu
}  // namespace posenc_fast
