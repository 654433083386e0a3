// The Python module posenc_fast._C, the CPU part of the extension: importing it defines the
// low-level ops and registers their CPU and Meta kernels (static registrations in each
// <op>/<op>_ops.cpp); the CUDA kernels are posenc_fast._C_cuda (module_cuda.cpp). The
// pybind11 functions describe the build, give tests the runtime's settings (cpu/isa.h,
// cpu/parallel.h, FLOATER's backward budget) and release the tapes' spare block (cpu/spare.h).
#include <torch/extension.h>
#include <torch/version.h>

#include <string>

#include "cpu/isa.h"
#include "cpu/parallel.h"
#include "cpu/spare.h"
#include "floater/floater_cpu.h"
#include "module_info.h"

namespace posenc_fast {
namespace {

pybind11::dict build_info() {
  pybind11::dict info = common_build_info();
#if defined(__clang__)
  info["compiler"] = std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  info["compiler"] = std::string("gcc ") + __VERSION__;
#endif
  info["cpu_isa_best"] = cpu::best_isa_name();
  info["cpu_isa"] = cpu::isa();
  return info;
}

// The settings tests and tools make (csrc/README.md, "Settings for tests and tools"): each
// keyword given (not None) replaces its setting; returns the settings as they were.
//   always_team: CPU teams even when the machine looks contended (cpu/parallel.h)
pybind11::dict set_development_options(const pybind11::object& always_team) {
  pybind11::dict before;
  before["always_team"] = cpu::always_team().load();
  if (!always_team.is_none()) cpu::always_team().store(always_team.cast<bool>());
  return before;
}

}  // namespace
}  // namespace posenc_fast

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "posenc_fast compiled kernels (FLOATER integrator, LFF, encodings, rotary); ops live in torch.ops.posenc_fast";
  m.def("build_info", &posenc_fast::build_info, "How this extension was built");
  m.def("cpu_isa", &posenc_fast::cpu::isa, "Instruction set of the CPU kernels");
  m.def("set_cpu_isa", &posenc_fast::cpu::set_isa, pybind11::arg("name"),
        "Force the CPU kernels' instruction set ('generic', 'avx2', 'avx512', or 'auto'); for tests");
  m.def("set_backward_keep_budget", &posenc_fast::floater::set_backward_keep_budget, pybind11::arg("bytes"),
        "Memory (bytes) the CPU backward may use to keep an interval's stage values; for tests");
  m.def("judge_regions_contended", &posenc_fast::cpu::judge_regions_contended, pybind11::arg("regions"),
        "Judge the next `regions` team regions of the CPU kernels contended (the contention fallback: calls "
        "then run on one thread for 250 ms); 0 also ends the current one-thread period; for tests");
  m.def("set_development_options", &posenc_fast::set_development_options, pybind11::kw_only(),
        pybind11::arg("always_team") = pybind11::none(),
        "Settings for tests and tools (always_team: CPU teams even on a busy machine); a keyword "
        "left at None keeps its setting; returns the settings as they were");
  m.def("cpu_contended", &posenc_fast::cpu::contended,
        "Whether the CPU kernels run on one thread for now (the contention fallback)");
  m.def("release_spare_memory", &posenc_fast::cpu::release_spare,
        "Free the block kept for the next FLOATER tape (cpu/spare.h); returns its size in bytes");
}
