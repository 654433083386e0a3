// CUDA implementations of the posenc_fast::floater_integrate* ops (defined by _C; this is
// part of _C_cuda, module_cuda.cpp): checks, allocation, device guard and current stream,
// and the backward's weight-gradient GEMMs (AtenSink); the kernels: floater_cuda.cu.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "floater_checks.h"
#include "floater_cuda.h"

namespace posenc_fast {
namespace floater {
namespace cuda {

int runtime_version() {
  int v = 0;
  if (cudaRuntimeGetVersion(&v) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return v;
}

namespace {

// needs: backward only (the gradients to compute)
Problem to_problem(const floater::Problem& pr, const at::Tensor& p0, bool backward,
                   const std::array<bool, 6>& needs = {}) {
  Problem cp{};
  cp.S = pr.S;
  cp.d = pr.d;
  cp.H = pr.H;
  cp.L = pr.L;
  cp.substeps = pr.opt.substeps;
  cp.method = static_cast<int>(pr.opt.method);
  cp.activation = static_cast<int>(pr.opt.act);
  cp.dtype_size = p0.scalar_type() == at::kDouble ? 8 : 4;
  cp.backward = backward;
  for (size_t i = 0; i < 6; ++i) cp.needs[i] = needs[i];
  return cp;
}

// The forced layout (set_forced_layout, floater_cuda.h; csrc/README.md lists its fields),
// used for the forward and the adjoint alike; one that does not fit fails at launch.
std::mutex forced_lock;
std::string forced_spec;

bool forced_layout(const Problem& cp, Layout* layout) {
  const std::string spec = forced_layout_spec();
  if (spec.empty()) return false;
  std::vector<std::string> f;
  size_t start = 0;
  while (true) {
    const size_t comma = spec.find(',', start);
    f.push_back(spec.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  TORCH_CHECK_VALUE(f.size() >= 3 && f.size() <= 5,
                    "floater_layout must be 'mode,C,Sg[,resident[,staged]]', got '", spec, "'");
  const int mode = f[0] == "solo" ? 0 : f[0] == "cluster" ? 1 : f[0] == "grid" ? 2 : -1;
  TORCH_CHECK_VALUE(mode >= 0, "floater_layout: mode must be solo, cluster or grid, got '", f[0], "'");
  int C = 0, Sg = 0;
  double resident = 1.0;
  try {
    C = std::stoi(f[1]);
    Sg = std::stoi(f[2]);
    if (f.size() >= 4) resident = std::stod(f[3]);
  } catch (const std::exception&) {
    TORCH_CHECK_VALUE(false, "floater_layout: C and Sg must be integers, resident a number, got '", spec, "'");
  }
  const bool staged = f.size() < 5 || f[4] != "0";
  const cudaError_t err = layout_for(cp, mode, C, Sg, resident, layout, staged);
  TORCH_CHECK_VALUE(err == cudaSuccess, "floater_layout='", spec, "' is not a valid layout for d=", cp.d,
                    ", H=", cp.H);
  return true;
}

std::mutex layouts_lock;
std::vector<std::string> layouts_made;  // layout_log()

void log_layout(const Problem& cp, const at::Tensor& p0, const Layout& layout) {
  std::string line = std::string(cp.backward ? "adjoint" : "forward") + " S=" + std::to_string(cp.S) +
                     " d=" + std::to_string(cp.d) + " H=" + std::to_string(cp.H) +
                     " stages=" + std::to_string(cp.method == 0 ? 1 : (cp.method == 1 ? 2 : 4)) +
                     (cp.dtype_size == 8 ? " float64" : " float32") + " on cuda:" + std::to_string(p0.get_device()) +
                     ": " + layout.why;
  const std::lock_guard<std::mutex> g(layouts_lock);
  if (std::find(layouts_made.begin(), layouts_made.end(), line) == layouts_made.end()) layouts_made.push_back(line);
}

// choose_layout() asks the device for occupancies (dozens of queries): its answer is kept per
// device and everything it depends on (not L: the layout does not depend on it).
Layout make_layout(const Problem& cp, const at::Tensor& p0) {
  Layout layout{};
  if (forced_layout(cp, &layout)) {
    log_layout(cp, p0, layout);
    return layout;
  }
  using Key = std::tuple<int, int64_t, int64_t, int64_t, int, int, bool, bool>;
  static std::map<Key, Layout> layouts;
  const Key key{p0.get_device(), cp.S, cp.d, cp.H, cp.method, cp.dtype_size, cp.backward, cp.needs[5]};
  {
    const std::lock_guard<std::mutex> g(layouts_lock);
    const auto it = layouts.find(key);
    if (it != layouts.end()) return it->second;
  }
  const cudaError_t err = cuda::choose_layout(cp, p0.get_device(), &layout);
  if (err != cudaSuccess) cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "floater (cuda): no launch configuration fits d=", cp.d, ", H=", cp.H, ", S=", cp.S,
              " on ", p0.device(), " (", cudaGetErrorString(err), ")");
  log_layout(cp, p0, layout);
  const std::lock_guard<std::mutex> g(layouts_lock);
  layouts.emplace(key, layout);
  return layout;
}

void check_launch(cudaError_t err, const Layout& layout) {
  if (err != cudaSuccess) cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "floater (cuda): launch failed: ", cudaGetErrorString(err), " [", layout.why, "]");
}

// The inputs' pointers (the tensors contiguous, on the current device).
Pointers input_pointers(const Inputs& in) {
  Pointers ptr{};
  ptr.p0 = in.p0.data_ptr();
  ptr.w1 = in.w1.data_ptr();
  ptr.b1 = in.b1.data_ptr();
  ptr.w2 = in.w2.data_ptr();
  ptr.b2 = in.b2.data_ptr();
  ptr.times = in.times.data_ptr();
  return ptr;
}

at::Tensor scratch(size_t bytes, const at::Tensor& like) {
  return at::empty({static_cast<int64_t>(std::max<size_t>(bytes, 1))}, like.options().dtype(at::kByte));
}

int64_t checked_tape_numel(const floater::Problem& pr, int64_t intervals) {
  TORCH_CHECK_VALUE(intervals >= 0 && intervals <= pr.L, "floater_integrate_taped: intervals must be in [0, ", pr.L,
                    "] (the number of times), got ", intervals);
  return tape_numel(pr.S, pr.d, pr.H, intervals, pr.opt.substeps, static_cast<int>(pr.opt.method));
}

// The forward, optionally keeping the stage values of the first `intervals` intervals.
std::tuple<at::Tensor, at::Tensor> forward_cuda(const at::Tensor& p0, const at::Tensor& w1, const at::Tensor& b1,
                                                const at::Tensor& w2, const at::Tensor& b2, const at::Tensor& times,
                                                int64_t substeps, c10::string_view method,
                                                c10::string_view activation, int64_t intervals) {
  const floater::Problem pr = check_forward(p0, w1, b1, w2, b2, times, substeps, std::string(method),
                                            std::string(activation), c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(p0.device());
  const Inputs in = contiguous_inputs(p0, w1, b1, w2, b2, times);
  at::Tensor out = at::empty({pr.S, pr.L, pr.d}, in.p0.options());
  at::Tensor tape = at::empty({checked_tape_numel(pr, intervals)}, in.p0.options());
  if (pr.S == 0 || pr.L == 0 || pr.d == 0) return {out, tape};
  Pointers ptr = input_pointers(in);
  ptr.out = out.data_ptr();
  const Problem cp = to_problem(pr, in.p0, false);
  const Layout layout = make_layout(cp, in.p0);
  at::Tensor ws = scratch(forward_workspace_bytes(cp, layout), in.p0);
  ptr.workspace = ws.data_ptr();
  const TapeRef tr{tape.numel() ? tape.data_ptr() : nullptr, intervals};
  check_launch(forward(cp, layout, ptr, tr, c10::cuda::getCurrentCUDAStream().stream()), layout);
  return {out, tape};
}

at::Tensor integrate_cuda(const at::Tensor& p0, const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2,
                          const at::Tensor& b2, const at::Tensor& times, int64_t substeps, c10::string_view method,
                          c10::string_view activation) {
  return std::get<0>(forward_cuda(p0, w1, b1, w2, b2, times, substeps, method, activation, 0));
}

std::tuple<at::Tensor, at::Tensor> integrate_taped_cuda(const at::Tensor& p0, const at::Tensor& w1,
                                                        const at::Tensor& b1, const at::Tensor& w2,
                                                        const at::Tensor& b2, const at::Tensor& times,
                                                        int64_t substeps, c10::string_view method,
                                                        c10::string_view activation, int64_t intervals) {
  return forward_cuda(p0, w1, b1, w2, b2, times, substeps, method, activation, intervals);
}

// The layers' weight gradients of a chunk (floater_cuda.h, GradSink) with ATen on the
// current stream: dw[:K] += X^T G (one GEMM), dw[K] += taus^T (G summed per stage),
// db += G summed over rows. Deterministic (cuBLAS without atomics, fixed shapes).
// TF32: whatever the process allows torch's float32 matmuls (torch's default: off).
class AtenSink : public GradSink {
 public:
  AtenSink(std::array<at::Tensor, 4> grads, int64_t S, Activation act, const at::TensorOptions& opt)
      : grads_(std::move(grads)), S_(S), act_(act), opt_(opt) {}

  cudaError_t layer(int layer, const void* X, const void* G, const void* taus, int64_t stages, int64_t K,
                    int64_t N) override {
    const at::Tensor& dw = grads_[layer == 1 ? 0 : 2];
    const at::Tensor& db = grads_[layer == 1 ? 1 : 3];
    const int64_t R = stages * S_;
    const at::Tensor g = at::from_blob(const_cast<void*>(G), {R, N}, opt_);
    const at::Tensor gs = g.view({stages, S_, N}).sum(1);  // [stages, N]
    if (dw.defined()) {
      at::Tensor x = at::from_blob(const_cast<void*>(X), {R, K}, opt_);
      if (layer == 2) x = activation(x);
      dw.narrow(0, 0, K).addmm_(x.t(), g);
      const at::Tensor t = at::from_blob(const_cast<void*>(taus), {stages}, opt_);
      dw.select(0, K).addmv_(gs.t(), t);
    }
    if (db.defined()) db.add_(gs.sum(0));
    return cudaSuccess;
  }

 private:
  at::Tensor activation(const at::Tensor& z) const {
    switch (act_) {
      case Activation::ReLU:
        return at::relu(z);
      case Activation::Tanh:
        return at::tanh(z);
      case Activation::GELU:
        return at::gelu(z);  // the erf form
      default:
        return z;
    }
  }
  std::array<at::Tensor, 4> grads_;  // dw1, db1, dw2, db2 (undefined: not needed)
  int64_t S_;
  Activation act_;
  at::TensorOptions opt_;
};

// tape: undefined (no tape) or what the taped forward returned.
std::vector<at::Tensor> backward_cuda(const at::Tensor& grad_, const at::Tensor& out_, const at::Tensor& p0,
                                      const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2,
                                      const at::Tensor& b2, const at::Tensor& times, int64_t substeps,
                                      c10::string_view method, c10::string_view activation,
                                      const c10::List<bool>& needs_list, const at::Tensor& tape_) {
  const BackwardProblem bp = check_backward(grad_, out_, p0, w1, b1, w2, b2, times, substeps, std::string(method),
                                            std::string(activation), needs_list, c10::DeviceType::CUDA);
  const floater::Problem& pr = bp.pr;
  int64_t taped = 0;
  if (tape_.defined()) {
    const int64_t per = checked_tape_numel(pr, 1);
    TORCH_CHECK_VALUE(tape_.dim() == 1 && tape_.scalar_type() == p0.scalar_type() && tape_.device() == p0.device(),
                      "floater_integrate_backward_taped: tape must be a 1-D ", p0.scalar_type(), " tensor on ",
                      p0.device(), " (what floater_integrate_taped returned), got ", tape_.sizes(), " ",
                      tape_.scalar_type(), " on ", tape_.device());
    TORCH_CHECK_VALUE(per == 0 ? tape_.numel() == 0 : tape_.numel() % per == 0 && tape_.numel() / per <= pr.L,
                      "floater_integrate_backward_taped: tape has ", tape_.numel(),
                      " elements, not the stage values of whole intervals of this problem (", per,
                      " per interval, at most ", pr.L, " intervals)");
    taped = per == 0 ? 0 : tape_.numel() / per;
  }
  const c10::cuda::CUDAGuard guard(p0.device());
  const at::Tensor grad = grad_.contiguous(), saved = out_.contiguous();
  const at::Tensor tape = tape_.defined() ? tape_.contiguous() : tape_;
  const Inputs in = contiguous_inputs(p0, w1, b1, w2, b2, times);
  // zero-filled (the weight gradients are accumulated chunk by chunk)
  std::vector<at::Tensor> res =
      grad_outputs(bp.needs, {p0.sizes(), w1.sizes(), b1.sizes(), w2.sizes(), b2.sizes(), times.sizes()},
                   in.p0.options());
  if (pr.S == 0 || pr.L == 0 || pr.d == 0) return res;
  Pointers ptr = input_pointers(in);
  ptr.grad = grad.data_ptr();
  ptr.out_saved = saved.data_ptr();
  void** outs[6] = {&ptr.dp0, &ptr.dw1, &ptr.db1, &ptr.dw2, &ptr.db2, &ptr.dtimes};
  for (int i = 0; i < 6; ++i) *outs[i] = bp.needs[i] ? res[i].data_ptr() : nullptr;
  const Problem fcp = to_problem(pr, in.p0, false, bp.needs), acp = to_problem(pr, in.p0, true, bp.needs);
  const Layout flayout = make_layout(fcp, in.p0), alayout = make_layout(acp, in.p0);
  const TapeRef tr{taped ? tape.data_ptr() : nullptr, taped};
  at::Tensor ws = scratch(backward_workspace_bytes(acp, flayout, alayout, tr), in.p0);
  ptr.workspace = ws.data_ptr();
  const at::Tensor none;
  AtenSink sink({bp.needs[1] ? res[1] : none, bp.needs[2] ? res[2] : none, bp.needs[3] ? res[3] : none,
                 bp.needs[4] ? res[4] : none},
                pr.S, pr.opt.act, in.p0.options());
  check_launch(backward(acp, flayout, alayout, ptr, tr, sink, c10::cuda::getCurrentCUDAStream().stream()), alayout);
  return res;
}

std::vector<at::Tensor> integrate_backward_cuda(const at::Tensor& grad, const at::Tensor& out, const at::Tensor& p0,
                                                const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2,
                                                const at::Tensor& b2, const at::Tensor& times, int64_t substeps,
                                                c10::string_view method, c10::string_view activation,
                                                const c10::List<bool>& needs) {
  return backward_cuda(grad, out, p0, w1, b1, w2, b2, times, substeps, method, activation, needs, at::Tensor());
}

std::vector<at::Tensor> integrate_backward_taped_cuda(const at::Tensor& grad, const at::Tensor& out,
                                                      const at::Tensor& p0, const at::Tensor& w1,
                                                      const at::Tensor& b1, const at::Tensor& w2,
                                                      const at::Tensor& b2, const at::Tensor& times,
                                                      int64_t substeps, c10::string_view method,
                                                      c10::string_view activation, const c10::List<bool>& needs,
                                                      const at::Tensor& tape) {
  TORCH_CHECK_VALUE(tape.defined(), "floater_integrate_backward_taped: tape must be a tensor");
  return backward_cuda(grad, out, p0, w1, b1, w2, b2, times, substeps, method, activation, needs, tape);
}

}  // namespace

std::string forced_layout_spec() {
  const std::lock_guard<std::mutex> g(forced_lock);
  return forced_spec;
}

std::string set_forced_layout(const std::string& spec) {
  const std::lock_guard<std::mutex> g(forced_lock);
  std::string before = forced_spec;
  forced_spec = spec;
  return before;
}

std::vector<std::string> layout_log() {
  const std::lock_guard<std::mutex> g(layouts_lock);
  return layouts_made;
}

}  // namespace cuda
}  // namespace floater
}  // namespace posenc_fast

TORCH_LIBRARY_IMPL(posenc_fast, CUDA, m) {
  m.impl("floater_integrate", &posenc_fast::floater::cuda::integrate_cuda);
  m.impl("floater_integrate_taped", &posenc_fast::floater::cuda::integrate_taped_cuda);
  m.impl("floater_integrate_backward", &posenc_fast::floater::cuda::integrate_backward_cuda);
  m.impl("floater_integrate_backward_taped", &posenc_fast::floater::cuda::integrate_backward_taped_cuda);
}
