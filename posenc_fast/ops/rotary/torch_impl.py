"""Rotary embeddings in pure PyTorch (the CPU and GPU fallback).

Shapes (see reference.py for the formulas), Hf = 1 for shared frequencies:
    q [B, Hq, N, d], k [B, Hk, N, d] in "heads first" view (``heads_first``), F <= d
    x [Bx, N - prefix, M] positions (Bx = B, or 1 for positions shared by the batch)
    freqs [F/2, M] (shared by the heads) or [H, F/2, M] (one per head: Hq = Hk = H)
    cos, sin of the angles: [Bx, Hf, n, F/2] per chunk of n positions
    table: [2, *x.shape[:-1], F] (shared) or [2, *x.shape[:-2], H, N, F], cos then sin

Phases are reduced in float64 before a float32 trig (float64 for float64 q; within 1e-6
of float64 math, ops/_torch_math.py); rotations in float32 for half-precision q / k,
rounded once. Chunks of positions; cos / sin computed once per position for all heads.
The backward recomputes cos / sin; dfreqs accumulates in a fixed order (reproducible).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .._export_phases import cos_sin_graph
from .._torch_math import feature_dtype, phase_turns, reduced_angle_, row_chunks


def heads_first(t: torch.Tensor, layout: str) -> torch.Tensor:
    """q or k as a [B, heads, N, d] view: "bhnd" as it is, "bnhd" transposed."""
    return t if layout == "bhnd" else t.transpose(1, 2)


def batch_positions(x: torch.Tensor) -> torch.Tensor:
    """x [B, n, M] as it is, [n, M] (shared by the batch) as a [1, n, M] view."""
    return x if x.dim() == 3 else x.unsqueeze(0)


def _heads(freqs: torch.Tensor) -> int:
    """Hf: 1 for shared frequencies [F/2, M], H for per-head ones [H, F/2, M]."""
    return 1 if freqs.dim() == 2 else freqs.shape[0]


def _cos_sin(x: torch.Tensor, freqs: torch.Tensor, dtype: torch.dtype):
    """cos and sin of the angles in ``dtype``: x [L, n, M] -> two [L, Hf, n, F/2]."""
    L, n, M = x.shape
    Hf, F2 = _heads(freqs), freqs.shape[-2]
    w = freqs if freqs.dim() == 2 else freqs.reshape(-1, M)  # [Hf * F/2, M]
    turns = phase_turns(x.reshape(-1, M), w)  # [L * n, Hf * F/2] float64
    angle = reduced_angle_(turns, dtype).view(L, n, Hf, F2).transpose(1, 2)
    return torch.cos(angle), torch.sin(angle)


def _spread(t: torch.Tensor, pairs: str) -> torch.Tensor:
    """Per-pair values [..., F/2] on both channels of their pair: [..., F]."""
    if pairs == "interleaved":
        return t.repeat_interleave(2, dim=-1)
    return torch.cat([t, t], dim=-1)


def _pair_sum(g: torch.Tensor, pairs: str, dtype: torch.dtype) -> torch.Tensor:
    """The sum over the two channels of each pair: [..., F] -> [..., F/2] in ``dtype``."""
    if pairs == "interleaved":
        return g.unflatten(-1, (-1, 2)).sum(-1, dtype=dtype)
    return g.unflatten(-1, (2, -1)).sum(-2, dtype=dtype)


def _phase_grads(dphi, x_part, freqs, dx_part, dfreqs) -> None:
    """The chain rule through theta = x . W_i for one chunk: dx_part [L, n, M] = the sum
    over heads of dphi_h @ W_h, dfreqs += dphi_h^T @ x_part (dphi [L, Hf, n, F/2])."""
    M, F2 = x_part.shape[-1], dphi.shape[-1]
    rows = None if dfreqs is None else x_part.reshape(-1, M).to(dphi.dtype)
    if freqs.dim() == 2:
        d = dphi.squeeze(1)  # [L, n, F/2]
        if dx_part is not None:
            dx_part.copy_(d @ freqs.to(d.dtype))
        if dfreqs is not None:
            dfreqs += (d.reshape(-1, F2).T @ rows).to(dfreqs.dtype)
        return
    w = freqs.to(dphi.dtype)
    if dx_part is not None:
        dx_part.copy_((dphi @ w).sum(1))
    if dfreqs is not None:
        per_head = dphi.permute(1, 3, 0, 2).reshape(dphi.shape[1], F2, -1)  # [H, F/2, L n]
        dfreqs += (per_head @ rows).to(dfreqs.dtype)


def _grad_buffers(x, freqs, dtype, need_x: bool, need_freqs: bool):
    acc = torch.float64 if freqs.dtype == torch.float64 else torch.float32
    dx = torch.empty(x.shape, dtype=dtype, device=x.device) if need_x else None
    dfreqs = torch.zeros(freqs.shape, dtype=acc, device=x.device) if need_freqs else None
    return dx, dfreqs


def _finish(dx, dfreqs, x, freqs):
    return (
        None if dx is None else dx.to(x.dtype),
        None if dfreqs is None else dfreqs.to(freqs.dtype),
    )


# ------------------------------------------------------------------------ the table


def _table_rows(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """x as [L, n, M]: every position one row of a single L = 1 for shared frequencies;
    for per-head frequencies L = the leading dimensions (the table is [.., H, N, F])."""
    if freqs.dim() == 2:
        return x.reshape(1, -1, x.shape[-1])
    return x.reshape(math.prod(x.shape[:-2]), *x.shape[-2:])


def _table_shape(x: torch.Tensor, freqs: torch.Tensor) -> tuple:
    F = 2 * freqs.shape[-2]
    if freqs.dim() == 2:
        return (2, *x.shape[:-1], F)
    return (2, *x.shape[:-2], freqs.shape[0], x.shape[-2], F)


def table_forward(x, freqs, pairs: str, out_dtype: torch.dtype) -> torch.Tensor:
    """x [..., M] -> the table (module doc) in out_dtype: cos and sin, each on two channels."""
    rows = _table_rows(x, freqs)
    L, n = rows.shape[:2]
    Hf = _heads(freqs)
    F2 = freqs.shape[-2]
    out = torch.empty((2, L, Hf, n, 2 * F2), dtype=out_dtype, device=x.device)
    fdt = feature_dtype(out_dtype)
    for sl in row_chunks(n, L * Hf * 2 * F2 * (8 + 4 * 6)):
        cos, sin = _cos_sin(rows[:, sl], freqs, fdt)
        out[0, :, :, sl] = _spread(cos, pairs)
        out[1, :, :, sl] = _spread(sin, pairs)
    return out.view(_table_shape(x, freqs))


def table_backward(grad, x, freqs, pairs: str, need_x: bool, need_freqs: bool):
    """(dx, dfreqs) of table_forward for ``grad`` of the table's shape; None where not
    needed. A pair's two channels carry the same value: their gradients add up."""
    rows = _table_rows(x, freqs)
    L, n = rows.shape[:2]
    Hf = _heads(freqs)
    F2 = freqs.shape[-2]
    fdt = feature_dtype(grad.dtype)
    dx, dfreqs = _grad_buffers(rows, freqs, fdt, need_x, need_freqs)
    if need_x or need_freqs:
        g = grad.reshape(2, L, Hf, n, 2 * F2)
        for sl in row_chunks(n, L * Hf * 2 * F2 * (8 + 4 * 8)):
            cos, sin = _cos_sin(rows[:, sl], freqs, fdt)
            g_cos, g_sin = _pair_sum(g[:, :, :, sl], pairs, fdt)
            dphi = g_sin * cos - g_cos * sin  # d[cos, sin]/dtheta = [-sin, cos]
            _phase_grads(dphi, rows[:, sl], freqs, None if dx is None else dx[:, sl], dfreqs)
    dx, dfreqs = _finish(dx, dfreqs, rows, freqs)
    return (None if dx is None else dx.view(x.shape)), dfreqs


def _cos_sin_graph(x: torch.Tensor, freqs: torch.Tensor, dtype: torch.dtype):
    """_cos_sin from differentiable ops (float32 phases while an ONNX export traces a
    float32 graph: ops/_export_phases.py): x [L, n, M] -> two [L, Hf, n, F/2]."""
    L, n, M = x.shape
    w = freqs if freqs.dim() == 2 else freqs.reshape(-1, M)
    cos, sin = cos_sin_graph(x.reshape(-1, M), w, dtype)  # [L n, Hf F/2]
    return tuple(t.view(L, n, _heads(freqs), freqs.shape[-2]).transpose(1, 2) for t in (cos, sin))


def _spread_graph(t: torch.Tensor, pairs: str) -> torch.Tensor:
    """_spread without repeat_interleave (a Tile in ONNX, rank lost by the TorchScript
    exporter)."""
    if pairs == "interleaved":
        return torch.stack([t, t], dim=-1).flatten(-2)
    return torch.cat([t, t], dim=-1)


def table_autograd(x, freqs, pairs: str, out_dtype: torch.dtype) -> torch.Tensor:
    """table_forward from differentiable ops (the graph of a double backward, and what an
    ONNX export traces: float32 phases there, ops/_export_phases.py)."""
    cos, sin = _cos_sin_graph(_table_rows(x, freqs), freqs, feature_dtype(out_dtype))
    table = _spread_graph(torch.stack([cos, sin]), pairs)
    return table.to(out_dtype).reshape(_table_shape(x, freqs))


# ------------------------------------------------------------------------ q and k
#
# swap(t): each pair's channels exchanged; C = (c, c), S = (-s, s) on a pair's channels:
#     rotation  t' = t * C + swap(t) * S         (a c - b s, b c + a s)
#     transpose g  -> g * C - swap(g) * S         (g_a c + g_b s, g_b c - g_a s)
# three passes per head (product, swap, addcmul); C / S built once per position.


def _swap(t: torch.Tensor, pairs: str) -> torch.Tensor:
    """The two channels of every pair exchanged: [..., F] -> [..., F] (a copy; stacking
    two strided halves beats a flip of a size-2 axis on the CPU)."""
    if pairs == "interleaved":
        return torch.stack([t[..., 1::2], t[..., 0::2]], dim=-1).flatten(-2)
    half = t.shape[-1] // 2
    return torch.cat([t[..., half:], t[..., :half]], dim=-1)


def _dense(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in ``dtype`` with unit channel stride (q, k sliced from a fused qkv have stride 3;
    one copy pays for itself over the three passes that follow)."""
    t = t.to(dtype)
    return t if t.stride(-1) == 1 else t.contiguous()


def _rotation_tables(cos, sin, pairs: str, spread=_spread):
    """C, S [Bx, Hf, n, F] from cos, sin [Bx, Hf, n, F/2] (see above)."""
    if pairs == "interleaved":
        S = torch.stack([-sin, sin], dim=-1).flatten(-2)
    else:
        S = torch.cat([-sin, sin], dim=-1)
    return spread(cos, pairs), S


def _bytes_per_position(q, k, Hf: int, F2: int) -> int:
    """Temporaries per position of a chunk: float64 turns and C / S per frequency head, a
    few float32 [F] tensors per head of q and k."""
    heads = q.shape[0] * q.shape[1] + k.shape[0] * k.shape[1]
    return F2 * (Hf * (8 + 4 * 8) + heads * 4 * 2 * 4) + 64


def _into(dst: torch.Tensor, t, C, swapped, S, sign: float) -> None:
    """dst = t * C + sign * swapped * S, written into dst (rounded once to its dtype)."""
    if dst.dtype == t.dtype:
        torch.mul(t, C, out=dst)
        dst.addcmul_(swapped, S, value=sign)
    else:
        dst.copy_(torch.addcmul(t * C, swapped, S, value=sign))


def _outputs(tensors, dtype, F: int, prefix: int, layout: str, sources):
    """Empty outputs like ``tensors`` (dtype ``dtype``) with what passes through copied from
    ``sources``: the first ``prefix`` tokens, and channels >= F of the others."""
    outs = []
    for t, src in zip(tensors, sources):
        out = torch.empty(t.shape, dtype=dtype, device=t.device)
        o, s = heads_first(out, layout), heads_first(src, layout)
        if prefix:
            o[:, :, :prefix] = s[:, :, :prefix]
        if t.shape[-1] > F:
            o[:, :, prefix:, F:] = s[:, :, prefix:, F:]
        outs.append(out)
    return outs


def forward(q, k, x, freqs, pairs: str, layout: str, prefix: int):
    """(q', k') in q's dtype, allocated in the layout of q and k (see the module doc)."""
    F2 = freqs.shape[-2]
    F, Hf = 2 * F2, _heads(freqs)
    fdt = feature_dtype(q.dtype)
    outs = _outputs((q, k), q.dtype, F, prefix, layout, (q, k))
    src = [heads_first(t, layout) for t in (q, k)]
    dst = [heads_first(t, layout) for t in outs]
    xb = batch_positions(x)
    for sl in row_chunks(xb.shape[1], _bytes_per_position(src[0], src[1], Hf, F2)):
        C, S = _rotation_tables(*_cos_sin(xb[:, sl], freqs, fdt), pairs)
        tokens = slice(prefix + sl.start, prefix + sl.stop)
        for s, d in zip(src, dst):
            t = _dense(s[:, :, tokens, :F], fdt)
            _into(d[:, :, tokens, :F], t, C, _swap(t, pairs), S, 1.0)
    return outs[0], outs[1]


def _cross_dot(cross, dot, pairs: str):
    """From the sums of g * swap(t) and g * t over heads ([.., F]), per pair (a, b):
    g_b a - g_a b and g_a a + g_b b ([.., F/2])."""
    if pairs == "interleaved":
        return cross[..., 1::2] - cross[..., 0::2], dot[..., 0::2] + dot[..., 1::2]
    half = cross.shape[-1] // 2
    return cross[..., half:] - cross[..., :half], dot[..., :half] + dot[..., half:]


def backward(
    gq, gk, q, k, x, freqs, pairs: str, layout: str, prefix: int, needs
) -> list[Optional[torch.Tensor]]:
    """[dq, dk, dx, dfreqs] of forward (None where ``needs`` is False).

    dq is the gradient rotated back (the transpose, above), passed through where q was.
    The angle of pair i gets cos * sum(g_b a - g_a b) - sin * sum(g_a a + g_b b) over the
    pairs (a, b) of q and k: over every head for shared frequencies, and over the batch
    for shared positions. sum(g * swap(t)) holds (g_a b, g_b a), sum(g * t) (g_a a, g_b b).
    """
    need_q, need_k, need_x, need_freqs = (bool(n) for n in needs)
    F2 = freqs.shape[-2]
    F, shared = 2 * F2, freqs.dim() == 2
    Hf = _heads(freqs)
    fdt = feature_dtype(gq.dtype)
    xb = batch_positions(x)
    dx, dfreqs = _grad_buffers(xb, freqs, fdt, need_x, need_freqs)
    wanted = [(t, g) for t, g, n in ((q, gq, need_q), (k, gk, need_k)) if n]
    made = iter(
        _outputs([t for t, _ in wanted], q.dtype, F, prefix, layout, [g for _, g in wanted])
    )
    grads = [next(made) if n else None for n in (need_q, need_k)]
    tensors = [
        [heads_first(a, layout) if a is not None else None for a in (t, g, d)]
        for t, g, d in zip((q, k), (gq, gk), grads)
    ]
    need_phase = need_x or need_freqs
    per_position = _bytes_per_position(tensors[0][0], tensors[1][0], Hf, F2)
    for sl in row_chunks(xb.shape[1], per_position):
        cos, sin = _cos_sin(xb[:, sl], freqs, fdt)  # [Bx, Hf, n, F/2]
        C, S = _rotation_tables(cos, sin, pairs)
        tokens = slice(prefix + sl.start, prefix + sl.stop)
        cross = dot = 0.0  # sums of g * swap(t) and g * t: [B, Hf, n, F]
        for t, g, d in tensors:
            gs = _dense(g[:, :, tokens, :F], fdt)
            if d is not None:
                _into(d[:, :, tokens, :F], gs, C, _swap(gs, pairs), S, -1.0)
            if need_phase:
                ts = t[:, :, tokens, :F].to(fdt)  # as it is: a copy measured no faster here
                c, p = gs * _swap(ts, pairs), gs * ts
                if shared:
                    c, p = c.sum(1, keepdim=True), p.sum(1, keepdim=True)
                cross, dot = cross + c, dot + p
        if need_phase:
            cross, dot = _cross_dot(cross, dot, pairs)
            dphi = cos * cross.sum_to_size(cos.shape) - sin * dot.sum_to_size(sin.shape)
            _phase_grads(dphi, xb[:, sl], freqs, None if dx is None else dx[:, sl], dfreqs)
    dx, dfreqs = _finish(dx, dfreqs, xb, freqs)
    if dx is not None:
        dx = dx.view(x.shape)
    return [grads[0], grads[1], dx, dfreqs]


def rotary_autograd(q, k, x, freqs, pairs: str, layout: str, prefix: int):
    """forward from differentiable, out-of-place ops (the graph of a double backward, and
    what an ONNX export traces: float32 phases there, ops/_export_phases.py)."""
    fdt = feature_dtype(q.dtype)
    cos, sin = _cos_sin_graph(batch_positions(x), freqs, fdt)
    C, S = _rotation_tables(cos, sin, pairs, _spread_graph)  # [Bx, Hf, n, F]
    F = 2 * freqs.shape[-2]
    outs = []
    for t in (q, k):
        th = heads_first(t, layout)
        moved = th[:, :, prefix:] if prefix else th
        head = moved[..., :F].to(fdt)
        rot = (head * C + _swap(head, pairs) * S).to(q.dtype)
        if th.shape[-1] > F:  # channels after F pass through (no empty cat: the
            # TorchScript-based ONNX exporter refuses one)
            rot = torch.cat([rot, moved[..., F:].to(q.dtype)], dim=-1)
        if prefix:
            rot = torch.cat([th[:, :, :prefix].to(q.dtype), rot], dim=2)
        outs.append(heads_first(rot, layout))
    return outs[0], outs[1]
