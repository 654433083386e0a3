// CPU entry points of the learnable Fourier rotary kernels (rotary_cpu.cpp; LightGlue's
// layout). Arguments are checked by the op layer (rotary_ops.cpp), outputs allocated there.
// Computation is float32 (phases with the error-free reduction of
// triton_kernels/_phase.py); storage may be float32, bfloat16 or float16. Deterministic:
// the same bits for any thread count.
#pragma once

#include <ATen/ATen.h>

namespace posenc_fast {
namespace rotary {

// The fused application's inputs: x3 [Bx, N, M] positions (Bx = 1: shared by the batch),
// wr [F2, M]; q [B, Hq, N, D], k [B, Hk, N, D] heads-first views with any strides, one dtype.
struct Apply {
  at::Tensor x3, wr, q, k;
};
// Its gradients: dq / dk [B, H, N, D] views with unit channel stride, dx [Bx, N, M]
// contiguous in x's dtype, dwr [F2, M] contiguous; undefined: not needed.
struct ApplyGrads {
  at::Tensor dq, dk, dx, dwr;
};

// q and k rotated into oq / ok (views with unit channel stride, filled here).
void apply_forward_cpu(const Apply& in, at::Tensor& oq, at::Tensor& ok);
// gq, gk: the gradients of oq, ok (q's shapes, any strides).
void apply_backward_cpu(const at::Tensor& gq, const at::Tensor& gk, const Apply& in, ApplyGrads& grads);

// rows [R, M] -> out [2, R, 2 F2] (cos plane, sin plane; unit channel stride); backward from
// grad [2, R, 2 F2] (any strides) into dx [R, M] / dwr (undefined: not needed).
void table_forward_cpu(const at::Tensor& rows, const at::Tensor& wr, at::Tensor& out);
void table_backward_cpu(const at::Tensor& grad, const at::Tensor& rows, const at::Tensor& wr, at::Tensor& dx,
                        at::Tensor& dwr);

}  // namespace rotary
}  // namespace posenc_fast
