"""Sinusoidal and DFT encodings in pure PyTorch (the CPU fallback).

Both encodings are sums of sinusoids of the position: a list of frequencies (in turns,
float64) and, per frequency, the output column and amplitude of its cosine and sine.
    sinusoidal: nu_i = base^(-2i/dim) / (2 pi); sin -> column 2i, cos -> column 2i+1
    dft:        nu_k = k / dim, k = 0..dim/2; cos -> column k (k = 0..K) and dim-1 (k = dim/2),
                sin -> column K+k (k = 1..K); amplitudes per Eq. 17-20
Phases are reduced in float64 before a float32 (or float64) trig, as for LFF.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch

from ._common import TWO_PI, feature_dtype, reduced_angle, row_chunks


@dataclass(frozen=True)
class Spectrum:
    turns: torch.Tensor  # [K] float64 frequencies in turns per unit position
    cos_col: torch.Tensor  # [K] int64 output column of the cosine, -1 if none
    cos_amp: torch.Tensor  # [K] float64
    sin_col: torch.Tensor
    sin_amp: torch.Tensor


@lru_cache(maxsize=64)
def _spectrum_cpu(kind: str, dim: int, base: float) -> Spectrum:
    if kind == "sinusoidal":
        i = torch.arange(dim // 2, dtype=torch.float64)
        turns = base ** (-2.0 * i / dim) / TWO_PI
        ones = torch.ones_like(turns)
        return Spectrum(turns, 2 * i.long() + 1, ones, 2 * i.long(), ones)
    if kind == "dft":
        K = dim // 2 - 1
        k = torch.arange(dim // 2 + 1, dtype=torch.float64)
        cos_col = k.long().clone()
        cos_col[-1] = dim - 1
        cos_amp = torch.full_like(k, math.sqrt(2.0 / dim))
        cos_amp[0] = cos_amp[-1] = 1.0 / math.sqrt(dim)
        sin_col = K + k.long()
        sin_col[0] = sin_col[-1] = -1  # sin(0) = 0 and sin(pi s) is not part of Eq. 21
        sin_amp = torch.full_like(k, math.sqrt(2.0 / dim))
        sin_amp[0] = sin_amp[-1] = 0.0
        return Spectrum(k / dim, cos_col, cos_amp, sin_col, sin_amp)
    raise ValueError(f"unknown encoding kind {kind!r}")


def spectrum(kind: str, dim: int, base: float, device: torch.device) -> Spectrum:
    sp = _spectrum_cpu(kind, dim, float(base))
    if device.type == "cpu":
        return sp
    return Spectrum(
        *(t.to(device) for t in (sp.turns, sp.cos_col, sp.cos_amp, sp.sin_col, sp.sin_amp))
    )


def _assemble(c: torch.Tensor, s: torch.Tensor, sp: Spectrum, dim: int) -> torch.Tensor:
    """Place amplitude-scaled cosines and sines into their columns: [n, K] x2 -> [n, dim]."""
    out = c.new_empty((c.shape[0], dim))
    has_cos = sp.cos_col >= 0
    has_sin = sp.sin_col >= 0
    out[:, sp.cos_col[has_cos]] = c[:, has_cos] * sp.cos_amp[has_cos].to(c.dtype)
    out[:, sp.sin_col[has_sin]] = s[:, has_sin] * sp.sin_amp[has_sin].to(c.dtype)
    return out


def _block_term(sp: Spectrum, dim: int, block: Optional[float], dtype) -> Optional[torch.Tensor]:
    if block is None:
        return None
    ang = reduced_angle(sp.turns * float(block), torch.float64)
    return _assemble(torch.cos(ang)[None], torch.sin(ang)[None], sp, dim)[0].to(dtype)


def _bytes_per_row(dim: int) -> int:
    return 8 * dim + 4 * 3 * dim + 64


def encoding_forward(positions, dim: int, kind: str, base: float, block, out_dtype) -> torch.Tensor:
    """positions [...] -> [..., dim] in out_dtype."""
    p = positions.reshape(-1)
    fdt = feature_dtype(out_dtype)
    sp = spectrum(kind, dim, base, positions.device)
    extra = _block_term(sp, dim, block, fdt)
    out = torch.empty((p.shape[0], dim), dtype=out_dtype, device=positions.device)
    for sl in row_chunks(p.shape[0], _bytes_per_row(dim)):
        ang = reduced_angle(p[sl].to(torch.float64)[:, None] * sp.turns, fdt)
        enc = _assemble(torch.cos(ang), torch.sin(ang), sp, dim)
        out[sl] = enc if extra is None else enc + extra
    return out.reshape(*positions.shape, dim)


def encoding_add(x, positions, kind: str, base: float, block) -> torch.Tensor:
    """x + encoding(positions), positions broadcast against x.shape[:-1]; one rounding."""
    dim = x.shape[-1]
    pe = encoding_forward(positions, dim, kind, base, block, feature_dtype(x.dtype))
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    # Computed in float32 and rounded once to x's dtype, without a float32 copy of x.
    torch.add(x, pe, out=out)
    return out


def encoding_backward(grad, positions, dim: int, kind: str, base: float) -> torch.Tensor:
    """d(sum grad * encoding(positions)) / d positions; grad [*positions.shape, dim]."""
    p = positions.reshape(-1)
    g = grad.reshape(-1, dim)
    fdt = feature_dtype(positions.dtype)
    sp = spectrum(kind, dim, base, positions.device)
    rate = (TWO_PI * sp.turns).to(fdt)  # d phase / d position
    has_cos = sp.cos_col >= 0
    has_sin = sp.sin_col >= 0
    out = torch.empty(p.shape, dtype=fdt, device=positions.device)
    for sl in row_chunks(p.shape[0], _bytes_per_row(dim)):
        ang = reduced_angle(p[sl].to(torch.float64)[:, None] * sp.turns, fdt)
        gs = g[sl].to(fdt)
        # d cos / dp = -rate sin ; d sin / dp = rate cos
        dcos = -(torch.sin(ang[:, has_cos]) * (rate[has_cos] * sp.cos_amp[has_cos].to(fdt)))
        dsin = torch.cos(ang[:, has_sin]) * (rate[has_sin] * sp.sin_amp[has_sin].to(fdt))
        out[sl] = (gs[:, sp.cos_col[has_cos]] * dcos).sum(1) + (
            gs[:, sp.sin_col[has_sin]] * dsin
        ).sum(1)
    return out.to(positions.dtype).reshape(positions.shape)
