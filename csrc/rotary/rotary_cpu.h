// CPU entry points of the rotary kernels (rotary_cpu.cpp): q and k rotated by the angles
// x . W, and the cos / sin table; checked and allocated by rotary_ops.cpp. float32
// arithmetic (triton_kernels/_phase.py's phase math) on float32, bfloat16 or float16
// storage; the same bits for any thread count.
#pragma once

#include <ATen/ATen.h>

namespace posenc_fast {
namespace rotary {

// The fused application's inputs: x3 [Bx, N', M] positions of tokens prefix..N-1 (Bx = 1:
// shared by the batch); freqs [G, F2, M] with any strides (G = 1: shared by the heads, a
// view of [F2, M]; else one group per head); q [B, Hq, N, D], k [B, Hk, N, D] heads-first
// views with any strides, one dtype (Hq and Hk multiples of G; group g rotates heads
// g Hq/G .. (g + 1) Hq/G - 1); half: pairs (i, i + F2) instead of (2i, 2i + 1); the first
// `prefix` tokens are copied.
struct Apply {
  at::Tensor x3, freqs, q, k;
  bool half;
  int64_t prefix;
};
// Its gradients: dq / dk [B, H, N, D] views with unit channel stride, dx [Bx, N', M]
// contiguous in x's dtype, dfreqs [G, F2, M] contiguous; undefined: not needed.
struct ApplyGrads {
  at::Tensor dq, dk, dx, dfreqs;
};

// q and k rotated into oq / ok (views with unit channel stride, filled here).
void apply_forward_cpu(const Apply& in, at::Tensor& oq, at::Tensor& ok);
// gq, gk: the gradients of oq, ok (q's shapes, any strides).
void apply_backward_cpu(const at::Tensor& gq, const at::Tensor& gk, const Apply& in, ApplyGrads& grads);

// x3 [Bx, N, M] and freqs [G, F2, M] -> out [2, Bx, G, N, 2 F2] (cos plane, sin plane; unit
// channel stride); backward from grad [2, Bx, G, N, 2 F2] (any strides) into dx [Bx, N, M] /
// dfreqs [G, F2, M] (undefined: not needed).
void table_forward_cpu(const at::Tensor& x3, const at::Tensor& freqs, bool half, at::Tensor& out);
void table_backward_cpu(const at::Tensor& grad, const at::Tensor& x3, const at::Tensor& freqs, bool half,
                        at::Tensor& dx, at::Tensor& dfreqs);

}  // namespace rotary
}  // namespace posenc_fast
