"""Learnable Fourier features + grouped MLP, backward: one fused pass (``lff_bwd``).

Nothing but x and the weights is saved by the forward; this kernel recomputes the
features and the hidden layer from them, reads dY once, and produces

    dx [R, M]            written per row (rows are independent)
    dwr, dw1, db1, dw2, db2   sums over all rows: reduced deterministically

Per tile of BLOCK_R rows (r = [cos || sin] / sqrt(F), a = r w1 + b1, h = act(a)):

    a      = sum over frequency chunks of r_k @ w1_k            (recompute, tl.dot)
    for each chunk of BLOCK_D output columns:                 (dY read once)
        gh  += dY_d @ w2_d^T                                    [BR, BH] registers
        dw2 partial[:, d] += h^T @ dY_d ;  db2 partial[d] += sum_rows dY_d
    ga     = gh * act'(a) ;  db1 partial += sum_rows ga        [BR, BH] registers
    for each frequency chunk k:                               (features recomputed)
        dw1 partial[k] += r_k^T @ ga
        gr_k   = ga @ w1_k^T                                    [BR, BK] (cos / sin parts)
        gphase = (gr_sin * cos - gr_cos * sin) / sqrt(F)        d loss / d phase
        dx    += gphase @ wr_k ;  dwr partial[k] += gphase^T @ x
    store dx

Determinism without atomics: a fixed number P of programs (independent of timing) each
owns one row of a float32 workspace [P, |weights|] and walks the row tiles
t = pid, pid + P, ... in order, adding its contributions to its own row (read-modify-write
by one program only, with a barrier between tiles so every thread sees the previous
tile's writes; the first tile, which every program has as P <= tiles, writes every
column of the row once and reads nothing, so the workspace needs no zeroing). A second
kernel sums the P rows in the fixed order p = 0, 1, ..., P-1.
Same inputs and same P -> bitwise-identical gradients. The configuration is chosen by a
fixed rule (no autotuning): a timing-dependent choice would change the summation order.

Only what ``needs`` asks for is computed: the constexpr flags remove the dY @ w2^T
pass, the second feature pass, and each partial sum when not needed.

Traffic (canonical case, bf16): dY 1.61 GB read once + x 8 MB + dx 8 MB from HBM. The
workspace (P * 132 kB, P = 2 x 132 SMs: ~35 MB, L2-resident on a 50 MB L2) is
read-modified-written once per tile: dw2 + dw1 partials = (32*768 + 256*32) * 8 B = 262 kB
per 128-row tile against 197 kB of dY -- about 1.3x the dY traffic, served by L2. This is
the first suspect if the H200 shows the backward short of its floor; the cure would be
more rows per read-modify-write (e.g. two sub-tiles accumulated in registers first),
which the register budget (234 of 255 at BLOCK_R=128) does not allow in this form.
Tensor-core work: 2*F*H (recompute) + 4*H*Dg (dY w2^T, h^T dY) + 4*F*H (dw1, gr) FLOPs
per row ~ 0.15 MFLOP -> ~0.16 TFLOP for 2^20 rows (~0.2 ms at ~790 TFLOP/s); sincos: two
feature passes, 2 * F/2 per row. Floor: ~0.38 ms (dY read). GPU timings: pending.

Large weights: the split-K path (``_split_k``). The fused kernel's cost has a term
tiles x |weights| that the canonical case keeps in L2 but large weights do not: at F=768,
H=256, Dg=1024 a program's partials are 1.8 MB, so P ~ 142 and 32-row tiles
read-modify-write 2^15 x 2 x 1.8 MB ~ 118 GB, mostly from HBM (measured on the H200,
2026-11-27: bf16 150 ms, fp32 746 ms, against 6.7 / 42 ms for torch.compile). When the
partials of one program exceed _SPLIT_K_BYTES (256 kB; the rule is in ``lff_bwd``), the
backward runs as four kernels per chunk of rows, the weight gradients as matrix products
over the rows:

    for each chunk of C rows (C: h and ga of the chunk fit _BUFFER_BYTES, 128 MB):
        first pass: _lff_bwd_kernel with H_SPLIT, one program per (block of 128 hidden
            columns, row-tile walker): a, h, gh = dY w2^T and ga for its columns only
            (half the registers: 64-row tiles), db1 / db2 partials (a few kB per
            program, as in the fused kernel); h and ga, rounded to the compute dtype
            exactly as the fused kernel uses them, stored to two [C, H] buffers
        phase: _lff_bwd_phase_kernel, 128-row tiles: gr = ga w1^T (cos and sin halves),
            d loss / d phase, dx, dwr partials (the fused kernel's second feature pass)
        dw2 += h^T @ dY                        _lff_bwd_wgrad_kernel, FEATURES=False
        dw1 += [cos || sin]^T @ ga / sqrt(F)   (features recomputed), FEATURES=True

_lff_bwd_wgrad_kernel is a split-K matmul: a program owns one output block (128 x 64 of
dw2; 32 frequencies x up to 256 hidden of dw1, cos and sin rows) and one contiguous range
of the chunk's rows (S ranges, S ~ 2 * SMs / blocks), accumulates over it in float32
registers, and touches its workspace row once per chunk (stored on the first chunk,
added on the others). sum_partials_kernel adds the S rows in the fixed order, as before.
Determinism: block sizes, C and S are fixed functions of the shapes, the dtype and the
SM count (C not of ``needs``); rows are summed in a fixed order within a range, ranges
and chunks in a fixed order; no atomics. The operands are the fused kernel's (the same
rounded h, ga, dY and features), so both paths agree to float32 summation order.
Memory: the two buffers (128 MB) + S x |dw1| and S x |dw2| float32 (~27 MB bf16, ~14 MB
float32 here) + the small partials: ~160 MB, bounded independently of N (eager: 9 GB).

Counts for the compute case (2^20 rows, M=2, F=768, H=256, Dg=1024), bf16, per row:
    first pass: HBM dY 2048 B (the second hidden block's read mostly from L2: both
        blocks of a tile run side by side) + h, ga 1024 B stored -> 3.2 GB, 0.75 ms at
        4275 GB/s; 2FH + 2HDg = 0.92 MFLOP (wgmma, 64 rows); 2 x F/2 sincos (once per
        hidden block); from L2 each weight once per 64 rows (~14 kB per row, as the
        forward; the fused kernel: three weight reads per 32 rows, ~41 kB)
    phase: ga 512 B -> 0.13 ms; 2FH = 0.39 MFLOP; F/2 sincos; w1 once per 128 rows
    dw2: dY 2048 B + h 512 B -> 2.7 GB, 0.63 ms; 2HDg = 0.52 MFLOP (wgmma)
    dw1: ga 512 B -> 0.13 ms; 2FH = 0.39 MFLOP (mma.sync: 32-row blocks); F/2 sincos
    workspaces: 8 chunks x 2 x 27 MB ~ 0.4 GB; the walkers' small partials in L2.
    In all ~7 GB of HBM traffic (1.6 ms), 2.23 MFLOP per row -> 2.34 TFLOP (3.4 ms at
    687 TFLOP/s), 4 x F/2 sincos per row (~1.6e9, ~60 FP32 instructions each: ~3 ms of
    FP32 issue, partly overlapping the tensor cores).
PREDICTION (not measured: no GPU in this session), bf16 on the H200: ~5-8 ms from the
counts. Calibrated instead by the forward, measured at 8.69 ms on the same case (0.45
MFLOP, ~14 kB of L2 weight reads and F/2 sincos per row: ~7x its count-based floor):
the first pass has 2x its FLOPs and sincos and the same weight reads, ~13-17 ms, the
other three kernels ~3-6 ms, ~16-23 ms in all. Either way against 150 ms measured for
the fused kernel here (and 6.7 ms for torch.compile). float32 ("ieee" FMA matmuls):
2.34 TFLOP -> 46 ms at 51 TFLOP/s; ~60-120 ms calibrated by the float32 forward (33.6
ms, ~3.7x its count), against 746 ms fused and 42 ms for torch.compile.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import _configs
from ._common import add_to, cos_sin_tile, max_programs, phase_chain_rule, sum_partials
from ._launch import (
    INTERPRET,
    device_guard,
    dot_precision,
    interpreter_blocks,
    pow2,
    rows_view,
    tl_dtype,
)
from ._mlp import activation, activation_grad, mma
from ._round import load_as, round_to
from .lff_forward import hidden_preactivation, split_features


@triton.jit
def _lff_bwd_kernel(
    X,
    WR,
    W1,
    B1,
    W2,
    GRAD,
    DX,
    WS,
    HB,
    GAB,
    n_rows,
    n_freq,
    hidden,
    width,
    n_tiles,
    stride_xr,
    stride_xm,
    stride_gr,
    stride_ws,
    off_dwr,
    off_dw1,
    off_dw2,
    off_db1,
    off_db2,
    ws_fresh,
    inv_sqrt_f,
    M: tl.constexpr,
    MLP: tl.constexpr,
    ACT: tl.constexpr,
    COMPUTE: tl.constexpr,
    PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
    SPLIT: tl.constexpr,
    NEED_X: tl.constexpr,
    NEED_WR: tl.constexpr,
    NEED_W1: tl.constexpr,
    NEED_B1: tl.constexpr,
    NEED_W2: tl.constexpr,
    NEED_B2: tl.constexpr,
    STORE_H: tl.constexpr,
    STORE_GA: tl.constexpr,
    H_SPLIT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    # X [R, M] any strides; WR [F2, M], W1 [2*F2, H], B1 [H], W2 [H, DG] contiguous;
    # GRAD [R, DG] (or [R, 2*F2] without the MLP) with row stride stride_gr, unit columns;
    # DX [R, M] contiguous; WS [P, stride_ws] float32 uninitialised, this program's row
    # holds its partial sums of dwr [F2, M] | dw1 [2*F2, H] | dw2 [H, DG] | db1 [H] |
    # db2 [DG] at the given offsets. Grid: (P,), programs walk tiles pid, pid + P, ...
    # ws_fresh = 0: the row already holds partial sums (an earlier chunk's launch of the
    # split-K path), which every tile adds to. STORE_H / STORE_GA (split-K path): h and
    # ga rounded to the compute dtype are stored to HB / GAB [R, H] contiguous, for
    # _lff_bwd_wgrad_kernel to form dw2 and dw1 from. H_SPLIT (split-K path, without
    # NEED_X / NEED_WR, which need every hidden column): grid (H blocks, P), program
    # (j, p) handles hidden columns j * BLOCK_H + [0, BLOCK_H) of the tiles of p, which
    # its db1 partials (disjoint columns of row p) and stores need alone; db2 is added
    # by the j = 0 programs only.
    if H_SPLIT:
        pid = tl.program_id(1)
        nprog = tl.num_programs(1)
        hs = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    else:
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        hs = tl.arange(0, BLOCK_H)
    ws = WS + pid.to(tl.int64) * stride_ws
    # What the flags imply: ga (the gradient at the pre-activation) feeds db1, dw1 and
    # the phase gradient; the phase gradient feeds dx and dwr.
    NEED_PHASE: tl.constexpr = NEED_X or NEED_WR
    NEED_GA: tl.constexpr = MLP and (NEED_B1 or (NEED_W1 or (NEED_PHASE or STORE_GA)))
    NEED_H: tl.constexpr = MLP and (NEED_W2 or (NEED_GA or STORE_H))
    # dY is read for gh and dw2 and for db2 (h alone, for STORE_H, needs none of it).
    NEED_DY: tl.constexpr = NEED_GA or (NEED_W2 or NEED_B2)
    hmask = hs < hidden
    ms = tl.arange(0, BLOCK_M)
    db1_acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for tile in range(pid, n_tiles, nprog):
        # This tile's read-modify-writes of the workspace row must see the previous
        # tile's, which other threads of this program may have made.
        tl.debug_barrier()
        # The first tile (tile = pid) stores its contributions: 0 + value, exactly what
        # adding to a zeroed row gives. Each column is written once per tile.
        accumulate = (tile >= nprog) | (ws_fresh == 0)
        rows = tl.cast(tile, tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < n_rows
        x_rows = X + rows * stride_xr
        g_rows = GRAD + rows[:, None] * stride_gr
        if NEED_H:
            a = hidden_preactivation(
                x_rows, rmask, stride_xm, WR, W1 + hs[None, :], hmask, n_freq, hidden,
                inv_sqrt_f, M, COMPUTE, PRECISION, INTERPRET, SPLIT, BLOCK_K,
            )  # fmt: skip
            a += tl.load(B1 + hs, mask=hmask, other=0.0).to(tl.float32)[None, :]
            h = round_to(activation(a, ACT), COMPUTE, INTERPRET)
            gh = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
            if STORE_H:
                hg_ptrs = rows[:, None] * hidden + hs[None, :]
                hg_mask = rmask[:, None] & hmask[None, :]
                tl.store(HB + hg_ptrs, h, mask=hg_mask)
        if NEED_DY:
            # One pass over dY (db2 alone: just its column sums, no recomputation above).
            for d0 in range(0, width, BLOCK_D):
                ds = d0 + tl.arange(0, BLOCK_D)
                dmask = ds < width
                # Padded rows read dY = 0, so they add nothing to any sum below.
                g = load_as(
                    g_rows + ds[None, :], rmask[:, None] & dmask[None, :], COMPUTE, INTERPRET
                )
                if NEED_GA:
                    w2t = load_as(
                        W2 + hs[None, :] * width + ds[:, None],
                        dmask[:, None] & hmask[None, :],
                        COMPUTE,
                        INTERPRET,
                    )  # [BD, BH] = w2[:, ds]^T
                    gh = mma(g, w2t, gh, PRECISION, INTERPRET)
                if NEED_W2:
                    part = mma(
                        tl.trans(h),
                        g,
                        tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32),
                        PRECISION,
                        INTERPRET,
                    )
                    add_to(
                        ws + off_dw2 + hs[:, None] * width + ds[None, :],
                        part,
                        hmask[:, None] & dmask[None, :],
                        accumulate,
                    )
                if NEED_B2:
                    if H_SPLIT:
                        if tl.program_id(0) == 0:
                            add_to(ws + off_db2 + ds, tl.sum(g.to(tl.float32), axis=0), dmask,
                                   accumulate)  # fmt: skip
                    else:
                        add_to(ws + off_db2 + ds, tl.sum(g.to(tl.float32), axis=0), dmask,
                               accumulate)  # fmt: skip
        if NEED_GA:
            ga = gh * activation_grad(a, ACT)  # [BR, BH] float32
            if NEED_B1:
                db1_acc += tl.sum(ga, axis=0)
            ga_c = round_to(ga, COMPUTE, INTERPRET)
            if STORE_GA:
                tl.store(
                    GAB + rows[:, None] * hidden + hs[None, :],
                    ga_c,
                    mask=rmask[:, None] & hmask[None, :],
                )
        if NEED_PHASE or (MLP and NEED_W1):
            dx_acc = tl.zeros([BLOCK_R, BLOCK_M], dtype=tl.float32)
            for k0 in range(0, n_freq, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                kmask = ks < n_freq
                c, s = cos_sin_tile(x_rows, rmask, stride_xm, WR, ks, kmask, M)
                if MLP:
                    if NEED_W1:
                        wmask = kmask[:, None] & hmask[None, :]
                        rc = round_to(c * inv_sqrt_f, COMPUTE, INTERPRET)
                        rs = round_to(s * inv_sqrt_f, COMPUTE, INTERPRET)
                        zero_kh = tl.zeros([BLOCK_K, BLOCK_H], dtype=tl.float32)
                        part_c = mma(tl.trans(rc), ga_c, zero_kh, PRECISION, INTERPRET)
                        part_s = mma(tl.trans(rs), ga_c, zero_kh, PRECISION, INTERPRET)
                        add_to(
                            ws + off_dw1 + ks[:, None] * hidden + hs[None, :],
                            part_c,
                            wmask,
                            accumulate,
                        )
                        add_to(
                            ws + off_dw1 + (ks + n_freq)[:, None] * hidden + hs[None, :],
                            part_s,
                            wmask,
                            accumulate,
                        )
                    if NEED_PHASE:
                        tmask = hmask[:, None] & kmask[None, :]
                        w1c_t = load_as(
                            W1 + ks[None, :] * hidden + hs[:, None], tmask, COMPUTE, INTERPRET
                        )
                        w1s_t = load_as(
                            W1 + (ks + n_freq)[None, :] * hidden + hs[:, None],
                            tmask,
                            COMPUTE,
                            INTERPRET,
                        )
                        zero_rk = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
                        gr_c = mma(ga_c, w1c_t, zero_rk, PRECISION, INTERPRET)
                        gr_s = mma(ga_c, w1s_t, zero_rk, PRECISION, INTERPRET)
                else:
                    gmask = rmask[:, None] & kmask[None, :]
                    gr_c = tl.load(g_rows + ks[None, :], mask=gmask, other=0.0).to(tl.float32)
                    gr_s = tl.load(g_rows + (ks + n_freq)[None, :], mask=gmask, other=0.0).to(
                        tl.float32
                    )
                if NEED_PHASE:
                    # d[cos, sin]/d phase = [-sin, cos]; padded rows / frequencies have
                    # gr = 0 (zero dY rows, zero w1 rows), so gphase = 0 there.
                    gphase = (gr_s * c - gr_c * s) * inv_sqrt_f  # [BR, BK]
                    dx_acc = phase_chain_rule(
                        gphase, x_rows, rmask, stride_xm, WR, ks, kmask, dx_acc, ms,
                        ws + off_dwr, accumulate, M, NEED_X, NEED_WR,
                    )  # fmt: skip
            if NEED_X:
                dmask_x = rmask[:, None] & (ms < M)[None, :]
                tl.store(
                    DX + rows[:, None] * M + ms[None, :],
                    round_to(dx_acc, DX.dtype.element_ty, INTERPRET),
                    mask=dmask_x,
                )
    if MLP and NEED_B1:
        add_to(ws + off_db1 + hs, db1_acc, hmask, ws_fresh == 0)


@triton.jit
def _lff_bwd_phase_kernel(
    X,
    WR,
    W1,
    GAB,
    DX,
    WS,
    n_rows,
    n_freq,
    hidden,
    n_tiles,
    stride_xr,
    stride_xm,
    stride_ws,
    ws_fresh,
    inv_sqrt_f,
    M: tl.constexpr,
    COMPUTE: tl.constexpr,
    PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
    NEED_X: tl.constexpr,
    NEED_WR: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    # Split-K path, the chain rule below the hidden layer: gr = ga @ w1^T (the cos and
    # sin halves), d loss / d phase, then dx and the dwr partials -- the fused kernel's
    # second feature pass, from the stored ga (GAB [R, H] contiguous, compute dtype,
    # the same rounded values the fused kernel multiplies) instead of registers.
    # X [R, M] any strides, WR [F2, M], W1 [2*F2, H] contiguous; DX [R, M] contiguous;
    # WS [P, stride_ws] float32: this program's dwr partials (ws_fresh as the fused
    # kernel's). Grid: (P,), programs walk tiles pid, pid + P, ...; H in BLOCK_H chunks.
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    ws = WS + pid.to(tl.int64) * stride_ws
    ms = tl.arange(0, BLOCK_M)
    for tile in range(pid, n_tiles, nprog):
        tl.debug_barrier()  # see the fused kernel: the previous tile's workspace writes
        accumulate = (tile >= nprog) | (ws_fresh == 0)
        rows = tl.cast(tile, tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < n_rows
        x_rows = X + rows * stride_xr
        dx_acc = tl.zeros([BLOCK_R, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, n_freq, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < n_freq
            gr_c = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
            gr_s = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
            for h0 in range(0, hidden, BLOCK_H):
                hs = h0 + tl.arange(0, BLOCK_H)
                hmask = hs < hidden
                ga = tl.load(
                    GAB + rows[:, None] * hidden + hs[None, :],
                    mask=rmask[:, None] & hmask[None, :],
                    other=0.0,
                )
                tmask = hmask[:, None] & kmask[None, :]
                w1c_t = load_as(W1 + ks[None, :] * hidden + hs[:, None], tmask, COMPUTE, INTERPRET)
                w1s_t = load_as(
                    W1 + (ks + n_freq)[None, :] * hidden + hs[:, None], tmask, COMPUTE, INTERPRET
                )
                gr_c = mma(ga, w1c_t, gr_c, PRECISION, INTERPRET)
                gr_s = mma(ga, w1s_t, gr_s, PRECISION, INTERPRET)
            c, s = cos_sin_tile(x_rows, rmask, stride_xm, WR, ks, kmask, M)
            # padded rows / frequencies: ga = 0 / w1 = 0 there, so gphase = 0
            gphase = (gr_s * c - gr_c * s) * inv_sqrt_f
            dx_acc = phase_chain_rule(
                gphase, x_rows, rmask, stride_xm, WR, ks, kmask, dx_acc, ms, ws, accumulate,
                M, NEED_X, NEED_WR,
            )  # fmt: skip
        if NEED_X:
            tl.store(
                DX + rows[:, None] * M + ms[None, :],
                round_to(dx_acc, DX.dtype.element_ty, INTERPRET),
                mask=rmask[:, None] & (ms < M)[None, :],
            )


@triton.jit
def _lff_bwd_wgrad_kernel(
    A,
    B,
    X,
    WR,
    WS,
    n_rows,
    n_freq,
    hidden,
    width,
    rows_per_split,
    stride_xr,
    stride_xm,
    stride_b,
    stride_ws,
    ws_fresh,
    inv_sqrt_f,
    FEATURES: tl.constexpr,
    M: tl.constexpr,
    COMPUTE: tl.constexpr,
    PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
    # Split-K weight gradient, one [BLOCK_I, BLOCK_J] block of it over one contiguous range
    # of rows per program, accumulated in registers; the partial goes to the workspace row
    # of its split once (stored if ws_fresh, else added: the previous chunk's sum).
    #   FEATURES = False: dw2 [H, DG] = h^T @ dY. A = h [R, H] (compute dtype), B = dY
    #     [R, DG] with row stride stride_b; I runs over H, J over DG.
    #   FEATURES = True: dw1 [2*F2, H] = r^T @ ga, r = [cos || sin](x wr^T) / sqrt(F)
    #     recomputed from X [R, M] (any strides) and WR [F2, M]; B = ga [R, H] (compute
    #     dtype, stride_b); I runs over the F2 frequencies (cos and sin rows of dw1), J
    #     over H. A is unused.
    # WS [S, stride_ws] float32, this gradient's columns. Grid: (I blocks * J blocks, S);
    # split s owns rows [s * rows_per_split, (s + 1) * rows_per_split) (a multiple of
    # BLOCK_R), walked in order: a fixed summation order, no atomics.
    blk = tl.program_id(0)
    split = tl.program_id(1)
    n_i = n_freq if FEATURES else hidden
    n_j = hidden if FEATURES else width
    blocks_j = tl.cdiv(n_j, BLOCK_J)
    iis = (blk // blocks_j) * BLOCK_I + tl.arange(0, BLOCK_I)
    js = (blk % blocks_j) * BLOCK_J + tl.arange(0, BLOCK_J)
    imask = iis < n_i
    jmask = js < n_j
    acc = tl.zeros([BLOCK_I, BLOCK_J], dtype=tl.float32)
    if FEATURES:
        acc_s = tl.zeros([BLOCK_I, BLOCK_J], dtype=tl.float32)
    row0 = tl.cast(split, tl.int64) * rows_per_split
    row_end = tl.minimum(row0 + rows_per_split, n_rows)
    for r0 in range(row0, row_end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        rmask = rows < row_end
        # Padded rows read b = 0: they add nothing, whatever the A side holds there.
        b = load_as(
            B + rows[:, None] * stride_b + js[None, :],
            rmask[:, None] & jmask[None, :],
            COMPUTE,
            INTERPRET,
        )  # [BR, BJ]
        if FEATURES:
            # The same rounded features as the forward's first matmul and the fused
            # kernel's dw1 partials (round_to(c / sqrt(F))), so both paths agree to
            # float32 summation order.
            c, s = cos_sin_tile(X + rows * stride_xr, rmask, stride_xm, WR, iis, imask, M)
            rc = round_to(c * inv_sqrt_f, COMPUTE, INTERPRET)
            rs = round_to(s * inv_sqrt_f, COMPUTE, INTERPRET)
            acc = mma(tl.trans(rc), b, acc, PRECISION, INTERPRET)
            acc_s = mma(tl.trans(rs), b, acc_s, PRECISION, INTERPRET)
        else:
            a_t = load_as(
                A + rows[None, :] * hidden + iis[:, None],
                imask[:, None] & rmask[None, :],
                COMPUTE,
                INTERPRET,
            )  # [BI, BR] = h[rows, iis]^T
            acc = mma(a_t, b, acc, PRECISION, INTERPRET)
    ws = WS + split.to(tl.int64) * stride_ws
    accumulate = ws_fresh == 0
    mask = imask[:, None] & jmask[None, :]
    add_to(ws + iis[:, None] * n_j + js[None, :], acc, mask, accumulate)
    if FEATURES:
        add_to(ws + (iis + n_freq)[:, None] * n_j + js[None, :], acc_s, mask, accumulate)


# Workspace budget: partial sums of all programs together stay below this many bytes
# (P shrinks for large weights, e.g. F=768, H=256, Dg=1024: 1.8 MB per program).
_WORKSPACE_BYTES = 256 * 2**20


# Launch options of the GPU configurations (see gpu_candidates).
_OPTIONS = {"num_warps": 8, "num_stages": 1}


def gpu_candidates(meta: dict) -> list[dict]:
    """Block sizes for the GPU, preferred first (launched with _OPTIONS). ``meta``: the
    kernel's constexprs (COMPUTE, BLOCK_H). A fixed rule, see the module docstring."""
    # Chosen by compiling for sm_90 (triton 3.9's ptxas, no GPU) and reading registers /
    # spills; timing on the H200 is pending. bf16/fp16, M=2..4: (128, 16, 32) uses 234
    # registers without spilling at H=32; H=128 and H=256 spill ~340 B / ~810 B with the
    # rows shrunk to 64 / 32 (the [rows, H] tiles a, gh, ga all live through the tile).
    # float32 uses FMA matmuls ("ieee"), which need far more registers: 32 rows.
    # num_stages=1: with 2 stages the H=32 tile above needs 252 registers (and spilled
    # 32 B before the workspace's first-tile stores, which cut 18 registers).
    # Second choice, where _configs refuses the first (Triton 3.1 cannot compile 64 rows
    # with 8 warps for sm_90): 32 rows, which use Ampere's mma.sync, no warpgroups.
    block_h = meta["BLOCK_H"]
    if meta["COMPUTE"] == tl.float32:
        block_r = 32 if block_h <= 64 else 16
    else:
        block_r = 128 if block_h <= 64 else (64 if block_h <= 128 else 32)
    rows = dict.fromkeys((block_r, min(block_r, 32)))
    return [{"BLOCK_R": r, "BLOCK_K": 16, "BLOCK_D": 32} for r in rows]


def _blocks(R: int, F2: int, H: int, DG: int, meta: dict, arch) -> tuple[dict, dict]:
    """(block sizes, launch options): under the interpreter its blocks; on the GPU the
    first of gpu_candidates that _configs allows on ``arch`` (compute capability x10)."""
    if INTERPRET:
        return interpreter_blocks(R, F2, DG), {}
    why = []
    for blocks in gpu_candidates(meta):
        reason = _configs.refusal("lff_bwd", {**meta, **blocks}, **_OPTIONS, arch=arch)
        if reason is None:
            return blocks, dict(_OPTIONS)
        why.append(f"BLOCK_R={blocks['BLOCK_R']}: {reason}")
    raise RuntimeError(
        f"posenc_fast: no lff_bwd configuration can be compiled for sm_{arch} with Triton "
        f"{triton.__version__}: " + "; ".join(why)
    )


# The split-K path (module docstring) takes over when the fused kernel's per-program
# partial sums (4 bytes per needed weight-gradient element) exceed this: beyond it the
# workspace rows no longer stay in L2 and their read-modify-write per row tile dominates
# (F=768, H=256, Dg=1024: 1.8 MB per program, ~118 GB of traffic for 2^20 rows). The
# canonical H=32 case (135 kB) stays on the fused kernel.
_SPLIT_K_BYTES = 256 * 1024

# Split-K path: h and ga of one chunk of rows ([rows, H] each, compute dtype) stay below
# this; the rows are processed chunk by chunk, so memory does not grow with N.
_BUFFER_BYTES = 128 * 2**20

# Launch options and block sizes of _lff_bwd_wgrad_kernel on the GPU, by (matmul kind,
# FEATURES): (BLOCK_R, BLOCK_I, BLOCK_J, num_warps, num_stages). Chosen by compiling for
# sm_80 / sm_90 (compile_report, Triton 3.9, no GPU): no spills, shared memory within
# 99 kB. dw2: 128 x 64 blocks (128 x 128 spills 16-40 B: the accumulator and the
# workspace pointers of the read-modify-write). dw1: 32 frequencies (cos and sin) x up to
# 256 hidden, so that H <= 256 recomputes each row's cos / sin once (64 x 128 would use
# Hopper's warpgroup MMA but compute them H / 128 times; 32 rows use mma.sync). float32
# FMA matmuls ("ieee") take smaller blocks. Triton 3.1 and 3.6 compile them too (dw1
# spills 8-40 B under 3.1); TF32 was compiled by hand (compile_report covers bf16 and
# IEEE float32), no spills under 3.9. Timing on the GPU is pending.
_WGRAD_CONFIGS = {
    ("mma16", False): (64, 128, 64, 8, 2),
    ("mma16", True): (32, 32, 256, 8, 2),
    ("tf32", False): (32, 128, 64, 8, 2),
    ("tf32", True): (32, 32, 256, 8, 2),
    ("ieee", False): (32, 64, 64, 8, 2),
    ("ieee", True): (32, 32, 128, 8, 2),
}


def wgrad_config(meta: dict, features: bool) -> tuple[dict, dict]:
    """(block sizes, launch options) of _lff_bwd_wgrad_kernel on the GPU for the kernel
    constexprs ``meta`` (COMPUTE, PRECISION); a fixed rule, no autotuning (the block
    sizes set the summation order)."""
    br, bi, bj, warps, stages = _WGRAD_CONFIGS[(_kind(meta), features)]
    if features:  # J runs over H: no wider than the hidden layer
        bj = min(bj, meta["BLOCK_H"])
    return (
        {"BLOCK_R": br, "BLOCK_I": bi, "BLOCK_J": bj},
        {"num_warps": warps, "num_stages": stages},
    )


def _wgrad_blocks(meta: dict, features: bool, n_i: int, n_j: int, chunk: int, arch):
    if INTERPRET:
        blocks = {
            "BLOCK_R": pow2(chunk, 16, 64),
            "BLOCK_I": pow2(n_i, 16, 64),
            "BLOCK_J": pow2(n_j, 16, 128),
        }
        return blocks, {}
    blocks, options = wgrad_config(meta, features)
    reason = _configs.refusal("lff_bwd_wgrad", {**meta, **blocks, "FEATURES": features},
                              **options, arch=arch)  # fmt: skip
    if reason is not None:
        raise RuntimeError(
            f"posenc_fast: the lff_bwd_wgrad configuration {blocks} cannot be compiled for "
            f"sm_{arch} with Triton {triton.__version__}: {reason}"
        )
    return blocks, options


# The split-K path's first pass (the fused kernel, H_SPLIT) and phase kernel on the GPU:
# (BLOCK_R, BLOCK_K, BLOCK_H, BLOCK_D, num_warps, num_stages) and (BLOCK_R, BLOCK_K,
# BLOCK_H, num_warps, num_stages), by matmul kind. Chosen by compiling for sm_80 / sm_90
# (H=256; no GPU). First pass, bf16: 64 rows x 128 hidden columns, 16 dY columns per
# step spill 24-32 B (Triton 3.9), 8-48 B (3.6), 112 B (3.1 sm_80; on sm_90 3.1 takes
# the 32-row second choice, no spill); 64 hidden columns would not spill but evaluate
# each row's sincos H / 64 times, 32 dY columns spill 112 B, 128 rows 1.3 kB. float32
# (FMA and TF32): 32 rows, no spill. Phase kernel: 128 rows (bf16; 64 TF32, 32 float32
# FMA) x 32 frequencies, 32 hidden columns per step: no spill with 3.9, at most 24 B
# with 3.1 / 3.6. Timing on the GPU is pending.
_FIRST_PASS_CONFIGS = {
    "mma16": (64, 16, 128, 16, 8, 1),
    "tf32": (32, 16, 128, 16, 8, 1),
    "ieee": (32, 16, 128, 16, 8, 1),
}
_PHASE_CONFIGS = {
    "mma16": (128, 32, 32, 8, 2),
    "tf32": (64, 32, 32, 8, 2),
    "ieee": (32, 16, 32, 8, 2),
}


def _kind(meta: dict) -> str:
    """The matmul kind: 16-bit tensor-core operands, TF32, or float32 FMA ("ieee")."""
    return "mma16" if meta["COMPUTE"] != tl.float32 else meta["PRECISION"]


def first_pass_candidates(meta: dict) -> list[tuple[dict, dict]]:
    """(block sizes, launch options) of the split-K path's first pass on the GPU,
    preferred first; the second (32 rows: mma.sync) where _configs refuses the first."""
    br, bk, bh, bd, warps, stages = _FIRST_PASS_CONFIGS[_kind(meta)]
    bh = min(bh, meta["BLOCK_H"])
    options = {"num_warps": warps, "num_stages": stages}
    rows = dict.fromkeys((br, min(br, 32)))
    return [({"BLOCK_R": r, "BLOCK_K": bk, "BLOCK_H": bh, "BLOCK_D": bd}, options) for r in rows]


def _first_pass_blocks(meta: dict, F2: int, DG: int, arch) -> tuple[dict, dict]:
    if INTERPRET:
        # 16 hidden columns per program: the H_SPLIT programs are exercised in CI
        blocks = interpreter_blocks(1 << 20, F2, DG)
        return {**blocks, "BLOCK_H": min(16, meta["BLOCK_H"])}, {}
    flags = dict(NEED_X=False, NEED_WR=False, NEED_W1=False, NEED_W2=False, H_SPLIT=True)
    why = []
    for blocks, options in first_pass_candidates(meta):
        reason = _configs.refusal("lff_bwd", {**meta, **flags, **blocks}, **options, arch=arch)
        if reason is None:
            return blocks, options
        why.append(f"BLOCK_R={blocks['BLOCK_R']}: {reason}")
    raise RuntimeError(
        f"posenc_fast: no lff_bwd first-pass configuration can be compiled for sm_{arch} "
        f"with Triton {triton.__version__}: " + "; ".join(why)
    )


def phase_config(meta: dict) -> tuple[dict, dict]:
    """(block sizes, launch options) of _lff_bwd_phase_kernel on the GPU."""
    br, bk, bh, warps, stages = _PHASE_CONFIGS[_kind(meta)]
    return {"BLOCK_R": br, "BLOCK_K": bk, "BLOCK_H": min(bh, meta["BLOCK_H"])}, {
        "num_warps": warps,
        "num_stages": stages,
    }


def _phase_blocks(meta: dict, F2: int, H: int, chunk: int, arch) -> tuple[dict, dict]:
    if INTERPRET:  # 16 hidden columns per step: the loop over H is exercised in CI
        return {"BLOCK_R": pow2(chunk, 16, 64), "BLOCK_K": pow2(F2, 16, 64), "BLOCK_H": 16}, {}
    blocks, options = phase_config(meta)
    reason = _configs.refusal("lff_bwd_phase", {**meta, **blocks}, **options, arch=arch)
    if reason is not None:
        raise RuntimeError(
            f"posenc_fast: the lff_bwd_phase configuration {blocks} cannot be compiled for "
            f"sm_{arch} with Triton {triton.__version__}: {reason}"
        )
    return blocks, options


def _sum_partials(ws, parts, n_parts, out, device):
    """One small launch per gradient, each into its own tensor (outputs of a custom op
    must not alias each other): the fixed-order sum of the n_parts workspace rows."""
    for idx, ref, off in parts:
        out[idx] = sum_partials(ws, ref, n_parts, off)


def _workspace_parts(items) -> tuple[list, int]:
    """[(index in the result, reference tensor, workspace offset)] of the needed
    gradients among ``items`` (index, need, reference), and the total columns."""
    parts, offset = [], 0
    for idx, need, ref in items:
        if need:
            parts.append((idx, ref, offset))
            offset += ref.numel()
    return parts, offset


def lff_bwd(grad, x, wr, w1, b1, w2, b2, activation: str, needs) -> list:
    """Gradients (dx, dwr, dw1, db1, dw2, db2) of lff_fwd; None where needs[i] is False.

    grad [..., G * width] in the forward's output dtype (the MLP compute dtype); x is
    floating, as in lff_fwd. Returned gradients have the dtypes of their inputs.
    """
    mlp = w1 is not None
    need_x, need_wr, need_w1, need_b1, need_w2, need_b2 = (bool(n) for n in needs)
    if not mlp:
        need_w1 = need_b1 = need_w2 = need_b2 = False
    M = x.shape[-1]
    rows = x.reshape(-1, M)
    R = rows.shape[0]
    F2 = wr.shape[0]
    H = w1.shape[1] if mlp else 0
    width = w2.shape[1] if mlp else 2 * F2
    device = x.device
    out: list = [None] * 6

    parts, total = _workspace_parts(
        (
            (1, need_wr, wr),
            (2, need_w1, w1),
            (4, need_w2, w2),
            (3, need_b1, b1),
            (5, need_b2, b2),
        )
    )

    dx = None
    if need_x:
        dx = torch.empty((R, M), dtype=x.dtype, device=device)
        out[0] = dx.view(x.shape)
    if R == 0 or not (need_x or parts):
        for idx, ref, _ in parts:
            out[idx] = torch.zeros_like(ref)
        return out

    g = rows_view(grad, width, R)
    compute = grad.dtype
    wr = wr.contiguous()
    if mlp:
        w1, b1, w2 = (t.contiguous() for t in (w1, b1, w2))
    else:
        w1 = b1 = w2 = wr  # never read: MLP is a compile-time False

    meta = {
        "M": M,
        "MLP": mlp,
        "ACT": activation,
        "COMPUTE": tl_dtype(compute),
        "PRECISION": dot_precision(compute),
        "INTERPRET": INTERPRET,
        "SPLIT": split_features(activation, compute),
        "BLOCK_H": pow2(H),
        "BLOCK_M": triton.next_power_of_2(M),
    }
    arch = None if INTERPRET else _configs.device_arch(device)
    # The rule between the two paths (see _SPLIT_K_BYTES): the fused kernel's partial sums
    # per program, which only the needed weight gradients occupy.
    split_k = (need_w1 or need_w2) and total * 4 > _SPLIT_K_BYTES
    blocks, options = (None, None) if split_k else _blocks(R, F2, H, width, meta, arch)
    flags = dict(NEED_X=need_x, NEED_WR=need_wr, NEED_B1=need_b1, NEED_B2=need_b2)
    args = (rows, wr, w1, b1, w2, g, dx, (F2, H, width), meta, blocks, options)
    with device_guard(x):
        if split_k:
            _split_k(out, args, flags, need_w1, need_w2, b2, arch, device)
        else:
            programs = _programs(R, blocks, total, device)
            # programs <= tiles: every program has a first tile, which writes its row.
            ws = torch.empty((programs, max(1, total)), dtype=torch.float32, device=device)
            offsets = {idx: off for idx, _, off in parts}
            _fused(args, ws, offsets, 0, R, True, None, None,
                   dict(flags, NEED_W1=need_w1, NEED_W2=need_w2))  # fmt: skip
            _sum_partials(ws, parts, programs, out, device)
    return out


def _programs(rows: int, blocks: dict, total: int, device) -> int:
    """Programs of the fused kernel: at most one per tile of ``rows`` (so that each has a
    first tile), two per SM, and a workspace of P * total * 4 B within the budget."""
    n_tiles = triton.cdiv(rows, blocks["BLOCK_R"])
    per_program = max(1, total) * 4
    return max(1, min(n_tiles, max_programs(device), _WORKSPACE_BYTES // per_program))


def _fused(args, ws, offsets, r0, r1, fresh, hb, gab, flags, blocks=None, options=None):
    """Launch _lff_bwd_kernel on rows [r0, r1) with ws.shape[0] programs; ``fresh``: the
    workspace rows are uninitialised (written by each program's first tile), else added
    to. hb / gab: where to store h / ga of these rows (STORE_H / STORE_GA), or None.
    blocks / options: instead of args' (with BLOCK_H: H_SPLIT, one program per block of
    BLOCK_H hidden columns and workspace row)."""
    rows, wr, w1, b1, w2, g, dx, (F2, H, width), meta, blocks0, options0 = args
    kw = {**meta, **(blocks or blocks0), **(options if blocks else options0)}
    h_blocks = triton.cdiv(H, kw["BLOCK_H"]) if blocks and "BLOCK_H" in blocks else 0
    grid = (h_blocks, ws.shape[0]) if h_blocks else (ws.shape[0],)
    n = r1 - r0
    _lff_bwd_kernel[grid](
        rows[r0:r1],
        wr,
        w1,
        b1,
        w2,
        g[r0:r1],
        dx[r0:r1] if dx is not None else ws,
        ws,
        hb if hb is not None else ws,
        gab if gab is not None else ws,
        n,
        F2,
        H,
        width,
        triton.cdiv(n, kw["BLOCK_R"]),
        rows.stride(0),
        rows.stride(1),
        g.stride(0),
        ws.stride(0),
        offsets.get(1, 0),
        offsets.get(2, 0),
        offsets.get(4, 0),
        offsets.get(3, 0),
        offsets.get(5, 0),
        1 if fresh else 0,
        1.0 / math.sqrt(2 * F2),
        STORE_H=hb is not None,
        STORE_GA=gab is not None,
        H_SPLIT=bool(h_blocks),
        enable_fp_fusion=False,
        **flags,
        **kw,
    )


def _split_k(out, args, flags, need_w1, need_w2, b2, arch, device):
    """The large-weights path (module docstring), per chunk of rows: the fused kernel over
    blocks of hidden columns for h, ga, db1 and db2 (storing h / ga), the phase kernel for
    dx and dwr, one split-K launch per weight gradient; partial sums carried across
    chunks in fixed workspaces."""
    rows, wr, w1, b1, w2, g, dx, (F2, H, width), meta, _, _ = args
    R = rows.shape[0]
    compute = g.dtype
    need_phase = flags["NEED_X"] or flags["NEED_WR"]
    # Rows per chunk: a multiple of 128 (every block size), at least 128, the same
    # whichever of h / ga are stored (the chunks are part of the summation order, which
    # must not depend on ``needs``).
    chunk = max(128, _BUFFER_BYTES // (2 * H * compute.itemsize) // 128 * 128)
    chunk = min(chunk, R)
    hb = torch.empty((chunk, H), dtype=compute, device=device) if need_w2 else None
    need_ga = need_w1 or need_phase
    gab = torch.empty((chunk, H), dtype=compute, device=device) if need_ga else None

    # First pass: db1 and db2 partials in its workspace rows.
    first_blocks, first_options = _first_pass_blocks(meta, F2, width, arch)
    small, small_total = _workspace_parts(((3, flags["NEED_B1"], b1), (5, flags["NEED_B2"], b2)))
    p1 = _programs(chunk, first_blocks, small_total, device)
    ws1 = torch.empty((p1, max(1, small_total)), dtype=torch.float32, device=device)
    offsets1 = {idx: off for idx, _, off in small}
    first_flags = dict(flags, NEED_X=False, NEED_WR=False, NEED_W1=False, NEED_W2=False)

    # Phase pass: dx and the dwr partials.
    if need_phase:
        phase_blocks, phase_options = _phase_blocks(meta, F2, H, chunk, arch)
        p2 = _programs(chunk, phase_blocks, wr.numel() if flags["NEED_WR"] else 0, device)
        ws2 = torch.empty((p2, wr.numel()), dtype=torch.float32, device=device)

    # Weight gradients: (result index, FEATURES, gradient tensor, I size, J size) each.
    grads = [(4, False, w2, H, width)] if need_w2 else []
    grads += [(2, True, w1, F2, H)] if need_w1 else []
    plans = []
    for idx, features, ref, n_i, n_j in grads:
        wb, wo = _wgrad_blocks(meta, features, n_i, n_j, chunk, arch)
        n_blocks = triton.cdiv(n_i, wb["BLOCK_I"]) * triton.cdiv(n_j, wb["BLOCK_J"])
        splits = max(1, min(triton.cdiv(max_programs(device), n_blocks),
                            triton.cdiv(chunk, wb["BLOCK_R"])))  # fmt: skip
        wws = torch.empty((splits, ref.numel()), dtype=torch.float32, device=device)
        plans.append((idx, features, ref, wb, wo, n_blocks, splits, wws))

    inv_sqrt_f = 1.0 / math.sqrt(2 * F2)
    for r0 in range(0, R, chunk):
        r1 = min(R, r0 + chunk)
        n = r1 - r0
        fresh = r0 == 0
        _fused(args, ws1, offsets1, r0, r1, fresh, hb, gab, first_flags, first_blocks,
               first_options)  # fmt: skip
        if need_phase:
            _lff_bwd_phase_kernel[(p2,)](
                rows[r0:r1],
                wr,
                w1,
                gab,
                dx[r0:r1] if dx is not None else ws2,
                ws2,
                n,
                F2,
                H,
                triton.cdiv(n, phase_blocks["BLOCK_R"]),
                rows.stride(0),
                rows.stride(1),
                ws2.stride(0),
                1 if fresh else 0,
                inv_sqrt_f,
                M=meta["M"],
                COMPUTE=meta["COMPUTE"],
                PRECISION=meta["PRECISION"],
                INTERPRET=INTERPRET,
                NEED_X=flags["NEED_X"],
                NEED_WR=flags["NEED_WR"],
                BLOCK_M=meta["BLOCK_M"],
                enable_fp_fusion=False,
                **phase_blocks,
                **phase_options,
            )
        for _, features, _, wb, wo, n_blocks, splits, wws in plans:
            b_op = g[r0:r1] if not features else gab
            per_split = triton.cdiv(triton.cdiv(n, splits), wb["BLOCK_R"]) * wb["BLOCK_R"]
            _lff_bwd_wgrad_kernel[(n_blocks, splits)](
                hb if hb is not None else wws,
                b_op,
                rows[r0:r1],
                wr,
                wws,
                n,
                F2,
                H,
                width,
                per_split,
                rows.stride(0),
                rows.stride(1),
                b_op.stride(0),
                wws.stride(0),
                1 if fresh else 0,
                inv_sqrt_f,
                FEATURES=features,
                M=meta["M"],
                COMPUTE=meta["COMPUTE"],
                PRECISION=meta["PRECISION"],
                INTERPRET=INTERPRET,
                enable_fp_fusion=False,
                **wb,
                **wo,
            )
    _sum_partials(ws1, small, p1, out, device)
    if flags["NEED_WR"]:
        _sum_partials(ws2, [(1, wr, 0)], p2, out, device)
    for idx, _, ref, _, _, _, splits, wws in plans:
        _sum_partials(wws, [(idx, ref, 0)], splits, out, device)
