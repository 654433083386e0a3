// CUDA implementations of posenc_fast::floater_integrate / floater_integrate_backward:
// checks, allocation through torch's caching allocator, device guard and the current
// stream; the kernels are in floater_cuda.cu (see there for the design). Part of the
// CUDA module posenc_fast._C_cuda (module_cuda.cpp); the ops are defined by posenc_fast._C.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <array>
#include <cstdlib>
#include <string>
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

// POSENC_FAST_CUDA_PLAN="mode,C,Sg[,resident[,staged]]" (mode: solo, cluster or grid)
// forces a layout instead of the automatic choice: for testing every layout on one GPU
// and for experiments. A layout that does not fit fails at launch with CUDA's error.
bool forced_plan(const Problem& cp, Plan* plan) {
  const char* env = std::getenv("POSENC_FAST_CUDA_PLAN");
  if (env == nullptr || *env == '\0') return false;
  std::string spec(env);
  std::vector<std::string> f;
  size_t start = 0;
  while (true) {
    const size_t comma = spec.find(',', start);
    f.push_back(spec.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  TORCH_CHECK_VALUE(f.size() >= 3 && f.size() <= 5,
                    "POSENC_FAST_CUDA_PLAN must be 'mode,C,Sg[,resident[,staged]]', got '", spec, "'");
  const int mode = f[0] == "solo" ? 0 : f[0] == "cluster" ? 1 : f[0] == "grid" ? 2 : -1;
  TORCH_CHECK_VALUE(mode >= 0, "POSENC_FAST_CUDA_PLAN: mode must be solo, cluster or grid, got '", f[0], "'");
  const int C = std::stoi(f[1]), Sg = std::stoi(f[2]);
  const bool resident = f.size() < 4 || f[3] != "0";
  const bool staged = f.size() < 5 || f[4] != "0";
  const cudaError_t err = plan_with(cp, mode, C, Sg, resident, plan, staged);
  TORCH_CHECK_VALUE(err == cudaSuccess, "POSENC_FAST_CUDA_PLAN='", spec, "' is not a valid layout for d=", cp.d,
                    ", H=", cp.H);
  return true;
}

Plan make_plan(const Problem& cp, const at::Tensor& p0) {
  Plan plan{};
  if (forced_plan(cp, &plan)) return plan;
  const cudaError_t err = cuda::plan(cp, p0.get_device(), &plan);
  if (err != cudaSuccess) cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "floater (cuda): no launch configuration fits d=", cp.d, ", H=", cp.H, ", S=", cp.S,
              " on ", p0.device(), " (", cudaGetErrorString(err), ")");
  return plan;
}

void check_launch(cudaError_t err, const Plan& plan) {
  if (err != cudaSuccess) cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "floater (cuda): launch failed: ", cudaGetErrorString(err), " [", plan.why, "]");
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

// Plans the launch, allocates its zero-filled workspace and launches on the current stream.
void run(const Problem& cp, const at::Tensor& p0, Pointers ptr) {
  const Plan plan = make_plan(cp, p0);
  at::Tensor ws = at::zeros({static_cast<int64_t>(plan.workspace_bytes)}, p0.options().dtype(at::kByte));
  ptr.workspace = ws.data_ptr();
  check_launch(launch(cp, plan, ptr, c10::cuda::getCurrentCUDAStream().stream()), plan);
}

at::Tensor integrate_cuda(const at::Tensor& p0, const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2,
                          const at::Tensor& b2, const at::Tensor& times, int64_t substeps, c10::string_view method,
                          c10::string_view activation) {
  const floater::Problem pr = check_forward(p0, w1, b1, w2, b2, times, substeps, std::string(method),
                                            std::string(activation), c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(p0.device());
  const Inputs in = contiguous_inputs(p0, w1, b1, w2, b2, times);
  at::Tensor out = at::empty({pr.S, pr.L, pr.d}, in.p0.options());
  if (pr.S == 0 || pr.L == 0 || pr.d == 0) return out;
  Pointers ptr = input_pointers(in);
  ptr.out = out.data_ptr();
  run(to_problem(pr, in.p0, false), in.p0, ptr);
  return out;
}

std::vector<at::Tensor> integrate_backward_cuda(const at::Tensor& grad_, const at::Tensor& out_, const at::Tensor& p0,
                                                const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2,
                                                const at::Tensor& b2, const at::Tensor& times, int64_t substeps,
                                                c10::string_view method, c10::string_view activation,
                                                const c10::List<bool>& needs_list) {
  const BackwardProblem bp = check_backward(grad_, out_, p0, w1, b1, w2, b2, times, substeps, std::string(method),
                                            std::string(activation), needs_list, c10::DeviceType::CUDA);
  const floater::Problem& pr = bp.pr;
  const c10::cuda::CUDAGuard guard(p0.device());
  const at::Tensor grad = grad_.contiguous(), saved = out_.contiguous();
  const Inputs in = contiguous_inputs(p0, w1, b1, w2, b2, times);
  std::vector<at::Tensor> res =
      grad_outputs(bp.needs, {p0.sizes(), w1.sizes(), b1.sizes(), w2.sizes(), b2.sizes(), times.sizes()},
                   in.p0.options());
  if (pr.S == 0 || pr.L == 0 || pr.d == 0) return res;
  Pointers ptr = input_pointers(in);
  ptr.grad = grad.data_ptr();
  ptr.out_saved = saved.data_ptr();
  void** outs[6] = {&ptr.dp0, &ptr.dw1, &ptr.db1, &ptr.dw2, &ptr.db2, &ptr.dtimes};
  for (int i = 0; i < 6; ++i) *outs[i] = bp.needs[i] ? res[i].data_ptr() : nullptr;
  run(to_problem(pr, in.p0, true, bp.needs), in.p0, ptr);
  return res;
}

}  // namespace
}  // namespace cuda
}  // namespace floater
}  // namespace posenc_fast

TORCH_LIBRARY_IMPL(posenc_fast, CUDA, m) {
  m.impl("floater_integrate", &posenc_fast::floater::cuda::integrate_cuda);
  m.impl("floater_integrate_backward", &posenc_fast::floater::cuda::integrate_backward_cuda);
}
