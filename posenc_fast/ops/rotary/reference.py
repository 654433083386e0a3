"""Rotary embeddings for grids, literally: the specification every backend of
``pf.rotary`` / ``pf.rotary_table`` is tested against (float64, unfused, differentiable
by autograd).

    q, k   [B, H, N, d] (layout "bhnd") or [B, N, H, d] ("bnhd")
    x      [N - P, M] positions shared by the batch, or [B, N - P, M] per sample
    freqs  W: [F/2, M] shared by the heads, or [H, F/2, M] one per head; F <= d
    P      prefix: the first P tokens (class, registers) are not rotated

    theta[(b,) (h,) n, i] = x[(b,) n] . W[(h,) i]           the angle of channel pair i

Pair i is channels (2i, 2i+1) with pairs="interleaved" (timm ``rot``, LightGlue, FLUX) or
(i, i + F/2) with pairs="half" (rotate-half: HF, timm ``half=True``, DINOv3). Each pair
(a, b) of token P + n is rotated by its angle,

    (a, b) -> (a cos theta - b sin theta,  a sin theta + b cos theta)

so that q'_n . k'_m depends on the positions only through x_n - x_m. Channels F..d-1 and
the first P tokens pass through unchanged. In table form, with C and S holding cos theta
and sin theta on both channels of every pair:

    t' = t * C + rotate_pairs(t) * S,   rotate_pairs(t) puts -b where a was and a where b was

The table ``rotary_table(x, W)`` is stack([C, S]): [2, *x.shape[:-1], F] for shared W,
[2, *x.shape[:-2], H, N, F] per head.
"""

from __future__ import annotations

import torch

LAYOUTS = ("bhnd", "bnhd")
PAIRS = ("interleaved", "half")


def angles(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """theta in float64: [..., N, F/2] for freqs [F/2, M], [..., H, N, F/2] for [H, F/2, M]."""
    x, w = x.to(torch.float64), freqs.to(torch.float64)
    if w.dim() == 2:
        return x @ w.T
    return x.unsqueeze(-3) @ w.transpose(-1, -2)


def spread(t: torch.Tensor, pairs: str) -> torch.Tensor:
    """Per-pair values [..., F/2] on both channels of their pair: [..., F]."""
    if pairs == "interleaved":
        return t.repeat_interleave(2, dim=-1)  # (f0, f0, f1, f1, ...)
    return torch.cat([t, t], dim=-1)  # (f0, f1, ..., f0, f1, ...)


def rotate_pairs(t: torch.Tensor, pairs: str) -> torch.Tensor:
    """(a, b) -> (-b, a) for every channel pair of the last axis."""
    if pairs == "interleaved":
        p = t.unflatten(-1, (-1, 2))
        return torch.stack([-p[..., 1], p[..., 0]], dim=-1).flatten(-2)
    a, b = t.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def rotary_table(x, freqs, pairs: str = "interleaved", out_dtype=None) -> torch.Tensor:
    """[2, ..., F]: cos then sin of the angles, each on both channels of its pair."""
    theta = angles(x, freqs)
    table = spread(torch.stack([torch.cos(theta), torch.sin(theta)]), pairs)
    return table if out_dtype is None else table.to(out_dtype)


def rotate(t, table, pairs: str = "interleaved", layout: str = "bhnd", prefix: int = 0):
    """t [B, H, N, d] ("bhnd") or [B, N, H, d] ("bnhd") rotated by a table [2, B or 1,
    H or 1, N - prefix, F] (F <= d), in float64; channels >= F and tokens < prefix kept."""
    cos, sin = table.to(torch.float64)
    if layout == "bnhd":
        cos, sin = cos.transpose(-3, -2), sin.transpose(-3, -2)  # [B, N - prefix, H, F]
    token_axis = 2 if layout == "bhnd" else 1
    t = t.to(torch.float64)
    kept, moved = t.split([prefix, t.shape[token_axis] - prefix], dim=token_axis)
    F = cos.shape[-1]
    head, tail = moved[..., :F], moved[..., F:]
    out = torch.cat([head * cos + rotate_pairs(head, pairs) * sin, tail], dim=-1)
    return torch.cat([kept, out], dim=token_axis) if prefix else out


def rotary(q, k, x, freqs, pairs="interleaved", layout="bhnd", prefix=0, out_dtype=None):
    """(q', k') in q's dtype (or ``out_dtype``): q and k rotated by the angles x . W_i."""
    table = rotary_table(x, freqs, pairs)  # [2, (B,) (H,) N - prefix, F]
    if freqs.dim() == 2:
        table = table.unsqueeze(-3)  # one table for every head
    if table.dim() == 4:  # x [N - prefix, M]: one table for the whole batch
        table = table.unsqueeze(1)
    dtype = q.dtype if out_dtype is None else out_dtype
    return tuple(rotate(t, table, pairs, layout, prefix).to(dtype) for t in (q, k))


# The LightGlue members (LearnableFourierRotary): interleaved pairs, shared frequencies
# wr [F/2, M], no prefix, the table with a broadcast heads axis [2, ..., 1, N, F].


def lff_rotary_table(x, wr, out_dtype=None) -> torch.Tensor:
    return rotary_table(x, wr, "interleaved", out_dtype).unsqueeze(-3)


def apply_lff_rotary(q, k, x, wr, layout: str = "bhnd", out_dtype=None):
    return rotary(q, k, x, wr, "interleaved", layout, 0, out_dtype)
