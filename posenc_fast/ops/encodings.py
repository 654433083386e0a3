"""torch.library custom ops for the fixed encodings (kind = "sinusoidal" | "dft").

posenc_fast::encoding(positions, dim, kind, base, block?, out_dtype, backend) -> [*P, dim]
posenc_fast::encoding_add(x, positions, kind, base, block?, backend) -> x + pe
    positions broadcast against x.shape[:-1]; read x once, write once
posenc_fast::encoding_nd_add(x, coords, kind, base, backend) -> x + pe_nd
    x [..., M * n], coords [..., M] broadcast against x.shape[:-1] + [M]: columns
    [m n, (m + 1) n) get the encoding of coords[..., m] (Sine-2D for M = 2); one pass
posenc_fast::encoding_backward(grad, positions, dim, kind, base, backend) -> d positions
    grad already summed over the broadcast dimensions: [*positions.shape, dim]
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import backends
from ._autocast import autocast_disabled


@torch.library.custom_op("posenc_fast::encoding", mutates_args=())
def encoding_op(
    positions: Tensor,
    dim: int,
    kind: str,
    base: float,
    block: Optional[float],
    out_dtype: torch.dtype,
    backend: str,
) -> Tensor:
    with autocast_disabled(positions.device.type):
        return backends.get(backend).encoding_forward(positions, dim, kind, base, block, out_dtype)


@encoding_op.register_fake
def _(positions, dim, kind, base, block, out_dtype, backend):
    return positions.new_empty((*positions.shape, dim), dtype=out_dtype)


@torch.library.custom_op("posenc_fast::encoding_add", mutates_args=())
def encoding_add_op(
    x: Tensor,
    positions: Tensor,
    kind: str,
    base: float,
    block: Optional[float],
    backend: str,
) -> Tensor:
    with autocast_disabled(x.device.type):
        return backends.get(backend).encoding_add(x, positions, kind, base, block)


@encoding_add_op.register_fake
def _(x, positions, kind, base, block, backend):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("posenc_fast::encoding_nd_add", mutates_args=())
def encoding_nd_add_op(x: Tensor, coords: Tensor, kind: str, base: float, backend: str) -> Tensor:
    with autocast_disabled(x.device.type):
        return backends.get(backend).encoding_nd_add(x, coords, kind, base)


@encoding_nd_add_op.register_fake
def _(x, coords, kind, base, backend):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("posenc_fast::encoding_backward", mutates_args=())
def encoding_backward_op(
    grad: Tensor, positions: Tensor, dim: int, kind: str, base: float, backend: str
) -> Tensor:
    with autocast_disabled(positions.device.type):
        return backends.get(backend).encoding_backward(grad, positions, dim, kind, base)


@encoding_backward_op.register_fake
def _(grad, positions, dim, kind, base, backend):
    return torch.empty_like(positions)


def _positions_grad(ctx, grad_pe: Tensor, positions: Tensor) -> Tensor:
    if torch.is_grad_enabled():
        # Double backward: differentiate the torch recomputation instead.
        from ..torch_impl.encodings import encoding_backward

        return encoding_backward(grad_pe, positions, ctx.dim, ctx.kind, ctx.base)
    return torch.ops.posenc_fast.encoding_backward(
        grad_pe, positions, ctx.dim, ctx.kind, ctx.base, ctx.backend
    )


def _setup_encoding(ctx, inputs, output):
    positions, dim, kind, base, _block, _out_dtype, backend = inputs
    ctx.save_for_backward(positions)
    ctx.dim, ctx.kind, ctx.base, ctx.backend = dim, kind, base, backend


def _backward_encoding(ctx, grad):
    (positions,) = ctx.saved_tensors
    gpos = _positions_grad(ctx, grad, positions) if ctx.needs_input_grad[0] else None
    return gpos, None, None, None, None, None, None


def _setup_add(ctx, inputs, output):
    x, positions, kind, base, _block, backend = inputs
    ctx.save_for_backward(positions)
    ctx.dim, ctx.kind, ctx.base, ctx.backend = x.shape[-1], kind, base, backend


def _backward_add(ctx, grad):
    (positions,) = ctx.saved_tensors
    gx = grad if ctx.needs_input_grad[0] else None
    gpos = None
    if ctx.needs_input_grad[1]:
        reduced = grad.sum_to_size(*positions.shape, ctx.dim)
        gpos = _positions_grad(ctx, reduced, positions)
    return gx, gpos, None, None, None, None


def _setup_nd_add(ctx, inputs, output):
    x, coords, kind, base, backend = inputs
    ctx.save_for_backward(coords)
    ctx.dim, ctx.kind, ctx.base, ctx.backend = x.shape[-1] // coords.shape[-1], kind, base, backend


def _backward_nd_add(ctx, grad):
    (coords,) = ctx.saved_tensors
    gx = grad if ctx.needs_input_grad[0] else None
    gcoords = None
    if ctx.needs_input_grad[1]:
        # Axis m's columns carry the 1-D encoding of coords[..., m]: its gradient is the
        # 1-D one of grad viewed as [..., M, dim per axis].
        per_axis = grad.unflatten(-1, (coords.shape[-1], ctx.dim))
        gcoords = _positions_grad(ctx, per_axis.sum_to_size(*coords.shape, ctx.dim), coords)
    return gx, gcoords, None, None, None


encoding_op.register_autograd(_backward_encoding, setup_context=_setup_encoding)
encoding_add_op.register_autograd(_backward_add, setup_context=_setup_add)
encoding_nd_add_op.register_autograd(_backward_nd_add, setup_context=_setup_nd_add)
