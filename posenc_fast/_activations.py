"""Activations of the LFF MLP and their derivatives, for the torch backend.

The reference writes the formulas out literally (posenc_fast/reference); here the same
functions come with hand-written derivatives so the backward can recompute them chunk by
chunk without autograd.
"""

from __future__ import annotations

import math

import torch

ACTIVATIONS = ("gelu", "gelu_tanh", "relu")

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_GELU_TANH_C = 0.044715


def apply(name: str, a: torch.Tensor) -> torch.Tensor:
    if name == "gelu":
        return 0.5 * a * (1.0 + torch.erf(a * _INV_SQRT_2))
    if name == "gelu_tanh":
        return 0.5 * a * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (a + _GELU_TANH_C * a * a * a)))
    if name == "relu":
        return torch.relu(a)
    raise ValueError(f"activation must be one of {ACTIVATIONS}; got {name!r}")


# The erf-form GELU kernels of torch's CPU build (aten::gelu / gelu_backward with
# approximate="none") stall for milliseconds when they follow an MKL matmul on a busy
# 2-core machine (measured: addmm + F.gelu 4.3 ms vs 17 us for erf-based arithmetic on a
# [16, 32] tensor; the tanh form does not stall). The fast paths below therefore compose the
# erf form from erf/exp, in place where possible, and use the fused kernels otherwise.


def apply_inplace(name: str, a: torch.Tensor) -> torch.Tensor:
    """Same values as ``apply`` with few passes (no autograd); may overwrite ``a``."""
    if name == "gelu":
        cdf = torch.erf(a * _INV_SQRT_2).add_(1.0).mul_(0.5)
        return a.mul_(cdf)
    if name == "gelu_tanh":
        return torch.nn.functional.gelu(a, approximate="tanh")
    if name == "relu":
        return a.relu_()
    raise ValueError(f"activation must be one of {ACTIVATIONS}; got {name!r}")


def backward_fused(name: str, grad: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """grad * act'(a) (no autograd); may overwrite ``grad``."""
    if name == "gelu":
        d = torch.erf(a * _INV_SQRT_2).add_(1.0).mul_(0.5)  # cdf
        d.add_(torch.exp(a * a * -0.5).mul_(a).mul_(_INV_SQRT_2PI))  # + a * pdf
        return grad.mul_(d)
    if name == "gelu_tanh":
        return torch.ops.aten.gelu_backward(grad, a, approximate="tanh")
    if name == "relu":
        return torch.ops.aten.threshold_backward(grad, a, 0.0)
    raise ValueError(f"activation must be one of {ACTIVATIONS}; got {name!r}")
