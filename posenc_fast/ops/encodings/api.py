"""Fixed encodings: sinusoidal (Vaswani et al.; FLOATER Eq. 7) and DFT (Idé et al.).

Path of a call: public function (checks) -> the registry's implementation (registry.py)
-> the custom op ``posenc_fast::encoding`` / ``encoding_add`` / ``encoding_nd_add`` (op.py)
-> its kernel. The modules add the encoding to their input in one pass (x read once, the
sum written once)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from ... import _checks, _dispatch
from ..._dispatch import Implementation, Problem
from .._custom_ops import run
from . import reference, torch_impl
from .op import (
    ENCODING_ADD_OP,
    ENCODING_ND_ADD_OP,
    ENCODING_OP,
    EncodingAddFunction,
    EncodingFunction,
    EncodingNdAddFunction,
)
from .registry import ENCODING, ENCODING_ADD, ENCODING_ND

__all__ = [
    "DFTPE",
    "KINDS",
    "SinusoidalNdPE",
    "SinusoidalPE",
    "dft",
    "dft_inverse",
    "sinusoidal",
    "sinusoidal_nd",
]

KINDS = ("sinusoidal", "dft")


def _encoding_dtype(positions: Tensor, dtype=None) -> torch.dtype:
    """``dtype`` if given, else the positions' floating dtype (the default dtype for
    integer positions)."""
    if dtype is not None:
        return _checks.float_dtype("dtype", dtype)
    return positions.dtype if positions.is_floating_point() else torch.get_default_dtype()


def _choose(
    registry: dict,
    kind: str,
    device: torch.device,
    dtype,
    dim: int,
    positions: Tensor,
    backend: str,
    axes: int = 0,
) -> Implementation:
    """The implementation of ``registry``'s op for an encoding of ``positions``, or with
    ``axes``, for the fused add of the encodings of ``axes`` coordinates per row (dim per
    axis)."""
    problem = Problem(
        "encoding_nd" if axes else "encoding",
        device.type,
        dtype,
        {"dim": dim, "axes": axes} if axes else {"dim": dim},
        {"kind": kind},
        {"coords" if axes else "positions": positions.dtype},
    )
    return _dispatch.choose(registry, problem, backend)


def _check_dim(kind: str, dim) -> int:
    odd = isinstance(dim, int) and not isinstance(dim, bool) and dim > 0 and dim % 2
    if kind == "dft" and odd:
        raise ValueError(
            f"dim must be even for the DFT encoding (Eq. 21 pairs cosines and sines), got {dim}"
        )
    return _checks.even_positive_int("dim", dim)


def _encode(kind: str, positions, dim, base: float, block, backend: str, dtype=None) -> Tensor:
    _checks.real_positions("positions", positions)
    _check_dim(kind, dim)
    base = _checks.positive_float("base", base)
    if block is not None:
        block = _checks.finite_float("block", block)
    out_dtype = _encoding_dtype(positions, dtype)
    impl = _choose(ENCODING, kind, positions.device, out_dtype, dim, positions, backend)
    return run(EncodingFunction, ENCODING_OP, impl, positions, dim, kind, base, block, out_dtype)


def sinusoidal(
    positions: Tensor,
    dim: int,
    base: float = 10000.0,
    block: Optional[float] = None,
    backend: str = "auto",
    dtype: Optional[torch.dtype] = None,
) -> Tensor:
    """Sinusoidal encoding, interleaved: [...] -> [..., dim].

    out[..., 2i] = sin(p / base^(2i/dim)), out[..., 2i+1] = cos(p / base^(2i/dim)): the
    frequencies run from 1 radian per unit of position down to 1/base
    (docs/ops/encodings.md, "Choosing base"). ``block=n`` adds the same encoding of the
    block index n (FLOATER's per-block Eq. 7). positions: floating or integer, any shape.
    The result has ``dtype``, by default the positions' floating dtype (the default dtype
    for integer positions); phases are always reduced in float32 or better, whatever
    ``dtype``."""
    return _encode("sinusoidal", positions, dim, base, block, backend, dtype)


def _check_coords(coords) -> Tensor:
    _checks.real_positions("coords", coords)
    if coords.dim() < 1:
        raise ValueError("coords must have shape [..., M] (at least 1 dimension), got a scalar")
    return coords


def sinusoidal_nd(
    coords: Tensor,
    dim_per_axis: int,
    base: float = 10000.0,
    backend: str = "auto",
    dtype: Optional[torch.dtype] = None,
) -> Tensor:
    """Each of the M coordinates encoded by ``sinusoidal`` and concatenated in coordinate
    order (the papers' Sine-2D / Sine-4D baselines): [..., M] -> [..., M * dim_per_axis],
    in ``dtype`` (default as for :func:`sinusoidal`: pass the model's dtype for integer
    grid indices in a bfloat16 model). :class:`SinusoidalNdPE` fuses the add into x."""
    _check_coords(coords)
    _checks.even_positive_int("dim_per_axis", dim_per_axis)
    return _encode("sinusoidal", coords, dim_per_axis, base, None, backend, dtype).flatten(-2)


def dft(
    positions: Tensor, dim: int, backend: str = "auto", dtype: Optional[torch.dtype] = None
) -> Tensor:
    """DFT positional encoding (Idé et al., Eq. 21): [...] -> [..., dim], layout
    (a0, a1..aK, b1..bK, b0) with K = dim/2 - 1, w_k = 2 pi k / dim:
    a0 = 1/sqrt(dim), a_k = sqrt(2/dim) cos(w_k s), b_k = sqrt(2/dim) sin(w_k s),
    b0 = cos(pi s)/sqrt(dim). dim must be even. Real-valued positions are allowed. The
    result has ``dtype``, by default as for :func:`sinusoidal`."""
    return _encode("dft", positions, dim, 1.0, None, backend, dtype)


def dft_inverse(encoding: Tensor, backend: str = "auto") -> Tensor:
    """Inverse DFT over the lattice t = 0..dim-1 (Eq. 13): [..., dim] -> [..., dim].

    f(t) = sum_l e_l phi_l(t). For integer s in [0, dim), dft_inverse(dft(s, dim)) is the
    one-hot vector at s (Theorem 1). This is one matmul with a constant orthonormal basis,
    so every backend but "reference" runs it as a plain (autograd-differentiable) matmul."""
    _checks.float_tensor("encoding", encoding)
    if encoding.dim() < 1:
        raise ValueError("encoding must have shape [..., dim], got a scalar")
    dim = encoding.shape[-1]
    if dim <= 0 or dim % 2:
        # The size comes from encoding's last dimension: name encoding, not a "dim" argument.
        need = "positive" if dim <= 0 else "even for the DFT (Eq. 21 pairs cosines and sines)"
        raise ValueError(
            f"encoding must have shape [..., dim], got {list(encoding.shape)}: dim must be {need}"
        )
    impl = _choose(ENCODING, "dft", encoding.device, encoding.dtype, dim, encoding, backend)
    return (reference if impl.name == "reference" else torch_impl).lattice_inverse(encoding)


def _add_encoding(kind: str, x, positions, dim: int, base: float, backend: str) -> Tensor:
    """x + encoding(positions) for the modules; x must be [..., L, dim]."""
    _checks.tensor("x", x)
    if x.dim() < 2 or x.shape[-1] != dim:
        raise ValueError(f"x must have shape [..., L, dim={dim}], got {list(x.shape)}")
    _checks.float_tensor("x", x)
    if positions is None:
        positions = torch.arange(x.shape[-2], device=x.device)
    else:
        _checks.real_positions("positions", positions)
        _checks.same_device("x", x, positions=positions)
        try:
            ok = torch.broadcast_shapes(positions.shape, x.shape[:-1]) == x.shape[:-1]
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(
                f"positions must broadcast to x.shape[:-1] = {list(x.shape[:-1])}, "
                f"got {list(positions.shape)}"
            )
    impl = _choose(ENCODING_ADD, kind, x.device, x.dtype, dim, positions, backend)
    return run(EncodingAddFunction, ENCODING_ADD_OP, impl, x, positions, kind, base, None)


class SinusoidalPE(nn.Module):
    """x + sinusoidal(positions): ``forward(x [..., L, dim], positions=None)``.

    positions default to 0..L-1 and otherwise broadcast to x.shape[:-1] (e.g. [L] or
    [B, L]). The add is fused into the encoding pass; the result has x's dtype."""

    def __init__(self, dim: int, base: float = 10000.0, backend: str = "auto"):
        super().__init__()
        self.dim = _checks.even_positive_int("dim", dim)
        self.base = _checks.positive_float("base", base)
        self.backend = _dispatch.validate_name(backend)

    def forward(self, x: Tensor, positions: Optional[Tensor] = None) -> Tensor:
        return _add_encoding("sinusoidal", x, positions, self.dim, self.base, self.backend)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base}" + (
            f", backend={self.backend!r}" if self.backend != "auto" else ""
        )


def _add_encoding_nd(x, coords, dim: int, axes: int, base: float, backend: str) -> Tensor:
    """x + sinusoidal_nd(coords) for SinusoidalNdPE; x [..., dim], coords [..., axes]
    broadcast against x.shape[:-1]."""
    _checks.tensor("x", x)
    if x.dim() < 1 or x.shape[-1] != dim:
        raise ValueError(f"x must have shape [..., dim={dim}], got {list(x.shape)}")
    _checks.float_tensor("x", x)
    _check_coords(coords)
    _checks.same_device("x", x, coords=coords)
    try:
        ok = coords.shape[-1] == axes and (
            torch.broadcast_shapes(coords.shape[:-1], x.shape[:-1]) == x.shape[:-1]
        )
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(
            f"coords must have shape [..., axes={axes}] with [...] broadcasting to "
            f"x.shape[:-1] = {list(x.shape[:-1])}, got {list(coords.shape)}"
        )
    per_axis = dim // axes
    impl = _choose(ENCODING_ND, "sinusoidal", x.device, x.dtype, per_axis, coords, backend, axes)
    return run(EncodingNdAddFunction, ENCODING_ND_ADD_OP, impl, x, coords, "sinusoidal", base)


class SinusoidalNdPE(nn.Module):
    """x + sinusoidal_nd(coords, dim // axes): ``forward(x [..., dim], coords [..., axes])``.

    The Sine-2D (``axes=2``) / Sine-nD encoding of each token's coordinates, added to the
    tokens in one pass (x read once, the sum written once, in x's dtype; the gradient to
    coords is exact). coords broadcast against x.shape[:-1] + [axes], e.g. a grid's
    [L, 2] against x [B, L, dim]. dim must be a multiple of 2 * axes.

    Example::

        pe = posenc_fast.SinusoidalNdPE(dim=256, axes=2, base=100.0)
        rc = posenc_fast.grid_positions(h, w, normalize=False)  # [h*w, 2] (row, col)
        tokens = pe(tokens, rc)                                  # [B, h*w, 256]
    """

    def __init__(self, dim: int, axes: int = 2, base: float = 10000.0, backend: str = "auto"):
        super().__init__()
        _checks.positive_int("dim", dim)
        self.axes = _checks.positive_int("axes", axes)
        if dim % (2 * axes):
            raise ValueError(
                f"dim must be a multiple of 2 * axes = {2 * axes} (an even number of "
                f"channels per axis), got {dim}"
            )
        self.dim = dim
        self.base = _checks.positive_float("base", base)
        self.backend = _dispatch.validate_name(backend)

    def forward(self, x: Tensor, coords: Tensor) -> Tensor:
        return _add_encoding_nd(x, coords, self.dim, self.axes, self.base, self.backend)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, axes={self.axes}, base={self.base}" + (
            f", backend={self.backend!r}" if self.backend != "auto" else ""
        )


class DFTPE(nn.Module):
    """x + dft(positions): ``forward(x [..., L, dim], positions=None)``, fused like
    :class:`SinusoidalPE`. dim must be even."""

    def __init__(self, dim: int, backend: str = "auto"):
        super().__init__()
        self.dim = _check_dim("dft", dim)
        self.backend = _dispatch.validate_name(backend)

    def forward(self, x: Tensor, positions: Optional[Tensor] = None) -> Tensor:
        return _add_encoding("dft", x, positions, self.dim, 1.0, self.backend)

    def extra_repr(self) -> str:
        return f"dim={self.dim}" + (f", backend={self.backend!r}" if self.backend != "auto" else "")
