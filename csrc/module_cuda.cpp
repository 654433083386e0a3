// The Python module posenc_fast._C_cuda, the CUDA part of the extension: importing it
// registers the CUDA kernels of the posenc_fast::floater_integrate* ops (static
// registrations in floater/floater_cuda_ops.cpp). The ops themselves are defined by the CPU
// part, posenc_fast._C, which the loader imports first. A separate module so that a failed
// CUDA build leaves the CPU part built and usable.
#include <torch/extension.h>
#include <torch/version.h>

#include <string>

#include "floater/floater_cuda.h"
#include "module_info.h"

#ifndef PF_CUDA_ARCHS
#define PF_CUDA_ARCHS ""
#endif

namespace posenc_fast {
namespace {

pybind11::dict build_info() {
  pybind11::dict info = common_build_info();
  info["cuda_compiled_version"] = floater::cuda::compiled_version();
  info["cuda_archs"] = std::string(PF_CUDA_ARCHS);
  return info;
}

// The settings tests and tools make (csrc/README.md, "Settings for tests and tools"): each
// keyword given (not None) replaces its setting; returns the settings as they were.
//   floater_layout: the layout forced on every call, "mode,C,Sg[,resident[,staged]]" or ""
pybind11::dict set_development_options(const pybind11::object& floater_layout) {
  pybind11::dict before;
  before["floater_layout"] = floater_layout.is_none()
                                 ? floater::cuda::forced_layout_spec()
                                 : floater::cuda::set_forced_layout(floater_layout.cast<std::string>());
  return before;
}

}  // namespace
}  // namespace posenc_fast

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "posenc_fast CUDA kernels (FLOATER integrator); ops live in torch.ops.posenc_fast";
  m.def("build_info", &posenc_fast::build_info, "How this module was built");
  m.def("cuda_runtime_version", &posenc_fast::floater::cuda::runtime_version,
        "Version of the CUDA runtime loaded in this process (-1 when unavailable)");
  m.def("set_development_options", &posenc_fast::set_development_options, pybind11::kw_only(),
        pybind11::arg("floater_layout") = pybind11::none(),
        "Settings for tests and tools (floater_layout: force the FLOATER integrator's layout, "
        "'mode,C,Sg[,resident[,staged]]', '' for the automatic choice); a keyword left at None "
        "keeps its setting; returns the settings as they were");
  m.def("floater_layouts", &posenc_fast::floater::cuda::layout_log,
        "The FLOATER integrator's launch layouts chosen in this process, one line each");
}
