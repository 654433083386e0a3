"""Learnable Fourier features + grouped MLP, forward: one fused pass (``lff_fwd``), the
"fused" plan (its design: the comment below)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._launch import (
    INTERPRET,
    autotuned,
    device_guard,
    dot_precision,
    interpreter_blocks,
    pow2,
    tl_dtype,
)
from ._mlp import activation, mma
from ._phase_tiles import cos_sin_tile
from ._round import load_as, round_to

# Every group of every position is one *row* of M coordinates (R = N * G rows): the
# group-major output [..., G * Dg] is exactly the row-major [R, Dg] matrix.
#
# Per program (BLOCK_R rows), everything between x and y stays on chip:
#
#     for each chunk of BLOCK_K frequencies (of F/2):
#         phases (float32, error-free reduction, _phase.py) -> cos, sin   [BR, BK] registers
#         acc += (cos / sqrt(F)) @ w1[cos rows] + (sin / sqrt(F)) @ w1[sin rows]  tl.dot
#     h = act(acc + b1)                                      [BR, BH] registers, compute dtype
#     for each chunk of BLOCK_D output columns:
#         y = h @ w2[:, chunk] + b2  -> stored once in the output dtype
#
# Memory traffic: x in, y out; features and hidden layer never exist in memory, the weights
# are re-read from L2. Memory-bound unless H(F + Dg)/Dg is large (benchmarks/NOTES.md).


@triton.jit
def hidden_preactivation(
    x_rows,
    rmask,
    stride_xm,
    WR,
    w1_cols,
    hmask,
    n_freq,
    hidden,
    inv_sqrt_f,
    M: tl.constexpr,
    COMPUTE: tl.constexpr,
    PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """features @ w1 for the rows x_rows (as cos_sin_tile's): [BR, BH] float32, no bias.

    w1_cols [1, BH]: W1 + hs[None, :] of W1 [F, H] contiguous (mask hmask [BH]); rows
    0..F/2-1 multiply the cosines, F/2..F-1 the sines. The features are scaled by
    1/sqrt(F) in float32 and rounded once to the compute dtype.
    SPLIT (relu with a bf16 / fp16 MLP): the features also contribute their rounding
    error, as a second compute-dtype term (hi + lo, ~2^-16 relative): with features rounded
    to bf16 alone (2^-9), relu's derivative, which jumps at a = 0, would flip for
    pre-activations that float32 math puts on the other side of 0."""
    acc = tl.zeros([x_rows.shape[0], hmask.shape[0]], dtype=tl.float32)
    for k0 in range(0, n_freq, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < n_freq
        c, s = cos_sin_tile(x_rows, rmask, stride_xm, WR, ks, kmask, M)
        wmask = kmask[:, None] & hmask[None, :]
        w1c = load_as(w1_cols + ks[:, None] * hidden, wmask, COMPUTE, INTERPRET)
        w1s = load_as(w1_cols + (ks + n_freq)[:, None] * hidden, wmask, COMPUTE, INTERPRET)
        fc = c * inv_sqrt_f
        fs = s * inv_sqrt_f
        rc = round_to(fc, COMPUTE, INTERPRET)
        rs = round_to(fs, COMPUTE, INTERPRET)
        acc = mma(rc, w1c, acc, PRECISION, INTERPRET)
        acc = mma(rs, w1s, acc, PRECISION, INTERPRET)
        if SPLIT:
            rc_lo = round_to(fc - rc.to(tl.float32), COMPUTE, INTERPRET)
            rs_lo = round_to(fs - rs.to(tl.float32), COMPUTE, INTERPRET)
            acc = mma(rc_lo, w1c, acc, PRECISION, INTERPRET)
            acc = mma(rs_lo, w1s, acc, PRECISION, INTERPRET)
    return acc


@triton.jit
def _lff_fwd_kernel(
    X,
    WR,
    W1,
    B1,
    W2,
    B2,
    OUT,
    n_rows,
    n_freq,
    hidden,
    width,
    stride_xr,
    stride_xm,
    stride_or,
    inv_sqrt_f,
    M: tl.constexpr,
    MLP: tl.constexpr,
    ACT: tl.constexpr,
    COMPUTE: tl.constexpr,
    PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # X [R, M] any strides (any float dtype); WR [F2, M], W1 [2*F2, H], B1 [H], W2 [H, DG],
    # B2 [DG] contiguous (any float dtype, converted on load); OUT [R, DG] (or [R, 2*F2]
    # without the MLP) with row stride stride_or and unit column stride.
    # Grid: (cdiv(R, BLOCK_R),). Row offsets are 64-bit: R * DG can exceed 2^31.
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    x_rows = X + rows * stride_xr
    out_rows = OUT + rows[:, None] * stride_or
    OUT_DTYPE: tl.constexpr = OUT.dtype.element_ty
    if MLP:
        hs = tl.arange(0, BLOCK_H)
        hmask = hs < hidden
        a = hidden_preactivation(
            x_rows, rmask, stride_xm, WR, W1 + hs[None, :], hmask, n_freq, hidden,
            inv_sqrt_f, M, COMPUTE, PRECISION, INTERPRET, SPLIT, BLOCK_K,
        )  # fmt: skip
        b1 = tl.load(B1 + hs, mask=hmask, other=0.0).to(tl.float32)
        # Padded hidden columns: a = 0 there and act(0) = 0, so they add nothing below.
        h = round_to(activation(a + b1[None, :], ACT), COMPUTE, INTERPRET)
        for d0 in range(0, width, BLOCK_D):
            ds = d0 + tl.arange(0, BLOCK_D)
            dmask = ds < width
            w2 = load_as(
                W2 + hs[:, None] * width + ds[None, :],
                hmask[:, None] & dmask[None, :],
                COMPUTE,
                INTERPRET,
            )
            b2 = tl.load(B2 + ds, mask=dmask, other=0.0).to(tl.float32)
            y = mma(h, w2, tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32), PRECISION, INTERPRET)
            y += b2[None, :]
            tl.store(
                out_rows + ds[None, :],
                round_to(y, OUT_DTYPE, INTERPRET),
                mask=rmask[:, None] & dmask[None, :],
            )
    else:
        # Features only: [cos || sin] / sqrt(F), cos block first (Algorithm 1, line 1).
        for k0 in range(0, n_freq, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < n_freq
            c, s = cos_sin_tile(x_rows, rmask, stride_xm, WR, ks, kmask, M)
            omask = rmask[:, None] & kmask[None, :]
            tl.store(
                out_rows + ks[None, :], round_to(c * inv_sqrt_f, OUT_DTYPE, INTERPRET), mask=omask
            )
            tl.store(
                out_rows + (ks + n_freq)[None, :],
                round_to(s * inv_sqrt_f, OUT_DTYPE, INTERPRET),
                mask=omask,
            )


# GPU autotuning set: (BLOCK_R, BLOCK_K, BLOCK_D, num_warps, num_stages) -> the BLOCK_H
# values it is offered for; the first allowed one is what runs without autotuning
# (POSENC_FAST_TRITON_AUTOTUNE=0). Memory-bound hidden sizes (BLOCK_H <= 64) take 128-row
# tiles (the weights loaded once per 128 rows) and 3 stages (the next w1 / w2 chunk's loads
# overlap the current products). Chosen by compiling for sm_80 / sm_90 (registers and
# spills: benchmarks/NOTES.md, "Kernel notes"); _configs.py's rules remove those a Triton
# version cannot compile for the GPU at hand; the 32-row entries (mma.sync) keep every
# hidden size covered there.
_MEMORY_BOUND = (16, 32, 64)
_CONFIGS = {
    (128, 64, 64, 16, 3): _MEMORY_BOUND,
    (128, 32, 64, 8, 3): _MEMORY_BOUND,
    (128, 64, 64, 8, 3): _MEMORY_BOUND,
    (128, 32, 64, 8, 2): _MEMORY_BOUND,
    (64, 32, 128, 8, 3): _MEMORY_BOUND,
    (64, 32, 64, 8, 3): (128,),
    (64, 32, 64, 8, 2): (128,),
    (32, 32, 64, 4, 2): (*_MEMORY_BOUND, 128),  # small problems: more programs
    (64, 16, 32, 8, 3): (256,),
    (64, 16, 32, 8, 1): (128, 256),
    # where 64 rows with 8 warps are refused, and float32 at H=128 on the 99 kB GPUs
    (32, 16, 32, 8, 1): (128, 256),
}


def configs_for(block_h: int) -> list[tuple]:
    """The _CONFIGS entries (BLOCK_R, BLOCK_K, BLOCK_D, num_warps, num_stages) offered
    for this BLOCK_H, in _CONFIGS order."""
    return [key for key, block_hs in _CONFIGS.items() if block_h in block_hs]


def _config_key(c) -> tuple:
    blocks = c.kwargs
    return (blocks["BLOCK_R"], blocks["BLOCK_K"], blocks["BLOCK_D"], c.num_warps, c.num_stages)


def offered(meta) -> list[tuple]:
    """The _CONFIGS entries offered for a call's constexprs ``meta`` (BLOCK_H, COMPUTE,
    PRECISION, M, SPLIT): those meant for its BLOCK_H, without 64-frequency blocks where
    they spill: IEEE float32, M > 2 coordinates and relu's SPLIT second product."""
    keys = configs_for(meta.get("BLOCK_H", 16))
    heavy = (
        (meta.get("COMPUTE") == tl.float32 and meta.get("PRECISION") == "ieee")
        or meta.get("M", 2) > 2
        or meta.get("SPLIT", False)
    )
    return [key for key in keys if not (heavy and key[1] >= 64)]


def _meant(configs, meta):
    """The configurations offered for this call (``offered``)."""
    meant = set(offered(meta))
    return [c for c in configs if _config_key(c) in meant]


_lff_fwd_tuned = autotuned(
    _lff_fwd_kernel,
    "lff_fwd",
    [
        triton.Config({"BLOCK_R": br, "BLOCK_K": bk, "BLOCK_D": bd}, num_warps=w, num_stages=st)
        for (br, bk, bd, w, st) in _CONFIGS
    ],
    key=["n_freq", "hidden", "width", "M", "MLP", "ACT"],
    select=_meant,
)


def split_features(activation: str, compute: torch.dtype) -> bool:
    """Whether hidden_preactivation adds the features' rounding error (see there)."""
    return activation == "relu" and compute != torch.float32


def lff_fwd(x, wr, w1, b1, w2, b2, activation: str, out_dtype: torch.dtype) -> torch.Tensor:
    """x [..., G, M] -> [..., G * width] in out_dtype (width = Dg, or F without the MLP).
    x is floating (posenc_fast.lff converts integer positions before dispatching).

    out_dtype is also the MLP's compute dtype: bf16 / fp16 run the matmuls on tensor cores
    with float32 accumulation; float32 runs them in IEEE float32 (TF32 only if enabled in
    torch.backends.cuda.matmul). Weights of another dtype (autocast) are converted on load."""
    G, M = x.shape[-2], x.shape[-1]
    rows = x.reshape(-1, M)
    R = rows.shape[0]
    F2 = wr.shape[0]
    mlp = w1 is not None
    H = w1.shape[1] if mlp else 0
    width = w2.shape[1] if mlp else 2 * F2
    out = torch.empty((R, width), dtype=out_dtype, device=x.device)
    result = out.view(*x.shape[:-2], G * width)
    if R == 0 or width == 0:
        return result
    wr = wr.contiguous()
    if mlp:
        w1, b1, w2, b2 = (t.contiguous() for t in (w1, b1, w2, b2))
    else:
        w1 = b1 = w2 = b2 = wr  # never read: MLP is a compile-time False
    meta = {
        "M": M,
        "MLP": mlp,
        "ACT": activation,
        "COMPUTE": tl_dtype(out_dtype),
        "PRECISION": dot_precision(out_dtype),
        "INTERPRET": INTERPRET,
        "SPLIT": split_features(activation, out_dtype),
        "BLOCK_H": pow2(H),
    }
    args = (
        rows,
        wr,
        w1,
        b1,
        w2,
        b2,
        out,
        R,
        F2,
        H,
        width,
        rows.stride(0),
        rows.stride(1),
        out.stride(0),
        1.0 / math.sqrt(2 * F2),
    )
    with device_guard(x):
        if INTERPRET:  # few programs with large blocks: the interpreter pays per program
            blocks = interpreter_blocks(R, F2, width)
            grid = (triton.cdiv(R, blocks["BLOCK_R"]),)
            _lff_fwd_kernel[grid](*args, **meta, **blocks, enable_fp_fusion=False)
        else:  # the autotuner picks BLOCK_R and the other blocks
            grid = lambda c: (triton.cdiv(R, c["BLOCK_R"]),)
            _lff_fwd_tuned[grid](*args, **meta, enable_fp_fusion=False)
    return result
