// Argument checks and inputs of the posenc_fast::floater_integrate* ops, shared by the CPU
// and CUDA registrations (what they guard, and the Python errors they raise: cpu/ops.h).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <array>
#include <string>
#include <vector>

#include "floater_common.h"

namespace posenc_fast {
namespace floater {

inline Method parse_method(const std::string& m) {
  if (m == "euler") return Method::Euler;
  if (m == "midpoint") return Method::Midpoint;
  if (m == "rk4") return Method::RK4;
  if (m == "rk38") return Method::RK38;
  TORCH_CHECK_VALUE(false, "floater: method must be one of 'euler', 'midpoint', 'rk4', 'rk38'; got '", m, "'");
}

inline Activation parse_activation(const std::string& a) {
  if (a == "relu") return Activation::ReLU;
  if (a == "tanh") return Activation::Tanh;
  if (a == "gelu") return Activation::GELU;
  if (a == "identity") return Activation::Identity;
  TORCH_CHECK_VALUE(false, "floater: activation must be one of 'relu', 'tanh', 'gelu', 'identity'; got '", a,
                    "'");
}

struct Problem {
  int64_t S, d, H, L;
  Options opt;
};

inline void check_tensor(const char* name, const at::Tensor& t, const at::Tensor& p0, int64_t dim) {
  TORCH_CHECK_VALUE(t.defined(), "floater: ", name, " must be a tensor");
  TORCH_CHECK_TYPE(t.scalar_type() == p0.scalar_type(), "floater: ", name, " must have the dtype of p0 (",
                   p0.scalar_type(), "), got ", t.scalar_type());
  TORCH_CHECK(t.device() == p0.device(), "floater: ", name, " must be on the device of p0 (", p0.device(),
              "), got ", t.device());
  TORCH_CHECK_VALUE(t.dim() == dim, "floater: ", name, " must have ", dim, " dimensions, got shape ", t.sizes());
}

inline Problem check_forward(const at::Tensor& p0, const at::Tensor& w1, const at::Tensor& b1,
                             const at::Tensor& w2, const at::Tensor& b2, const at::Tensor& times,
                             int64_t substeps, const std::string& method, const std::string& activation,
                             c10::DeviceType device) {
  TORCH_CHECK_VALUE(p0.defined(), "floater: p0 must be a tensor");
  TORCH_CHECK(p0.device().type() == device, "floater: p0 must be a ", c10::DeviceTypeName(device),
              " tensor for this kernel, got ", p0.device());
  TORCH_CHECK_TYPE(p0.scalar_type() == at::kFloat || p0.scalar_type() == at::kDouble,
                   "floater: p0 must be float32 or float64, got ", p0.scalar_type());
  TORCH_CHECK_VALUE(p0.dim() == 2, "floater: p0 must have shape [S, d], got ", p0.sizes());
  check_tensor("w1", w1, p0, 2);
  check_tensor("b1", b1, p0, 1);
  check_tensor("w2", w2, p0, 2);
  check_tensor("b2", b2, p0, 1);
  check_tensor("times", times, p0, 1);
  Problem pr{};
  pr.S = p0.size(0);
  pr.d = p0.size(1);
  pr.H = w1.size(1);
  pr.L = times.size(0);
  TORCH_CHECK_VALUE(w1.size(0) == pr.d + 1, "floater: w1 must have shape [d+1, H] = [", pr.d + 1,
                    ", H], got ", w1.sizes());
  TORCH_CHECK_VALUE(b1.size(0) == pr.H, "floater: b1 must have shape [H] = [", pr.H, "], got ", b1.sizes());
  TORCH_CHECK_VALUE(w2.size(0) == pr.H + 1 && w2.size(1) == pr.d, "floater: w2 must have shape [H+1, d] = [",
                    pr.H + 1, ", ", pr.d, "], got ", w2.sizes());
  TORCH_CHECK_VALUE(b2.size(0) == pr.d, "floater: b2 must have shape [d] = [", pr.d, "], got ", b2.sizes());
  TORCH_CHECK_VALUE(substeps >= 1, "floater: substeps must be >= 1, got ", substeps);
  pr.opt = Options{substeps, parse_method(method), parse_activation(activation)};
  return pr;
}

// The backward op's arguments: the forward's (check_forward) plus grad and out, and which
// of the six gradients (p0, w1, b1, w2, b2, times) are needed.
struct BackwardProblem {
  Problem pr;
  std::array<bool, 6> needs;
};

inline BackwardProblem check_backward(const at::Tensor& grad, const at::Tensor& out, const at::Tensor& p0,
                                      const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2,
                                      const at::Tensor& b2, const at::Tensor& times, int64_t substeps,
                                      const std::string& method, const std::string& activation,
                                      const c10::List<bool>& needs, c10::DeviceType device) {
  const Problem pr = check_forward(p0, w1, b1, w2, b2, times, substeps, method, activation, device);
  check_tensor("grad", grad, p0, 3);
  check_tensor("out", out, p0, 3);
  const std::vector<int64_t> shape{pr.S, pr.L, pr.d};
  TORCH_CHECK_VALUE(grad.sizes() == c10::IntArrayRef(shape), "floater: grad must have shape [S, L, d] = ",
                    c10::IntArrayRef(shape), ", got ", grad.sizes());
  TORCH_CHECK_VALUE(out.sizes() == c10::IntArrayRef(shape), "floater: out must have shape [S, L, d] = ",
                    c10::IntArrayRef(shape), ", got ", out.sizes());
  TORCH_CHECK_VALUE(needs.size() == 6, "floater: needs must have 6 entries (p0, w1, b1, w2, b2, times), got ",
                    needs.size());
  BackwardProblem bp{pr, {}};
  for (size_t i = 0; i < 6; ++i) bp.needs[i] = needs.get(i);
  return bp;
}

// The problem's tensors (floater_common.h), contiguous, one dtype: what the CPU and CUDA
// implementations read.
struct Inputs {
  at::Tensor p0, w1, b1, w2, b2, times;
};

// Never write into the caller's storage: the kernels read contiguous views or copies.
inline Inputs contiguous_inputs(const at::Tensor& p0, const at::Tensor& w1, const at::Tensor& b1,
                                const at::Tensor& w2, const at::Tensor& b2, const at::Tensor& times) {
  return Inputs{p0.contiguous(), w1.contiguous(), b1.contiguous(), w2.contiguous(), b2.contiguous(), times.contiguous()};
}

// The backward op's results: a zero-filled tensor of the input's shape where that gradient
// is needed, else an empty one. sizes: of p0, w1, b1, w2, b2, times.
inline std::vector<at::Tensor> grad_outputs(const std::array<bool, 6>& needs,
                                            const std::array<c10::IntArrayRef, 6>& sizes,
                                            const at::TensorOptions& opt) {
  std::vector<at::Tensor> res(6);
  for (size_t i = 0; i < 6; ++i) res[i] = needs[i] ? at::zeros(sizes[i], opt) : at::empty({0}, opt);
  return res;
}

}  // namespace floater
}  // namespace posenc_fast
