"""The LFF op: the custom ops and the autograd.Function of the eager path

    posenc_fast::lff(x, wr, w1?, b1?, w2?, b2?, activation, out_dtype, backend) -> y
    posenc_fast::lff_backward(grad, x, wr, w1?, b1?, w2?, b2?, activation, backend, needs)
        -> [dx, dwr, dw1, db1, dw2, db2]   (empty tensors where needs[i] is False)

``backend`` names the implementation in the registry. The backward saves only the inputs
and recomputes features and hidden layer; a double backward differentiates the torch
implementation's recomputation instead."""

from __future__ import annotations

from typing import List, Optional  # noqa: UP035 (torch 2.5's infer_schema)

import torch
from torch import Tensor

from .._custom_ops import autocast_disabled, custom_op, differentiable_grads, direct_call_ok
from . import torch_impl
from .registry import LFF


def lff_backward(
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


LFF_BACKWARD_OP = custom_op("lff_backward", lff_backward, _backward_fake)


def lff(
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


def _setup_context(ctx, inputs, output):
    x, wr, w1, b1, w2, b2, activation, out_dtype, backend = inputs
    ctx.save_for_backward(x, wr, w1, b1, w2, b2)
    ctx.activation, ctx.out_dtype, ctx.backend = activation, out_dtype, backend


class LffFunction(torch.autograd.Function):
    """x [..., G, M] -> [..., G * width]: the features and the grouped MLP."""

    @staticmethod
    def forward(ctx, x, wr, w1, b1, w2, b2, activation, out_dtype, backend):
        ctx.save_for_backward(x, wr, w1, b1, w2, b2)  # _setup_context, inlined: a small call
        ctx.activation, ctx.out_dtype, ctx.backend = activation, out_dtype, backend
        with autocast_disabled(x.device.type):
            return LFF[backend].forward(x, wr, w1, b1, w2, b2, activation, out_dtype)

    @staticmethod
    def backward(ctx, grad):
        x, wr, w1, b1, w2, b2 = ctx.saved_tensors
        needs = [bool(n) for n in ctx.needs_input_grad[:6]]
        args = (x, wr, w1, b1, w2, b2)
        if torch.is_grad_enabled():  # a double backward: a differentiable recomputation
            grads = differentiable_grads(
                lambda: torch_impl.lff_autograd(*args, ctx.activation, ctx.out_dtype),
                args,
                needs,
                grad,
            )
        elif direct_call_ok(grad, *args):
            grads = lff_backward(grad, *args, ctx.activation, ctx.backend, needs)
        else:
            grads = LFF_BACKWARD_OP(grad, *args, ctx.activation, ctx.backend, needs)
        return (*(g if n else None for g, n in zip(grads, needs)), None, None, None)

    @staticmethod
    def onnx(x, wr, w1, b1, w2, b2, activation, out_dtype):
        """What an ONNX export traces: plain ATen ops (ops/_custom_ops.py)."""
        return torch_impl.lff_autograd(x, wr, w1, b1, w2, b2, activation, out_dtype)


def _forward_fake(x, wr, w1, b1, w2, b2, activation, out_dtype, backend):
    width = 2 * wr.shape[0] if w1 is None else w2.shape[1]
    return x.new_empty((*x.shape[:-2], x.shape[-2] * width), dtype=out_dtype)


LFF_OP = custom_op(
    "lff", lff, _forward_fake, backward=LffFunction.backward, setup_context=_setup_context
)
