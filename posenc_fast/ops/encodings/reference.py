"""Sinusoidal and DFT positional encodings, literally, in float64.

Sinusoidal (Vaswani et al.; Eq. 1 of the LFF paper), interleaved:
    out[..., 2i]   = sin(p / base^(2i/dim))
    out[..., 2i+1] = cos(p / base^(2i/dim))
FLOATER's per-block form (Liu et al. 2020, Eq. 7) adds the same encoding of the block
index n to every position: p^(n)_i = PE(i) + PE(n). Sine-2D / Sine-nD (the LFF paper's
baselines) concatenate the encodings of each coordinate.

DFT positional encoding (Idé et al., Eq. 10-21): with K = dim/2 - 1, w_k = 2 pi k / dim,
the orthonormal DFT basis on the lattice t = 0..dim-1 is
    phi_0(t) = 1/sqrt(dim)
    phi_k(t) = sqrt(2/dim) cos(w_k t),     k = 1..K
    phi_{K+k}(t) = sqrt(2/dim) sin(w_k t), k = 1..K
    phi_{dim-1}(t) = cos(pi t)/sqrt(dim)
and the encoding of position s is e(s) = (phi_0(s), ..., phi_{dim-1}(s)), i.e. Eq. 21's
(a0, a1..aK, b1..bK, b0). Its inverse DFT (Eq. 13) on the lattice is
    f(t) = sum_l e_l phi_l(t),  t = 0..dim-1,
which for integer s in [0, dim) is the one-hot vector at s (Theorem 1)."""

from __future__ import annotations

import math
from typing import Optional

import torch


def sinusoidal(
    positions: torch.Tensor,
    dim: int,
    base: float = 10000.0,
    block: Optional[float] = None,
    out_dtype: Optional[torch.dtype] = None,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    p = positions.to(compute_dtype).unsqueeze(-1)  # [..., 1]
    i = torch.arange(dim // 2, dtype=compute_dtype, device=positions.device)
    freq = base ** (-2.0 * i / dim)  # 1 / base^(2i/dim)
    out = torch.stack([torch.sin(p * freq), torch.cos(p * freq)], dim=-1).flatten(-2)
    if block is not None:
        n = torch.tensor(float(block), dtype=compute_dtype, device=positions.device)
        out = out + torch.stack([torch.sin(n * freq), torch.cos(n * freq)], dim=-1).flatten()
    return out if out_dtype is None else out.to(out_dtype)


def sinusoidal_nd(
    coords: torch.Tensor,
    dim_per_axis: int,
    base: float = 10000.0,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Sine-2D / Sine-nD: the sinusoidal encoding of each of the M coordinates, concatenated
    in coordinate order: [..., M] -> [..., M * dim_per_axis]."""
    axes = [sinusoidal(coords[..., m], dim_per_axis, base) for m in range(coords.shape[-1])]
    out = torch.cat(axes, dim=-1)
    return out if out_dtype is None else out.to(out_dtype)


def dft_basis(
    dim: int, t: torch.Tensor, compute_dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """phi_l(t) for l = 0..dim-1: [..., dim] for t [...] (float64 unless told otherwise)."""
    t = t.to(compute_dtype).unsqueeze(-1)  # [..., 1]
    K = dim // 2 - 1
    w = 2.0 * math.pi / dim * torch.arange(1, K + 1, dtype=compute_dtype, device=t.device)  # w_k
    return torch.cat(
        [
            torch.full_like(t, 1.0 / math.sqrt(dim)),  # phi_0 = a0
            math.sqrt(2.0 / dim) * torch.cos(w * t),  # phi_1..phi_K = a_k
            math.sqrt(2.0 / dim) * torch.sin(w * t),  # phi_{K+1}..phi_{2K} = b_k
            torch.cos(math.pi * t) / math.sqrt(dim),  # phi_{dim-1} = b0
        ],
        dim=-1,
    )


def dft(
    positions: torch.Tensor,
    dim: int,
    out_dtype: Optional[torch.dtype] = None,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    out = dft_basis(dim, positions, compute_dtype)
    return out if out_dtype is None else out.to(out_dtype)


def dft_inverse(encoding: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """f(t) = sum_l e_l phi_l(t) on the lattice t = 0..dim-1: [..., dim] -> [..., dim]."""
    dim = encoding.shape[-1]
    lattice = torch.arange(dim, dtype=torch.float64, device=encoding.device)
    phi = dft_basis(dim, lattice)  # [t, l] = phi_l(t)
    out = encoding.to(torch.float64) @ phi.T
    return out if out_dtype is None else out.to(out_dtype)


# -- the implementation interface of the registry (registry.py) --------------------------


def encoding_forward(positions, dim: int, kind: str, base: float, block, out_dtype):
    if kind == "dft":
        return dft(positions, dim, out_dtype)
    return sinusoidal(positions, dim, base, block, out_dtype)


def encoding_add(x, positions, kind: str, base: float, block):
    """x + the encoding, summed in float64 and rounded once to x's dtype."""
    ref = (
        dft(positions, x.shape[-1])
        if kind == "dft"
        else sinusoidal(positions, x.shape[-1], base, block)
    )
    return (x.to(torch.float64) + ref).to(x.dtype)


def encoding_nd_add(x, coords, kind: str, base: float):
    """x [..., M * n] + sinusoidal_nd(coords [..., M], n), in float64, rounded once."""
    ref = sinusoidal_nd(coords, x.shape[-1] // coords.shape[-1], base)
    return (x.to(torch.float64) + ref).to(x.dtype)


def lattice_inverse(encoding):
    """dft_inverse in the encoding's dtype."""
    return dft_inverse(encoding, encoding.dtype)
