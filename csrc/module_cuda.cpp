// The Python module posenc_fast._C_cuda, the CUDA part of the extension: importing it
// registers the CUDA kernels of the posenc_fast::floater_integrate* ops (static
// registrations in floater/floater_cuda_ops.cpp). The ops themselves are defined by the CPU
// part, posenc_fast._C, which the loader imports first. A separate module so that a CUDA
// build that fails (toolkit missing or of another version than torch's, compile or link
// errors) leaves the CPU part built and usable.
#include <torch/extension.h>
#include <torch/version.h>

#include <string>

#include "floater/floater_cuda.h"
#include "module_info.h"

#ifndef POSENC_FAST_CUDA_ARCHS
#define POSENC_FAST_CUDA_ARCHS ""
#endif

namespace posenc_fast {
namespace {

pybind11::dict build_info() {
  pybind11::dict info = common_build_info();
  info["cuda_compiled_version"] = floater::cuda::compiled_version();
  info["cuda_archs"] = std::string(POSENC_FAST_CUDA_ARCHS);
  return info;
}

}  // namespace
}  // namespace posenc_fast

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "posenc_fast CUDA kernels (FLOATER integrator); ops live in torch.ops.posenc_fast";
  m.def("build_info", &posenc_fast::build_info, "How this module was built");
  m.def("cuda_runtime_version", &posenc_fast::floater::cuda::runtime_version,
        "Version of the CUDA runtime loaded in this process (-1 when unavailable)");
  m.def("floater_plans", &posenc_fast::floater::cuda::plan_log,
        "The FLOATER integrator's launch layouts chosen in this process, one line each");
}
