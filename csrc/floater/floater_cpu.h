// CPU entry points of the FLOATER integrator (floater_cpu.cpp). Arguments are checked and
// made contiguous by the op layer (floater_ops.cpp); outputs are allocated there:
// out [S, L, d]; dp0, dw1, db1, dw2, db2, dtimes zero-filled, or undefined tensors when
// that gradient is not needed.
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "floater_common.h"

namespace posenc_fast {
namespace floater {
namespace cpu {

void forward(const at::Tensor& p0, const at::Tensor& w1, const at::Tensor& b1, const at::Tensor& w2,
             const at::Tensor& b2, const at::Tensor& times, int64_t substeps, Method method,
             Activation act, at::Tensor& out);

void backward(const at::Tensor& grad, const at::Tensor& out, const at::Tensor& p0, const at::Tensor& w1,
              const at::Tensor& b1, const at::Tensor& w2, const at::Tensor& b2, const at::Tensor& times,
              int64_t substeps, Method method, Activation act, at::Tensor& dp0, at::Tensor& dw1,
              at::Tensor& db1, at::Tensor& dw2, at::Tensor& db2, at::Tensor& dtimes);

// Instruction set the kernels run with ("avx512", "avx2" or "generic"), the best the CPU
// supports, and a process-wide override (tests run every path; "auto" clears it).
std::string isa();
std::string best_isa_name();
void set_isa(const std::string& name);
// The active instruction set as a level: 0 generic, 1 avx2, 2 avx512 (what isa() names);
// the LFF and encoding kernels (csrc/fourier) follow the same choice and override.
int isa_level();

// Bytes the backward may use per chunk to keep a whole interval's stage values instead of
// recomputing each step twice (default 64 MiB); returns the previous value. For tests.
int64_t set_backward_keep_budget(int64_t bytes);

}  // namespace cpu
}  // namespace floater
}  // namespace posenc_fast
