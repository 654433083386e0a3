"""torch.library custom ops for the fixed encodings (kind = "sinusoidal" | "dft").

posenc_fast::encoding(positions, dim, kind, base, block?, out_dtype, backend) -> [*P, dim]
posenc_fast::encoding_add(x, positions, kind, base, block?, backend) -> x + pe
    positions broadcast against x.shape[:-1]; read x once, write once
posenc_fast::encoding_nd_add(x, coords, kind, base, backend) -> x + pe_nd
    x [..., M * n], coords [..., M] broadcast against x.shape[:-1] + [M]: columns
    [m n, (m + 1) n) get the encoding of coords[..., m] (Sine-2D for M = 2); one pass
posenc_fast::encoding_backward(grad, positions, dim, kind, base, backend) -> d positions
    grad already summed over the broadcast dimensions: [*positions.shape, dim]

``backend`` names the implementation, looked up in the registry (registry.py) by the body.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .._common import CustomOp, autocast_disabled
from . import torch_impl
from .registry import ENCODING, ENCODING_ND


def _encoding(
    positions: Tensor,
    dim: int,
    kind: str,
    base: float,
    block: Optional[float],
    out_dtype: torch.dtype,
    backend: str,
) -> Tensor:
    with autocast_disabled(positions.device.type):
        return ENCODING[backend].forward(positions, dim, kind, base, block, out_dtype)


def _encoding_fake(positions, dim, kind, base, block, out_dtype, backend):
    return positions.new_empty((*positions.shape, dim), dtype=out_dtype)


def _add(
    x: Tensor,
    positions: Tensor,
    kind: str,
    base: float,
    block: Optional[float],
    backend: str,
) -> Tensor:
    with autocast_disabled(x.device.type):
        return ENCODING[backend].add(x, positions, kind, base, block)


def _add_fake(x, positions, kind, base, block, backend):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _nd_add(x: Tensor, coords: Tensor, kind: str, base: float, backend: str) -> Tensor:
    with autocast_disabled(x.device.type):
        return ENCODING_ND[backend].nd_add(x, coords, kind, base)


def _nd_add_fake(x, coords, kind, base, backend):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _backward_body(
    grad: Tensor, positions: Tensor, dim: int, kind: str, base: float, backend: str
) -> Tensor:
    with autocast_disabled(positions.device.type):
        return ENCODING[backend].backward(grad, positions, dim, kind, base)


def _backward_fake(grad, positions, dim, kind, base, backend):
    return torch.empty_like(positions)


ENCODING_BACKWARD = CustomOp("posenc_fast::encoding_backward", _backward_body, _backward_fake)


def _positions_grad(ctx, grad_pe: Tensor, positions: Tensor) -> Tensor:
    if torch.is_grad_enabled():
        # Double backward: differentiate the torch recomputation instead.
        return torch_impl.encoding_backward(grad_pe, positions, ctx.dim, ctx.kind, ctx.base)
    return ENCODING_BACKWARD(grad_pe, positions, ctx.dim, ctx.kind, ctx.base, ctx.backend)


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


ENCODING_OP = CustomOp(
    "posenc_fast::encoding",
    _encoding,
    _encoding_fake,
    backward=_backward_encoding,
    setup_context=_setup_encoding,
    op_function="forward",
    onnx=lambda positions, dim, kind, base, block, out_dtype, backend: torch_impl.encoding_graph(
        positions, dim, kind, base, block, out_dtype
    ),
)
ENCODING_ADD = CustomOp(
    "posenc_fast::encoding_add",
    _add,
    _add_fake,
    backward=_backward_add,
    setup_context=_setup_add,
    op_function="add",
    onnx=lambda x, positions, kind, base, block, backend: torch_impl.encoding_add_graph(
        x, positions, kind, base, block
    ),
)
ENCODING_ND_ADD = CustomOp(
    "posenc_fast::encoding_nd_add",
    _nd_add,
    _nd_add_fake,
    backward=_backward_nd_add,
    setup_context=_setup_nd_add,
    op_function="nd_add",
    onnx=lambda x, coords, kind, base, backend: torch_impl.encoding_nd_add_graph(
        x, coords, kind, base
    ),
)
