"""The rotary tests' cases: one call's shapes and options, its inputs, and the scale that
outputs are compared at (tests/rotary/test_rotary_family.py, test_rotary_kernels.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from posenc_fast.cli import _inputs


@dataclass(frozen=True)
class Case:
    batch: int
    heads_q: int
    heads_k: int
    n: int  # tokens, prefix included
    head_dim: int
    rotary_dim: int
    pos_dim: int
    layout: str = "bhnd"
    pairs: str = "interleaved"
    per_head: bool = False  # freqs [H, F/2, M]
    shared_x: bool = False  # positions [N - prefix, M] shared by the batch
    prefix: int = 0
    strided: bool = False  # q, k slices of a fused qkv; freqs a block's permuted view

    @property
    def id(self) -> str:
        s = (
            f"B{self.batch}-H{self.heads_q}.{self.heads_k}-N{self.n}-D{self.head_dim}"
            f"-F{self.rotary_dim}-M{self.pos_dim}-{self.layout}-{self.pairs}"
        )
        flags = [("per_head", self.per_head), ("shared_x", self.shared_x),
                 (f"prefix{self.prefix}", self.prefix), ("strided", self.strided)]  # fmt: skip
        return s + "".join(f"-{name}" for name, on in flags if on)


def case_inputs(case: Case, dtype, device, seed: int, x_dtype: Optional[torch.dtype] = None):
    """(q, k, x, freqs): q, k in ``dtype``; x and freqs in ``x_dtype`` (default float64 for
    float64, else float32). Strided: q, k channel stride 3 (LightGlue's fused qkv) and, per
    head, freqs block 1 of timm's Mixed parameter [M, depth, H, F/2] seen as [H, F/2, M]."""
    g = _inputs.generator(seed)
    if x_dtype is None:
        x_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    B, N, D, F2, M = case.batch, case.n, case.head_dim, case.rotary_dim // 2, case.pos_dim
    if case.strided:  # [B, N, H, D, 3] -> q = [..., 0], k = [..., 1]
        qkv = _inputs.randn((B, N, case.heads_q, D, 3), g, dtype, device)
        if case.layout == "bhnd":
            qkv = qkv.transpose(1, 2)
        q, k = qkv[..., 0], qkv[..., 1]
    else:
        shape = (B, case.heads_q, N, D) if case.layout == "bhnd" else (B, N, case.heads_q, D)
        q = _inputs.randn(shape, g, dtype, device)
        kshape = list(shape)
        kshape[1 if case.layout == "bhnd" else 2] = case.heads_k
        k = _inputs.randn(tuple(kshape), g, dtype, device)
    n = N - case.prefix
    x = _inputs.randn((n, M) if case.shared_x else (B, n, M), g, x_dtype, device, 3.0)
    if case.per_head and case.strided:
        freqs = _inputs.randn((M, 3, case.heads_q, F2), g, x_dtype, device)[:, 1].permute(1, 2, 0)
    elif case.per_head:
        freqs = _inputs.randn((case.heads_q, F2, M), g, x_dtype, device)
    else:
        freqs = _inputs.randn((F2, M), g, x_dtype, device)
    return q, k, x, freqs


def output_scale(*refs) -> float:
    """The largest magnitude among the reference outputs (0 when all are empty)."""
    return max([float(r.detach().abs().max()) for r in refs if r.numel()] or [0.0])
