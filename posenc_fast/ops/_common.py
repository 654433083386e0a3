"""The double-backward path shared by the ops' autograd registrations."""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from ._autocast import autocast_disabled


def differentiable_grads(
    recompute: Callable[[], Tensor],
    inputs,
    needs,
    grad: Tensor,
    zero_fill: bool = False,
) -> list[Optional[Tensor]]:
    """Gradients of ``recompute()`` (the op's output rebuilt from ``inputs`` with ops autograd
    can trace) as a differentiable graph of the inputs (create_graph=True), so that a
    double backward works. None where ``needs`` is False; where an input is needed but
    unused, None, or zeros of its shape with ``zero_fill``."""
    wanted = [t for t, n in zip(inputs, needs) if n]
    with autocast_disabled(grad.device.type), torch.enable_grad():
        y = recompute()
        got = iter(torch.autograd.grad(y, wanted, grad, create_graph=True, allow_unused=True))
    out: list[Optional[Tensor]] = []
    for t, n in zip(inputs, needs):
        g = next(got) if n else None
        if n and g is None and zero_fill:
            g = torch.zeros_like(t)
        out.append(g)
    return out
