// Registration of the low-level FLOATER integrator ops in the posenc_fast namespace, and
// their CPU implementations. The autograd-carrying op is the Python custom op
// posenc_fast::floater (posenc_fast/ops/floater.py); its "cpp" and "cuda" backends call:
//
//   posenc_fast::floater_integrate(p0 [S,d], w1 [d+1,H], b1 [H], w2 [H+1,d], b2 [d],
//                                  times [L], substeps, method, activation) -> out [S,L,d]
//   posenc_fast::floater_integrate_backward(grad [S,L,d], out [S,L,d], p0, w1, b1, w2, b2,
//                                  times, substeps, method, activation, needs[6])
//       -> [dp0, dw1, db1, dw2, db2, dtimes]   (empty tensors where needs[i] is false)
//
// Each op in turn: its schema, its CPU kernel, its Meta kernel (shapes only, so that
// torch.compile and opcheck can trace it) and their registration (cpu/ops.h: define).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <array>
#include <vector>

#include "cpu/ops.h"
#include "floater_checks.h"
#include "floater_cpu.h"

namespace posenc_fast {
namespace floater {

namespace {

constexpr char kIntegrateSchema[] =
    "floater_integrate(Tensor p0, Tensor w1, Tensor b1, Tensor w2, Tensor b2, Tensor times, "
    "int substeps, str method, str activation) -> Tensor";
at::Tensor integrate_cpu(const at::Tensor& p0, const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2,
                         const at::Tensor& b2, const at::Tensor& times, int64_t substeps, c10::string_view method,
                         c10::string_view activation) {
  const Problem pr = check_forward(p0, w1, b1, w2, b2, times, substeps, std::string(method),
                                   std::string(activation), c10::DeviceType::CPU);
  // Never write into the caller's storage: inputs are read through contiguous views or
  // copies, the output is a fresh tensor.
  at::Tensor out = at::empty({pr.S, pr.L, pr.d}, p0.options());
  forward_cpu(contiguous_inputs(p0, w1, b1, w2, b2, times), pr.opt, out);
  return out;
}

at::Tensor integrate_meta(const at::Tensor& p0, const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2,
                          const at::Tensor& b2, const at::Tensor& times, int64_t substeps, c10::string_view method,
                          c10::string_view activation) {
  return at::empty({p0.size(0), times.size(0), p0.size(1)}, p0.options());
}

TORCH_LIBRARY_FRAGMENT(posenc_fast, m) { cpu::define(m, kIntegrateSchema, &integrate_cpu, &integrate_meta); }

constexpr char kIntegrateBackwardSchema[] =
    "floater_integrate_backward(Tensor grad, Tensor out, Tensor p0, Tensor w1, Tensor b1, Tensor w2, "
    "Tensor b2, Tensor times, int substeps, str method, str activation, bool[] needs) -> Tensor[]";
std::vector<at::Tensor> integrate_backward_cpu(const at::Tensor& grad, const at::Tensor& out, const at::Tensor& p0,
                                               const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2,
                                               const at::Tensor& b2, const at::Tensor& times, int64_t substeps,
                                               c10::string_view method, c10::string_view activation,
                                               const c10::List<bool>& needs_list) {
  const BackwardProblem bp = check_backward(grad, out, p0, w1, b1, w2, b2, times, substeps, std::string(method),
                                            std::string(activation), needs_list, c10::DeviceType::CPU);
  std::vector<at::Tensor> res =
      grad_outputs(bp.needs, {p0.sizes(), w1.sizes(), b1.sizes(), w2.sizes(), b2.sizes(), times.sizes()},
                   p0.options());
  // The kernels write into the needed outputs; an undefined tensor skips that gradient.
  std::array<at::Tensor, 6> g;
  for (size_t i = 0; i < 6; ++i) g[i] = bp.needs[i] ? res[i] : at::Tensor();
  backward_cpu(grad.contiguous(), out.contiguous(), contiguous_inputs(p0, w1, b1, w2, b2, times), bp.pr.opt, g);
  return res;
}

std::vector<at::Tensor> integrate_backward_meta(const at::Tensor& grad, const at::Tensor& out, const at::Tensor& p0,
                                                const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2,
                                                const at::Tensor& b2, const at::Tensor& times, int64_t substeps,
                                                c10::string_view method, c10::string_view activation,
                                                const c10::List<bool>& needs) {
  const at::Tensor* refs[6] = {&p0, &w1, &b1, &w2, &b2, &times};
  std::vector<at::Tensor> res;
  for (size_t i = 0; i < 6; ++i) {
    const bool need = i < needs.size() && needs.get(i);
    res.push_back(need ? at::empty(refs[i]->sizes(), p0.options()) : at::empty({0}, p0.options()));
  }
  return res;
}

TORCH_LIBRARY_FRAGMENT(posenc_fast, m) {
  cpu::define(m, kIntegrateBackwardSchema, &integrate_backward_cpu, &integrate_backward_meta);
}

}  // namespace
}  // namespace floater
}  // namespace posenc_fast
