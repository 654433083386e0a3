// Registration of the low-level FLOATER integrator ops in the posenc_fast namespace, and
// their CPU implementations. The autograd-carrying op is the Python custom op
// posenc_fast::floater (posenc_fast/ops/floater.py); its "cpp" and "cuda" backends call:
//
//   posenc_fast::floater_integrate(p0 [S,d], w1 [d+1,H], b1 [H], w2 [H+1,d], b2 [d],
//                                  times [L], substeps, method, activation) -> out [S,L,d]
//   posenc_fast::floater_integrate_backward(grad [S,L,d], out [S,L,d], p0, w1, b1, w2, b2,
//                                  times, substeps, method, activation, needs[6])
//       -> [dp0, dw1, db1, dw2, db2, dtimes]   (empty tensors where needs[i] is false)
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "floater_checks.h"
#include "floater_cpu.h"

namespace posenc_fast {
namespace floater {

namespace {

at::Tensor integrate_cpu(const at::Tensor& p0, const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2,
                         const at::Tensor& b2, const at::Tensor& times, int64_t substeps, c10::string_view method,
                         c10::string_view activation) {
  const Problem pr = check_forward(p0, w1, b1, w2, b2, times, substeps, std::string(method),
                                   std::string(activation), c10::DeviceType::CPU);
  // Never write into the caller's storage: inputs are read through contiguous views or
  // copies, the output is a fresh tensor.
  at::Tensor out = at::empty({pr.S, pr.L, pr.d}, p0.options());
  cpu::forward(p0.contiguous(), w1.contiguous(), b1.contiguous(), w2.contiguous(), b2.contiguous(),
               times.contiguous(), substeps, pr.method, pr.act, out);
  return out;
}

std::vector<at::Tensor> integrate_backward_cpu(const at::Tensor& grad, const at::Tensor& out, const at::Tensor& p0,
                                               const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2,
                                               const at::Tensor& b2, const at::Tensor& times, int64_t substeps,
                                               c10::string_view method, c10::string_view activation,
                                               const c10::List<bool>& needs_list) {
  const Problem pr = check_forward(p0, w1, b1, w2, b2, times, substeps, std::string(method),
                                   std::string(activation), c10::DeviceType::CPU);
  check_backward(pr, grad, out, p0, needs_list.size());
  bool needs[6];
  for (size_t i = 0; i < 6; ++i) needs[i] = needs_list.get(i);
  const auto opt = p0.options();
  at::Tensor dp0 = at::empty({pr.S, pr.d}, opt);  // the adjoint is computed in any case
  at::Tensor dw1 = needs[1] ? at::zeros_like(w1, at::MemoryFormat::Contiguous) : at::Tensor();
  at::Tensor db1 = needs[2] ? at::zeros_like(b1, at::MemoryFormat::Contiguous) : at::Tensor();
  at::Tensor dw2 = needs[3] ? at::zeros_like(w2, at::MemoryFormat::Contiguous) : at::Tensor();
  at::Tensor db2 = needs[4] ? at::zeros_like(b2, at::MemoryFormat::Contiguous) : at::Tensor();
  at::Tensor dtimes = needs[5] ? at::zeros_like(times, at::MemoryFormat::Contiguous) : at::Tensor();
  if (pr.S == 0 || pr.L == 0 || pr.d == 0) dp0.zero_();
  cpu::backward(grad.contiguous(), out.contiguous(), p0.contiguous(), w1.contiguous(), b1.contiguous(),
                w2.contiguous(), b2.contiguous(), times.contiguous(), substeps, pr.method, pr.act, dp0, dw1, db1,
                dw2, db2, dtimes);
  auto or_empty = [&](bool need, const at::Tensor& t) { return need ? t : at::empty({0}, opt); };
  return {or_empty(needs[0], dp0), or_empty(needs[1], dw1), or_empty(needs[2], db1),
          or_empty(needs[3], dw2), or_empty(needs[4], db2), or_empty(needs[5], dtimes)};
}

// Meta (fake tensor) kernels: shapes only, so torch.compile and opcheck can trace the ops.
at::Tensor integrate_meta(const at::Tensor& p0, const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2,
                          const at::Tensor& b2, const at::Tensor& times, int64_t substeps, c10::string_view method,
                          c10::string_view activation) {
  return at::empty({p0.size(0), times.size(0), p0.size(1)}, p0.options());
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

}  // namespace

}  // namespace floater
}  // namespace posenc_fast

// FRAGMENT: the Python custom ops (torch.library.custom_op) define other ops of the same
// namespace, so no side may claim it with TORCH_LIBRARY.
TORCH_LIBRARY_FRAGMENT(posenc_fast, m) {
  m.def(
      "floater_integrate(Tensor p0, Tensor w1, Tensor b1, Tensor w2, Tensor b2, Tensor times, "
      "int substeps, str method, str activation) -> Tensor");
  m.def(
      "floater_integrate_backward(Tensor grad, Tensor out, Tensor p0, Tensor w1, Tensor b1, Tensor w2, "
      "Tensor b2, Tensor times, int substeps, str method, str activation, bool[] needs) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(posenc_fast, CPU, m) {
  m.impl("floater_integrate", &posenc_fast::floater::integrate_cpu);
  m.impl("floater_integrate_backward", &posenc_fast::floater::integrate_backward_cpu);
}

TORCH_LIBRARY_IMPL(posenc_fast, Meta, m) {
  m.impl("floater_integrate", &posenc_fast::floater::integrate_meta);
  m.impl("floater_integrate_backward", &posenc_fast::floater::integrate_backward_meta);
}
