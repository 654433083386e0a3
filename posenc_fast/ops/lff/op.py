"""torch.library custom ops for learnable Fourier features.

    posenc_fast::lff(x, wr, w1?, b1?, w2?, b2?, activation, out_dtype, backend) -> y
    posenc_fast::lff_backward(grad, x, wr, w1?, b1?, w2?, b2?, activation, backend, needs)
        -> [dx, dwr, dw1, db1, dw2, db2]   (empty tensors where needs[i] is False)

``backend`` names the implementation (chosen by the dispatcher before the call; a
torch.library op cannot take the implementation itself), looked up once in the registry
by the op's body, so one op serves every backend and opcheck / torch.compile / export see
the same schema. The backward saves only the inputs; the implementation recomputes
features and hidden layer. When a double backward is requested (grad mode on inside
backward), the gradient is instead built by differentiating the torch implementation's
recomputation, so gradgradcheck works.
"""

from __future__ import annotations

from typing import List, Optional  # noqa: UP035 (torch 2.5: see ops/_common.CustomOp)

import torch
from torch import Tensor

from .._common import CustomOp, autocast_disabled, differentiable_grads
from . import torch_impl
from .registry import LFF


def _forward(
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
    with autocast_disabled(x.device.type):
        return LFF[backend].forward(x, wr, w1, b1, w2, b2, activation, out_dtype)


def _forward_fake(x, wr, w1, b1, w2, b2, activation, out_dtype, backend):
    width = 2 * wr.shape[0] if w1 is None else w2.shape[1]
    return x.new_empty((*x.shape[:-2], x.shape[-2] * width), dtype=out_dtype)


def _backward_body(
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
    with autocast_disabled(x.device.type):
        grads = LFF[backend].backward(grad, x, wr, w1, b1, w2, b2, activation, needs)
    return [g if g is not None else grad.new_empty(0) for g in grads]


def _backward_fake(grad, x, wr, w1, b1, w2, b2, activation, backend, needs):
    refs = (x, wr, w1, b1, w2, b2)
    return [
        torch.empty_like(t) if (need and t is not None) else grad.new_empty(0)
        for need, t in zip(needs, refs)
    ]


LFF_BACKWARD = CustomOp("posenc_fast::lff_backward", _backward_body, _backward_fake)


def _setup_context(ctx, inputs, output):
    x, wr, w1, b1, w2, b2, activation, out_dtype, backend = inputs
    ctx.save_for_backward(x, wr, w1, b1, w2, b2)
    ctx.activation, ctx.out_dtype, ctx.backend = activation, out_dtype, backend


def _backward(ctx, grad):
    x, wr, w1, b1, w2, b2 = ctx.saved_tensors
    needs = [bool(n) for n in ctx.needs_input_grad[:6]]
    if torch.is_grad_enabled():
        grads = differentiable_grads(
            lambda: torch_impl.lff_autograd(x, wr, w1, b1, w2, b2, ctx.activation, ctx.out_dtype),
            (x, wr, w1, b1, w2, b2),
            needs,
            grad,
        )
    else:
        grads = LFF_BACKWARD(grad, x, wr, w1, b1, w2, b2, ctx.activation, ctx.backend, needs)
    return (*(g if n else None for g, n in zip(grads, needs)), None, None, None)


LFF_OP = CustomOp(
    "posenc_fast::lff",
    _forward,
    _forward_fake,
    backward=_backward,
    setup_context=_setup_context,
    op_function="forward",
    onnx=lambda x, wr, w1, b1, w2, b2, activation, out_dtype, backend: torch_impl.lff_autograd(
        x, wr, w1, b1, w2, b2, activation, out_dtype
    ),
)
