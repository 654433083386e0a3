"""Learnable Fourier features + grouped MLP, backward: the fused kernel (one pass over dY
for every gradient), its block rules, its workspace and its launcher. lff_backward.lff_bwd
chooses between it and the split-K path; that path's first pass is this kernel too."""

from __future__ import annotations

import math

import triton
import triton.language as tl

from . import _configs
from ._launch import INTERPRET, interpreter_blocks
from ._mlp import activation, activation_grad, mma
from ._partial_sums import add_to, max_programs
from ._phase_tiles import cos_sin_tile, phase_chain_rule
from ._round import load_as, round_to
from .lff_forward import hidden_preactivation

# Workspace budget: partial sums of all programs together stay below this many bytes
# (P shrinks for large weights, e.g. F=768, H=256, Dg=1024: 1.8 MB per program).
_WORKSPACE_BYTES = 256 * 2**20


# Launch options of the GPU configurations (block sizes: gpu_candidates): 8 warps, one
# stage (two would need 252 registers at H=32). Fixed, like the block sizes: part of what
# compile_report checked for each architecture.
OPTIONS = {"num_warps": 8, "num_stages": 1}


# The forward saves only x and the weights; this kernel recomputes features and hidden
# layer, reads dY once, writes dx [R, M] per row and reduces dwr, dw1, db1, dw2, db2
# deterministically. Per tile of BLOCK_R rows (r = [cos || sin] / sqrt(F), a = r w1 + b1,
# h = act(a)):
#
#     a      = sum over frequency chunks of r_k @ w1_k            (recompute, tl.dot)
#     for each chunk of BLOCK_D output columns:                 (dY read once)
#         gh  += dY_d @ w2_d^T                                    [BR, BH] registers
#         dw2 partial[:, d] += h^T @ dY_d ;  db2 partial[d] += sum_rows dY_d
#     ga     = gh * act'(a) ;  db1 partial += sum_rows ga        [BR, BH] registers
#     for each frequency chunk k:                               (features recomputed)
#         dw1 partial[k] += r_k^T @ ga
#         gr_k   = ga @ w1_k^T                                    [BR, BK] (cos / sin parts)
#         gphase = (gr_sin * cos - gr_cos * sin) / sqrt(F)        d loss / d phase
#         dx    += gphase @ wr_k ;  dwr partial[k] += gphase^T @ x
#     store dx
#
# Determinism without atomics: a fixed number P of programs each owns one row of a float32
# workspace [P, |weights|] and walks the row tiles t = pid, pid + P, ... in order, adding
# to its own row (a barrier between tiles; the first tile, which every program has as
# P <= tiles, writes every column once, so the workspace needs no zeroing).
# sum_partials_kernel sums the P rows in the fixed order p = 0, ..., P-1. The configuration
# is a fixed rule (no autotuning: it sets the summation order). The constexpr flags skip
# whatever ``needs`` does not ask for.
#
# Large weights (one program's partials above lff_backward._SPLIT_K_BYTES) take the
# split-K path (lff_backward_split_k.py), whose first pass is this kernel with H_SPLIT
# and STORE_H / STORE_GA. Byte and FLOP counts: benchmarks/NOTES.md, "Kernel notes".
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
    # ws_fresh = 0: the row already holds partial sums (an earlier chunk's), added to.
    # Split-K path: STORE_H / STORE_GA store h and ga (rounded to the compute dtype) to
    # HB / GAB [R, H] contiguous; H_SPLIT (without NEED_X / NEED_WR): grid (H blocks, P),
    # program (j, p) handles hidden columns j * BLOCK_H + [0, BLOCK_H) of the tiles of p;
    # db2 is added by the j = 0 programs only.
    if H_SPLIT:
        pid = tl.program_id(1)
        nprog = tl.num_programs(1)
        hs = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    else:
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        hs = tl.arange(0, BLOCK_H)
    ws = WS + pid.to(tl.int64) * stride_ws
    # ga feeds db1, dw1 and the phase gradient; the phase gradient feeds dx and dwr.
    NEED_PHASE: tl.constexpr = NEED_X or NEED_WR
    NEED_GA: tl.constexpr = MLP and (NEED_B1 or (NEED_W1 or (NEED_PHASE or STORE_GA)))
    NEED_H: tl.constexpr = MLP and (NEED_W2 or (NEED_GA or STORE_H))
    # dY is read for gh and dw2 and for db2 (h alone, for STORE_H, needs none of it).
    NEED_DY: tl.constexpr = NEED_GA or (NEED_W2 or NEED_B2)
    hmask = hs < hidden
    ms = tl.arange(0, BLOCK_M)
    db1_acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for tile in range(pid, n_tiles, nprog):
        # Barrier: this tile's read-modify-writes of the workspace row must see the
        # previous tile's. The first tile (tile = pid) stores 0 + value instead.
        tl.debug_barrier()
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


def gpu_candidates(meta: dict) -> list[dict]:
    """Block sizes for the GPU, preferred first (launched with OPTIONS). ``meta``: the
    kernel's constexprs (COMPUTE, BLOCK_H). A fixed rule: the block sizes set the
    summation order."""
    # Block sizes chosen by compiling for sm_90 (registers / spills: benchmarks/NOTES.md,
    # "Kernel notes"): the [rows, H] tiles a, gh, ga all live through the tile, so rows
    # shrink as H grows; float32 FMA matmuls ("ieee") need far more registers. Second
    # choice, where _configs refuses the first: 32 rows (Ampere's mma.sync, no warpgroups).
    block_h = meta["BLOCK_H"]
    if meta["COMPUTE"] == tl.float32:
        block_r = 32 if block_h <= 64 else 16
    else:
        block_r = 128 if block_h <= 64 else (64 if block_h <= 128 else 32)
    rows = dict.fromkeys((block_r, min(block_r, 32)))
    return [{"BLOCK_R": r, "BLOCK_K": 16, "BLOCK_D": 32} for r in rows]


def choose_blocks(R: int, F2: int, H: int, DG: int, meta: dict, arch) -> tuple[dict, dict]:
    """(block sizes, launch options): under the interpreter its blocks; on the GPU the
    first of gpu_candidates that _configs allows on ``arch`` (compute capability x10)."""
    if INTERPRET:
        return interpreter_blocks(R, F2, DG), {}
    why = []
    for blocks in gpu_candidates(meta):
        reason = _configs.refusal("lff_bwd", {**meta, **blocks}, **OPTIONS, arch=arch)
        if reason is None:
            return blocks, dict(OPTIONS)
        why.append(f"BLOCK_R={blocks['BLOCK_R']}: {reason}")
    raise RuntimeError(
        f"posenc_fast: no lff_bwd configuration can be compiled for sm_{arch} with Triton "
        f"{triton.__version__}: " + "; ".join(why)
    )


def programs(rows: int, blocks: dict, total: int, device) -> int:
    """Programs of the kernel: at most one per tile of ``rows`` (so that each has a first
    tile), two per SM, and a workspace of P * total * 4 B within the budget."""
    n_tiles = triton.cdiv(rows, blocks["BLOCK_R"])
    per_program = max(1, total) * 4
    return max(1, min(n_tiles, max_programs(device), _WORKSPACE_BYTES // per_program))


def run(args, ws, offsets, r0, r1, fresh, hb, gab, flags, blocks=None, options=None):
    """Launch _lff_bwd_kernel on rows [r0, r1) with ws.shape[0] programs; ``fresh``: the
    workspace rows are uninitialised, else added to. hb / gab: where to store h / ga, or
    None. blocks / options: instead of args' (with BLOCK_H: the H_SPLIT grid)."""
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
        **flags,
        **kw,
        enable_fp_fusion=False,
    )
