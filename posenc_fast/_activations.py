"""Activations of the LFF MLP and their derivatives, for the torch backend.

The reference writes the formulas out literally (posenc_fast/ops/lff/reference.py); here the same
functions come as single ATen ops with their derivatives (aten::gelu_backward,
threshold_backward), so the backward can recompute them chunk by chunk without autograd.
``apply`` stays composed of differentiable ops: the double backward differentiates it.
"""

from __future__ import annotations

import math

import torch

ACTIVATIONS = ("gelu", "gelu_tanh", "relu")

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_GELU_TANH_C = 0.044715


def apply(name: str, a: torch.Tensor) -> torch.Tensor:
    if name == "gelu":
        return 0.5 * a * (1.0 + torch.erf(a * _INV_SQRT_2))
    if name == "gelu_tanh":
        return 0.5 * a * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (a + _GELU_TANH_C * a * a * a)))
    if name == "relu":
        return torch.relu(a)
    raise ValueError(f"activation must be one of {ACTIVATIONS}; got {name!r}")


def apply_fast(name: str, a: torch.Tensor) -> torch.Tensor:
    """Same values as ``apply`` in one ATen op (no autograd)."""
    if name in ("gelu", "gelu_tanh"):
        approximate = "tanh" if name == "gelu_tanh" else "none"
        return torch.nn.functional.gelu(a, approximate=approximate)
    if name == "relu":
        return torch.relu(a)
    raise ValueError(f"activation must be one of {ACTIVATIONS}; got {name!r}")


def backward_fused(name: str, grad: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """grad * act'(a) (no autograd) in one ATen op."""
    if name in ("gelu", "gelu_tanh"):
        approximate = "tanh" if name == "gelu_tanh" else "none"
        return torch.ops.aten.gelu_backward(grad, a, approximate=approximate)
    if name == "relu":
        return torch.ops.aten.threshold_backward(grad, a, 0.0)
    raise ValueError(f"activation must be one of {ACTIVATIONS}; got {name!r}")
