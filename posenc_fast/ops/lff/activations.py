"""The activations of the LFF MLP, in one table: per name, every form the package needs.

The literal formula is the reference's (the specification); the folded one is the same
formula with its constants computed once, for the differentiable torch path (double
backward, ONNX export); one ATen op and its derivative for the chunked torch backend; the
nn.Module a user writes, for the eager baselines of the benchmarks."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_GELU_TANH_C = 0.044715


@dataclass(frozen=True)
class Activation:
    literal: Callable[[Tensor], Tensor]  # as the papers write it (the float64 reference)
    # The same formula with constants folded: it rounds differently from ``literal`` (a few
    # ulps), and the outputs that use it stay as they were.
    folded: Callable[[Tensor], Tensor]
    aten: Callable[[Tensor], Tensor]  # the same values in one ATen op (no autograd)
    aten_backward: Callable[[Tensor, Tensor], Tensor]  # (grad, a) -> grad * act'(a)
    module: Callable[[], nn.Module]  # what a user writes in an nn.Sequential


TABLE = {
    "gelu": Activation(  # erf form
        literal=lambda a: 0.5 * a * (1.0 + torch.erf(a / math.sqrt(2.0))),
        folded=lambda a: 0.5 * a * (1.0 + torch.erf(a * _INV_SQRT_2)),
        aten=lambda a: nn.functional.gelu(a, approximate="none"),
        aten_backward=lambda g, a: torch.ops.aten.gelu_backward(g, a, approximate="none"),
        module=nn.GELU,
    ),
    "gelu_tanh": Activation(
        literal=lambda a: (
            0.5 * a * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (a + 0.044715 * a**3)))
        ),
        folded=lambda a: (
            0.5 * a * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (a + _GELU_TANH_C * a * a * a)))
        ),
        aten=lambda a: nn.functional.gelu(a, approximate="tanh"),
        aten_backward=lambda g, a: torch.ops.aten.gelu_backward(g, a, approximate="tanh"),
        module=lambda: nn.GELU(approximate="tanh"),
    ),
    "relu": Activation(
        literal=lambda a: torch.clamp(a, min=0.0),
        folded=torch.relu,
        aten=torch.relu,
        aten_backward=lambda g, a: torch.ops.aten.threshold_backward(g, a, 0.0),
        module=nn.ReLU,
    ),
}
ACTIVATIONS = tuple(TABLE)


def get(name: str) -> Activation:
    try:
        return TABLE[name]
    except (KeyError, TypeError):
        raise ValueError(f"activation must be one of {ACTIVATIONS}; got {name!r}") from None
