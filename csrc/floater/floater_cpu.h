// CPU entry points of the FLOATER integrator (floater_cpu.cpp). Arguments are checked and
// made contiguous by the op layer (floater_ops.cpp); outputs are allocated there:
// out [S, L, d]; dp0, dw1, db1, dw2, db2, dtimes zero-filled, or undefined tensors when
// that gradient is not needed. The instruction set and the parallel region are the CPU
// runtime's (csrc/cpu/).
#pragma once

#include <ATen/ATen.h>

#include <array>

#include "floater_checks.h"

namespace posenc_fast {
namespace floater {

void forward_cpu(const Inputs& in, const Options& opt, at::Tensor& out);

// grads: dp0, dw1, db1, dw2, db2, dtimes (undefined: not needed).
void backward_cpu(const at::Tensor& grad, const at::Tensor& out, const Inputs& in, const Options& opt,
                  std::array<at::Tensor, 6>& grads);

// Bytes the backward may use per chunk to keep a whole interval's stage values instead of
// recomputing each step twice (default 64 MiB); returns the previous value. For tests.
int64_t set_backward_keep_budget(int64_t bytes);

}  // namespace floater
}  // namespace posenc_fast
