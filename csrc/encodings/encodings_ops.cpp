// Registration of the low-level encoding ops in the posenc_fast namespace, their argument
// checks and their CPU and Meta implementations. The autograd-carrying ops are the Python
// custom ops posenc_fast::encoding / encoding_add; their "cpp" backend calls:
//
//   encoding_kernel(positions [...], dim, kind, base, block?, out_dtype) -> [..., dim]
//   encoding_add_kernel(x [..., dim], positions (broadcast to x.shape[:-1]), kind, base, block?)
//       -> x + encoding, in x's dtype
//   encoding_kernel_backward(grad [*positions.shape, dim], positions, dim, kind, base)
//       -> d positions (float32 for integer positions)
//
// Each op in turn: schema, CPU kernel, Meta kernel (shapes only), registration (cpu/ops.h).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <string>
#include <vector>

#include "cpu/ops.h"
#include "encodings/encodings_cpu.h"

namespace posenc_fast {
namespace encodings {
namespace {

void check_positions(const char* op, const at::Tensor& p) {
  TORCH_CHECK_VALUE(p.defined(), op, ": positions must be a tensor");
  const at::ScalarType t = p.scalar_type();
  const bool ok = cpu::is_half_or_single(t) || t == at::kByte || t == at::kChar || t == at::kShort ||
                  t == at::kInt || t == at::kLong;
  TORCH_CHECK_TYPE(ok, op, ": positions must be float32, bfloat16, float16 or an integer dtype, got ", t);
}

Kind parse_kind(const char* op, c10::string_view k) {
  if (k == "sinusoidal") return Kind::Sinusoidal;
  if (k == "dft") return Kind::DFT;
  TORCH_CHECK_VALUE(false, op, ": kind must be 'sinusoidal' or 'dft'; got '", std::string(k), "'");
}

Spec check_spec(const char* op, int64_t dim, Kind kind, double base, c10::optional<double> block) {
  TORCH_CHECK_VALUE(dim > 0 && dim % 2 == 0, op, ": dim must be a positive even number, got ", dim);
  TORCH_CHECK_VALUE(std::isfinite(base) && base > 0.0, op, ": base must be a finite positive number, got ", base);
  TORCH_CHECK_VALUE(!block || std::isfinite(*block), op, ": block must be finite, got ", block ? *block : 0.0);
  return Spec{dim, kind, base, block};
}

std::vector<int64_t> with_dim(const at::Tensor& positions, int64_t dim) {
  std::vector<int64_t> shape(positions.sizes().begin(), positions.sizes().end());
  shape.push_back(dim);
  return shape;
}

constexpr char kEncodingSchema[] =
    "encoding_kernel(Tensor positions, int dim, str kind, float base, float? block, ScalarType out_dtype) -> Tensor";
at::Tensor encoding_cpu(const at::Tensor& positions, int64_t dim, c10::string_view kind, double base,
                        c10::optional<double> block, at::ScalarType out_dtype) {
  const char* op = "encoding_kernel";
  check_positions(op, positions);
  const Spec spec = check_spec(op, dim, parse_kind(op, kind), base, block);
  cpu::check_out_dtype(op, out_dtype);
  return forward_cpu(positions.reshape({-1}), 0, at::Tensor(), spec, out_dtype).view(with_dim(positions, dim));
}

at::Tensor encoding_meta(const at::Tensor& positions, int64_t dim, c10::string_view kind, double base,
                         c10::optional<double> block, at::ScalarType out_dtype) {
  return at::empty(with_dim(positions, dim), positions.options().dtype(out_dtype));
}

TORCH_LIBRARY_FRAGMENT(posenc_fast, m) { cpu::define(m, kEncodingSchema, &encoding_cpu, &encoding_meta); }

constexpr char kEncodingAddSchema[] =
    "encoding_add_kernel(Tensor x, Tensor positions, str kind, float base, float? block) -> Tensor";
at::Tensor encoding_add_cpu(const at::Tensor& x, const at::Tensor& positions, c10::string_view kind, double base,
                            c10::optional<double> block) {
  const char* op = "encoding_add_kernel";
  cpu::check_float(op, "x", x);
  check_positions(op, positions);
  const Kind k = parse_kind(op, kind);
  TORCH_CHECK_VALUE(x.dim() >= 1, op, ": x must have shape [..., dim], got a scalar");
  const int64_t dim = x.size(-1);
  const Spec spec = check_spec(op, dim, k, base, block);
  const c10::IntArrayRef lead = x.sizes().slice(0, x.dim() - 1);
  bool broadcasts = positions.dim() <= static_cast<int64_t>(lead.size());
  for (int64_t i = 1; broadcasts && i <= positions.dim(); ++i) {
    const int64_t s = positions.size(-i);
    broadcasts = s == 1 || s == lead[lead.size() - i];
  }
  TORCH_CHECK_VALUE(broadcasts, op, ": positions must broadcast to x.shape[:-1] = ", lead, ", got ",
                    positions.sizes());
  // positions [L] against [..., L]: each position is encoded once for all its rows.
  at::Tensor p;
  int64_t period = 0;
  if (positions.dim() == 1 && !lead.empty() && positions.size(0) == lead.back() && positions.size(0) > 0) {
    p = positions;
    period = positions.size(0);
  } else {
    p = positions.expand(lead).reshape({-1});
  }
  at::Tensor rows = x.reshape({-1, dim});
  if (dim > 1 && rows.stride(1) != 1) rows = rows.contiguous();
  return forward_cpu(p, period, rows, spec, x.scalar_type()).view(x.sizes());
}

at::Tensor encoding_add_meta(const at::Tensor& x, const at::Tensor& positions, c10::string_view kind, double base,
                             c10::optional<double> block) {
  return at::empty(x.sizes(), x.options());
}

TORCH_LIBRARY_FRAGMENT(posenc_fast, m) { cpu::define(m, kEncodingAddSchema, &encoding_add_cpu, &encoding_add_meta); }

constexpr char kEncodingBackwardSchema[] =
    "encoding_kernel_backward(Tensor grad, Tensor positions, int dim, str kind, float base) -> Tensor";
at::Tensor encoding_backward_cpu(const at::Tensor& grad, const at::Tensor& positions, int64_t dim,
                                 c10::string_view kind, double base) {
  const char* op = "encoding_kernel_backward";
  check_positions(op, positions);
  cpu::check_float(op, "grad", grad);
  const Spec spec = check_spec(op, dim, parse_kind(op, kind), base, c10::nullopt);
  const std::vector<int64_t> shape = with_dim(positions, dim);
  TORCH_CHECK_VALUE(grad.sizes() == c10::IntArrayRef(shape), op, ": grad must have shape [*positions.shape, dim] = ",
                    c10::IntArrayRef(shape), ", got ", grad.sizes());
  at::Tensor g = grad.reshape({-1, dim});
  if (dim > 1 && g.stride(1) != 1) g = g.contiguous();
  return backward_cpu(g, positions.reshape({-1}), spec).view(positions.sizes());
}

at::Tensor encoding_backward_meta(const at::Tensor& grad, const at::Tensor& positions, int64_t dim,
                                  c10::string_view kind, double base) {
  const at::ScalarType t = at::isFloatingType(positions.scalar_type()) ? positions.scalar_type() : at::kFloat;
  return at::empty(positions.sizes(), positions.options().dtype(t));
}

TORCH_LIBRARY_FRAGMENT(posenc_fast, m) {
  cpu::define(m, kEncodingBackwardSchema, &encoding_backward_cpu, &encoding_backward_meta);
}

}  // namespace
}  // namespace encodings
}  // namespace posenc_fast
