// Registration of the low-level FLOATER integrator ops in the posenc_fast namespace, and
// their CPU implementations. The autograd-carrying op is the Python custom op
// posenc_fast::floater (posenc_fast/ops/floater/op.py); its "cpp" and "cuda" backends call:
//
//   posenc_fast::floater_integrate(p0 [S,d], w1 [d+1,H], b1 [H], w2 [H+1,d], b2 [d],
//                                  times [L], substeps, method, activation) -> out [S,L,d]
//   posenc_fast::floater_integrate_backward(grad [S,L,d], out [S,L,d], p0, w1, b1, w2, b2,
//                                  times, substeps, method, activation, needs[6])
//       -> [dp0, dw1, db1, dw2, db2, dtimes]   (empty tensors where needs[i] is false)
//   posenc_fast::floater_integrate_taped(..., intervals) -> (out, tape)   (CPU only: the
//       stage values of the first `intervals` intervals, floater_cpu.h)
//   posenc_fast::floater_integrate_backward_taped(..., needs, tape) -> the same gradients
//       bitwise, without integrating the taped intervals again
//
// Each op in turn: schema, CPU kernel, Meta kernel (shapes only), registration (cpu/ops.h).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <array>
#include <tuple>
#include <vector>

#include "cpu/ops.h"
#include "cpu/spare.h"
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

// The taped forward (CPU only): out and the stage values of the first `intervals` intervals
// (floater_cpu.h), for floater_integrate_backward_taped.
constexpr char kIntegrateTapedSchema[] =
    "floater_integrate_taped(Tensor p0, Tensor w1, Tensor b1, Tensor w2, Tensor b2, Tensor times, "
    "int substeps, str method, str activation, int intervals) -> (Tensor, Tensor)";
int64_t checked_tape_numel(const Problem& pr, int64_t intervals) {
  TORCH_CHECK_VALUE(intervals >= 0 && intervals <= pr.L, "floater_integrate_taped: intervals must be in [0, ", pr.L,
                    "] (the number of times), got ", intervals);
  return tape_numel(pr.S, pr.d, pr.H, intervals, pr.opt);
}
std::tuple<at::Tensor, at::Tensor> integrate_taped_cpu(const at::Tensor& p0, const at::Tensor& w1,
                                                       const at::Tensor& b1, const at::Tensor& w2,
                                                       const at::Tensor& b2, const at::Tensor& times,
                                                       int64_t substeps, c10::string_view method,
                                                       c10::string_view activation, int64_t intervals) {
  const Problem pr = check_forward(p0, w1, b1, w2, b2, times, substeps, std::string(method),
                                   std::string(activation), c10::DeviceType::CPU);
  at::Tensor out = at::empty({pr.S, pr.L, pr.d}, p0.options());
  // from the spare block: each training step makes one tape and frees it (cpu/spare.h)
  at::Tensor tape = cpu::spare_empty(checked_tape_numel(pr, intervals), p0.options());
  forward_cpu(contiguous_inputs(p0, w1, b1, w2, b2, times), pr.opt, out, tape);
  return {out, tape};
}
std::tuple<at::Tensor, at::Tensor> integrate_taped_meta(const at::Tensor& p0, const at::Tensor& w1,
                                                        const at::Tensor& b1, const at::Tensor& w2,
                                                        const at::Tensor& b2, const at::Tensor& times,
                                                        int64_t substeps, c10::string_view method,
                                                        c10::string_view activation, int64_t intervals) {
  const Problem pr{p0.size(0), p0.size(1), w1.size(1), times.size(0),
                   Options{substeps, parse_method(std::string(method)), parse_activation(std::string(activation))}};
  return {at::empty({pr.S, pr.L, pr.d}, p0.options()), at::empty({checked_tape_numel(pr, intervals)}, p0.options())};
}

TORCH_LIBRARY_FRAGMENT(posenc_fast, m) {
  cpu::define(m, kIntegrateTapedSchema, &integrate_taped_cpu, &integrate_taped_meta);
}

constexpr char kIntegrateBackwardSchema[] =
    "floater_integrate_backward(Tensor grad, Tensor out, Tensor p0, Tensor w1, Tensor b1, Tensor w2, "
    "Tensor b2, Tensor times, int substeps, str method, str activation, bool[] needs) -> Tensor[]";
// tape: undefined (the plain backward) or the taped forward's (checked against the problem).
std::vector<at::Tensor> backward_with_tape(const at::Tensor& grad, const at::Tensor& out, const at::Tensor& p0,
                                           const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2,
                                           const at::Tensor& b2, const at::Tensor& times, int64_t substeps,
                                           c10::string_view method, c10::string_view activation,
                                           const c10::List<bool>& needs_list, const at::Tensor& tape) {
  const BackwardProblem bp = check_backward(grad, out, p0, w1, b1, w2, b2, times, substeps, std::string(method),
                                            std::string(activation), needs_list, c10::DeviceType::CPU);
  if (tape.defined()) {
    const int64_t per = tape_numel(bp.pr.S, bp.pr.d, bp.pr.H, 1, bp.pr.opt);
    TORCH_CHECK_VALUE(tape.dim() == 1 && tape.scalar_type() == p0.scalar_type() && tape.device() == p0.device(),
                      "floater_integrate_backward_taped: tape must be a 1-D ", p0.scalar_type(), " tensor on ",
                      p0.device(), " (what floater_integrate_taped returned), got ", tape.sizes(), " ",
                      tape.scalar_type(), " on ", tape.device());
    TORCH_CHECK_VALUE(per == 0 ? tape.numel() == 0 : tape.numel() % per == 0 && tape.numel() / per <= bp.pr.L,
                      "floater_integrate_backward_taped: tape has ", tape.numel(),
                      " elements, not the stage values of whole intervals of this problem (",
                      per, " per interval, at most ", bp.pr.L, " intervals)");
  }
  std::vector<at::Tensor> res =
      grad_outputs(bp.needs, {p0.sizes(), w1.sizes(), b1.sizes(), w2.sizes(), b2.sizes(), times.sizes()},
                   p0.options());
  // The kernels write into the needed outputs; an undefined tensor skips that gradient.
  std::array<at::Tensor, 6> g;
  for (size_t i = 0; i < 6; ++i) g[i] = bp.needs[i] ? res[i] : at::Tensor();
  backward_cpu(grad.contiguous(), out.contiguous(), contiguous_inputs(p0, w1, b1, w2, b2, times), bp.pr.opt, g,
               tape.defined() ? tape.contiguous() : tape);
  return res;
}

std::vector<at::Tensor> integrate_backward_cpu(const at::Tensor& grad, const at::Tensor& out, const at::Tensor& p0,
                                               const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2,
                                               const at::Tensor& b2, const at::Tensor& times, int64_t substeps,
                                               c10::string_view method, c10::string_view activation,
                                               const c10::List<bool>& needs_list) {
  return backward_with_tape(grad, out, p0, w1, b1, w2, b2, times, substeps, method, activation, needs_list,
                            at::Tensor());
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

// The backward of the taped forward: floater_integrate_backward's arguments and the tape.
constexpr char kIntegrateBackwardTapedSchema[] =
    "floater_integrate_backward_taped(Tensor grad, Tensor out, Tensor p0, Tensor w1, Tensor b1, Tensor w2, "
    "Tensor b2, Tensor times, int substeps, str method, str activation, bool[] needs, Tensor tape) -> Tensor[]";
std::vector<at::Tensor> integrate_backward_taped_cpu(const at::Tensor& grad, const at::Tensor& out,
                                                     const at::Tensor& p0, const at::Tensor& w1, const at::Tensor& b1,
                                                     const at::Tensor& w2, const at::Tensor& b2,
                                                     const at::Tensor& times, int64_t substeps,
                                                     c10::string_view method, c10::string_view activation,
                                                     const c10::List<bool>& needs, const at::Tensor& tape) {
  TORCH_CHECK_VALUE(tape.defined(), "floater_integrate_backward_taped: tape must be a tensor");
  return backward_with_tape(grad, out, p0, w1, b1, w2, b2, times, substeps, method, activation, needs, tape);
}
std::vector<at::Tensor> integrate_backward_taped_meta(const at::Tensor& grad, const at::Tensor& out,
                                                      const at::Tensor& p0, const at::Tensor& w1,
                                                      const at::Tensor& b1, const at::Tensor& w2,
                                                      const at::Tensor& b2, const at::Tensor& times,
                                                      int64_t substeps, c10::string_view method,
                                                      c10::string_view activation, const c10::List<bool>& needs,
                                                      const at::Tensor& tape) {
  return integrate_backward_meta(grad, out, p0, w1, b1, w2, b2, times, substeps, method, activation, needs);
}

TORCH_LIBRARY_FRAGMENT(posenc_fast, m) {
  cpu::define(m, kIntegrateBackwardTapedSchema, &integrate_backward_taped_cpu, &integrate_backward_taped_meta);
}

}  // namespace
}  // namespace floater
}  // namespace posenc_fast
