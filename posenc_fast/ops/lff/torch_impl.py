"""Learnable Fourier features in pure PyTorch, the CPU and GPU fallback: rows processed in
chunks so that the [N, F] features and [N, H] hidden layer exist for one chunk only; the
backward saves the inputs alone and recomputes chunk by chunk."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .._export_phases import cos_sin_graph
from .._torch_math import (
    TWO_PI,
    feature_dtype,
    float32_phases_suffice,
    row_chunks,
)
from . import activations

# Shapes (R = rows = N * G: every group of every position is one row of M coordinates):
#     rows [R, M], wr [F/2, M], w1 [F, H], b1 [H], w2 [H, Dg], b2 [Dg] -> out [R, Dg]
# Precision: phases in float32 when a cheap per-call bound proves them accurate enough
# (float32_phases_suffice), else in float64 reduced exactly before a float32 trig; either way
# every cos/sin is within 1e-6 of float64 math. Features and MLP in float32 (float64 for
# float64 weights), half-precision outputs rounded once at the end. Matmuls follow torch's
# TF32 setting; the float32 phases themselves are never a matmul.
# Speed: few, large ATen ops per chunk. cos and sin stay two contiguous [n, F/2] blocks
# (no out= into half of a [n, F] buffer, no torch.cat copy), so the MLP's first layer is two
# GEMMs (cos rows and sin rows of w1); the 1/sqrt(F) scale rides in the GEMMs' alpha.

# Below this many phases per call the float64 path costs less than deciding (a few small
# ops and a host sync): take it without looking.
_CHECK_FLOAT32_FROM = 32768


def _mlp_dtype(out_dtype: torch.dtype) -> torch.dtype:
    """float32 for half-precision outputs, rounded once at the end: accuracy and identical
    numbers on CPU and GPU (a bf16 pre-activation would flip relu's gradient near 0)."""
    if out_dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return out_dtype


def _rows_of(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.is_floating_point() else rows.to(torch.float32)


def _bytes_per_row(wr, w1, w2, float64_phases: bool) -> int:
    f2 = wr.shape[0]
    hidden = 0 if w1 is None else w1.shape[1]
    width = 2 * f2 if w1 is None else w2.shape[1]
    # float64 turns, angle, cos, sin and their gradients, hidden layer x 4, output
    turns = 8 * f2 if float64_phases else 0
    return turns + 4 * 5 * f2 + 4 * 4 * hidden + 4 * 2 * width + 64


def _to(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in dtype; t itself, without a dispatcher call, when it already is."""
    return t if t.dtype == dtype else t.to(dtype)


def _part(t: torch.Tensor, sl: slice) -> torch.Tensor:
    """t[sl], or t itself when sl covers all its rows (one chunk: no slicing)."""
    return t if sl.start == 0 and sl.stop >= t.shape[0] else t[sl]


@dataclass
class _Prepared:
    """Weights in the layout and dtype one call uses, computed once per call."""

    feat_dtype: torch.dtype
    mlp_dtype: torch.dtype
    inv_sqrt_f: float
    wr: torch.Tensor  # [F/2, M] in feat_dtype: dx and dwr
    wr_t: Optional[torch.Tensor]  # [M, F/2] feat_dtype: float32 phases (None: float64 path)
    turns_t: Optional[torch.Tensor]  # [M, F/2] float64 wr^T (a view): float64 path
    w1c: Optional[torch.Tensor] = None  # [F/2, H] rows of w1 that multiply the cosines
    w1s: Optional[torch.Tensor] = None  # [F/2, H] rows of w1 that multiply the sines
    b1: Optional[torch.Tensor] = None
    w2: Optional[torch.Tensor] = None
    b2: Optional[torch.Tensor] = None

    @property
    def half(self) -> int:
        return self.wr.shape[0]


def _prepare(rows, wr, w1, b1, w2, b2, mlp_dtype) -> _Prepared:
    fdt = feature_dtype(mlp_dtype)
    half = wr.shape[0]
    fast = (
        fdt == torch.float32
        and rows.shape[0] * half >= _CHECK_FLOAT32_FROM
        and float32_phases_suffice(rows, wr)
    )
    wr_f = _to(wr, fdt)
    p = _Prepared(
        fdt,
        mlp_dtype,
        1.0 / math.sqrt(2 * half),
        wr_f,
        wr_f.T.contiguous() if fast else None,
        None if fast else _to(wr, torch.float64).T,
    )
    if w1 is not None:
        w1m = _to(w1, mlp_dtype)
        p.w1c, p.w1s = w1m[:half], w1m[half:]
        p.b1, p.w2, p.b2 = _to(b1, mlp_dtype), _to(w2, mlp_dtype), _to(b2, mlp_dtype)
    return p


class _Workspace:
    """Buffers of one call, allocated for the first (largest) chunk and reused."""

    def __init__(self, p: _Prepared, n: int, device):
        self.p = p
        self.angle, self.cos, self.sin = torch.empty(
            (3, n, p.half), dtype=p.feat_dtype, device=device
        ).unbind(0)
        self.turns = None
        if p.turns_t is not None:
            self.turns = torch.empty((n, p.half), dtype=torch.float64, device=device)

    def phase_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """rows in the dtype of the phase computation (convert once per call)."""
        return _to(rows, torch.float32 if self.p.wr_t is not None else torch.float64)

    def cos_sin(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the phases rows wr^T, unscaled: two [n, F/2] blocks. rows in
        the dtype ``phase_rows`` gives."""
        p, part = self.p, slice(0, rows.shape[0])
        angle = _part(self.angle, part)
        if p.wr_t is not None:  # float32 phases, proven accurate enough for this call
            # elementwise, never a matmul: no TF32 or reduced-precision GEMM can touch it
            torch.mul(rows[:, :1], p.wr_t[0], out=angle)
            for m in range(1, rows.shape[1]):
                angle.addcmul_(rows[:, m : m + 1], p.wr_t[m])
        else:  # float64 turns (x wr products exact), reduced exactly, rounded once
            turns = _part(self.turns, part)
            turns.addmm_(rows, p.turns_t, beta=0.0, alpha=1.0 / TWO_PI)
            angle.copy_(turns.frac_().mul_(TWO_PI))
        cos = torch.cos(angle, out=_part(self.cos, part))
        return cos, torch.sin(angle, out=_part(self.sin, part))


def _pre_activation(p: _Prepared, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """[cos | sin] / sqrt(F) @ w1 + b1: [n, H]."""
    a = torch.addmm(p.b1, c, p.w1c, alpha=p.inv_sqrt_f)
    return a.addmm_(s, p.w1s, alpha=p.inv_sqrt_f)


def lff_forward(x, wr, w1, b1, w2, b2, activation: str, out_dtype: torch.dtype) -> torch.Tensor:
    """x [..., G, M] -> [..., G * width] in out_dtype (width = Dg, or F without MLP)."""
    G = x.shape[-2]
    rows = _rows_of(x)
    R = rows.shape[0]
    width = 2 * wr.shape[0] if w1 is None else w2.shape[1]
    out = torch.empty((R, width), dtype=out_dtype, device=x.device)
    p = _prepare(rows, wr, w1, b1, w2, b2, _mlp_dtype(out_dtype))
    ws = phase_rows = None
    for sl in row_chunks(R, _bytes_per_row(wr, w1, w2, p.turns_t is not None), x.device.type):
        if ws is None:
            ws = _Workspace(p, sl.stop - sl.start, x.device)
            phase_rows = ws.phase_rows(rows)
        c, s = ws.cos_sin(_part(phase_rows, sl))
        if w1 is None:
            torch.mul(c, p.inv_sqrt_f, out=out[sl, : p.half])
            torch.mul(s, p.inv_sqrt_f, out=out[sl, p.half :])
            continue
        h = activations.get(activation).aten(_pre_activation(p, c, s))
        if out.dtype == p.mlp_dtype:
            torch.addmm(p.b2, h, p.w2, out=_part(out, sl))
        else:
            out[sl] = torch.addmm(p.b2, h, p.w2)
    return out.reshape(*x.shape[:-2], G * width)


def lff_autograd(x, wr, w1, b1, w2, b2, activation: str, out_dtype: torch.dtype) -> torch.Tensor:
    """Unchunked forward made of differentiable ops: the graph of a double backward
    (create_graph=True) and what an ONNX export traces (ops/_custom_ops.py; float32 phases
    there: ops/_export_phases.py). Same math as lff_forward, written plainly."""
    G = x.shape[-2]
    rows = _rows_of(x)
    mlp_dtype = _mlp_dtype(out_dtype)
    cos, sin = cos_sin_graph(rows, wr, feature_dtype(mlp_dtype))
    r = torch.cat([cos, sin], dim=1) / math.sqrt(2 * wr.shape[0])
    if w1 is None:
        y = r
    else:
        h = activations.get(activation).folded(
            r.to(mlp_dtype) @ w1.to(mlp_dtype) + b1.to(mlp_dtype)
        )
        y = h @ w2.to(mlp_dtype) + b2.to(mlp_dtype)
    return y.to(out_dtype).reshape(*x.shape[:-2], G * y.shape[-1])


class _Sums:
    """Weight gradients summed chunk after chunk in a fixed order (bitwise reproducible):
    a block's first product is written (beta = 0), later ones are added in place."""

    def __init__(self, dtype, device):
        self.dtype, self.device = dtype, device
        self.grads: dict[str, torch.Tensor] = {}
        self.written: set = set()

    def addmm(self, name: str, shape, a, b, alpha: float = 1.0, cols=None) -> None:
        """grads[name][:, cols] += alpha * a @ b (all columns when cols is None)."""
        g = self.grads.get(name)
        if g is None:
            g = self.grads[name] = torch.empty(shape, dtype=self.dtype, device=self.device)
        key = (name, None if cols is None else cols.start)
        beta = 1.0 if key in self.written else 0.0
        self.written.add(key)
        target = g if cols is None else g[:, cols]
        target.addmm_(_to(a, self.dtype), _to(b, self.dtype), beta=beta, alpha=alpha)

    def sum_rows(self, name: str, t: torch.Tensor) -> None:
        """grads[name] += t summed over its rows."""
        part = t.sum(0, dtype=self.dtype)
        g = self.grads.get(name)
        self.grads[name] = part if g is None else g.add_(part)

    def get(self, name: str, shape) -> torch.Tensor:
        g = self.grads.get(name)
        if g is None:  # no rows: nothing was summed
            g = torch.zeros(shape, dtype=self.dtype, device=self.device)
        return g


def lff_backward(
    grad, x, wr, w1, b1, w2, b2, activation: str, needs
) -> list[Optional[torch.Tensor]]:
    """Gradients (dx, dwr, dw1, db1, dw2, db2); None where ``needs`` is False.

    Recomputes features and hidden layer per chunk; weight gradients summed chunk after
    chunk in float32 (float64 for float64 weights), a fixed order: bitwise reproducible.
    GEMMs avoid few output columns (slow in CPU BLAS): dwr as x^T gphase [M, F/2], dx as
    wr^T gphase^T [M, n], dw1 as ga^T [cos | sin] [H, F]; db2 rides in dw2's GEMM."""
    need_x, need_wr, need_w1, need_b1, need_w2, need_b2 = needs
    mlp = w1 is not None
    out: list[Optional[torch.Tensor]] = [None] * 6
    if not (need_x or need_wr or (mlp and (need_w1 or need_b1 or need_w2 or need_b2))):
        return out
    rows = _rows_of(x)
    R, M = rows.shape
    p = _prepare(rows, wr, w1, b1, w2, b2, _mlp_dtype(grad.dtype))
    inv, half = p.inv_sqrt_f, p.half
    acc = torch.float64 if wr.dtype == torch.float64 else torch.float32
    sums = _Sums(acc, x.device)
    g_rows = grad.reshape(R, grad.shape[-1] // x.shape[-2])
    dx_t = torch.empty((M, R), dtype=p.feat_dtype, device=x.device) if need_x else None
    need_phase = need_x or need_wr
    H = w1.shape[1] if mlp else 0
    ws = h1 = phase_rows = None

    for sl in row_chunks(R, _bytes_per_row(wr, w1, w2, p.turns_t is not None), x.device.type):
        if ws is None:
            ws = _Workspace(p, sl.stop - sl.start, x.device)
            phase_rows = ws.phase_rows(rows)
        xr = _part(rows, sl)
        c, s = ws.cos_sin(_part(phase_rows, sl))  # unscaled [n, F/2] each
        gy = _to(_part(g_rows, sl), p.mlp_dtype)
        if mlp:
            a = _pre_activation(p, c, s)  # [n, H]
            if need_w2 or need_b2:  # [h | 1]^T gy: dw2 and db2 in one GEMM
                if h1 is None:
                    h1 = torch.ones((a.shape[0], H + 1), dtype=a.dtype, device=x.device)
                h = _part(h1, slice(0, a.shape[0]))
                h[:, :H].copy_(activations.get(activation).aten(a))
                sums.addmm("w2b2", (H + 1, w2.shape[1]), h.T, gy)
            ga = activations.get(activation).aten_backward(gy @ p.w2.T, a)  # [n, H]
            if need_b1:
                sums.sum_rows("b1", ga)
            if need_w1:
                sums.addmm("w1_t", (H, 2 * half), ga.T, c, inv, slice(0, half))
                sums.addmm("w1_t", (H, 2 * half), ga.T, s, inv, slice(half, 2 * half))
            if not need_phase:
                continue
            # d loss / d [cos | sin], without the 1/sqrt(F) (it rides in the GEMMs below)
            g_cos, g_sin = ga @ p.w1c.T, ga @ p.w1s.T  # [n, F/2] each, fresh
        else:
            g = _to(gy, p.feat_dtype)
            g_cos, g_sin = g[:, :half], g[:, half:].clone()  # gy may be the caller's
        # d[cos, sin]/dphase = [-sin, cos]: gphase = g_sin * cos - g_cos * sin
        gphase = g_sin.mul_(c).addcmul_(g_cos, s, value=-1.0)
        if dx_t is not None:
            dx_t[:, sl].addmm_(p.wr.T, gphase.T, beta=0.0, alpha=inv)
        if need_wr:
            sums.addmm("wr_t", (M, half), _to(xr, p.feat_dtype).T, gphase, inv)

    # transposed sums back to the weights' layout, each output its own contiguous tensor
    if dx_t is not None:
        out[0] = _to(dx_t.T, x.dtype).contiguous().reshape(x.shape)
    if need_wr:
        out[1] = _to(sums.get("wr_t", (M, half)).T, wr.dtype).contiguous()
    if mlp:
        if need_w1:
            out[2] = _to(sums.get("w1_t", (H, 2 * half)).T, w1.dtype).contiguous()
        if need_b1:
            out[3] = _to(sums.get("b1", (H,)), b1.dtype)
        w2b2 = sums.get("w2b2", (H + 1, w2.shape[1])) if (need_w2 or need_b2) else None
        if need_w2:
            out[4] = _to(w2b2[:H], w2.dtype)
        if need_b2:
            out[5] = w2b2[H].to(b2.dtype, copy=True)  # not a view of dw2's tensor
    return out
