// CPU entry points of the FLOATER integrator (floater_cpu.cpp). Arguments are checked and
// made contiguous by the op layer (floater_ops.cpp); outputs are allocated there:
// out [S, L, d]; dp0, dw1, db1, dw2, db2, dtimes zero-filled, or undefined tensors when
// that gradient is not needed.
#pragma once

#include <ATen/ATen.h>

#include <array>

#include "floater_checks.h"

namespace posenc_fast {
namespace floater {

// tape: undefined or empty, or the taped forward's stage values of the first `intervals`
// intervals (floater_cpu.cpp, Tape), tape_numel(S, d, H, intervals, opt) elements of p0's
// dtype: the forward fills it, the backward reads it instead of recomputing those
// intervals (bitwise the same gradients). The backward ignores it when the times need a
// gradient.
int64_t tape_numel(int64_t S, int64_t d, int64_t H, int64_t intervals, const Options& opt);

void forward_cpu(const Inputs& in, const Options& opt, at::Tensor& out, const at::Tensor& tape = at::Tensor());

// grads: dp0, dw1, db1, dw2, db2, dtimes (undefined: not needed).
void backward_cpu(const at::Tensor& grad, const at::Tensor& out, const Inputs& in, const Options& opt,
                  std::array<at::Tensor, 6>& grads, const at::Tensor& tape = at::Tensor());

// Bytes the backward may use per chunk to keep a whole interval's stage values instead of
// recomputing each step twice (default 64 MiB); returns the previous value. For tests.
int64_t set_backward_keep_budget(int64_t bytes);

}  // namespace floater
}  // namespace posenc_fast
