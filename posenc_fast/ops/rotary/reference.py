"""Learnable Fourier features as rotary embeddings (LightGlue's layout), literally.

The specification every backend of ``pf.lff_rotary`` / ``pf.apply_lff_rotary`` is tested
against: float64, unfused, differentiable by autograd.

    x  [..., N, M]   positions (e.g. keypoints [B, N, 2])
    wr [F/2, M]      learnable frequencies, no bias

    phase = x wr^T                                          [..., N, F/2]
    cos table C[..., 2i] = C[..., 2i+1] = cos(phase_i)      each frequency on two
    sin table S[..., 2i] = S[..., 2i+1] = sin(phase_i)      neighbouring channels
    table = stack([C, S]) with a broadcast heads axis:      [2, ..., 1, N, F]

Unlike the features of Li et al. (``ops/lff``) the cosines and sines are not
scaled by 1/sqrt(F) and not concatenated: they are the rotation of channel pair
(2i, 2i+1) of every query and key by the angle phase_i,

    rotate_half(t)[2i] = -t[2i+1],  rotate_half(t)[2i+1] = t[2i]
    t' = t * C + rotate_half(t) * S
       i.e. t'[2i] = t[2i] cos - t[2i+1] sin,  t'[2i+1] = t[2i+1] cos + t[2i] sin

so that q'_n . k'_m depends on the positions only through (x_n - x_m) wr^T. Channels
F..head_dim-1 (when F < head_dim) are left as they are.

Layouts of q and k: "bhnd" = [B, heads, N, head_dim] (LightGlue's), "bnhd" =
[B, N, heads, head_dim]; positions [B, N, M], or [N, M] shared by the batch.
"""

from __future__ import annotations

import torch

LAYOUTS = ("bhnd", "bnhd")


def rotary_table(x: torch.Tensor, wr: torch.Tensor, out_dtype=None) -> torch.Tensor:
    """[2, ..., 1, N, F] (cos, sin) from positions x [..., N, M] and wr [F/2, M]."""
    phase = x.to(torch.float64) @ wr.to(torch.float64).T  # [..., N, F/2]
    table = torch.stack([torch.cos(phase), torch.sin(phase)])  # [2, ..., N, F/2]
    table = table.repeat_interleave(2, dim=-1).unsqueeze(-3)  # [2, ..., 1, N, F]
    return table if out_dtype is None else table.to(out_dtype)


def rotate_half(t: torch.Tensor) -> torch.Tensor:
    """(t[2i], t[2i+1]) -> (-t[2i+1], t[2i]) for every channel pair of the last axis."""
    pairs = t.unflatten(-1, (-1, 2))
    return torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)


def rotate(t: torch.Tensor, table: torch.Tensor, layout: str = "bhnd") -> torch.Tensor:
    """t [B, heads, N, D] ("bhnd") or [B, N, heads, D] ("bnhd") rotated by a table
    [2, B or 1, 1, N, F] of rotary_table (F <= D); float64, channels >= F unchanged."""
    cos, sin = table.to(torch.float64)  # [B, 1, N, F]
    if layout == "bnhd":
        cos, sin = cos.transpose(-3, -2), sin.transpose(-3, -2)  # [B, N, 1, F]
    F = cos.shape[-1]
    t = t.to(torch.float64)
    head, tail = t[..., :F], t[..., F:]
    return torch.cat([head * cos + rotate_half(head) * sin, tail], dim=-1)


def apply_rotary(q, k, x, wr, layout: str = "bhnd", out_dtype=None):
    """(q', k'): q and k rotated by the table of positions x [B, N, M] (or [N, M])."""
    table = rotary_table(x, wr)
    if table.dim() == 4:  # x [N, M]: one table for the whole batch
        table = table.unsqueeze(1)
    dtype = q.dtype if out_dtype is None else out_dtype
    return rotate(q, table, layout).to(dtype), rotate(k, table, layout).to(dtype)
