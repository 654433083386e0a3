"""The rotary ops: autograd.Functions that are also the bodies of the custom ops

    posenc_fast::rotary(q, k, x, freqs, pairs, layout, prefix, backend) -> (q', k')
    posenc_fast::rotary_backward(gq, gk, q, k, x, freqs, pairs, layout, prefix, backend,
        need_q, need_k, need_x, need_freqs) -> (dq, dk, dx, dfreqs)
    posenc_fast::rotary_table(x, freqs, pairs, out_dtype, backend) -> table
    posenc_fast::rotary_table_backward(grad, x, freqs, pairs, backend, need_x, need_freqs)
        -> (dx, dfreqs)

``backend`` names the implementation (registry.ROTARY / TABLE); unneeded
gradients come back empty. Only the inputs are saved (cos / sin recomputed); a double
backward differentiates torch_impl's graph form. Separate bool flags and tuple results:
what torch 2.5's custom_op accepts.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._custom_ops import autocast_disabled, custom_op, differentiable_grads, direct_call_ok
from . import torch_impl
from .registry import ROTARY, TABLE


def _or_empty(t, like: Tensor) -> Tensor:
    return t if t is not None else like.new_empty(0)


# ------------------------------------------------------------------------ the table


def table_backward(
    grad: Tensor, x: Tensor, freqs: Tensor, pairs: str, backend: str, need_x: bool,
    need_freqs: bool,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    with autocast_disabled(x.device.type):
        dx, dfreqs = TABLE[backend].backward(grad, x, freqs, pairs, need_x, need_freqs)
    return _or_empty(dx, grad), _or_empty(dfreqs, grad)


def _table_backward_fake(grad, x, freqs, pairs, backend, need_x, need_freqs):
    return (
        x.new_empty(x.shape) if need_x else grad.new_empty(0),
        freqs.new_empty(freqs.shape) if need_freqs else grad.new_empty(0),
    )


TABLE_BACKWARD_OP = custom_op("rotary_table_backward", table_backward, _table_backward_fake)


def table(x: Tensor, freqs: Tensor, pairs: str, out_dtype: torch.dtype, backend: str) -> Tensor:
    with autocast_disabled(x.device.type):
        return TABLE[backend].forward(x, freqs, pairs, out_dtype)


def _setup_table(ctx, inputs, output):
    x, freqs, pairs, out_dtype, backend = inputs
    ctx.save_for_backward(x, freqs)
    ctx.pairs, ctx.out_dtype, ctx.backend = pairs, out_dtype, backend


class TableFunction(torch.autograd.Function):
    """x [..., M] -> the cos / sin table [2, ..., F] (per head [2, ..., H, N, F])."""

    @staticmethod
    def forward(ctx, x, freqs, pairs, out_dtype, backend):
        _setup_table(ctx, (x, freqs, pairs, out_dtype, backend), None)
        with autocast_disabled(x.device.type):
            return TABLE[backend].forward(x, freqs, pairs, out_dtype)

    @staticmethod
    def backward(ctx, grad):
        x, freqs = ctx.saved_tensors
        needs = [bool(n) for n in ctx.needs_input_grad[:2]]
        if torch.is_grad_enabled():
            dx, dfreqs = differentiable_grads(
                lambda: torch_impl.table_autograd(x, freqs, ctx.pairs, ctx.out_dtype),
                (x, freqs),
                needs,
                grad,
            )
        elif direct_call_ok(grad, x, freqs):
            dx, dfreqs = table_backward(grad, x, freqs, ctx.pairs, ctx.backend, *needs)
        else:
            dx, dfreqs = TABLE_BACKWARD_OP(grad, x, freqs, ctx.pairs, ctx.backend, *needs)
        return (dx if needs[0] else None), (dfreqs if needs[1] else None), None, None, None

    @staticmethod
    def onnx(x, freqs, pairs, out_dtype):
        return torch_impl.table_autograd(x, freqs, pairs, out_dtype)


def _table_fake(x, freqs, pairs, out_dtype, backend):
    F = 2 * freqs.shape[-2]
    if freqs.dim() == 2:
        return x.new_empty((2, *x.shape[:-1], F), dtype=out_dtype)
    return x.new_empty((2, *x.shape[:-2], freqs.shape[0], x.shape[-2], F), dtype=out_dtype)


TABLE_OP = custom_op(
    "rotary_table",
    table,
    _table_fake,
    backward=TableFunction.backward,
    setup_context=_setup_table,
)


# ------------------------------------------------------------------------ q and k


def rotary_backward(
    gq: Tensor, gk: Tensor, q: Tensor, k: Tensor, x: Tensor, freqs: Tensor, pairs: str,
    layout: str, prefix: int, backend: str, need_q: bool, need_k: bool, need_x: bool,
    need_freqs: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    needs = (need_q, need_k, need_x, need_freqs)
    with autocast_disabled(q.device.type):
        grads = ROTARY[backend].backward(gq, gk, q, k, x, freqs, pairs, layout, prefix, needs)
    dq, dk, dx, dfreqs = (_or_empty(g, gq) for g in grads)
    return dq, dk, dx, dfreqs


def _rotary_backward_fake(
    gq, gk, q, k, x, freqs, pairs, layout, prefix, backend, need_q, need_k, need_x, need_freqs
):
    wanted = ((q, q.dtype, need_q), (k, q.dtype, need_k), (x, x.dtype, need_x))
    grads = [t.new_empty(t.shape, dtype=dt) if n else gq.new_empty(0) for t, dt, n in wanted]
    return (*grads, freqs.new_empty(freqs.shape) if need_freqs else gq.new_empty(0))


ROTARY_BACKWARD_OP = custom_op("rotary_backward", rotary_backward, _rotary_backward_fake)


def rotary(
    q: Tensor, k: Tensor, x: Tensor, freqs: Tensor, pairs: str, layout: str, prefix: int,
    backend: str,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    with autocast_disabled(q.device.type):
        return ROTARY[backend].forward(q, k, x, freqs, pairs, layout, prefix)


def _setup_rotary(ctx, inputs, output):
    q, k, x, freqs, pairs, layout, prefix, backend = inputs
    ctx.save_for_backward(q, k, x, freqs)
    ctx.pairs, ctx.layout, ctx.prefix, ctx.backend = pairs, layout, prefix, backend


class RotaryFunction(torch.autograd.Function):
    """(q, k) -> (q', k') rotated by the angles x . W_i."""

    @staticmethod
    def forward(ctx, q, k, x, freqs, pairs, layout, prefix, backend):
        _setup_rotary(ctx, (q, k, x, freqs, pairs, layout, prefix, backend), None)
        with autocast_disabled(q.device.type):
            return ROTARY[backend].forward(q, k, x, freqs, pairs, layout, prefix)

    @staticmethod
    def backward(ctx, gq, gk):
        q, k, x, freqs = ctx.saved_tensors
        needs = [bool(n) for n in ctx.needs_input_grad[:4]]
        options = (ctx.pairs, ctx.layout, ctx.prefix)
        if torch.is_grad_enabled():
            # Both outputs as one flat tensor, so that one autograd.grad call serves them.
            def both():
                oq, ok = torch_impl.rotary_autograd(q, k, x, freqs, *options)
                return torch.cat([oq.flatten(), ok.flatten()])

            grad = torch.cat([gq.flatten(), gk.flatten()])
            grads = differentiable_grads(both, (q, k, x, freqs), needs, grad)
        else:
            args = (gq, gk, q, k, x, freqs, *options, ctx.backend, *needs)
            if direct_call_ok(gq, gk, q, k, x, freqs):
                grads = rotary_backward(*args)
            else:
                grads = ROTARY_BACKWARD_OP(*args)
        return (*(g if n else None for g, n in zip(grads, needs)), None, None, None, None)

    @staticmethod
    def onnx(q, k, x, freqs, pairs, layout, prefix):
        return torch_impl.rotary_autograd(q, k, x, freqs, pairs, layout, prefix)


def _rotary_fake(q, k, x, freqs, pairs, layout, prefix, backend):
    # Outputs are contiguous in the caller's layout, in q's dtype.
    return q.new_empty(q.shape), k.new_empty(k.shape, dtype=q.dtype)


ROTARY_OP = custom_op(
    "rotary",
    rotary,
    _rotary_fake,
    backward=RotaryFunction.backward,
    setup_context=_setup_rotary,
)
