// What both Python modules (module.cpp: posenc_fast._C, module_cuda.cpp: _C_cuda) report
// of their build; the loader compares it with the package and the running torch.
#pragma once

#include <torch/extension.h>
#include <torch/version.h>

#include <string>

namespace posenc_fast {

inline pybind11::dict common_build_info() {
  pybind11::dict info;
  info["ops_version"] = 3;  // bump when the op schemas change
  info["torch_version"] = std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
                          std::to_string(TORCH_VERSION_PATCH);
  // The sanitizers it was built with (tools/sanitized_extension.py defines the macro),
  // joined by '_' ("address_undefined"); "" for a normal build.
#ifdef PF_SANITIZERS
#define PF_STR2(x) #x
#define PF_STR(x) PF_STR2(x)
  info["sanitize"] = std::string(PF_STR(PF_SANITIZERS));
#else
  info["sanitize"] = std::string();
#endif
  return info;
}

}  // namespace posenc_fast
