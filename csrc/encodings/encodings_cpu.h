// CPU entry points of the sinusoidal and DFT encoding kernels (encodings_cpu.cpp), checked
// by encodings_ops.cpp; they allocate their outputs. float32 arithmetic (the phase math of
// triton_kernels/_phase.py) on float32, bfloat16 or float16 storage.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

namespace posenc_fast {
namespace encodings {

enum class Kind { Sinusoidal, DFT };

// Which encoding: dim columns, the kind, the sinusoidal base and FLOATER's block term
// (the encoding of position `block` added to every row; the backward takes none).
struct Spec {
  int64_t dim;
  Kind kind;
  double base;
  c10::optional<double> block;
};

// positions p [R] (any real dtype, strided) -> [R, dim] in out_dtype; with x [R, dim]
// (row stride, unit column stride): x + encoding in x's dtype. period > 0: row r reads
// p[r % period] (positions [L] broadcast over the leading dimensions of x).
at::Tensor forward_cpu(const at::Tensor& p, int64_t period, const at::Tensor& x, const Spec& spec,
                       at::ScalarType out_dtype);

// d(sum grad * encoding(p)) / dp for p [R], grad [R, dim]; float32 for integer positions.
at::Tensor backward_cpu(const at::Tensor& grad, const at::Tensor& p, const Spec& spec);

}  // namespace encodings
}  // namespace posenc_fast
