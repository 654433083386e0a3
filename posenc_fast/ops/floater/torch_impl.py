"""FLOATER in pure PyTorch: the "torch" backend's integrator and its discrete adjoint,
arranged to keep the number of PyTorch ops per solver stage small."""

# Shapes: p0 [S, d], w1 [d+1, H], b1 [H], w2 [H+1, d], b2 [d], times [L] -> out [S, L, d].
# Semantics: reference.py. The cost is the number of ops per solver stage, so:
# - the time enters only through biases (t w1[d] + b1, t w2[H] + b2), precomputed for a
#   block of intervals; a stage is addmm -> activation -> addmm on all S states at once;
# - step sizes stay on the device (no host sync); a stage input and a step are each one
#   addmm of a tableau row [1, s] with the [s, S*d] stage derivatives;
# - storage is preallocated and written with out=, views listed once per call.
# Backward (discrete adjoint): each interval's substeps are recomputed from its stored
# starting state, the stages walked in reverse, weight gradients accumulated with one
# matmul per weight per interval. Every sum has a fixed order: bitwise reproducible.

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .._torch_math import chunk_bytes, device_constant
from .reference import FloaterOptions

_INV_SQRT_2 = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327


@dataclass(frozen=True)
class Tableau:
    """An explicit Runge-Kutta method: stage i at t + c[i] h with input
    y + h * sum_m a[i][m] k_m; the step is y + h * sum_i b[i] k_i."""

    c: tuple[float, ...]
    a: tuple[tuple[float, ...], ...]  # a[i] has i entries (strictly lower triangular)
    b: tuple[float, ...]

    @property
    def stages(self) -> int:
        return len(self.c)

    def column_below(self, i: int) -> tuple[float, ...]:
        """(a[m][i] for m > i): how stage i's derivative feeds the later stages."""
        return tuple(self.a[m][i] for m in range(i + 1, self.stages))


TABLEAUX: dict[str, Tableau] = {
    "euler": Tableau((0.0,), ((),), (1.0,)),
    "midpoint": Tableau((0.0, 0.5), ((), (0.5,)), (0.0, 1.0)),
    "rk4": Tableau(
        (0.0, 0.5, 0.5, 1.0),
        ((), (0.5,), (0.0, 0.5), (0.0, 0.0, 1.0)),
        (1 / 6, 1 / 3, 1 / 3, 1 / 6),
    ),
    "rk38": Tableau(
        (0.0, 1 / 3, 2 / 3, 1.0),
        ((), (1 / 3,), (-1 / 3, 1.0), (1.0, -1.0, 1.0)),
        (1 / 8, 3 / 8, 3 / 8, 1 / 8),
    ),
}


def _const(values: tuple[float, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A tableau row as a tensor on ``device``, made once (shared: never modified)."""
    return device_constant(
        ("tableau", values, dtype),
        lambda dev: torch.tensor(values, dtype=dtype, device=dev),
        device,
    )


def _act(name: str, z: Tensor) -> Tensor:
    if name == "relu":
        return torch.relu(z)
    if name == "tanh":
        return torch.tanh(z)
    if name == "gelu":
        return F.gelu(z)  # erf form, one kernel
    return z  # identity


def _act_derivative(name: str, z: Tensor) -> Optional[Tensor]:
    """d act / dz elementwise; None for the identity (multiplying by one is skipped)."""
    if name == "relu":
        return (z > 0).to(z.dtype)
    if name == "tanh":
        t = torch.tanh(z)
        return 1.0 - t * t
    if name == "gelu":
        cdf = 0.5 * (1.0 + torch.erf(z * _INV_SQRT_2))
        return cdf + z * torch.exp(-0.5 * z * z) * _INV_SQRT_2PI
    return None


def _split(w1: Tensor, w2: Tensor, d: int):
    """(w1[:d], w1[d], w2[:H], w2[H]) as contiguous tensors: split once per call."""
    H = w1.shape[1]
    return w1[:d].contiguous(), w1[d].contiguous(), w2[:H].contiguous(), w2[H].contiguous()


def _interval_blocks(L: int, per_interval_bytes: int) -> list[range]:
    """Consecutive intervals whose precomputed stage data fit in chunk_bytes() / 4."""
    n = max(1, min(L, (chunk_bytes() // 4) // max(1, per_interval_bytes)))
    return [range(start, min(L, start + n)) for start in range(0, L, n)]


@dataclass
class _Block:
    """Precomputed data of a block of n consecutive intervals (lists indexed by interval)."""

    ts: Tensor  # [n, K, s] stage times
    hstep: list[Tensor]  # 0-d step sizes
    c1: list[Tensor]  # [H] biases t * w1[d] + b1, K*s per interval, interval-major
    c2: list[Tensor]  # [d] biases t * w2[H] + b2
    a_rows: list[list[Tensor]]  # per interval, per stage i >= 1: [1, i] row hstep * a[i]
    b_row: list[Tensor]  # per interval: [1, s] row hstep * b


def _block(times: Tensor, block: range, K: int, tab: Tableau, w1t, b1, w2t, b2) -> _Block:
    j0, j1 = block.start, block.stop
    dt, dev = times.dtype, times.device
    t_end = times[j0:j1]
    t_prev = torch.cat([times.new_zeros(1), times[: j1 - 1]]) if j0 == 0 else times[j0 - 1 : j1 - 1]
    hstep = (t_end - t_prev) / K  # [n]
    k = torch.arange(K, dtype=dt, device=dev)
    c = _const(tab.c, dt, dev)
    # Step k starts at t_prev + k * hstep; stage i is at that + c_i * hstep.
    starts = t_prev[:, None] + k[None, :] * hstep[:, None]  # [n, K]
    ts = starts[:, :, None] + c[None, None, :] * hstep[:, None, None]  # [n, K, s]
    flat = ts.reshape(-1, 1)
    c1 = torch.addcmul(b1, flat, w1t).unbind(0)  # n*K*s x [H]
    c2 = torch.addcmul(b2, flat, w2t).unbind(0)  # n*K*s x [d]
    rows_per_stage = [
        (hstep[:, None] * _const(tab.a[i], dt, dev))[:, None, :].unbind(0)
        for i in range(1, tab.stages)
    ]
    a_rows = [[rows[jj] for rows in rows_per_stage] for jj in range(len(block))]
    b_row = (hstep[:, None] * _const(tab.b, dt, dev))[:, None, :].unbind(0)
    return _Block(ts, list(hstep.unbind(0)), list(c1), list(c2), a_rows, list(b_row))


class _Buffers:
    """One interval's K x s stages: inputs Y [S, d], pre-activations Z [S, H], derivatives
    Kd [S, d], with the loop's views made once (indexing per stage costs as much as math)."""

    def __init__(self, K: int, s: int, S: int, d: int, H: int, like: Tensor):
        self.K, self.s = K, s
        self.Y = like.new_empty((K, s, S, d))
        self.Z = like.new_empty((K, s, S, H))
        self.Kd = like.new_empty((K, s, S, d))
        self.y_end = like.new_empty((S, d))
        self.Yv = self.Y.view(K * s, S, d).unbind(0)  # per stage [S, d]
        self.Yflat = self.Y.view(K * s, 1, S * d).unbind(0)  # per stage [1, S*d]
        self.Zv = self.Z.view(K * s, S, H).unbind(0)
        self.Kv = self.Kd.view(K * s, S, d).unbind(0)
        kstep = self.Kd.view(K, s, S * d).unbind(0)
        self.Kstep = kstep  # per step [s, S*d]
        self.Kprefix = [[ks[:i] for i in range(s)] for ks in kstep]  # [i, S*d]: k_0..k_{i-1}
        self.y_end_flat = self.y_end.view(1, S * d)


def _run_interval(
    y0: Tensor, blk: _Block, jj: int, w1p, w2a, activation: str, buf: _Buffers
) -> Tensor:
    """Integrate interval jj of ``blk`` from y0, filling ``buf``; returns buf.y_end."""
    K, s = buf.K, buf.s
    Yv, Yflat, Zv, Kv = buf.Yv, buf.Yflat, buf.Zv, buf.Kv
    a_rows, b_row = blk.a_rows[jj], blk.b_row[jj]
    lo = jj * K * s
    c1, c2 = blk.c1[lo : lo + K * s], blk.c2[lo : lo + K * s]
    Yv[0].copy_(y0)
    for k in range(K):
        base = k * s
        y = Yflat[base]
        for i in range(s):
            q = base + i
            if i:  # Y_i = y + hstep * sum_{m<i} a_im k_m
                torch.addmm(y, a_rows[i - 1], buf.Kprefix[k][i], out=Yflat[q])
            torch.addmm(c1[q], Yv[q], w1p, out=Zv[q])
            torch.addmm(c2[q], _act(activation, Zv[q]), w2a, out=Kv[q])
        y_next = Yflat[base + s] if k + 1 < K else buf.y_end_flat
        torch.addmm(y, b_row, buf.Kstep[k], out=y_next)  # y + hstep * sum_i b_i k_i
    return buf.y_end


def _per_interval_bytes(K: int, s: int, H: int, d: int, itemsize: int) -> int:
    return K * s * (H + d + 1) * itemsize + 8 * s * itemsize


def floater_forward(p0, w1, b1, w2, b2, times, options: FloaterOptions) -> Tensor:
    """States at the sample times, [S, L, d] (semantics: reference.py)."""
    substeps, method, activation = options
    S, d = p0.shape
    H = w1.shape[1]
    L = times.shape[0]
    K, tab = substeps, TABLEAUX[method]
    s = tab.stages
    out = p0.new_empty((S, L, d))
    if L == 0:
        return out
    w1p, w1t, w2a, w2t = _split(w1, w2, d)
    b1, b2 = b1.contiguous(), b2.contiguous()
    buf = _Buffers(K, s, S, d, H, p0)
    y = p0
    for block in _interval_blocks(L, _per_interval_bytes(K, s, H, d, p0.element_size())):
        blk = _block(times, block, K, tab, w1t, b1, w2t, b2)
        for jj, j in enumerate(block):
            y = _run_interval(y, blk, jj, w1p, w2a, activation, buf)
            out[:, j] = y
    return out


def floater_backward(
    grad, out, p0, w1, b1, w2, b2, times, options: FloaterOptions, needs, tape=None
) -> list[Optional[Tensor]]:
    """Exact gradients of the discretised solution: (dp0, dw1, db1, dw2, db2, dtimes),
    None where ``needs`` is False.

    Per RK step y -> y_new = y + h sum_i b_i k_i with k_i = f(t + c_i h, Y_i) and
    Y_i = y + h sum_m a_im k_m, given ybar = dLoss/dy_new, stages are visited in reverse:
        u_i   = b_i ybar + sum_{m>i} a_mi Ybar_m      (dLoss/dk_i = h u_i)
        Ybar_i and the weight and time gradients of f by the chain rule through
              f = act(Y w1[:d] + t w1[d] + b1) w2[:H] + t w2[H] + b2
        dLoss/dy = ybar + sum_i Ybar_i
    and dLoss/dh = sum_i <u_i, k_i> + sum_i tbar_i (k + c_i), because stage i of step k sits
    at t_prev + (k + c_i) h, with h = (times[j] - t_prev) / K.
    (``tape``: the registry's signature; this backend has no taped forward, so never one.)
    """
    substeps, method, activation = options
    need_p0, need_w1, need_b1, need_w2, need_b2, need_t = (bool(n) for n in needs)
    if not any((need_p0, need_w1, need_b1, need_w2, need_b2, need_t)):
        return [None] * 6
    S, d = p0.shape
    H = w1.shape[1]
    L = times.shape[0]
    K, tab = substeps, TABLEAUX[method]
    s = tab.stages
    dt, dev = p0.dtype, p0.device
    w1p, w1t, w2a, w2t = _split(w1, w2, d)
    b1c, b2c = b1.contiguous(), b2.contiguous()
    w1pT, w2aT = w1p.T, w2a.T  # mm reads transposed views without copying

    dw1p = p0.new_zeros((d, H)) if need_w1 else None
    dw1t = p0.new_zeros((H,)) if need_w1 else None
    db1 = p0.new_zeros((H,)) if need_b1 else None
    dw2a = p0.new_zeros((H, d)) if need_w2 else None
    dw2t = p0.new_zeros((d,)) if need_w2 else None
    db2 = p0.new_zeros((d,)) if need_b2 else None
    g_end: list[Optional[Tensor]] = [None] * L  # dLoss/d times[j] as the end of interval j
    g_start: list[Optional[Tensor]] = [None] * L  # dLoss/d t_prev of interval j

    ybar = p0.new_zeros((1, S * d))
    if L:
        buf = _Buffers(K, s, S, d, H, p0)
        U = p0.new_empty((K, s, S, d))  # u_i
        ZB = p0.new_empty((K, s, S, H))  # zbar_i = dLoss/d(pre-activation)
        YB = p0.new_empty((K, s, S, d))  # Ybar_i
        Uv, Uflat = U.view(K * s, S, d).unbind(0), U.view(K * s, 1, S * d).unbind(0)
        Ustep = U.view(K, s, S * d).unbind(0)
        ZBv, YBv = ZB.view(K * s, S, H).unbind(0), YB.view(K * s, S, d).unbind(0)
        YBstep = YB.view(K, s, S * d).unbind(0)
        YBsuffix = [[yb[i + 1 :] for i in range(s)] for yb in YBstep]  # Ybar_{i+1..s-1}
        b_col = _const(tab.b, dt, dev)[:, None]  # [s, 1]
        a_cols = [_const(tab.column_below(i), dt, dev)[None, :] for i in range(s)]
        feeds_later = [any(x != 0.0 for x in tab.column_below(i)) for i in range(s)]
        ones_s = p0.new_ones((1, s))
        # stage i of step k sits at t_prev + (k + c_i) h
        kc = torch.arange(K, dtype=dt, device=dev)[:, None] + _const(tab.c, dt, dev)
        blocks = _interval_blocks(L, _per_interval_bytes(K, s, H, d, p0.element_size()))
        for block in reversed(blocks):
            blk = _block(times, block, K, tab, w1t, b1c, w2t, b2c)
            for jj in reversed(range(len(block))):
                j = block[jj]
                ybar = (ybar.view(S, d) + grad[:, j]).view(1, S * d)
                y0 = p0 if j == 0 else out[:, j - 1]
                _run_interval(y0, blk, jj, w1p, w2a, activation, buf)
                D = _act_derivative(activation, buf.Z)  # [K, s, S, H]
                Dv = None if D is None else D.view(K * s, S, H).unbind(0)
                h = blk.hstep[jj]
                # dLoss/dk_i = h u_i reaches the pre-activation through w2[:H]: scale it once.
                w2aT_h = w2aT * h
                for k in reversed(range(K)):
                    base = k * s
                    torch.mul(b_col, ybar, out=Ustep[k])  # u_i = b_i ybar + ...
                    for i in reversed(range(s)):
                        q = base + i
                        if feeds_later[i]:  # ... + sum_{m>i} a_mi Ybar_m
                            Uflat[q].addmm_(a_cols[i], YBsuffix[k][i])
                        if Dv is None:
                            torch.mm(Uv[q], w2aT_h, out=ZBv[q])
                        else:
                            torch.mul(torch.mm(Uv[q], w2aT_h), Dv[q], out=ZBv[q])
                        torch.mm(ZBv[q], w1pT, out=YBv[q])
                    ybar = torch.addmm(ybar, ones_s, YBstep[k])  # ybar + sum_i Ybar_i
                FB = U * h  # dLoss/dk_i, the gradient at the output of f, [K, s, S, d]
                ts = blk.ts[jj].reshape(-1)
                _accumulate_weights(buf, FB, ZB, ts, activation, dw1p, dw1t, db1, dw2a, dw2t, db2)
                if need_t:
                    # tbar of each stage: t enters through t w1[d] and t w2[H].
                    tbar = ZB.sum(2) @ w1t + FB.sum(2) @ w2t  # [K, s]
                    hbar = (U * buf.Kd).sum() + (tbar * kc).sum()
                    g_end[j] = hbar / K
                    g_start[j] = tbar.sum() - hbar / K

    grads: list[Optional[Tensor]] = [None] * 6
    if need_p0:
        grads[0] = ybar.view(S, d)
    if need_w1:
        grads[1] = torch.cat([dw1p, dw1t[None]], dim=0)
    if need_b1:
        grads[2] = db1
    if need_w2:
        grads[3] = torch.cat([dw2a, dw2t[None]], dim=0)
    if need_b2:
        grads[4] = db2
    if need_t:
        if L:
            dtimes = torch.stack(g_end)
            if L > 1:
                dtimes[:-1] += torch.stack(g_start[1:])  # times[j] also starts interval j+1
        else:
            dtimes = times.new_zeros((0,))
        grads[5] = dtimes
    return grads


def _accumulate_weights(buf, FB, ZB, ts, activation, dw1p, dw1t, db1, dw2a, dw2t, db2) -> None:
    """Weight gradients of one interval's K*s stages, one matmul per weight."""
    H, d = ZB.shape[-1], FB.shape[-1]
    if dw1p is not None or db1 is not None:
        ZBs = ZB.sum(2).reshape(-1, H)  # [K*s, H], summed over states
        if dw1p is not None:
            dw1p.addmm_(buf.Y.reshape(-1, d).T, ZB.reshape(-1, H))
            dw1t.addmv_(ZBs.T, ts)
        if db1 is not None:
            db1 += ZBs.sum(0)
    if dw2a is not None or db2 is not None:
        FBs = FB.sum(2).reshape(-1, d)  # [K*s, d]
        if dw2a is not None:
            A = _act(activation, buf.Z).reshape(-1, H)
            dw2a.addmm_(A.T, FB.reshape(-1, d))
            dw2t.addmv_(FBs.T, ts)
        if db2 is not None:
            db2 += FBs.sum(0)
