"""Learnable Fourier rotary embeddings in pure PyTorch (the CPU and GPU fallback).

Shapes (see reference.py for the formulas):
    x [Bx, N, M] positions (Bx = B, or 1 for positions shared by the batch), wr [F/2, M]
    q [B, Hq, N, D], k [B, Hk, N, D] in "heads first" view (``heads_first``), F <= D
    table: [2, *x.shape[:-1], F], cos then sin, each frequency on channels 2i and 2i+1

Phases are reduced in float64 before a float32 trig (float64 for float64 q), as for
LFF (_torch_math.py); rotations run in float32 for half-precision q / k, rounded once. The
positions are processed in chunks, and the cos / sin of a position are computed once
for every head and batch row that uses them. The backward saves only the inputs and
recomputes the cos / sin; the weight gradient is accumulated chunk after chunk in a
fixed order (bitwise reproducible).
"""

from __future__ import annotations

from typing import Optional

import torch

from .._custom_ops import onnx_exporting
from .._export_phases import cos_sin_graph
from .._torch_math import (
    feature_dtype,
    phase_turns,
    reduced_angle_,
    row_chunks,
)


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


# ------------------------------------------------------------------------ the table


def table_forward(x: torch.Tensor, wr: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """x [..., M] -> [2, ..., F] in out_dtype: cos and sin, each on two channels."""
    rows = x.reshape(-1, x.shape[-1])
    R, F2 = rows.shape[0], wr.shape[0]
    out = torch.empty((2, R, 2 * F2), dtype=out_dtype, device=x.device)
    fdt = feature_dtype(out_dtype)
    for sl in row_chunks(R, 2 * F2 * (8 + 4 * 6)):
        cos, sin = _cos_sin(rows[sl], wr, fdt)
        out[0, sl] = cos.repeat_interleave(2, dim=-1)
        out[1, sl] = sin.repeat_interleave(2, dim=-1)
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
    """table_forward from differentiable ops (the graph of a double backward, and what an
    ONNX export traces: float32 phases there, ops/_export_phases.py)."""
    fdt = feature_dtype(out_dtype)
    rows = x.reshape(-1, x.shape[-1])
    table = torch.stack(cos_sin_graph(rows, wr, fdt))
    if onnx_exporting():  # each frequency on two channels (as _rotation_tables)
        table = torch.stack([table, table], dim=-1).flatten(-2)
    else:
        table = table.repeat_interleave(2, dim=-1)
    return table.to(out_dtype).view(2, *x.shape[:-1], 2 * wr.shape[0])


# ------------------------------------------------------------------------ q and k
#
# In the interleaved layout, with swap(t) = (t[1], t[0], t[3], t[2], ...) the channel
# pairs exchanged, C = (c, c, ...) and S = (-s, s, ...) per frequency:
#     rotation  t' = t * C + swap(t) * S         (e c - o s, o c + e s)
#     transpose g  -> g * C - swap(g) * S         (g_e c + g_o s, g_o c - g_e s)
# three passes over each head's channels (a product, the swap, an addcmul), the C / S
# tables built once per position for all heads.


def _swap(t: torch.Tensor) -> torch.Tensor:
    """Channels 2i and 2i+1 exchanged: [..., F] -> [..., F] (a copy; stack of the two
    strided halves: ~10x faster on the CPU than flip of a size-2 axis)."""
    return torch.stack([t[..., 1::2], t[..., 0::2]], dim=-1).flatten(-2)


def _dense(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in ``dtype`` with unit channel stride: LightGlue's q and k are slices of a fused
    qkv tensor (channel stride 3), on which every elementwise op is ~2x slower; one
    copy first pays for itself over the three passes that follow."""
    t = t.to(dtype)
    return t if t.stride(-1) == 1 else t.contiguous()


def _rotation_tables(cos: torch.Tensor, sin: torch.Tensor):
    """C, S [Bx, 1, n, F] from cos, sin [Bx, n, F/2] (see above); broadcast over heads."""
    if onnx_exporting():  # the TorchScript-based exporter loses repeat_interleave's rank
        C = torch.stack([cos, cos], dim=-1).flatten(-2)
    else:
        C = cos.repeat_interleave(2, dim=-1)
    S = torch.stack([-sin, sin], dim=-1).flatten(-2)
    return C[:, None], S[:, None]


def _bytes_per_position(q, k, F2: int) -> int:
    """Temporaries per position of one chunk: float64 turns, the C / S tables, and per
    head of q and k a few float32 [F] tensors (converted input, swap, products)."""
    heads = q.shape[0] * q.shape[1] + k.shape[0] * k.shape[1]
    return F2 * (8 + 4 * 8 + heads * 4 * 2 * 4) + 64


def _into(dst: torch.Tensor, t, C, swapped, S, sign: float) -> None:
    """dst = t * C + sign * swapped * S, written into dst (rounded once to its dtype)."""
    if dst.dtype == t.dtype:
        torch.mul(t, C, out=dst)
        dst.addcmul_(swapped, S, value=sign)
    else:
        dst.copy_(torch.addcmul(t * C, swapped, S, value=sign))


def _outputs(tensors, dtype, F: int, sources):
    """Empty outputs like ``tensors`` (dtype ``dtype``), channels >= F copied from
    ``sources`` (the pass-through part)."""
    outs = []
    for t, src in zip(tensors, sources):
        out = torch.empty(t.shape, dtype=dtype, device=t.device)
        if t.shape[-1] > F:
            out[..., F:] = src[..., F:]
        outs.append(out)
    return outs


def apply_forward(q, k, x, wr, layout: str):
    """(q', k') in q's dtype, allocated in the layout of q and k (see the module doc)."""
    F = 2 * wr.shape[0]
    fdt = feature_dtype(q.dtype)
    outs = _outputs((q, k), q.dtype, F, (q, k))
    src = [heads_first(t, layout) for t in (q, k)]
    dst = [heads_first(t, layout) for t in outs]
    xb = batch_positions(x)
    for sl in row_chunks(xb.shape[1], _bytes_per_position(src[0], src[1], F // 2)):
        C, S = _rotation_tables(*_cos_sin(xb[:, sl], wr, fdt))
        for s, d in zip(src, dst):
            t = _dense(s[:, :, sl, :F], fdt)
            _into(d[:, :, sl, :F], t, C, _swap(t), S, 1.0)
    return outs[0], outs[1]


def apply_backward(gq, gk, q, k, x, wr, layout: str, needs) -> list[Optional[torch.Tensor]]:
    """[dq, dk, dx, dwr] of apply_forward (None where ``needs`` is False).

    dq is the gradient rotated back (the transpose, above). The phase of frequency i gets
    cos * sum(g_o e - g_e o) - sin * sum(g_o o + g_e e) over the channel pairs (e, o) of
    every head of q and k (and every batch row when the positions are shared):
    sum(g * swap(t)) holds (g_e o, g_o e) and sum(g * t) holds (g_e e, g_o o).
    """
    need_q, need_k, need_x, need_wr = (bool(n) for n in needs)
    F2 = wr.shape[0]
    F = 2 * F2
    fdt = feature_dtype(gq.dtype)
    xb = batch_positions(x)
    dx, dwr = _grad_buffers(xb, wr, fdt, need_x, need_wr)
    wanted = [(t, g) for t, g, n in ((q, gq, need_q), (k, gk, need_k)) if n]
    made = iter(_outputs([t for t, _ in wanted], q.dtype, F, [g for _, g in wanted]))
    grads = [next(made) if n else None for n in (need_q, need_k)]
    tensors = [
        [heads_first(a, layout) if a is not None else None for a in (t, g, d)]
        for t, g, d in zip((q, k), (gq, gk), grads)
    ]
    need_phase = need_x or need_wr
    for sl in row_chunks(xb.shape[1], _bytes_per_position(tensors[0][0], tensors[1][0], F2)):
        cos, sin = _cos_sin(xb[:, sl], wr, fdt)  # [Bx, n, F/2]
        C, S = _rotation_tables(cos, sin)
        cross = dot = 0.0  # sums over heads of g * swap(t) and g * t: [B, n, F]
        for t, g, d in tensors:
            gs = _dense(g[:, :, sl, :F], fdt)
            if d is not None:
                _into(d[:, :, sl, :F], gs, C, _swap(gs), S, -1.0)
            if need_phase:
                ts = t[:, :, sl, :F].to(fdt)  # as it is: a copy measured no faster here
                cross = cross + (gs * _swap(ts)).sum(1)
                dot = dot + (gs * ts).sum(1)
        if need_phase:
            cross = cross[..., 1::2] - cross[..., 0::2]  # g_o e - g_e o
            dot = dot[..., 0::2] + dot[..., 1::2]  # g_e e + g_o o
            dphi = cos * cross.sum_to_size(cos.shape) - sin * dot.sum_to_size(sin.shape)
            _phase_grads(dphi, xb[:, sl], wr, None if dx is None else dx[:, sl], dwr)
    dx, dwr = _finish(dx, dwr, xb, wr)
    if dx is not None:
        dx = dx.view(x.shape)
    return [grads[0], grads[1], dx, dwr]


def apply_autograd(q, k, x, wr, layout: str):
    """apply_forward from differentiable ops (the graph of a double backward, and what an
    ONNX export traces: float32 phases there, ops/_export_phases.py)."""
    fdt = feature_dtype(q.dtype)
    xb = batch_positions(x)
    rows = xb.reshape(-1, xb.shape[-1])
    cos, sin = (t.view(*xb.shape[:-1], wr.shape[0]) for t in cos_sin_graph(rows, wr, fdt))
    C, S = _rotation_tables(cos, sin)  # [Bx, 1, N, F]
    F = 2 * wr.shape[0]
    outs = []
    for t in (q, k):
        th = heads_first(t, layout)
        head = th[..., :F].to(fdt)
        rot = (head * C + _swap(head) * S).to(q.dtype)
        if th.shape[-1] > F:  # channels after rotary_dim pass through (no empty cat: the
            # TorchScript-based ONNX exporter refuses one)
            rot = torch.cat([rot, th[..., F:].to(q.dtype)], dim=-1)
        outs.append(heads_first(rot, layout))
    return outs[0], outs[1]
