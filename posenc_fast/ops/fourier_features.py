"""torch.library custom ops for learnable Fourier features.

    posenc_fast::lff(x, wr, w1?, b1?, w2?, b2?, activation, out_dtype, backend) -> y
    posenc_fast::lff_backward(grad, x, wr, w1?, b1?, w2?, b2?, activation, backend, needs)
        -> [dx, dwr, dw1, db1, dw2, db2]   (empty tensors where needs[i] is False)

``backend`` names the implementation (chosen by the dispatcher before the call), so one
op serves every backend and opcheck / torch.compile / export see the same schema. The
backward saves only the inputs; the backend recomputes features and hidden layer. When a
double backward is requested (grad mode on inside backward), the gradient is instead
built by differentiating the torch backend's recomputation, so gradgradcheck works.
"""

from __future__ import annotations

from typing import List, Optional  # noqa: UP035 (torch 2.5, see ops/__init__.py)

import torch
from torch import Tensor

from .. import backends
from ..torch_impl import fourier_features as _torch_lff
from ._autocast import autocast_disabled
from ._common import differentiable_grads, direct_call_ok


@torch.library.custom_op("posenc_fast::lff", mutates_args=())
def lff_op(
    x: Tensor,
    wr: Tensor,
    w1: Optional[Tensor],
    b1: Optional[Tensor],
    w2: Optional[Tensor],
    b2: Optional[Tensor],
    activation: str,
    out_dtype: torch.dtype,
    backend: str,
) -> Tensor:
    return _run_forward(x, wr, w1, b1, w2, b2, activation, out_dtype, backend)


def _run_forward(x, wr, w1, b1, w2, b2, activation, out_dtype, backend) -> Tensor:
    """The op's body, shared with its direct eager path (_LffDirect)."""
    with autocast_disabled(x.device.type):
        return backends.get(backend).lff_forward(x, wr, w1, b1, w2, b2, activation, out_dtype)


def _run_backward(grad, x, wr, w1, b1, w2, b2, activation, backend, needs) -> list:
    """The backward op's body (None where not needed), shared with the direct eager path."""
    with autocast_disabled(x.device.type):
        return backends.get(backend).lff_backward(grad, x, wr, w1, b1, w2, b2, activation, needs)


@lff_op.register_fake
def _(x, wr, w1, b1, w2, b2, activation, out_dtype, backend):
    width = 2 * wr.shape[0] if w1 is None else w2.shape[1]
    return x.new_empty((*x.shape[:-2], x.shape[-2] * width), dtype=out_dtype)


@torch.library.custom_op("posenc_fast::lff_backward", mutates_args=())
def lff_backward_op(
    grad: Tensor,
    x: Tensor,
    wr: Tensor,
    w1: Optional[Tensor],
    b1: Optional[Tensor],
    w2: Optional[Tensor],
    b2: Optional[Tensor],
    activation: str,
    backend: str,
    needs: List[bool],  # noqa: UP006
) -> List[Tensor]:  # noqa: UP006
    grads = _run_backward(grad, x, wr, w1, b1, w2, b2, activation, backend, needs)
    return [g if g is not None else grad.new_empty(0) for g in grads]


@lff_backward_op.register_fake
def _(grad, x, wr, w1, b1, w2, b2, activation, backend, needs):
    refs = (x, wr, w1, b1, w2, b2)
    return [
        torch.empty_like(t) if (need and t is not None) else grad.new_empty(0)
        for need, t in zip(needs, refs)
    ]


def _setup_context(ctx, inputs, output):
    x, wr, w1, b1, w2, b2, activation, out_dtype, backend = inputs
    ctx.save_for_backward(x, wr, w1, b1, w2, b2)
    ctx.activation, ctx.out_dtype, ctx.backend = activation, out_dtype, backend


def _backward(ctx, grad):
    x, wr, w1, b1, w2, b2 = ctx.saved_tensors
    needs = [bool(n) for n in ctx.needs_input_grad[:6]]
    if torch.is_grad_enabled():
        grads = differentiable_grads(
            lambda: _torch_lff.lff_autograd(x, wr, w1, b1, w2, b2, ctx.activation, ctx.out_dtype),
            (x, wr, w1, b1, w2, b2),
            needs,
            grad,
        )
    elif direct_call_ok(grad, x, wr, w1, b1, w2, b2):
        grads = _run_backward(grad, x, wr, w1, b1, w2, b2, ctx.activation, ctx.backend, needs)
    else:
        grads = torch.ops.posenc_fast.lff_backward(
            grad, x, wr, w1, b1, w2, b2, ctx.activation, ctx.backend, needs
        )
    return (*(g if n else None for g, n in zip(grads, needs)), None, None, None)


lff_op.register_autograd(_backward, setup_context=_setup_context)


class _LffDirect(torch.autograd.Function):
    """posenc_fast::lff without the custom op's dispatch, for plain eager calls
    (direct_call_ok): the same implementation, saved tensors and backward."""

    @staticmethod
    def forward(ctx, *inputs):  # x, wr, w1, b1, w2, b2, activation, out_dtype, backend
        y = _run_forward(*inputs)
        _setup_context(ctx, inputs, y)
        return y

    backward = staticmethod(_backward)


def lff(x, wr, w1, b1, w2, b2, activation: str, out_dtype: torch.dtype, backend: str) -> Tensor:
    """posenc_fast::lff, or its direct eager path where nothing needs to see the op."""
    if direct_call_ok(x, wr, w1, b1, w2, b2):
        return _LffDirect.apply(x, wr, w1, b1, w2, b2, activation, out_dtype, backend)
    return torch.ops.posenc_fast.lff(x, wr, w1, b1, w2, b2, activation, out_dtype, backend)
