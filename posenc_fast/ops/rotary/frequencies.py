"""The rotary families as frequency matrices W and positions x (``posenc_fast.rope``).

Every family rotates channel pair i by x . W_i (reference.py); each differs only in W
(and in how it lays out its coordinates x):

    axial(head_dim)          EVA-02 / timm RotaryEmbeddingCat: one axis per frequency
    mixed(head_dim, ...)     RoPE-Mixed (Heo et al. 2024) / timm RotaryEmbeddingMixed:
                             a learnable dense W per block and head
    dinov3(head_dim)         DINOv3 / timm RotaryEmbeddingDinoV3: 2 pi / period per axis
    nd(axes_dim)             FLUX's EmbedND: per-axis bands, axis after axis

and the coordinates ``grid`` (timm's ``_build_grid``) and ``augment`` (its training-time
shift / jitter / rescale), each bit for bit its family's (tests/rotary/test_frequencies.py).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ... import _checks

GRID_KINDS = ("index", "pixel", "centered")


def _swap_xy(shape: list) -> list:
    return shape if len(shape) < 2 else [shape[1], shape[0], *shape[2:]]


def grid(
    feat_shape,
    kind: str = "index",
    ref_feat_shape=None,
    offset: float = 0.0,
    indexing: str = "ij",
    normalize: str = "separate",
    *,
    device=None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The coordinates of every cell of a grid: [prod(feat_shape), len(feat_shape)], cells
    in row-major order of feat_shape, as timm's ``_build_grid(...).reshape(-1, ndim)``.

    Args:
        feat_shape: the grid's size per axis, e.g. (H, W).
        kind: "index" (i + offset), "pixel" (evenly spaced in [-1, 1]) or "centered"
            ((i + 0.5 + offset) / size, mapped to [-1, 1]: DINOv3's).
        ref_feat_shape: coordinates rescaled so that feat_shape spans this (pretraining)
            shape (EVA-02's resizing).
        offset: added to "index" and "centered" coordinates.
        indexing: "ij" (coordinates in feat_shape's order) or "xy" (first two swapped).
        normalize: the denominator of "centered" grids: "separate" (each axis its own
            size), "min" or "max" (of all sizes).
    """
    _checks.choice("kind", kind, GRID_KINDS)
    _checks.choice("indexing", indexing, ("ij", "xy"))
    _checks.choice("normalize", normalize, ("separate", "min", "max"))
    shape = list(feat_shape)
    if not shape:
        raise ValueError("feat_shape must have at least one size")
    for axis, s in enumerate(shape):
        _checks.size(f"feat_shape[{axis}]", s)
    ref = None if ref_feat_shape is None else list(ref_feat_shape)
    if ref is not None and len(ref) != len(shape):
        raise ValueError(f"ref_feat_shape {ref} must have the {len(shape)} sizes of feat_shape")
    if indexing == "xy":
        shape = _swap_xy(shape)
        ref = None if ref is None else _swap_xy(ref)
    f32 = torch.float32
    if kind == "pixel":
        t = [torch.linspace(-1.0, 1.0, steps=s, device=device, dtype=f32) for s in shape]
    elif kind == "centered":
        if normalize == "separate":
            denom = [float(s) for s in shape]
        else:
            d = float(max(shape) if normalize == "max" else min(shape))
            denom = [d] * len(shape)
        t = [
            (torch.arange(0.5, s, device=device, dtype=f32) + offset) / d
            for s, d in zip(shape, denom)
        ]
    else:
        t = [torch.arange(s, device=device, dtype=torch.int64).to(f32) + offset for s in shape]
    if ref is not None:
        t = [c / f * r for c, f, r in zip(t, shape, ref)]
    coords = torch.stack(torch.meshgrid(t, indexing=indexing), dim=-1).to(dtype=dtype)
    if kind == "centered":
        coords = 2.0 * coords - 1.0  # [0, 1] -> [-1, 1]
    return coords.reshape(-1, len(shape))


def _factor(name: str, value, minimum: float) -> Optional[float]:
    if value is None:
        return None
    value = _checks.finite_float(name, value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum:g}, got {value:g}")
    return value


def augment(
    coords: torch.Tensor,
    shift: Optional[float] = None,
    jitter: Optional[float] = None,
    rescale: Optional[float] = None,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """coords [..., ndim] transformed by one random draw, as timm's ``_apply_coord_augs``
    (DINOv3's training augmentation; the same draws in the same order, in coords' dtype and
    device, so the same generator state gives the same result): a shift uniform in
    [-shift, shift] per axis, a per-axis scale log-uniform in [1/jitter, jitter], a shared
    scale log-uniform in [1/rescale, rescale]. None skips one. A new tensor."""
    _checks.tensor("coords", coords)
    shift = _factor("shift", shift, 0.0)
    jitter = _factor("jitter", jitter, 1.0)
    rescale = _factor("rescale", rescale, 1.0)
    n, like = coords.shape[-1], {"device": coords.device, "dtype": coords.dtype}
    if shift is not None:
        coords = coords + torch.empty(n, **like).uniform_(-shift, shift, generator=generator)
    if jitter is not None:
        m = math.log(jitter)
        coords = coords * torch.empty(n, **like).uniform_(-m, m, generator=generator).exp()
    if rescale is not None:
        m = math.log(rescale)
        coords = coords * torch.empty(1, **like).uniform_(-m, m, generator=generator).exp()
    return coords


def _block_diagonal(bands: list, dtype, device) -> torch.Tensor:
    """W [sum of the bands' lengths, len(bands)]: axis a's bands on rows of their own."""
    rows = sum(b.shape[0] for b in bands)
    w = torch.zeros(rows, len(bands), dtype=dtype, device=device)
    start = 0
    for axis, b in enumerate(bands):
        w[start : start + b.shape[0], axis] = b
        start += b.shape[0]
    return w


def axial(
    head_dim: int,
    ndim: int = 2,
    in_pixels: bool = True,
    max_res: int = 224,
    temperature: float = 10000.0,
    linear_bands: bool = False,
    *,
    device=None,
) -> torch.Tensor:
    """Axial frequencies (EVA-02, timm ``RotaryEmbeddingCat``): W [ndim * nb, ndim] float32,
    nb = head_dim // (2 ndim) bands per axis, axis-major, each frequency on one axis.
    ``in_pixels``: timm's pixel bands (pi x linear or log2-spaced values up to max_res / 2;
    with ``grid(shape, "pixel")``), else 1 / temperature^(j / nb) (with ``grid(shape)``).
    pairs="interleaved" (timm's ``rotate_half=True`` is pairs="half")."""
    _checks.positive_int("head_dim", head_dim)
    _checks.positive_int("ndim", ndim)
    nb = head_dim // (2 * ndim)
    if nb == 0:
        raise ValueError(f"head_dim ({head_dim}) must be >= 2 * ndim ({2 * ndim})")
    f32 = torch.float32
    if in_pixels:
        if linear_bands:
            bands = torch.linspace(1.0, float(max_res) / 2, nb, dtype=f32)
        else:
            bands = 2 ** torch.linspace(0, math.log(float(max_res), 2) - 1, nb, dtype=f32)
        bands = bands * torch.pi
    else:
        exponents = torch.arange(0, nb, 1, dtype=torch.int64).to(f32) / nb
        bands = 1.0 / (float(temperature) ** exponents)
    return _block_diagonal([bands] * ndim, f32, device)


def mixed(
    head_dim: int,
    depth: int,
    heads: int,
    temperature: float = 10.0,
    rotate: bool = True,
    generator: Optional[torch.Generator] = None,
    *,
    device=None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """RoPE-Mixed's initial frequencies (timm ``init_random_2d_freqs``): [depth, heads,
    head_dim / 2, 2], block d's per-head W = ``w[d]``: magnitudes 1 / temperature^(4j /
    head_dim) at a random angle per block and head (and + pi/2), drawn as timm draws them.
    Learnable (a Parameter); pairs="interleaved"; positions ``grid(shape, indexing="xy")``."""
    _checks.positive_int("head_dim", head_dim)
    _checks.positive_int("depth", depth)
    _checks.positive_int("heads", heads)
    if head_dim % 4:
        raise ValueError(f"head_dim must be divisible by 4, got {head_dim}")
    like = {"device": device, "dtype": dtype}
    mag = 1.0 / (temperature ** (torch.arange(0, head_dim, 4, **like) / head_dim))
    if rotate:
        angles = torch.rand(depth, heads, 1, generator=generator, **like) * 2 * torch.pi
    else:
        angles = torch.zeros(depth, heads, 1, **like)
    fx = torch.cat([mag * torch.cos(angles), mag * torch.cos(angles + torch.pi / 2)], dim=-1)
    fy = torch.cat([mag * torch.sin(angles), mag * torch.sin(angles + torch.pi / 2)], dim=-1)
    return torch.stack([fx, fy], dim=-1)


def mixed_from_timm(freqs: torch.Tensor) -> torch.Tensor:
    """timm's RotaryEmbeddingMixed.freqs [2, depth, heads, F/2] as W [depth, heads, F/2, 2]:
    a permuted view (gradients reach timm's parameter)."""
    _checks.shape("freqs", freqs, (2, None, None, None), "[2, depth, heads, F/2]")
    return freqs.permute(1, 2, 3, 0)


def mixed_to_timm(w: torch.Tensor) -> torch.Tensor:
    """W [depth, heads, F/2, 2] as timm's [2, depth, heads, F/2] layout: a permuted view."""
    _checks.shape("w", w, (None, None, None, 2), "[depth, heads, F/2, 2]")
    return w.permute(3, 0, 1, 2)


def dinov3(
    head_dim: int,
    temperature: Optional[float] = 100.0,
    min_period: Optional[float] = None,
    max_period: Optional[float] = None,
    *,
    device=None,
) -> torch.Tensor:
    """DINOv3's frequencies (timm ``RotaryEmbeddingDinoV3``): W [head_dim / 2, 2] float32,
    2 pi / period_j on each axis, axis-major, with head_dim // 4 periods
    temperature^(2j / (head_dim / 2)), or geometric from min_period to max_period when
    both are given. Use with pairs="half" and ``grid(shape, "centered")`` (and
    ``augment`` in training), as DINOv3."""
    _checks.positive_int("head_dim", head_dim)
    d = head_dim // 4
    if d == 0:
        raise ValueError(f"head_dim must be >= 4, got {head_dim}")
    if min_period is not None and max_period is not None:
        exponents = torch.linspace(0, 1, d, dtype=torch.float32)
        periods = min_period * ((max_period / min_period) ** exponents)
    elif temperature is not None:
        exponents = 2.0 * torch.arange(d, dtype=torch.float32) / (head_dim // 2)
        periods = float(temperature) ** exponents
    else:
        raise ValueError("give temperature, or both min_period and max_period")
    w = (2 * math.pi / periods.to(torch.float64)).to(torch.float32)
    return _block_diagonal([w, w], torch.float32, device)


def nd(
    axes_dim,
    theta: float = 10000.0,
    *,
    device=None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """FLUX's EmbedND frequencies: W [sum(axes_dim) / 2, len(axes_dim)], axis a with
    axes_dim[a] / 2 frequencies 1 / theta^(2j / axes_dim[a]), axis after axis (computed
    in float64 as FLUX does, then ``dtype``: float64 keeps FLUX's exact angles for large
    positions). Use with pairs="interleaved" and positions [..., N, len(axes_dim)] (FLUX's
    ids)."""
    dims = list(axes_dim)
    if not dims:
        raise ValueError("axes_dim must name at least one axis")
    bands = []
    for axis, d in enumerate(dims):
        _checks.even_positive_int(f"axes_dim[{axis}]", d)
        scale = torch.arange(0, d, 2, dtype=torch.float64) / d
        bands.append(1.0 / (theta**scale))
    return _block_diagonal(bands, torch.float64, device).to(dtype)
