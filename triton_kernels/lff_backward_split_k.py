"""Learnable Fourier features + grouped MLP, backward: the split-K path for large weights
(``split_k``), which lff_backward.lff_bwd takes where the fused kernel's per-program partial
sums would not stay in L2. Per chunk of rows: the fused kernel's first pass, a phase kernel
and two split-K matrix products, as deterministic as the fused kernel."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import _configs, _partial_sums
from . import lff_backward_fused as fused
from ._launch import INTERPRET, interpreter_blocks, pow2
from ._mlp import mma
from ._partial_sums import add_to, max_programs
from ._phase_tiles import cos_sin_tile, phase_chain_rule
from ._round import load_as, round_to


# Why a second path: the fused kernel read-modify-writes each program's partials once per
# row tile, which large weights push out of L2 (benchmarks/NOTES.md, "Triton LFF backward
# with large weights"). When one program's partials exceed lff_backward._SPLIT_K_BYTES,
# the backward runs as four kernels per chunk of rows:
#
#     for each chunk of C rows (C: h and ga of the chunk fit _BUFFER_BYTES):
#         first pass: _lff_bwd_kernel with H_SPLIT, one program per (block of hidden
#             columns, row-tile walker): a, h, gh = dY w2^T and ga for its columns only,
#             db1 / db2 partials; h and ga, rounded to the compute dtype exactly as the
#             fused kernel uses them, stored to two [C, H] buffers
#         phase: _lff_bwd_phase_kernel: gr = ga w1^T (cos and sin halves),
#             d loss / d phase, dx, dwr partials (the fused kernel's second feature pass)
#         dw2 += h^T @ dY                        _lff_bwd_wgrad_kernel, FEATURES=False
#         dw1 += [cos || sin]^T @ ga / sqrt(F)   (features recomputed), FEATURES=True
#
# _lff_bwd_wgrad_kernel is a split-K matmul: a program owns one output block and one of S
# contiguous row ranges of the chunk, accumulates in float32 registers and touches its
# workspace row once per chunk. Deterministic: block sizes, C and S are fixed functions of
# the shapes, dtype and SM count (C not of ``needs``), all sums in fixed order, no atomics.
# The operands are the fused kernel's, so both paths agree to float32 summation order.
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
    # The fused kernel's second feature pass (gr = ga @ w1^T, d loss / d phase, dx, dwr
    # partials), reading ga from GAB [R, H] contiguous (the same rounded values).
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
    # One [BLOCK_I, BLOCK_J] block of a weight gradient over one contiguous range of rows,
    # accumulated in registers, then stored (ws_fresh) or added to its split's workspace row.
    #   FEATURES = False: dw2 [H, DG] = h^T @ dY; A = h [R, H], B = dY [R, DG] (row stride
    #     stride_b); I runs over H, J over DG.
    #   FEATURES = True: dw1 [2*F2, H] = r^T @ ga, r = [cos || sin](x wr^T) / sqrt(F)
    #     recomputed from X [R, M] (any strides) and WR [F2, M]; B = ga [R, H]; I runs over
    #     the F2 frequencies (cos and sin rows), J over H; A unused.
    # A, B in the compute dtype. WS [S, stride_ws] float32. Grid: (I blocks * J blocks, S);
    # split s owns rows [s, s + 1) * rows_per_split (a multiple of BLOCK_R), walked in order.
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


# Split-K path: h and ga of one chunk of rows ([rows, H] each, compute dtype) stay below
# this; the rows are processed chunk by chunk, so memory does not grow with N.
_BUFFER_BYTES = 128 * 2**20

# Launch options and block sizes of _lff_bwd_wgrad_kernel on the GPU, by (matmul kind,
# FEATURES): (BLOCK_R, BLOCK_I, BLOCK_J, num_warps, num_stages); chosen by compiling for
# sm_80 / sm_90: no spills, shared memory within 99 kB. dw1 takes 32 frequencies x up to 256
# hidden so that H <= 256 recomputes each row's cos / sin once (benchmarks/NOTES.md).
_WGRAD_CONFIGS = {
    ("mma16", False): (64, 128, 64, 8, 2),
    ("mma16", True): (32, 32, 256, 8, 2),
    ("tf32", False): (32, 128, 64, 8, 2),
    ("tf32", True): (32, 32, 256, 8, 2),
    ("ieee", False): (32, 64, 64, 8, 2),
    ("ieee", True): (32, 32, 128, 8, 2),
}


def wgrad_config(meta: dict, features: bool) -> tuple[dict, dict]:
    """(block sizes, launch options) of _lff_bwd_wgrad_kernel on the GPU for ``meta``;
    fixed, no autotuning (the block sizes set the summation order)."""
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
# BLOCK_H, num_warps, num_stages), by matmul kind; chosen by compiling for sm_80 / sm_90
# (register and spill counts: benchmarks/NOTES.md, "Kernel notes").
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


def split_k(out, args, flags, need_w1, need_w2, b2, arch, device):
    """The large-weights path, per chunk of rows: the fused kernel over blocks of hidden
    columns (h, ga, db1, db2; h / ga stored), the phase kernel (dx, dwr), one split-K launch
    per weight gradient; partial sums carried across chunks in fixed workspaces."""
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
    biases = ((3, flags["NEED_B1"], b1), (5, flags["NEED_B2"], b2))
    small, small_total = _partial_sums.workspace_parts(biases)
    p1 = fused.programs(chunk, first_blocks, small_total, device)
    ws1 = torch.empty((p1, max(1, small_total)), dtype=torch.float32, device=device)
    offsets1 = {idx: off for idx, _, off in small}
    first_flags = dict(flags, NEED_X=False, NEED_WR=False, NEED_W1=False, NEED_W2=False)

    # Phase pass: dx and the dwr partials.
    if need_phase:
        phase_blocks, phase_options = _phase_blocks(meta, F2, H, chunk, arch)
        p2 = fused.programs(chunk, phase_blocks, wr.numel() if flags["NEED_WR"] else 0, device)
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
        fused.run(args, ws1, offsets1, r0, r1, fresh, hb, gab, first_flags, first_blocks,
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
                **phase_blocks,
                **phase_options,
                enable_fp_fusion=False,
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
                **wb,
                **wo,
                enable_fp_fusion=False,
            )
    _partial_sums.sum_parts_into(out, ws1, small, p1)
    if flags["NEED_WR"]:
        _partial_sums.sum_parts_into(out, ws2, [(1, wr, 0)], p2)
    for idx, _, ref, _, _, _, splits, wws in plans:
        _partial_sums.sum_parts_into(out, wws, [(idx, ref, 0)], splits)
