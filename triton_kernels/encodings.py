"""Sinusoidal and DFT encodings, and their fused add: one pass each (``encoding_fwd``,
``encoding_add_fwd``, ``encoding_bwd``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from ._launch import (
    INTERPRET,
    autotuned,
    device_guard,
    interpreter_blocks,
    rows_view,
)
from ._phase import accumulate_phase, phase_term, sincos_turns
from ._round import round_to

# Both encodings are sums of sinusoids of the position, described by a *spectrum*
# (``_spectrum``, from posenc_fast/ops/encodings/reference.py's formulas): per frequency its
# rate in turns per unit position (float64 on the host, split into a float32 pair hi + lo),
# and the output column and amplitude of its cosine and sine.
#
# Per program (BLOCK_R rows of positions) and chunk of BLOCK_K frequencies: phases with the
# error-free reduction of _phase.py, cos and sin once per frequency, and the two columns
# written (interleaved for sinusoidal: one contiguous store via tl.join). The fused add
# reads x at the same columns, adds in float32 and rounds once to x's dtype. Memory-bound
# (counts: benchmarks/NOTES.md, "Kernel notes").

# Rows of the float32 table TAB [6, K]: frequency (turns per unit, hi and lo), amplitude
# of cos and sin, and d(amp * cos)/dp, d(amp * sin)/dp factors (2 pi nu amp).
_NU_HI, _NU_LO, _COS_AMP, _SIN_AMP, _DCOS, _DSIN = (tl.constexpr(i) for i in range(6))


@triton.jit
def _positions(P, rows, rmask, stride_p, period, POS_INT: tl.constexpr, WRAP: tl.constexpr):
    """Positions of the rows as (hi, lo) float32, hi + lo exact (integers up to ~2^48).
    WRAP: positions [L] broadcast over leading dimensions, row r reads P[r % period]."""
    idx = rows % period if WRAP else rows
    if POS_INT:
        p = tl.load(P + idx * stride_p, mask=rmask, other=0).to(tl.int64)
        hi = p.to(tl.float32)
        lo = (p - hi.to(tl.int64)).to(tl.float32)
    else:
        hi = tl.load(P + idx * stride_p, mask=rmask, other=0.0).to(tl.float32)
        lo = tl.zeros_like(hi)
    return hi, lo


@triton.jit
def _cos_sin(p_hi, p_lo, TAB, ks, kmask, stride_tab, POS_INT: tl.constexpr):
    """cos and sin of 2 pi p nu_k, [BLOCK_R, BLOCK_K] float32."""
    nu_hi = tl.load(TAB + ks + stride_tab * _NU_HI, mask=kmask, other=0.0)[None, :]
    nu_lo = tl.load(TAB + ks + stride_tab * _NU_LO, mask=kmask, other=0.0)[None, :]
    hi, lo = phase_term(p_hi[:, None], nu_hi, nu_lo)
    if POS_INT:
        hi, lo = accumulate_phase(hi, lo, p_lo[:, None], nu_hi, nu_lo)
    return sincos_turns(hi, lo)


@triton.jit
def _put(
    OUT,
    X,
    BIAS,
    rows,
    rmask,
    cols,
    cmask,
    value,
    stride_or,
    stride_xr,
    ADD: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """OUT[rows, cols] = (x[rows, cols] +) value (+ bias[cols]), rounded once."""
    mask = rmask[:, None] & cmask
    if HAS_BIAS:
        value += tl.load(BIAS + cols, mask=cmask, other=0.0)
    if ADD:
        value += tl.load(X + rows[:, None] * stride_xr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        OUT + rows[:, None] * stride_or + cols,
        round_to(value, OUT.dtype.element_ty, INTERPRET),
        mask=mask,
    )


@triton.jit
def _encoding_fwd_kernel(
    P,
    X,
    OUT,
    TAB,
    COLS,
    BIAS,
    n_rows,
    n_freq,
    stride_p,
    period,
    stride_xr,
    stride_or,
    stride_tab,
    POS_INT: tl.constexpr,
    WRAP: tl.constexpr,
    ADD: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # P [R] (or [period] with WRAP) positions, any real dtype, stride stride_p;
    # TAB [6, K] float32 (rows _NU_HI.._DSIN), COLS [2, K] int32 (cos / sin column, -1 for
    # none; unused when INTERLEAVED); BIAS [dim] float32 (FLOATER's block term);
    # X, OUT [R, dim] with row strides stride_xr / stride_or and unit column stride.
    # Grid: (cdiv(R, BLOCK_R),); 64-bit row offsets (R * dim can exceed 2^31).
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    p_hi, p_lo = _positions(P, rows, rmask, stride_p, period, POS_INT, WRAP)
    for k0 in range(0, n_freq, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < n_freq
        c, s = _cos_sin(p_hi, p_lo, TAB, ks, kmask, stride_tab, POS_INT)
        cos_amp = tl.load(TAB + ks + stride_tab * _COS_AMP, mask=kmask, other=0.0)[None, :]
        c *= cos_amp
        s *= tl.load(TAB + ks + stride_tab * _SIN_AMP, mask=kmask, other=0.0)[None, :]
        if INTERLEAVED:
            # sin of frequency i at column 2i, cos at 2i + 1: one contiguous [BR, 2 BK] tile.
            cols = 2 * k0 + tl.arange(0, 2 * BLOCK_K)
            value = tl.reshape(tl.join(s, c), (BLOCK_R, 2 * BLOCK_K))
            _put(
                OUT,
                X,
                BIAS,
                rows,
                rmask,
                cols[None, :],
                (cols < 2 * n_freq)[None, :],
                value,
                stride_or,
                stride_xr,
                ADD,
                HAS_BIAS,
                INTERPRET,
            )
        else:
            # DFT frequency 0 is the constant a0: keep it constant for a NaN / inf position
            # (0 * inf is NaN), as the reference and the torch backend do.
            c = tl.where((ks == 0)[None, :], cos_amp, c)
            ccol = tl.load(COLS + ks, mask=kmask, other=-1)
            scol = tl.load(COLS + n_freq + ks, mask=kmask, other=-1)
            _put(
                OUT,
                X,
                BIAS,
                rows,
                rmask,
                ccol[None, :],
                (ccol >= 0)[None, :],
                c,
                stride_or,
                stride_xr,
                ADD,
                HAS_BIAS,
                INTERPRET,
            )
            _put(
                OUT,
                X,
                BIAS,
                rows,
                rmask,
                scol[None, :],
                (scol >= 0)[None, :],
                s,
                stride_or,
                stride_xr,
                ADD,
                HAS_BIAS,
                INTERPRET,
            )


@triton.jit
def _encoding_bwd_kernel(
    P,
    GRAD,
    DP,
    TAB,
    COLS,
    n_rows,
    n_freq,
    stride_p,
    stride_gr,
    stride_tab,
    POS_INT: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # P [R] positions (stride stride_p); GRAD [R, dim] (row stride stride_gr, unit
    # columns, any float dtype); DP [R] contiguous. dp = sum_k g_cos * (-2 pi nu amp sin)
    # + g_sin * (2 pi nu amp cos), summed per row in a fixed order: deterministic.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    p_hi, p_lo = _positions(P, rows, rmask, stride_p, 1, POS_INT, False)
    g_rows = GRAD + rows[:, None] * stride_gr
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, n_freq, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < n_freq
        c, s = _cos_sin(p_hi, p_lo, TAB, ks, kmask, stride_tab, POS_INT)
        dcos = tl.load(TAB + ks + stride_tab * _DCOS, mask=kmask, other=0.0)[None, :]
        dsin = tl.load(TAB + ks + stride_tab * _DSIN, mask=kmask, other=0.0)[None, :]
        if INTERLEAVED:
            cols = 2 * k0 + tl.arange(0, 2 * BLOCK_K)
            mask = rmask[:, None] & (cols < 2 * n_freq)[None, :]
            g = tl.load(g_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            g_sin, g_cos = tl.split(tl.reshape(g, (BLOCK_R, BLOCK_K, 2)))
        else:
            ccol = tl.load(COLS + ks, mask=kmask, other=-1)
            scol = tl.load(COLS + n_freq + ks, mask=kmask, other=-1)
            cmask = rmask[:, None] & (ccol >= 0)[None, :]
            smask = rmask[:, None] & (scol >= 0)[None, :]
            g_cos = tl.load(g_rows + ccol[None, :], mask=cmask, other=0.0).to(tl.float32)
            g_sin = tl.load(g_rows + scol[None, :], mask=smask, other=0.0).to(tl.float32)
        acc += tl.sum(g_sin * c * dsin - g_cos * s * dcos, axis=1)
    tl.store(DP + rows, round_to(acc, DP.dtype.element_ty, INTERPRET), mask=rmask)


@dataclass(frozen=True)
class _Spectrum:
    turns: torch.Tensor  # [K] float64, frequencies in turns per unit position
    cos_col: torch.Tensor  # [K] int64 output column of the cosine, -1 if none
    cos_amp: torch.Tensor  # [K] float64
    sin_col: torch.Tensor
    sin_amp: torch.Tensor


@lru_cache(maxsize=64)
def _spectrum(kind: str, dim: int, base: float) -> _Spectrum:
    if kind == "sinusoidal":
        i = torch.arange(dim // 2, dtype=torch.float64)
        ones = torch.ones_like(i)
        turns = base ** (-2.0 * i / dim) / (2.0 * math.pi)
        return _Spectrum(turns, 2 * i.long() + 1, ones, 2 * i.long(), ones)
    if kind == "dft":
        K = dim // 2 - 1
        k = torch.arange(dim // 2 + 1, dtype=torch.float64)
        cos_col = k.long().clone()
        cos_col[-1] = dim - 1  # b0 = cos(pi s) / sqrt(dim), the last column
        cos_amp = torch.full_like(k, math.sqrt(2.0 / dim))
        cos_amp[0] = cos_amp[-1] = 1.0 / math.sqrt(dim)
        sin_col = K + k.long()
        sin_col[0] = sin_col[-1] = -1  # sin(0) = 0, and sin(pi s) is not part of Eq. 21
        sin_amp = torch.full_like(k, math.sqrt(2.0 / dim))
        sin_amp[0] = sin_amp[-1] = 0.0
        return _Spectrum(k / dim, cos_col, cos_amp, sin_col, sin_amp)
    raise ValueError(f"unknown encoding kind {kind!r}")


@lru_cache(maxsize=64)
def _tables_cpu(kind: str, dim: int, base: float):
    """(TAB [6, K] float32, COLS [2, K] int32, interleaved) from the float64 spectrum."""
    sp = _spectrum(kind, dim, base)
    nu = sp.turns  # float64
    nu_hi = nu.to(torch.float32)
    nu_lo = (nu - nu_hi.to(torch.float64)).to(torch.float32)
    rate = 2.0 * math.pi * nu
    tab = torch.stack(
        [
            nu_hi,
            nu_lo,
            sp.cos_amp.to(torch.float32),
            sp.sin_amp.to(torch.float32),
            (rate * sp.cos_amp).to(torch.float32),
            (rate * sp.sin_amp).to(torch.float32),
        ]
    ).contiguous()
    cols = torch.stack([sp.cos_col, sp.sin_col]).to(torch.int32).contiguous()
    k = torch.arange(nu.shape[0])
    interleaved = bool(torch.equal(sp.sin_col, 2 * k) and torch.equal(sp.cos_col, 2 * k + 1))
    return tab, cols, interleaved


# The cached tensors below are shared by every call: they are read-only kernel inputs,
# never written to and never returned to the caller.


@lru_cache(maxsize=256)
def _tables(kind: str, dim: int, base: float, device: torch.device):
    """The tables on ``device``, built once per (kind, dim, base, device)."""
    tab, cols, interleaved = _tables_cpu(kind, dim, float(base))
    return tab.to(device), cols.to(device), interleaved


@lru_cache(maxsize=256)
def _block_bias(kind: str, dim: int, base: float, block: float, device) -> torch.Tensor:
    """The encoding of the block index (FLOATER Eq. 7) as a float32 [dim] vector on
    ``device``, computed in float64 with the phase reduced before the trig; built once
    per (kind, dim, base, block, device)."""
    sp = _spectrum(kind, dim, float(base))
    turns = sp.turns * float(block)
    angle = 2.0 * math.pi * (turns - torch.round(turns))
    bias = torch.zeros(dim, dtype=torch.float64)
    has_cos, has_sin = sp.cos_col >= 0, sp.sin_col >= 0
    bias[sp.cos_col[has_cos]] = (torch.cos(angle) * sp.cos_amp)[has_cos]
    bias[sp.sin_col[has_sin]] = (torch.sin(angle) * sp.sin_amp)[has_sin]
    return bias.to(torch.float32).to(device)


# GPU autotuning set of the forward, (BLOCK_R, BLOCK_K, num_warps): none spills on sm_90.
# The forward's results do not depend on the configuration (every element on its own).
_FWD_CONFIGS = [(64, 32, 8), (32, 32, 4), (128, 16, 8), (16, 64, 4), (32, 64, 8)]

_encoding_fwd_tuned = autotuned(
    _encoding_fwd_kernel,
    "encoding_fwd",
    [
        triton.Config({"BLOCK_R": br, "BLOCK_K": bk}, num_warps=w, num_stages=2)
        for br, bk, w in _FWD_CONFIGS
    ],
    key=["n_freq", "ADD", "HAS_BIAS", "POS_INT", "INTERLEAVED"],
)


def _bwd_blocks(R: int, K: int) -> tuple[dict, dict]:
    """Fixed: the backward sums over frequency chunks, so its configuration is part of
    its (deterministic) summation order."""
    if INTERPRET:
        return interpreter_blocks(R, K), {}
    return {"BLOCK_R": 64, "BLOCK_K": 32}, {"num_warps": 8}


def encoding_fwd(positions, kind: str, base: float, block, out_dtype=None, x=None, dim: int = 0):
    """positions [...] -> [..., dim] in out_dtype; with ``x``, x + encoding(positions) in
    x's dtype, positions broadcast against x.shape[:-1] (x read once, the sum written
    once). Phases and trig in float32."""
    if x is None:
        lead, device = positions.shape, positions.device
        p, period = positions.reshape(-1), 0
        out = torch.empty((*lead, dim), dtype=out_dtype, device=device)
    else:
        lead, device, dim = x.shape[:-1], x.device, x.shape[-1]
        out = torch.empty(x.shape, dtype=x.dtype, device=device)
        if positions.dim() == 1 and len(lead) >= 1 and positions.shape[0] == lead[-1]:
            p, period = positions, positions.shape[0]  # [L] against [..., L]: row r -> r % L
        else:
            p, period = positions.expand(lead).reshape(-1), 0
    R = math.prod(lead)
    if R == 0:
        return out
    rows = out.view(R, dim)
    x_rows = rows_view(x, dim) if x is not None else None
    tab, cols, interleaved = _tables(kind, dim, base, device)
    bias = None if block is None else _block_bias(kind, dim, base, block, device)
    K = tab.shape[1]
    args = (
        p,
        x_rows if x_rows is not None else rows,
        rows,
        tab,
        cols,
        bias if bias is not None else tab,
        R,
        K,
        p.stride(0),
        max(1, period),
        x_rows.stride(0) if x_rows is not None else 0,
        rows.stride(0),
        tab.stride(0),
    )
    meta = {
        "POS_INT": not p.is_floating_point(),
        "WRAP": period > 0,
        "ADD": x_rows is not None,
        "HAS_BIAS": bias is not None,
        "INTERLEAVED": interleaved,
        "INTERPRET": INTERPRET,
    }
    with device_guard(out):
        if INTERPRET:  # few programs with large blocks: the interpreter pays per program
            blocks = interpreter_blocks(R, K)
            grid = (triton.cdiv(R, blocks["BLOCK_R"]),)
            _encoding_fwd_kernel[grid](*args, **meta, **blocks, enable_fp_fusion=False)
        else:  # the autotuner picks the blocks
            grid = lambda c: (triton.cdiv(R, c["BLOCK_R"]),)
            _encoding_fwd_tuned[grid](*args, **meta, enable_fp_fusion=False)
    return out


def encoding_bwd(grad, positions, dim: int, kind: str, base: float) -> torch.Tensor:
    """d(sum grad * encoding(positions)) / d positions; grad [*positions.shape, dim]."""
    p = positions.reshape(-1)
    R = p.shape[0]
    dtype = positions.dtype if positions.is_floating_point() else torch.float32
    dp = torch.empty(R, dtype=dtype, device=positions.device)
    if R == 0:
        return dp.view(positions.shape)
    g = rows_view(grad, dim)
    tab, cols, interleaved = _tables(kind, dim, base, positions.device)
    K = tab.shape[1]
    blocks, options = _bwd_blocks(R, K)
    with device_guard(positions):
        _encoding_bwd_kernel[(triton.cdiv(R, blocks["BLOCK_R"]),)](
            p,
            g,
            dp,
            tab,
            cols,
            R,
            K,
            p.stride(0),
            g.stride(0),
            tab.stride(0),
            POS_INT=not p.is_floating_point(),
            INTERLEAVED=interleaved,
            INTERPRET=INTERPRET,
            enable_fp_fusion=False,
            **blocks,
            **options,
        )
    return dp.view(positions.shape)
