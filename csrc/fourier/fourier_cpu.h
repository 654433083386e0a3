// CPU entry points of the fused learnable-Fourier-feature and encoding kernels
// (lff_cpu.cpp, encoding_cpu.cpp). Arguments are checked by the op layer (fourier_ops.cpp);
// these functions allocate and return their outputs. Computation is float32 (phases with
// the error-free reduction of triton_kernels/_phase.py); inputs and outputs may be float32,
// bfloat16 or float16.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <array>
#include <vector>

namespace posenc_fast {
namespace fourier {

enum class LffActivation { GELU, GELU_TANH, RELU };
enum class EncodingKind { Sinusoidal, DFT };

namespace cpu {

// rows [R, M] positions (any strides); wr [F2, M]; w1 [F, H], b1 [H], w2 [H, D], b2 [D]
// (undefined tensors: features only). Returns [R, D] (or [R, F]) in out_dtype.
at::Tensor lff_forward(const at::Tensor& rows, const at::Tensor& wr, const at::Tensor& w1, const at::Tensor& b1,
                       const at::Tensor& w2, const at::Tensor& b2, LffActivation act, at::ScalarType out_dtype);

// grad [R, D] (or [R, F]) -> [dx [R, M], dwr, dw1, db1, dw2, db2]: undefined where not
// needed; dx in rows' dtype, the others in the weights' dtype. Deterministic: the same bits
// for any thread count.
std::vector<at::Tensor> lff_backward(const at::Tensor& grad, const at::Tensor& rows, const at::Tensor& wr,
                                     const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2,
                                     const at::Tensor& b2, LffActivation act, const std::array<bool, 6>& needs);

// positions p [R] (any real dtype, strided) -> [R, dim] in out_dtype; with x [R, dim]
// (row stride, unit column stride): x + encoding in x's dtype. period > 0: row r reads
// p[r % period] (positions [L] broadcast over the leading dimensions of x).
at::Tensor encoding_forward(const at::Tensor& p, int64_t period, const at::Tensor& x, int64_t dim, EncodingKind kind,
                            double base, c10::optional<double> block, at::ScalarType out_dtype);

// d(sum grad * encoding(p)) / dp for p [R], grad [R, dim]; float32 for integer positions.
at::Tensor encoding_backward(const at::Tensor& grad, const at::Tensor& p, int64_t dim, EncodingKind kind,
                             double base);

// Rotary embeddings (rotary_cpu.cpp). x3 [Bx, N, M] positions (Bx = 1: shared by the
// batch), wr [F2, M]; q [B, Hq, N, D], k [B, Hk, N, D] and their gradients: heads-first views
// with any strides, one dtype; oq / ok / dq / dk: views with unit channel stride, filled
// here (undefined dq / dk / dx / dwr: not needed). dx [Bx, N, M] contiguous in x's dtype,
// dwr [F2, M] contiguous. Deterministic: the same bits for any thread count.
void rotary_apply_forward(const at::Tensor& x3, const at::Tensor& wr, const at::Tensor& q, const at::Tensor& k,
                          at::Tensor& oq, at::Tensor& ok);
void rotary_apply_backward(const at::Tensor& gq, const at::Tensor& gk, const at::Tensor& q, const at::Tensor& k,
                           const at::Tensor& x3, const at::Tensor& wr, at::Tensor& dq, at::Tensor& dk, at::Tensor& dx,
                           at::Tensor& dwr);
// rows [R, M] -> out [2, R, 2 F2] (cos plane, sin plane; unit channel stride); backward from
// grad [2, R, 2 F2] (any strides) into dx [R, M] / dwr.
void rotary_table_forward(const at::Tensor& rows, const at::Tensor& wr, at::Tensor& out);
void rotary_table_backward(const at::Tensor& grad, const at::Tensor& rows, const at::Tensor& wr, at::Tensor& dx,
                           at::Tensor& dwr);

}  // namespace cpu
}  // namespace fourier
}  // namespace posenc_fast
