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


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def direct_call_ok(*tensors: Optional[Tensor]) -> bool:
    """Whether an op may run its implementation directly instead of going through its
    torch.library custom op: plain tensors in plain eager mode. The custom op's dispatch
    and autograd wrapper cost 100-150 µs per training step on a CPU (issue 12: a third of
    a small LFF call); everything that must see the op — torch.compile / export (dynamo),
    jit tracing, fake or functional tensors and other subclasses, dispatch and function
    modes (make_fx, FlopCounter, ``with torch.device(...)``), vmap / grad transforms —
    still goes through it. Private torch APIs are looked up defensively: where one is
    missing the op is used."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False
    C = torch._C
    try:
        if C._len_torch_dispatch_stack() or C._is_torch_function_mode_enabled():
            return False
        if C._functorch.peek_interpreter_stack() is not None:
            return False
    except AttributeError:
        return False
    return all(t is None or type(t) in _PLAIN_TENSORS for t in tensors)
