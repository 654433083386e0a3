"""The baselines of ``bench``: every op as users write it in eager PyTorch.

These are what a user already runs, not our specification (the float64 reference is the
spec; ``bench`` only compares outputs against it):

- LFF: the public learnable-Fourier-feature modules' form: an ``nn.Linear`` without bias
  holding Wr, cos and sin of its output joined by ``torch.cat`` and scaled by 1/sqrt(F),
  then ``nn.Linear`` + ``nn.GELU`` + ``nn.Linear``.
- sinusoidal: the usual table: ``div_term = exp(arange(0, dim, 2) * -log(base) / dim)``,
  ``pe[:, 0::2] = sin(p * div_term)``, ``pe[:, 1::2] = cos(p * div_term)``.
- DFT: the angles as a matmul of the positions with the row of basis frequencies
  w_k = 2 pi k / dim, then the basis columns (Eq. 21's a0, a_k, b_k, b0) joined by
  ``torch.cat``.
- adds: ``x + table`` with the table computed in ``forward`` ("eager"), and with the table
  computed once at construction and sliced per call, the tutorial ``PositionalEncoding``
  ("eager-cached").
- rotary (LightGlue): its learnable Fourier positional encoding restated, an ``nn.Linear``
  without bias holding Wr, then cos and sin of the phases stacked and each repeated on two
  adjacent channels (the table [2, B, 1, N, F]), then ``t * cos + rotate_half(t) * sin``
  for q and for k ("eager"); and that rotation alone with the table computed beforehand
  ("eager-rotate": LightGlue builds the table once per image and reuses it in each of its
  layers, so this is its per-layer cost). benchmarks/rotary.py (the GPU run) uses the same
  code; tests/rotary/test_rotary.py names the LightGlue commit the formulas come from.

All of them compute phases in float32, so at large |phase| they carry float32 rounding
(about |phase| * 6e-8): ``bench`` records each one's largest error against the float64
spec next to its time.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

_ACTIVATIONS = {
    "gelu": lambda: nn.GELU(),
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
    "relu": lambda: nn.ReLU(),
}


class EagerLFF(nn.Module):
    """x [..., G, M] -> [..., G * Dg], as the public LFF modules compute it."""

    def __init__(self, M: int, F: int, H: int, Dg: int, activation: str = "gelu"):
        super().__init__()
        self.wr = nn.Linear(M, F // 2, bias=False)
        self.mlp = nn.Sequential(nn.Linear(F, H), _ACTIVATIONS[activation](), nn.Linear(H, Dg))
        self.scale = 1.0 / math.sqrt(F)

    def forward(self, x: Tensor) -> Tensor:
        projected = self.wr(x)  # [..., G, F/2]
        feats = torch.cat([torch.cos(projected), torch.sin(projected)], dim=-1) * self.scale
        return self.mlp(feats).flatten(-2)

    @classmethod
    def from_weights(cls, wr, w1, b1, w2, b2, activation: str = "gelu") -> EagerLFF:
        """The module holding copies of posenc_fast's weights (wr [F/2, M], w1 [F, H],
        b1 [H], w2 [H, Dg], b2 [Dg]); nn.Linear stores weights as [out, in]."""
        m = cls(wr.shape[1], 2 * wr.shape[0], w1.shape[1], w2.shape[1], activation)
        m = m.to(device=wr.device, dtype=wr.dtype)
        with torch.no_grad():
            m.wr.weight.copy_(wr)
            m.mlp[0].weight.copy_(w1.T)
            m.mlp[0].bias.copy_(b1)
            m.mlp[2].weight.copy_(w2.T)
            m.mlp[2].bias.copy_(b2)
        return m


class EagerSinusoidal(nn.Module):
    """positions [...] -> [..., dim], interleaved sin / cos (the usual div_term table)."""

    def __init__(self, dim: int, base: float = 10000.0, device=None):
        super().__init__()
        self.dim = dim
        div_term = torch.exp(
            torch.arange(0, dim, 2, dtype=torch.float32, device=device) * (-math.log(base) / dim)
        )
        self.register_buffer("div_term", div_term)

    def forward(self, positions: Tensor) -> Tensor:
        angle = positions.to(self.div_term.dtype).unsqueeze(-1) * self.div_term  # [..., dim/2]
        pe = torch.zeros(*positions.shape, self.dim, dtype=angle.dtype, device=angle.device)
        pe[..., 0::2] = torch.sin(angle)
        pe[..., 1::2] = torch.cos(angle)
        return pe


class EagerDFT(nn.Module):
    """positions [...] -> [..., dim]: (a0, a1..aK, b1..bK, b0) of Idé et al.'s Eq. 21."""

    def __init__(self, dim: int, device=None):
        super().__init__()
        self.dim = dim
        K = dim // 2 - 1
        w = 2.0 * math.pi / dim * torch.arange(1, K + 1, dtype=torch.float32, device=device)
        self.register_buffer("w", w[None, :])  # [1, K]: the basis frequencies as a row

    def forward(self, positions: Tensor) -> Tensor:
        s = positions.to(self.w.dtype).unsqueeze(-1)  # [..., 1]
        angle = s @ self.w  # [..., K]
        amp = math.sqrt(2.0 / self.dim)
        return torch.cat(
            [
                torch.full_like(s, 1.0 / math.sqrt(self.dim)),
                amp * torch.cos(angle),
                amp * torch.sin(angle),
                torch.cos(math.pi * s) / math.sqrt(self.dim),
            ],
            dim=-1,
        )


class EagerAdd(nn.Module):
    """x [..., L, dim] + table(0..L-1), the table computed in every call."""

    def __init__(self, table: nn.Module):
        super().__init__()
        self.table = table

    def forward(self, x: Tensor) -> Tensor:
        positions = torch.arange(x.shape[-2], device=x.device)
        return x + self.table(positions).to(x.dtype)


class EagerCachedAdd(nn.Module):
    """x [..., L, dim] + pe[:L], pe computed once for max_len positions (a buffer)."""

    def __init__(self, table: nn.Module, max_len: int, dtype, device=None):
        super().__init__()
        pe = table(torch.arange(max_len, device=device)).to(dtype)
        self.register_buffer("pe", pe)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.pe[: x.shape[-2]]


def table_module(kind: str, dim: int, device=None) -> nn.Module:
    return EagerDFT(dim, device) if kind == "dft" else EagerSinusoidal(dim, device=device)


def rotate_half(t: Tensor) -> Tensor:
    """(t0, t1, t2, t3, ...) -> (-t1, t0, -t3, t2, ...): LightGlue's channel pairs."""
    pairs = t.unflatten(-1, (-1, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


def apply_cached_rotary(table: Tensor, t: Tensor) -> Tensor:
    """t rotated by a table [2, ..., F] of cos / sin (LightGlue's per-layer rotation)."""
    return t * table[0] + rotate_half(t) * table[1]


class EagerRotary(nn.Module):
    """LightGlue's rotary encoding: ``table(x)`` [2, B, 1, N, F] from positions [B, N, M];
    ``forward(q, k, x)`` builds it and rotates q and k [B, heads, N, F] with it."""

    def __init__(self, M: int, F: int):
        super().__init__()
        self.wr = nn.Linear(M, F // 2, bias=False)

    def table(self, x: Tensor) -> Tensor:
        phases = self.wr(x)
        return torch.stack((phases.cos(), phases.sin())).unsqueeze(-3).repeat_interleave(2, -1)

    def forward(self, q: Tensor, k: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
        table = self.table(x)
        return apply_cached_rotary(table, q), apply_cached_rotary(table, k)

    @classmethod
    def from_weights(cls, wr: Tensor) -> EagerRotary:
        """The module holding a copy of posenc_fast's ``wr`` [F/2, M] (nn.Linear's [out, in])."""
        m = cls(wr.shape[1], 2 * wr.shape[0]).to(device=wr.device, dtype=wr.dtype)
        with torch.no_grad():
            m.wr.weight.copy_(wr)
        return m
