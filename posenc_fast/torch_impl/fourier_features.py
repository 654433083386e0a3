"""Learnable Fourier features in pure PyTorch: the CPU fallback and the GPU fallback.

Memory-efficient by construction: rows of positions are processed in chunks, so the
[N, F] features and the [N, H] hidden layer only ever exist for one chunk; the backward
saves nothing but the inputs and recomputes features and hidden layer chunk by chunk.

Shapes (R = rows = N * G: every group of every position is one row of M coordinates):
    rows [R, M], wr [F/2, M], w1 [F, H], b1 [H], w2 [H, Dg], b2 [Dg] -> out [R, Dg]
Precision: phases in float64 reduced to [-pi, pi] before the trig (see _common.py);
features and MLP in float32 (float64 for float64 weights). On the CPU half-precision
outputs are computed in float32 and rounded once at the end; on the GPU the MLP runs in
the output dtype on tensor cores, like the Triton kernel. Matmuls follow
torch.backends.cuda.matmul.allow_tf32 (off by default), so fp32 means fp32.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .. import _activations
from ._common import feature_dtype, phase_turns, reduced_angle, row_chunks


def _mlp_dtype(out_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    if out_dtype in (torch.float16, torch.bfloat16) and device.type == "cpu":
        return torch.float32
    return out_dtype


def _cos_sin(rows: torch.Tensor, wr: torch.Tensor, dtype: torch.dtype):
    """cos and sin of rows @ wr^T, each [R, F/2] in ``dtype``."""
    angle = reduced_angle(phase_turns(rows, wr), dtype)
    return torch.cos(angle), torch.sin(angle)


def _bytes_per_row(wr, w1, w2) -> int:
    f2 = wr.shape[0]
    hidden = 0 if w1 is None else w1.shape[1]
    width = 2 * f2 if w1 is None else w2.shape[1]
    # float64 phase + cos/sin + features + pre-activation, activation, gradients + output
    return 8 * f2 + 4 * 4 * f2 + 4 * 4 * hidden + 4 * 2 * width + 64


def forward_rows(rows, wr, w1, b1, w2, b2, activation: str, mlp_dtype: torch.dtype) -> torch.Tensor:
    """One chunk, differentiable by autograd (double backward differentiates this)."""
    fdt = feature_dtype(mlp_dtype)
    c, s = _cos_sin(rows, wr, fdt)
    r = torch.cat([c, s], dim=1) * (1.0 / math.sqrt(2 * wr.shape[0]))  # [R, F]
    if w1 is None:
        return r
    a = torch.addmm(b1.to(mlp_dtype), r.to(mlp_dtype), w1.to(mlp_dtype))  # [R, H]
    h = _activations.apply(activation, a)
    return torch.addmm(b2.to(mlp_dtype), h, w2.to(mlp_dtype))  # [R, Dg]


def _rows_of(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.is_floating_point() else rows.to(torch.float32)


def lff_forward(x, wr, w1, b1, w2, b2, activation: str, out_dtype: torch.dtype) -> torch.Tensor:
    """x [..., G, M] -> [..., G * width] in out_dtype (width = Dg, or F without MLP)."""
    G = x.shape[-2]
    rows = _rows_of(x)
    width = 2 * wr.shape[0] if w1 is None else w2.shape[1]
    out = torch.empty((rows.shape[0], width), dtype=out_dtype, device=x.device)
    mlp_dtype = _mlp_dtype(out_dtype, x.device)
    for sl in row_chunks(rows.shape[0], _bytes_per_row(wr, w1, w2)):
        out[sl] = forward_rows(rows[sl], wr, w1, b1, w2, b2, activation, mlp_dtype)
    return out.reshape(*x.shape[:-2], G * width)


def lff_autograd(x, wr, w1, b1, w2, b2, activation: str, out_dtype: torch.dtype) -> torch.Tensor:
    """Unchunked, autograd-traceable forward: used only to build double-backward graphs."""
    G = x.shape[-2]
    rows = _rows_of(x)
    y = forward_rows(rows, wr, w1, b1, w2, b2, activation, _mlp_dtype(out_dtype, x.device))
    return y.to(out_dtype).reshape(*x.shape[:-2], G * y.shape[-1])


def lff_backward(
    grad, x, wr, w1, b1, w2, b2, activation: str, needs
) -> list[Optional[torch.Tensor]]:
    """Gradients (dx, dwr, dw1, db1, dw2, db2); None where ``needs`` is False.

    Recomputes features and hidden layer per chunk from x and the weights. Weight
    gradients are accumulated chunk after chunk in float32 (float64 for float64 weights):
    a fixed order, so repeated runs are bitwise identical.
    """
    need_x, need_wr, need_w1, need_b1, need_w2, need_b2 = needs
    rows = _rows_of(x)
    R, M = rows.shape
    mlp = w1 is not None
    mlp_dtype = _mlp_dtype(grad.dtype, x.device)
    fdt = feature_dtype(mlp_dtype)
    acc = torch.float64 if wr.dtype == torch.float64 else torch.float32
    inv_sqrt_f = 1.0 / math.sqrt(2 * wr.shape[0])
    g_rows = grad.reshape(R, grad.shape[-1] // x.shape[-2])

    dx = torch.empty((R, M), dtype=fdt, device=x.device) if need_x else None
    dwr = torch.zeros(wr.shape, dtype=acc, device=x.device) if need_wr else None
    dw1 = torch.zeros(w1.shape, dtype=acc, device=x.device) if (mlp and need_w1) else None
    db1 = torch.zeros(b1.shape, dtype=acc, device=x.device) if (mlp and need_b1) else None
    dw2 = torch.zeros(w2.shape, dtype=acc, device=x.device) if (mlp and need_w2) else None
    db2 = torch.zeros(b2.shape, dtype=acc, device=x.device) if (mlp and need_b2) else None
    if mlp:
        w1c, b1c, w2c = w1.to(mlp_dtype), b1.to(mlp_dtype), w2.to(mlp_dtype)
    wr_f = wr.to(fdt)

    for sl in row_chunks(R, _bytes_per_row(wr, w1, w2)):
        xr = rows[sl]
        c, s = _cos_sin(xr, wr, fdt)  # [n, F/2]
        gy = g_rows[sl].to(mlp_dtype)
        if mlp:
            r = (torch.cat([c, s], dim=1) * inv_sqrt_f).to(mlp_dtype)  # [n, F]
            a = torch.addmm(b1c, r, w1c)  # [n, H]
            h = _activations.apply(activation, a)
            if db2 is not None:
                db2 += gy.sum(0, dtype=acc)
            if dw2 is not None:
                dw2 += (h.T @ gy).to(acc)
            ga = (gy @ w2c.T) * _activations.derivative(activation, a)  # [n, H]
            if db1 is not None:
                db1 += ga.sum(0, dtype=acc)
            if dw1 is not None:
                dw1 += (r.T @ ga).to(acc)
            if not (need_x or need_wr):
                continue
            gr = (ga @ w1c.T).to(fdt)  # [n, F]
        else:
            gr = gy.to(fdt)
        f2 = c.shape[1]
        # d[cos, sin]/dphase = [-sin, cos]
        gphase = (gr[:, f2:] * c - gr[:, :f2] * s) * inv_sqrt_f  # [n, F/2]
        if dx is not None:
            dx[sl] = gphase @ wr_f
        if dwr is not None:
            dwr += (gphase.T @ xr.to(fdt)).to(acc)

    out = [None] * 6
    if dx is not None:
        out[0] = dx.to(x.dtype).reshape(x.shape)
    for i, (g, ref) in enumerate(zip((dwr, dw1, db1, dw2, db2), (wr, w1, b1, w2, b2)), start=1):
        if g is not None:
            out[i] = g.to(ref.dtype)
    return out
