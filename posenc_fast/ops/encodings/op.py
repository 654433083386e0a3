"""The fixed encodings' ops (kind = "sinusoidal" | "dft"): autograd.Functions that are also
the bodies of the custom ops

posenc_fast::encoding(positions, dim, kind, base, block?, out_dtype, backend) -> [*P, dim]
posenc_fast::encoding_add(x, positions, kind, base, block?, backend) -> x + pe
    positions broadcast against x.shape[:-1]; read x once, write once
posenc_fast::encoding_nd_add(x, coords, kind, base, backend) -> x + pe_nd
    x [..., M * n], coords [..., M] broadcast against x.shape[:-1] + [M]: columns
    [m n, (m + 1) n) get the encoding of coords[..., m] (Sine-2D for M = 2); one pass
posenc_fast::encoding_backward(grad, positions, dim, kind, base, backend) -> d positions
    grad already summed over the broadcast dimensions: [*positions.shape, dim]

``backend`` names the implementation in the registry."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .._custom_ops import autocast_disabled, custom_op, direct_call_ok
from . import torch_impl
from .registry import ENCODING, ENCODING_ADD, ENCODING_ND


def encoding_backward(
    grad: Tensor, positions: Tensor, dim: int, kind: str, base: float, backend: str
) -> Tensor:
    """d(sum grad * encoding(positions)) / d positions, an op of its own."""
    with autocast_disabled(positions.device.type):
        return ENCODING[backend].backward(grad, positions, dim, kind, base)


def _backward_fake(grad, positions, dim, kind, base, backend):
    return torch.empty_like(positions)


ENCODING_BACKWARD_OP = custom_op("encoding_backward", encoding_backward, _backward_fake)


def _positions_grad(ctx, grad_pe: Tensor, positions: Tensor) -> Tensor:
    if torch.is_grad_enabled():  # a double backward: differentiate the recomputation
        return torch_impl.encoding_backward(grad_pe, positions, ctx.dim, ctx.kind, ctx.base)
    args = (grad_pe, positions, ctx.dim, ctx.kind, ctx.base, ctx.backend)
    if direct_call_ok(grad_pe, positions):
        return encoding_backward(*args)
    return ENCODING_BACKWARD_OP(*args)


def encoding(
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


def _setup_encoding(ctx, inputs, output):
    positions, dim, kind, base, _block, _out_dtype, backend = inputs
    ctx.save_for_backward(positions)
    ctx.dim, ctx.kind, ctx.base, ctx.backend = dim, kind, base, backend


class EncodingFunction(torch.autograd.Function):
    """positions [...] -> the encoding [..., dim]."""

    @staticmethod
    def forward(ctx, positions, dim, kind, base, block, out_dtype, backend):
        _setup_encoding(ctx, (positions, dim, kind, base, block, out_dtype, backend), None)
        with autocast_disabled(positions.device.type):
            return ENCODING[backend].forward(positions, dim, kind, base, block, out_dtype)

    @staticmethod
    def backward(ctx, grad):
        (positions,) = ctx.saved_tensors
        gpos = _positions_grad(ctx, grad, positions) if ctx.needs_input_grad[0] else None
        return gpos, None, None, None, None, None, None

    @staticmethod
    def onnx(positions, dim, kind, base, block, out_dtype):
        return torch_impl.encoding_graph(positions, dim, kind, base, block, out_dtype)


def _encoding_fake(positions, dim, kind, base, block, out_dtype, backend):
    return positions.new_empty((*positions.shape, dim), dtype=out_dtype)


ENCODING_OP = custom_op(
    "encoding",
    encoding,
    _encoding_fake,
    backward=EncodingFunction.backward,
    setup_context=_setup_encoding,
)


def encoding_add(
    x: Tensor, positions: Tensor, kind: str, base: float, block: Optional[float], backend: str
) -> Tensor:
    with autocast_disabled(x.device.type):
        return ENCODING_ADD[backend].forward(x, positions, kind, base, block)


def _setup_add(ctx, inputs, output):
    x, positions, kind, base, _block, backend = inputs
    ctx.save_for_backward(positions)
    ctx.dim, ctx.kind, ctx.base, ctx.backend = x.shape[-1], kind, base, backend


class EncodingAddFunction(torch.autograd.Function):
    """x + encoding(positions), in one pass."""

    @staticmethod
    def forward(ctx, x, positions, kind, base, block, backend):
        _setup_add(ctx, (x, positions, kind, base, block, backend), None)
        with autocast_disabled(x.device.type):
            return ENCODING_ADD[backend].forward(x, positions, kind, base, block)

    @staticmethod
    def backward(ctx, grad):
        (positions,) = ctx.saved_tensors
        gx = grad if ctx.needs_input_grad[0] else None
        gpos = None
        if ctx.needs_input_grad[1]:
            reduced = grad.sum_to_size(*positions.shape, ctx.dim)
            gpos = _positions_grad(ctx, reduced, positions)
        return gx, gpos, None, None, None, None

    @staticmethod
    def onnx(x, positions, kind, base, block):
        return torch_impl.encoding_add_graph(x, positions, kind, base, block)


def _same_as_x(x, *args):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


ENCODING_ADD_OP = custom_op(
    "encoding_add",
    encoding_add,
    _same_as_x,
    backward=EncodingAddFunction.backward,
    setup_context=_setup_add,
)


def encoding_nd_add(x: Tensor, coords: Tensor, kind: str, base: float, backend: str) -> Tensor:
    with autocast_disabled(x.device.type):
        return ENCODING_ND[backend].forward(x, coords, kind, base)


def _setup_nd_add(ctx, inputs, output):
    x, coords, kind, base, backend = inputs
    ctx.save_for_backward(coords)
    ctx.dim, ctx.kind, ctx.base = x.shape[-1] // coords.shape[-1], kind, base
    ctx.backend = backend


class EncodingNdAddFunction(torch.autograd.Function):
    """x + the encodings of each coordinate on its block of columns, in one pass."""

    @staticmethod
    def forward(ctx, x, coords, kind, base, backend):
        _setup_nd_add(ctx, (x, coords, kind, base, backend), None)
        with autocast_disabled(x.device.type):
            return ENCODING_ND[backend].forward(x, coords, kind, base)

    @staticmethod
    def backward(ctx, grad):
        (coords,) = ctx.saved_tensors
        gx = grad if ctx.needs_input_grad[0] else None
        gcoords = None
        if ctx.needs_input_grad[1]:
            # Axis m's columns carry the 1-D encoding of coords[..., m]: its gradient is the
            # 1-D one of grad viewed as [..., M, dim per axis].
            per_axis = grad.unflatten(-1, (coords.shape[-1], ctx.dim))
            gcoords = _positions_grad(ctx, per_axis.sum_to_size(*coords.shape, ctx.dim), coords)
        return gx, gcoords, None, None, None

    @staticmethod
    def onnx(x, coords, kind, base):
        return torch_impl.encoding_nd_add_graph(x, coords, kind, base)


ENCODING_ND_ADD_OP = custom_op(
    "encoding_nd_add",
    encoding_nd_add,
    _same_as_x,
    backward=EncodingNdAddFunction.backward,
    setup_context=_setup_nd_add,
)
