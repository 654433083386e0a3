"""Learnable Fourier features in pure PyTorch: the CPU fallback and the GPU fallback.

Memory-efficient by construction: rows of positions are processed in chunks, so the
[N, F] features and the [N, H] hidden layer only ever exist for one chunk; the backward
saves nothing but the inputs and recomputes features and hidden layer chunk by chunk.

Shapes (R = rows = N * G: every group of every position is one row of M coordinates):
    rows [R, M], wr [F/2, M], w1 [F, H], b1 [H], w2 [H, Dg], b2 [Dg] -> out [R, Dg]
Precision: phases in float64 reduced exactly before a float32 trig (see _common.py);
features and MLP in float32 (float64 for float64 weights); half-precision outputs are
computed in float32 and rounded once at the end, on every device. Matmuls follow
torch.backends.cuda.matmul.allow_tf32 (off by default), so fp32 means fp32.
Speed: the 1/sqrt(F) scale is folded into w1, cos and sin are written straight into one
feature buffer reused across chunks, and the last matmul writes into the output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .. import _activations
from ._common import TWO_PI, feature_dtype, phase_turns, reduced_angle, reduced_angle_, row_chunks


def _mlp_dtype(out_dtype: torch.dtype) -> torch.dtype:
    """The torch backend runs the MLP in float32 for half-precision outputs on every device
    and rounds once at the end: the fallback favours accuracy and identical numbers on CPU
    and GPU (a bf16 pre-activation would flip relu's gradient for near-zero entries)."""
    if out_dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return out_dtype


def _rows_of(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.is_floating_point() else rows.to(torch.float32)


def _bytes_per_row(wr, w1, w2) -> int:
    f2 = wr.shape[0]
    hidden = 0 if w1 is None else w1.shape[1]
    width = 2 * f2 if w1 is None else w2.shape[1]
    # float64 turns + angle + features + pre-activation, activation, gradients + output
    return 2 * 8 * f2 + 4 * 2 * f2 + 4 * 4 * hidden + 4 * 2 * width + 64


@dataclass
class _Prepared:
    """Weights in the layout and dtype one call uses, computed once per call."""

    turns_t: torch.Tensor  # [M, F/2] float64: (wr / 2 pi)^T
    feat_dtype: torch.dtype
    mlp_dtype: torch.dtype
    inv_sqrt_f: float
    w1s: Optional[torch.Tensor] = None  # [F, H] w1 / sqrt(F): the feature scale folded in
    b1: Optional[torch.Tensor] = None
    w2: Optional[torch.Tensor] = None
    b2: Optional[torch.Tensor] = None

    @property
    def half(self) -> int:
        return self.turns_t.shape[1]


def _prepare(wr, w1, b1, w2, b2, mlp_dtype) -> _Prepared:
    inv = 1.0 / math.sqrt(2 * wr.shape[0])
    p = _Prepared(
        (wr.to(torch.float64) / TWO_PI).T.contiguous(), feature_dtype(mlp_dtype), mlp_dtype, inv
    )
    if w1 is not None:
        p.w1s = (w1.to(mlp_dtype) * inv).contiguous()
        p.b1, p.w2, p.b2 = b1.to(mlp_dtype), w2.to(mlp_dtype), b2.to(mlp_dtype)
    return p


def _cos_sin_into(rows: torch.Tensor, p: _Prepared, buf: torch.Tensor) -> None:
    """buf[:, :F/2] = cos(phase), buf[:, F/2:] = sin(phase) (unscaled), phase = rows wr^T."""
    turns = rows.to(torch.float64) @ p.turns_t  # [n, F/2], exact products (float64)
    angle = reduced_angle_(turns, buf.dtype)  # error-free reduction, rounded once
    torch.cos(angle, out=buf[:, : p.half])
    torch.sin(angle, out=buf[:, p.half :])


def lff_forward(x, wr, w1, b1, w2, b2, activation: str, out_dtype: torch.dtype) -> torch.Tensor:
    """x [..., G, M] -> [..., G * width] in out_dtype (width = Dg, or F without MLP)."""
    G = x.shape[-2]
    rows = _rows_of(x)
    R = rows.shape[0]
    width = 2 * wr.shape[0] if w1 is None else w2.shape[1]
    out = torch.empty((R, width), dtype=out_dtype, device=x.device)
    p = _prepare(wr, w1, b1, w2, b2, _mlp_dtype(out_dtype))
    buf = None
    for sl in row_chunks(R, _bytes_per_row(wr, w1, w2)):
        n = sl.stop - sl.start
        if buf is None or buf.shape[0] < n:
            buf = torch.empty((n, 2 * p.half), dtype=p.feat_dtype, device=x.device)
        feats = buf[:n]
        _cos_sin_into(rows[sl], p, feats)
        if w1 is None:
            out[sl] = feats.mul_(p.inv_sqrt_f)
            continue
        a = torch.addmm(p.b1, feats.to(p.mlp_dtype), p.w1s)  # [n, H]
        h = _activations.apply_inplace(activation, a)
        if out.dtype == p.mlp_dtype:
            torch.addmm(p.b2, h, p.w2, out=out[sl])
        else:
            out[sl] = torch.addmm(p.b2, h, p.w2)
    return out.reshape(*x.shape[:-2], G * width)


def lff_autograd(x, wr, w1, b1, w2, b2, activation: str, out_dtype: torch.dtype) -> torch.Tensor:
    """Unchunked forward made of differentiable ops: only used to build the graph of a
    double backward (create_graph=True). Same math as lff_forward, written plainly."""
    G = x.shape[-2]
    rows = _rows_of(x)
    mlp_dtype = _mlp_dtype(out_dtype)
    angle = reduced_angle(phase_turns(rows, wr), feature_dtype(mlp_dtype))
    r = torch.cat([torch.cos(angle), torch.sin(angle)], dim=1) / math.sqrt(2 * wr.shape[0])
    if w1 is None:
        y = r
    else:
        h = _activations.apply(activation, r.to(mlp_dtype) @ w1.to(mlp_dtype) + b1.to(mlp_dtype))
        y = h @ w2.to(mlp_dtype) + b2.to(mlp_dtype)
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
    mlp = w1 is not None
    out: list[Optional[torch.Tensor]] = [None] * 6
    if not (need_x or need_wr or (mlp and (need_w1 or need_b1 or need_w2 or need_b2))):
        return out
    rows = _rows_of(x)
    R, M = rows.shape
    p = _prepare(wr, w1, b1, w2, b2, _mlp_dtype(grad.dtype))
    fdt = p.feat_dtype
    acc = torch.float64 if wr.dtype == torch.float64 else torch.float32
    g_rows = grad.reshape(R, grad.shape[-1] // x.shape[-2])
    dev = x.device

    def zeros_if(flag, ref):
        return torch.zeros(ref.shape, dtype=acc, device=dev) if flag else None

    dx = torch.empty((R, M), dtype=fdt, device=dev) if need_x else None
    dwr = zeros_if(need_wr, wr)
    dw1, db1 = (zeros_if(need_w1, w1), zeros_if(need_b1, b1)) if mlp else (None, None)
    dw2, db2 = (zeros_if(need_w2, w2), zeros_if(need_b2, b2)) if mlp else (None, None)
    wr_f = wr.to(fdt)
    need_phase = need_x or need_wr

    for sl in row_chunks(R, _bytes_per_row(wr, w1, w2)):
        xr = rows[sl]
        feats = torch.empty((xr.shape[0], 2 * p.half), dtype=fdt, device=dev)  # unscaled cos|sin
        _cos_sin_into(xr, p, feats)
        gy = g_rows[sl].to(p.mlp_dtype)
        if mlp:
            r = feats.to(p.mlp_dtype)
            a = torch.addmm(p.b1, r, p.w1s)  # [n, H] pre-activation
            if dw2 is not None or db2 is not None:
                # [h | 1]^T gy gives dw2 and db2 in one pass over the [n, Dg] gradient
                h1 = torch.ones((a.shape[0], a.shape[1] + 1), dtype=a.dtype, device=dev)
                h1[:, :-1] = _activations.apply_inplace(activation, a.clone())
                dw2_b2 = (h1.T @ gy).to(acc)  # [H + 1, Dg]
                if dw2 is not None:
                    dw2 += dw2_b2[:-1]
                if db2 is not None:
                    db2 += dw2_b2[-1]
            ga = _activations.backward_fused(activation, gy @ p.w2.T, a)  # [n, H]
            if db1 is not None:
                db1 += ga.sum(0, dtype=acc)
            if dw1 is not None:
                dw1 += (r.T @ ga).to(acc).mul_(p.inv_sqrt_f)
            if not need_phase:
                continue
            g_feats = (ga @ p.w1s.T).to(fdt)  # d loss / d unscaled [cos | sin], [n, F]
        else:
            g_feats = gy.to(fdt) * p.inv_sqrt_f
        c, s = feats[:, : p.half], feats[:, p.half :]
        # d[cos, sin]/dphase = [-sin, cos]: gphase = g_sin * cos - g_cos * sin
        gphase = torch.mul(g_feats[:, p.half :], c).addcmul_(g_feats[:, : p.half], s, value=-1.0)
        if dx is not None:
            dx[sl] = gphase @ wr_f
        if dwr is not None:
            dwr += (gphase.T @ xr.to(fdt)).to(acc)

    if dx is not None:
        out[0] = dx.to(x.dtype).reshape(x.shape)
    for i, (g, ref) in enumerate(zip((dwr, dw1, db1, dw2, db2), (wr, w1, b1, w2, b2)), start=1):
        if g is not None:
            out[i] = g.to(ref.dtype)
    return out
