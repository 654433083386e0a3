// CPU entry points of the fused LFF kernels (lff_cpu.cpp), checked by lff_ops.cpp; they
// allocate their outputs. float32 arithmetic (the phase math of triton_kernels/_phase.py)
// on float32, bfloat16 or float16 storage.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <vector>

namespace posenc_fast {
namespace lff {

enum class Activation { GELU, GELU_TANH, RELU };

// The MLP after the features: w1 [F, H], b1 [H], w2 [H, D], b2 [D] (undefined: features only).
struct Mlp {
  at::Tensor w1, b1, w2, b2;
};

// rows [R, M] positions (any strides); wr [F2, M]. Returns [R, D] (or [R, F]) in out_dtype.
at::Tensor forward_cpu(const at::Tensor& rows, const at::Tensor& wr, const Mlp& mlp, Activation act,
                       at::ScalarType out_dtype);

// grad [R, D] (or [R, F]) -> [dx [R, M], dwr, dw1, db1, dw2, db2]: undefined where not
// needed; dx in rows' dtype, the others in the weights' dtype. Deterministic: the same bits
// for any thread count.
std::vector<at::Tensor> backward_cpu(const at::Tensor& grad, const at::Tensor& rows, const at::Tensor& wr,
                                     const Mlp& mlp, Activation act, const std::array<bool, 6>& needs);

}  // namespace lff
}  // namespace posenc_fast
