"""torch.library custom ops for learnable Fourier rotary embeddings (LightGlue's layout).

    posenc_fast::lff_rotary(x, wr, out_dtype, backend) -> [2, *x.shape[:-1], F]
    posenc_fast::lff_rotary_backward(grad, x, wr, backend, need_x, need_wr) -> (dx, dwr)
    posenc_fast::apply_lff_rotary(q, k, x, wr, layout, backend) -> (q', k')
    posenc_fast::apply_lff_rotary_backward(gq, gk, q, k, x, wr, layout, backend,
        need_q, need_k, need_x, need_wr) -> (dq, dk, dx, dwr)

``backend`` names the implementation, looked up in the registry (registry.py) by the body.
Gradients that are not needed come back as empty tensors. The backward ops save only
the inputs (the implementation recomputes the cos / sin). With grad mode on inside
backward (a double backward) the gradient is built by differentiating the torch
implementation's recomputation instead. Flags are separate bools and results tuples (not
lists): the schemas torch 2.5's custom_op accepts.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._common import CustomOp, autocast_disabled, differentiable_grads
from . import torch_impl
from .registry import APPLY, TABLE


def _or_empty(t, like: Tensor) -> Tensor:
    return t if t is not None else like.new_empty(0)


# ------------------------------------------------------------------------ the table


def _table(x: Tensor, wr: Tensor, out_dtype: torch.dtype, backend: str) -> Tensor:
    with autocast_disabled(x.device.type):
        return TABLE[backend].forward(x, wr, out_dtype)


def _table_fake(x, wr, out_dtype, backend):
    return x.new_empty((2, *x.shape[:-1], 2 * wr.shape[0]), dtype=out_dtype)


def _table_backward_body(
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


LFF_ROTARY_BACKWARD = CustomOp(
    "posenc_fast::lff_rotary_backward", _table_backward_body, _table_backward_fake
)


def _setup_table(ctx, inputs, output):
    x, wr, out_dtype, backend = inputs
    ctx.save_for_backward(x, wr)
    ctx.out_dtype, ctx.backend = out_dtype, backend


def _backward_table(ctx, grad):
    x, wr = ctx.saved_tensors
    needs = [bool(n) for n in ctx.needs_input_grad[:2]]
    if torch.is_grad_enabled():
        dx, dwr = differentiable_grads(
            lambda: torch_impl.table_autograd(x, wr, ctx.out_dtype), (x, wr), needs, grad
        )
    else:
        dx, dwr = LFF_ROTARY_BACKWARD(grad, x, wr, ctx.backend, *needs)
    return (dx if needs[0] else None), (dwr if needs[1] else None), None, None


LFF_ROTARY = CustomOp(
    "posenc_fast::lff_rotary",
    _table,
    _table_fake,
    backward=_backward_table,
    setup_context=_setup_table,
    op_function="forward",
    onnx=lambda x, wr, out_dtype, backend: torch_impl.table_autograd(x, wr, out_dtype),
)


# ------------------------------------------------------------------------ q and k


def _apply(
    q: Tensor, k: Tensor, x: Tensor, wr: Tensor, layout: str, backend: str
) -> tuple[Tensor, Tensor]:
    with autocast_disabled(q.device.type):
        return APPLY[backend].forward(q, k, x, wr, layout)


def _apply_fake(q, k, x, wr, layout, backend):
    # Outputs are contiguous in the caller's layout, in q's dtype.
    return q.new_empty(q.shape), k.new_empty(k.shape, dtype=q.dtype)


def _apply_backward_body(
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


APPLY_LFF_ROTARY_BACKWARD = CustomOp(
    "posenc_fast::apply_lff_rotary_backward", _apply_backward_body, _apply_backward_fake
)


def _setup_apply(ctx, inputs, output):
    q, k, x, wr, layout, backend = inputs
    ctx.save_for_backward(q, k, x, wr)
    ctx.layout, ctx.backend = layout, backend


def _backward_apply(ctx, gq, gk):
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
        grads = APPLY_LFF_ROTARY_BACKWARD(gq, gk, q, k, x, wr, ctx.layout, ctx.backend, *needs)
    return (*(g if n else None for g, n in zip(grads, needs)), None, None)


APPLY_LFF_ROTARY = CustomOp(
    "posenc_fast::apply_lff_rotary",
    _apply,
    _apply_fake,
    backward=_backward_apply,
    setup_context=_setup_apply,
    op_function="forward",
    onnx=lambda q, k, x, wr, layout, backend: torch_impl.apply_autograd(q, k, x, wr, layout),
)
