"""The learnable Fourier rotary ops (LightGlue's layout): autograd.Functions that are also
the bodies of the custom ops

    posenc_fast::lff_rotary(x, wr, out_dtype, backend) -> [2, *x.shape[:-1], F]
    posenc_fast::lff_rotary_backward(grad, x, wr, backend, need_x, need_wr) -> (dx, dwr)
    posenc_fast::apply_lff_rotary(q, k, x, wr, layout, backend) -> (q', k')
    posenc_fast::apply_lff_rotary_backward(gq, gk, q, k, x, wr, layout, backend,
        need_q, need_k, need_x, need_wr) -> (dq, dk, dx, dwr)

``backend`` names the implementation in the registry. Gradients that are not needed come
back as empty tensors. The backward ops save only the inputs (the cos / sin are
recomputed); a double backward differentiates the torch implementation's recomputation.
Flags are separate bools and results tuples: the schemas torch 2.5's custom_op accepts.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._custom_ops import autocast_disabled, custom_op, differentiable_grads, direct_call_ok
from . import torch_impl
from .registry import APPLY, TABLE


def _or_empty(t, like: Tensor) -> Tensor:
    return t if t is not None else like.new_empty(0)


# ------------------------------------------------------------------------ the table


def table_backward(
    grad: Tensor, x: Tensor, wr: Tensor, backend: str, need_x: bool, need_wr: bool
) -> tuple[Tensor, Tensor]:
    with autocast_disabled(x.device.type):
        dx, dwr = TABLE[backend].backward(grad, x, wr, need_x, need_wr)
    return _or_empty(dx, grad), _or_empty(dwr, grad)


def _table_backward_fake(grad, x, wr, backend, need_x, need_wr):
    return (
        torch.empty_like(x) if need_x else grad.new_empty(0),
        torch.empty_like(wr) if need_wr else grad.new_empty(0),
    )


TABLE_BACKWARD_OP = custom_op("lff_rotary_backward", table_backward, _table_backward_fake)


def table(x: Tensor, wr: Tensor, out_dtype: torch.dtype, backend: str) -> Tensor:
    with autocast_disabled(x.device.type):
        return TABLE[backend].forward(x, wr, out_dtype)


def _setup_table(ctx, inputs, output):
    x, wr, out_dtype, backend = inputs
    ctx.save_for_backward(x, wr)
    ctx.out_dtype, ctx.backend = out_dtype, backend


class TableFunction(torch.autograd.Function):
    """x [..., M] -> the cos / sin table [2, ..., F]."""

    @staticmethod
    def forward(ctx, x, wr, out_dtype, backend):
        _setup_table(ctx, (x, wr, out_dtype, backend), None)
        with autocast_disabled(x.device.type):
            return TABLE[backend].forward(x, wr, out_dtype)

    @staticmethod
    def backward(ctx, grad):
        x, wr = ctx.saved_tensors
        needs = [bool(n) for n in ctx.needs_input_grad[:2]]
        if torch.is_grad_enabled():
            dx, dwr = differentiable_grads(
                lambda: torch_impl.table_autograd(x, wr, ctx.out_dtype), (x, wr), needs, grad
            )
        elif direct_call_ok(grad, x, wr):
            dx, dwr = table_backward(grad, x, wr, ctx.backend, *needs)
        else:
            dx, dwr = TABLE_BACKWARD_OP(grad, x, wr, ctx.backend, *needs)
        return (dx if needs[0] else None), (dwr if needs[1] else None), None, None

    @staticmethod
    def onnx(x, wr, out_dtype):
        return torch_impl.table_autograd(x, wr, out_dtype)


def _table_fake(x, wr, out_dtype, backend):
    return x.new_empty((2, *x.shape[:-1], 2 * wr.shape[0]), dtype=out_dtype)


TABLE_OP = custom_op(
    "lff_rotary", table, _table_fake, backward=TableFunction.backward, setup_context=_setup_table
)


# ------------------------------------------------------------------------ q and k


def apply_backward(
    gq: Tensor,
    gk: Tensor,
    q: Tensor,
    k: Tensor,
    x: Tensor,
    wr: Tensor,
    layout: str,
    backend: str,
    need_q: bool,
    need_k: bool,
    need_x: bool,
    need_wr: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    needs = (need_q, need_k, need_x, need_wr)
    with autocast_disabled(q.device.type):
        grads = APPLY[backend].backward(gq, gk, q, k, x, wr, layout, needs)
    dq, dk, dx, dwr = (_or_empty(g, gq) for g in grads)
    return dq, dk, dx, dwr


def _apply_backward_fake(gq, gk, q, k, x, wr, layout, backend, need_q, need_k, need_x, need_wr):
    refs = (q, k, x, wr)
    return tuple(
        t.new_empty(t.shape) if need else gq.new_empty(0)
        for t, need in zip(refs, (need_q, need_k, need_x, need_wr))
    )


APPLY_BACKWARD_OP = custom_op("apply_lff_rotary_backward", apply_backward, _apply_backward_fake)


def apply(
    q: Tensor, k: Tensor, x: Tensor, wr: Tensor, layout: str, backend: str
) -> tuple[Tensor, Tensor]:
    with autocast_disabled(q.device.type):
        return APPLY[backend].forward(q, k, x, wr, layout)


def _setup_apply(ctx, inputs, output):
    q, k, x, wr, layout, backend = inputs
    ctx.save_for_backward(q, k, x, wr)
    ctx.layout, ctx.backend = layout, backend


class ApplyFunction(torch.autograd.Function):
    """(q, k) -> (q', k') rotated by the angles x . wr_i."""

    @staticmethod
    def forward(ctx, q, k, x, wr, layout, backend):
        _setup_apply(ctx, (q, k, x, wr, layout, backend), None)
        with autocast_disabled(q.device.type):
            return APPLY[backend].forward(q, k, x, wr, layout)

    @staticmethod
    def backward(ctx, gq, gk):
        q, k, x, wr = ctx.saved_tensors
        needs = [bool(n) for n in ctx.needs_input_grad[:4]]
        if torch.is_grad_enabled():
            # Both outputs as one flat tensor, so that one autograd.grad call serves them.
            def both():
                oq, ok = torch_impl.apply_autograd(q, k, x, wr, ctx.layout)
                return torch.cat([oq.flatten(), ok.flatten()])

            grad = torch.cat([gq.flatten(), gk.flatten()])
            grads = differentiable_grads(both, (q, k, x, wr), needs, grad)
        else:
            args = (gq, gk, q, k, x, wr, ctx.layout, ctx.backend, *needs)
            if direct_call_ok(gq, gk, q, k, x, wr):
                grads = apply_backward(*args)
            else:
                grads = APPLY_BACKWARD_OP(*args)
        return (*(g if n else None for g, n in zip(grads, needs)), None, None)

    @staticmethod
    def onnx(q, k, x, wr, layout):
        return torch_impl.apply_autograd(q, k, x, wr, layout)


def _apply_fake(q, k, x, wr, layout, backend):
    # Outputs are contiguous in the caller's layout, in q's dtype.
    return q.new_empty(q.shape), k.new_empty(k.shape, dtype=q.dtype)


APPLY_OP = custom_op(
    "apply_lff_rotary",
    apply,
    _apply_fake,
    backward=ApplyFunction.backward,
    setup_context=_setup_apply,
)
