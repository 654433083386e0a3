"""Learnable Fourier rotary embeddings in pure PyTorch (the CPU and GPU fallback).

Shapes (see posenc_fast/reference/rotary.py for the formulas):
    x [Bx, N, M] positions (Bx = B, or 1 for positions shared by the batch), wr [F/2, M]
    q [B, Hq, N, D], k [B, Hk, N, D] in "heads first" view (``heads_first``), F <= D
    table: [2, *x.shape[:-1], F], cos then sin, each frequency on channels 2i and 2i+1

Phases are reduced in float64 before a float32 trig (float64 for float64 q), as for
LFF (_common.py); rotations run in float32 for half-precision q / k, rounded once. The
positions are processed in chunks, and the cos / sin of a position are computed once
for every head and batch row that uses them. The backward saves only the inputs and
recomputes the cos / sin; the weight gradient is accumulated chunk after chunk in a
fixed order (bitwise reproducible).
"""

from __future__ import annotations

from typing import Optional

import torch

from ._common import feature_dtype, phase_turns, reduced_angle, reduced_angle_, row_chunks


def heads_first(t: torch.Tensor, layout: str) -> torch.Tensor:
    """q or k as a [B, heads, N, D] view: "bhnd" as it is, "bnhd" transposed."""
    return t if layout == "bhnd" else t.transpose(1, 2)


def batch_positions(x: torch.Tensor) -> torch.Tensor:
    """x [B, N, M] as it is, [N, M] (shared by the batch) as a [1, N, M] view."""
    return x if x.dim() == 3 else x.unsqueeze(0)


def _cos_sin(x: torch.Tensor, wr: torch.Tensor, dtype: torch.dtype):
    """cos and sin of x wr^T in ``dtype``: [..., M] -> two [..., F/2] tensors."""
    rows = x.reshape(-1, x.shape[-1])
    turns = phase_turns(rows, wr)  # [R, F/2] float64
    angle = reduced_angle_(turns, dtype).view(*x.shape[:-1], wr.shape[0])
    return torch.cos(angle), torch.sin(angle)


def _pairs(t: torch.Tensor, F: int, dtype: torch.dtype):
    """Even and odd channels of t[..., :F] in ``dtype``: two [..., F/2] tensors."""
    p = t[..., :F].unflatten(-1, (F // 2, 2)).to(dtype)
    return p[..., 0], p[..., 1]


def _interleave(even: torch.Tensor, odd: torch.Tensor) -> torch.Tensor:
    """[..., F/2] x 2 -> [..., F]: even[i] on channel 2i, odd[i] on 2i+1."""
    return torch.stack([even, odd], dim=-1).flatten(-2)


# ------------------------------------------------------------------------ the table


def table_forward(x: torch.Tensor, wr: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """x [..., M] -> [2, ..., F] in out_dtype: cos and sin, each on two channels."""
    rows = x.reshape(-1, x.shape[-1])
    R, F2 = rows.shape[0], wr.shape[0]
    out = torch.empty((2, R, 2 * F2), dtype=out_dtype, device=x.device)
    fdt = feature_dtype(out_dtype)
    for sl in row_chunks(R, 2 * F2 * (8 + 4 * 6)):
        cos, sin = _cos_sin(rows[sl], wr, fdt)
        out[0, sl] = _interleave(cos, cos)
        out[1, sl] = _interleave(sin, sin)
    return out.view(2, *x.shape[:-1], 2 * F2)


def _phase_grads(dphi, x_part, wr, dx_part, dwr) -> None:
    """The chain rule through phase = x wr^T for one chunk: dx_part = dphi @ wr and
    dwr += dphi^T @ x_part (dphi [..., F/2] and x_part [..., M] over the same positions)."""
    if dx_part is not None:
        dx_part.copy_(dphi @ wr.to(dphi.dtype))
    if dwr is not None:
        rows = x_part.reshape(-1, x_part.shape[-1]).to(dphi.dtype)
        dwr += (dphi.reshape(-1, dphi.shape[-1]).T @ rows).to(dwr.dtype)


def _grad_buffers(x, wr, dtype, need_x: bool, need_wr: bool):
    acc = torch.float64 if wr.dtype == torch.float64 else torch.float32
    dx = torch.empty(x.shape, dtype=dtype, device=x.device) if need_x else None
    dwr = torch.zeros(wr.shape, dtype=acc, device=x.device) if need_wr else None
    return dx, dwr


def _finish(dx, dwr, x, wr):
    return (
        None if dx is None else dx.to(x.dtype),
        None if dwr is None else dwr.to(wr.dtype),
    )


def table_backward(grad, x, wr, need_x: bool, need_wr: bool):
    """(dx, dwr) of table_forward for grad [2, ..., F]; None where not needed."""
    M, F2 = x.shape[-1], wr.shape[0]
    rows = x.reshape(-1, M)
    R = rows.shape[0]
    fdt = feature_dtype(grad.dtype)
    dx, dwr = _grad_buffers(rows, wr, fdt, need_x, need_wr)
    if need_x or need_wr:
        # A frequency's two channels carry the same value: their gradients add up.
        g = grad.reshape(2, R, F2, 2)
        for sl in row_chunks(R, 2 * F2 * (8 + 4 * 8)):
            cos, sin = _cos_sin(rows[sl], wr, fdt)
            g_cos, g_sin = g[:, sl].sum(-1, dtype=fdt)
            dphi = g_sin * cos - g_cos * sin  # d[cos, sin]/dphase = [-sin, cos]
            _phase_grads(dphi, rows[sl], wr, None if dx is None else dx[sl], dwr)
    dx, dwr = _finish(dx, dwr, rows, wr)
    return (None if dx is None else dx.view(x.shape)), dwr


def table_autograd(x, wr, out_dtype):
    """table_forward from differentiable ops (the graph of a double backward)."""
    fdt = feature_dtype(out_dtype)
    rows = x.reshape(-1, x.shape[-1])
    angle = reduced_angle(phase_turns(rows, wr), fdt)
    table = torch.stack([torch.cos(angle), torch.sin(angle)]).repeat_interleave(2, dim=-1)
    return table.to(out_dtype).view(2, *x.shape[:-1], 2 * wr.shape[0])


# ------------------------------------------------------------------------ q and k


def _bytes_per_position(q, k, F2: int) -> int:
    """Temporaries per position of one chunk: float64 turns, cos / sin, and per head of q
    and k a few float32 [F/2] tensors (pairs, products, the interleaved result)."""
    heads = q.shape[0] * q.shape[1] + k.shape[0] * k.shape[1]
    return F2 * (8 + 8 + heads * 4 * 8) + 64


def _rotated(src, cos, sin, fdt):
    """src's first F channels rotated by the angles: [B, H, n, F]."""
    e, o = _pairs(src, 2 * cos.shape[-1], fdt)
    return _interleave(e * cos - o * sin, o * cos + e * sin)


def apply_forward(q, k, x, wr, layout: str):
    """(q', k') in q's dtype, allocated in the layout of q and k (see the module doc)."""
    F = 2 * wr.shape[0]
    fdt = feature_dtype(q.dtype)
    outs = []
    for t in (q, k):
        out = torch.empty(t.shape, dtype=q.dtype, device=t.device)
        if t.shape[-1] > F:
            out[..., F:] = t[..., F:]  # channels beyond the rotary ones pass through
        outs.append(out)
    src = [heads_first(t, layout) for t in (q, k)]
    dst = [heads_first(t, layout) for t in outs]
    xb = batch_positions(x)
    for sl in row_chunks(xb.shape[1], _bytes_per_position(src[0], src[1], F // 2)):
        cos, sin = _cos_sin(xb[:, sl], wr, fdt)  # [Bx, n, F/2]
        cos, sin = cos[:, None], sin[:, None]  # broadcast over the heads
        for s, d in zip(src, dst):
            d[:, :, sl, :F] = _rotated(s[:, :, sl], cos, sin, fdt)
    return outs[0], outs[1]


def apply_backward(gq, gk, q, k, x, wr, layout: str, needs) -> list[Optional[torch.Tensor]]:
    """[dq, dk, dx, dwr] of apply_forward (None where ``needs`` is False).

    With (e, o) a channel pair of q and (g_e, g_o) its gradient: dq is the gradient
    rotated back, (g_e cos + g_o sin, g_o cos - g_e sin), and the phase gets
    cos * sum(g_o e - g_e o) - sin * sum(g_o o + g_e e), summed over heads, q and k
    (and the batch when the positions are shared).
    """
    need_q, need_k, need_x, need_wr = (bool(n) for n in needs)
    F2 = wr.shape[0]
    F = 2 * F2
    fdt = feature_dtype(gq.dtype)
    xb = batch_positions(x)
    dx, dwr = _grad_buffers(xb, wr, fdt, need_x, need_wr)
    grads: list[Optional[torch.Tensor]] = []
    for t, g, need in ((q, gq, need_q), (k, gk, need_k)):
        d = None
        if need:
            d = torch.empty(t.shape, dtype=t.dtype, device=t.device)
            if t.shape[-1] > F:
                d[..., F:] = g[..., F:]
        grads.append(d)
    tensors = [
        (
            heads_first(t, layout),
            heads_first(g, layout),
            None if d is None else heads_first(d, layout),
        )
        for t, g, d in zip((q, k), (gq, gk), grads)
    ]
    need_phase = need_x or need_wr
    for sl in row_chunks(xb.shape[1], _bytes_per_position(tensors[0][0], tensors[1][0], F2)):
        cos, sin = _cos_sin(xb[:, sl], wr, fdt)  # [Bx, n, F/2]
        c, s = cos[:, None], sin[:, None]
        cross = dot = None  # sum(g_o e - g_e o), sum(g_o o + g_e e): [B, n, F/2]
        for t, g, d in tensors:
            g_e, g_o = _pairs(g[:, :, sl], F, fdt)
            if d is not None:
                d[:, :, sl, :F] = _interleave(g_e * c + g_o * s, g_o * c - g_e * s)
            if need_phase:
                e, o = _pairs(t[:, :, sl], F, fdt)
                cr = (g_o * e - g_e * o).sum(1)
                dt = (g_o * o + g_e * e).sum(1)
                cross = cr if cross is None else cross + cr
                dot = dt if dot is None else dot + dt
        if need_phase:
            dphi = cos * cross.sum_to_size(cos.shape) - sin * dot.sum_to_size(sin.shape)
            _phase_grads(dphi, xb[:, sl], wr, None if dx is None else dx[:, sl], dwr)
    dx, dwr = _finish(dx, dwr, xb, wr)
    if dx is not None:
        dx = dx.view(x.shape)
    return [grads[0], grads[1], dx, dwr]


def apply_autograd(q, k, x, wr, layout: str):
    """apply_forward from differentiable ops (the graph of a double backward)."""
    fdt = feature_dtype(q.dtype)
    xb = batch_positions(x)
    rows = xb.reshape(-1, xb.shape[-1])
    angle = reduced_angle(phase_turns(rows, wr), fdt).view(*xb.shape[:-1], 1, wr.shape[0])
    cos, sin = torch.cos(angle), torch.sin(angle)  # [Bx, N, 1, F/2]
    F = 2 * wr.shape[0]
    outs = []
    for t in (q, k):
        th = heads_first(t, layout).transpose(1, 2)  # [B, N, H, D]
        rot = _rotated(th, cos, sin, fdt).to(q.dtype)
        full = torch.cat([rot, th[..., F:].to(q.dtype)], dim=-1)
        outs.append(heads_first(full.transpose(1, 2), layout))
    return outs[0], outs[1]
