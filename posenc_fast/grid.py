"""Coordinates of every cell of a grid, for encoders of 2-D/3-D positions."""

from __future__ import annotations

import torch

from . import _checks


def grid_positions(*sizes, normalize: bool = True, device=None, dtype=None) -> torch.Tensor:
    """[prod(sizes), len(sizes)]: the coordinates of every cell, first axis slowest.

    normalize=True gives cell centres (i + 0.5) / size in (0, 1) (DETR's convention of
    normalised positions), in ``dtype`` (default: torch's default float dtype).
    normalize=False gives the integer indices i, as int64 unless ``dtype`` is given.
    Sizes may be symbolic (dynamic image sizes under torch.export / torch.compile).
    """
    if not sizes:
        raise ValueError("grid_positions needs at least one size")
    for axis, n in enumerate(sizes):
        _checks.size(f"sizes[{axis}]", n)
    if dtype is None:
        dtype = torch.get_default_dtype() if normalize else torch.int64
    axes = []
    for n in sizes:
        idx = torch.arange(n, device=device, dtype=torch.float64 if normalize else torch.int64)
        axes.append((idx + 0.5) / n if normalize else idx)
    mesh = torch.meshgrid(*axes, indexing="ij")  # first axis slowest once flattened
    return torch.stack([m.reshape(-1) for m in mesh], dim=-1).to(dtype)
