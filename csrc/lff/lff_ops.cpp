// Registration of the low-level LFF ops in the posenc_fast namespace, their argument checks
// and their CPU and Meta implementations. The autograd-carrying op is the Python custom op
// posenc_fast::lff; its "cpp" backend calls:
//
//   lff_kernel(x [..., G, M], wr [F/2, M], w1? [F, H], b1? [H], w2? [H, Dg], b2? [Dg],
//              activation, out_dtype) -> [..., G * Dg]   ([..., G * F] without w1..b2)
//   lff_kernel_backward(grad, x, wr, w1?, b1?, w2?, b2?, activation, needs[6])
//       -> [dx, dwr, dw1, db1, dw2, db2]   (empty tensors where needs[i] is false)
//
// Each op in turn: schema, CPU kernel, Meta kernel (shapes only), registration (cpu/ops.h).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <array>
#include <string>
#include <vector>

#include "cpu/ops.h"
#include "lff/lff_cpu.h"

namespace posenc_fast {
namespace lff {
namespace {

using cpu::check_float;

Activation parse_activation(const char* op, c10::string_view a) {
  if (a == "gelu") return Activation::GELU;
  if (a == "gelu_tanh") return Activation::GELU_TANH;
  if (a == "relu") return Activation::RELU;
  TORCH_CHECK_VALUE(false, op, ": activation must be one of 'gelu', 'gelu_tanh', 'relu'; got '", std::string(a),
                    "'");
}

// The LFF arguments, checked; width of a group's output (Dg, or F without the MLP).
struct Lff {
  Mlp mlp;  // undefined without the MLP
  int64_t M, F2, H, width;
};

Lff check_lff(const char* op, const at::Tensor& x, const at::Tensor& wr, const c10::optional<at::Tensor>& w1,
              const c10::optional<at::Tensor>& b1, const c10::optional<at::Tensor>& w2,
              const c10::optional<at::Tensor>& b2) {
  check_float(op, "x", x);
  TORCH_CHECK_VALUE(x.dim() >= 2 && x.size(-1) >= 1, op, ": x must have shape [..., G, M] with M >= 1, got ",
                    x.sizes());
  Lff l{};
  l.M = x.size(-1);
  l.F2 = cpu::check_wr(op, x, wr);
  const int given = w1.has_value() + b1.has_value() + w2.has_value() + b2.has_value();
  TORCH_CHECK_VALUE(given == 0 || given == 4, op, ": w1, b1, w2 and b2 must be given together");
  if (given == 0) {
    l.width = 2 * l.F2;
    return l;
  }
  Mlp& m = l.mlp;
  m = Mlp{*w1, *b1, *w2, *b2};
  const char* names[4] = {"w1", "b1", "w2", "b2"};
  const at::Tensor* ts[4] = {&m.w1, &m.b1, &m.w2, &m.b2};
  for (int i = 0; i < 4; ++i) check_float(op, names[i], *ts[i], "wr", wr);
  TORCH_CHECK_VALUE(m.w1.dim() == 2 && m.w1.size(0) == 2 * l.F2, op, ": w1 must have shape [F, H] with F = ",
                    2 * l.F2, ", got ", m.w1.sizes());
  l.H = m.w1.size(1);
  TORCH_CHECK_VALUE(m.b1.dim() == 1 && m.b1.size(0) == l.H, op, ": b1 must have shape [H] = [", l.H, "], got ",
                    m.b1.sizes());
  TORCH_CHECK_VALUE(m.w2.dim() == 2 && m.w2.size(0) == l.H, op, ": w2 must have shape [H, Dg] with H = ", l.H,
                    ", got ", m.w2.sizes());
  l.width = m.w2.size(1);
  TORCH_CHECK_VALUE(m.b2.dim() == 1 && m.b2.size(0) == l.width, op, ": b2 must have shape [Dg] = [", l.width,
                    "], got ", m.b2.sizes());
  return l;
}

std::vector<int64_t> out_shape(const at::Tensor& x, int64_t width) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 2);
  shape.push_back(x.size(-2) * width);
  return shape;
}

constexpr char kLffSchema[] =
    "lff_kernel(Tensor x, Tensor wr, Tensor? w1, Tensor? b1, Tensor? w2, Tensor? b2, str activation, "
    "ScalarType out_dtype) -> Tensor";
at::Tensor lff_cpu(const at::Tensor& x, const at::Tensor& wr, const c10::optional<at::Tensor>& w1,
                   const c10::optional<at::Tensor>& b1, const c10::optional<at::Tensor>& w2,
                   const c10::optional<at::Tensor>& b2, c10::string_view activation, at::ScalarType out_dtype) {
  const Lff l = check_lff("lff_kernel", x, wr, w1, b1, w2, b2);
  const Activation act = parse_activation("lff_kernel", activation);
  cpu::check_out_dtype("lff_kernel", out_dtype);
  // Never written: the kernels read x through a [R, M] view (or copy) and write a new output.
  const at::Tensor rows = x.reshape({-1, l.M});
  return forward_cpu(rows, wr, l.mlp, act, out_dtype).view(out_shape(x, l.width));
}

at::Tensor lff_meta(const at::Tensor& x, const at::Tensor& wr, const c10::optional<at::Tensor>& w1,
                    const c10::optional<at::Tensor>& b1, const c10::optional<at::Tensor>& w2,
                    const c10::optional<at::Tensor>& b2, c10::string_view activation, at::ScalarType out_dtype) {
  const int64_t width = w2.has_value() ? w2->size(1) : 2 * wr.size(0);
  return at::empty(out_shape(x, width), x.options().dtype(out_dtype));
}

TORCH_LIBRARY_FRAGMENT(posenc_fast, m) { cpu::define(m, kLffSchema, &lff_cpu, &lff_meta); }

constexpr char kLffBackwardSchema[] =
    "lff_kernel_backward(Tensor grad, Tensor x, Tensor wr, Tensor? w1, Tensor? b1, Tensor? w2, Tensor? b2, "
    "str activation, bool[] needs) -> Tensor[]";
std::vector<at::Tensor> lff_backward_cpu(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& wr,
                                         const c10::optional<at::Tensor>& w1, const c10::optional<at::Tensor>& b1,
                                         const c10::optional<at::Tensor>& w2, const c10::optional<at::Tensor>& b2,
                                         c10::string_view activation, const c10::List<bool>& needs_list) {
  const char* op = "lff_kernel_backward";
  const Lff l = check_lff(op, x, wr, w1, b1, w2, b2);
  const Activation act = parse_activation(op, activation);
  check_float(op, "grad", grad);
  const std::vector<int64_t> shape = out_shape(x, l.width);
  TORCH_CHECK_VALUE(grad.sizes() == c10::IntArrayRef(shape), op, ": grad must have the output's shape ",
                    c10::IntArrayRef(shape), ", got ", grad.sizes());
  TORCH_CHECK_VALUE(needs_list.size() == 6, op, ": needs must have 6 entries (x, wr, w1, b1, w2, b2), got ",
                    needs_list.size());
  std::array<bool, 6> needs{};
  for (size_t i = 0; i < 6; ++i) needs[i] = needs_list.get(i);
  const at::Tensor rows = x.reshape({-1, l.M});
  at::Tensor g = grad.reshape({rows.size(0), l.width});
  if (l.width > 1 && g.stride(1) != 1) g = g.contiguous();
  std::vector<at::Tensor> res = backward_cpu(g, rows, wr, l.mlp, act, needs);
  if (res[0].defined()) res[0] = res[0].view(x.sizes());
  return cpu::or_empty(std::move(res), grad.options());
}

std::vector<at::Tensor> lff_backward_meta(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& wr,
                                          const c10::optional<at::Tensor>& w1, const c10::optional<at::Tensor>& b1,
                                          const c10::optional<at::Tensor>& w2, const c10::optional<at::Tensor>& b2,
                                          c10::string_view activation, const c10::List<bool>& needs) {
  const at::Tensor refs[6] = {x, wr, w1.value_or(at::Tensor()), b1.value_or(at::Tensor()),
                              w2.value_or(at::Tensor()), b2.value_or(at::Tensor())};
  std::vector<at::Tensor> res(6);
  for (size_t i = 0; i < 6; ++i)
    if (i < needs.size() && needs.get(i) && refs[i].defined()) res[i] = at::empty(refs[i].sizes(), refs[i].options());
  return cpu::or_empty(std::move(res), grad.options());
}

TORCH_LIBRARY_FRAGMENT(posenc_fast, m) { cpu::define(m, kLffBackwardSchema, &lff_backward_cpu, &lff_backward_meta); }

}  // namespace
}  // namespace lff
}  // namespace posenc_fast
