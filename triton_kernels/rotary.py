"""Learnable Fourier rotary embeddings (LightGlue's layout): the cos / sin table, and its
fused application to q and k, forward and backward (``rotary_table_fwd/bwd``,
``rotary_apply_fwd/bwd``). Formulas: posenc_fast/ops/rotary/reference.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cos_sin_tile, max_programs, phase_chain_rule, sum_partials_kernel
from ._launch import INTERPRET, device_guard, pow2, rows_view
from ._round import round_to

# One kernel per direction, with a constexpr TABLE for the table variant. A program owns
# BLOCK_N positions of one batch row b (a *tile*) and, per chunk of BLOCK_K frequencies:
#
#     cos, sin of x[b, n] . wr[k]  (float32, error-free reduction of _phase.py)  [BN, BK]
#     TABLE:   store them, each on channels 2k and 2k+1 of the cos / sin planes
#     forward: for every head of q, then of k: load the channel pairs (2k, 2k+1) as one
#              [BN, 2 BK] tile, rotate by the angle, round once, store
#     backward: gradient rotated back into dq / dk, and the phase gradient
#              cos * sum_h (g_o e - g_e o) - sin * sum_h (g_o o + g_e e)   [BN, BK]
#              -> dx += dphase @ wr (registers), dwr += dphase^T @ x (workspace)
#
# so the cos / sin of a position are computed once for all the heads of q and k, and the
# [B, N, F] table never exists in memory. Channels F..head_dim-1 are copied (forward) or
# pass the gradient through (backward). q, k and their gradients may have any strides
# (LightGlue's q is a slice of a fused qkv tensor with channel stride 3); outputs are
# allocated contiguous in the caller's layout.
#
# Bytes per position (bf16, LightGlue: 4 heads, head_dim = F = 64): q and k read and
# written, 2 * 2 * 4 * 64 * 2 = 2 kB, + 8 B of positions; eager PyTorch additionally writes
# and reads the fp32 table (512 B) and ~4 temporaries per rotation. sincos: F/2 = 32 per
# position (~60 float32 instructions each), shared by 8 head rotations. Memory-bound.
# GPU timings: pending (no GPU in this project's sessions so far).
#
# Weight gradient without atomics (as lff_backward.py): a fixed number P of programs walk
# the tiles pid, pid + P, ... and add their dwr contributions to their own row of a float32
# workspace [P, F/2 * M]; a second kernel sums the rows in the fixed order 0..P-1. Block
# sizes come from a fixed rule (no autotuning), so the summation order is reproducible.


def heads_first(t: torch.Tensor, layout: str) -> torch.Tensor:
    """q or k as a [B, heads, N, D] view: "bhnd" as it is, "bnhd" transposed."""
    return t if layout == "bhnd" else t.transpose(1, 2)


def batch_positions(x: torch.Tensor) -> torch.Tensor:
    """x [B, N, M] as it is, [N, M] (shared by the batch) as a [1, N, M] view."""
    return x if x.dim() == 3 else x.unsqueeze(0)


@triton.jit
def _pair_tile(
    T, base, ns, nmask, k0, n_freq, stride_n, stride_d,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Channels (2k, 2k+1), k = k0..k0+BLOCK_K-1, of rows ns: (even, odd), float32
    [BLOCK_N, BLOCK_K] each, 0 where masked. One [BN, 2 BK] load, split in registers."""
    cols = 2 * k0 + tl.arange(0, 2 * BLOCK_K)
    mask = nmask[:, None] & (cols < 2 * n_freq)[None, :]
    ptrs = T + base + ns[:, None] * stride_n + cols[None, :] * stride_d
    t = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    return tl.split(tl.reshape(t, (BLOCK_N, BLOCK_K, 2)))


@triton.jit
def _store_pairs(
    T, base, ns, nmask, k0, n_freq, stride_n, even, odd,
    INTERPRET: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """T[base + n * stride_n + 2k] = even, [.. + 2k + 1] = odd (unit channel stride),
    rounded once to T's dtype."""
    cols = 2 * k0 + tl.arange(0, 2 * BLOCK_K)
    mask = nmask[:, None] & (cols < 2 * n_freq)[None, :]
    value = tl.reshape(tl.join(even, odd), (BLOCK_N, 2 * BLOCK_K))
    ptrs = T + base + ns[:, None] * stride_n + cols[None, :]
    tl.store(ptrs, round_to(value, T.dtype.element_ty, INTERPRET), mask=mask)


@triton.jit
def _copy_tail(
    SRC, DST, src_base, dst_base, n_heads, s_h, s_n, s_d, d_h, d_n, ns, nmask, first, last,
    BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    """DST[h, n, c] = SRC[h, n, c] for every head and channel first <= c < last (the
    channels beyond the rotary ones; DST has unit channel stride)."""
    for h in range(n_heads):
        hh = tl.cast(h, tl.int64)
        for c0 in range(first, last, BLOCK_P):
            cols = c0 + tl.arange(0, BLOCK_P)
            mask = nmask[:, None] & (cols < last)[None, :]
            src = SRC + src_base + hh * s_h + ns[:, None] * s_n + cols[None, :] * s_d
            v = tl.load(src, mask=mask, other=0.0)
            dst = DST + dst_base + hh * d_h + ns[:, None] * d_n + cols[None, :]
            tl.store(dst, v.to(DST.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_heads(
    SRC, DST, src_base, dst_base, n_heads, s_h, s_n, s_d, d_h, d_n, ns, nmask, k0, n_freq,
    c, s, INTERPRET: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Forward: every head's channel pairs (e, o) -> (e cos - o sin, o cos + e sin)."""
    for h in range(n_heads):
        hh = tl.cast(h, tl.int64)
        e, o = _pair_tile(SRC, src_base + hh * s_h, ns, nmask, k0, n_freq, s_n, s_d,
                          BLOCK_N, BLOCK_K)  # fmt: skip
        _store_pairs(DST, dst_base + hh * d_h, ns, nmask, k0, n_freq, d_n, e * c - o * s,
                     o * c + e * s, INTERPRET, BLOCK_N, BLOCK_K)  # fmt: skip


@triton.jit
def _rotate_grads(
    T, G, D, t_base, g_base, d_base, n_heads, t_h, t_n, t_d, g_h, g_n, g_d, d_h, d_n,
    ns, nmask, k0, n_freq, c, s, cross, dot,
    NEED_T: tl.constexpr, NEED_PHASE: tl.constexpr, INTERPRET: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Backward over every head: D = the gradient rotated back (the transpose of the
    rotation), and (cross, dot) += (g_o e - g_e o, g_o o + g_e e) for the phase."""
    for h in range(n_heads):
        hh = tl.cast(h, tl.int64)
        ge, go = _pair_tile(G, g_base + hh * g_h, ns, nmask, k0, n_freq, g_n, g_d,
                            BLOCK_N, BLOCK_K)  # fmt: skip
        if NEED_T:
            _store_pairs(D, d_base + hh * d_h, ns, nmask, k0, n_freq, d_n, ge * c + go * s,
                         go * c - ge * s, INTERPRET, BLOCK_N, BLOCK_K)  # fmt: skip
        if NEED_PHASE:
            e, o = _pair_tile(T, t_base + hh * t_h, ns, nmask, k0, n_freq, t_n, t_d,
                              BLOCK_N, BLOCK_K)  # fmt: skip
            cross += go * e - ge * o
            dot += go * o + ge * e
    return cross, dot


@triton.jit
def _rotary_fwd_kernel(
    X, WR, Q, K, OQ, OK,
    n_pos, n_freq, head_dim, heads_q, heads_k, tiles_per_batch,
    stride_xb, stride_xn, stride_xm,
    sq_b, sq_h, sq_n, sq_d, sk_b, sk_h, sk_n, sk_d,
    soq_b, soq_h, soq_n, sok_b, sok_h, sok_n,
    M: tl.constexpr, TABLE: tl.constexpr, INTERPRET: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    # X [B or 1, N, M] positions (any strides, stride_xb = 0 when shared by the batch),
    # WR [F2, M] contiguous. Apply: Q [B, HQ, N, D], K [B, HK, N, D] with any strides;
    # OQ, OK the same shapes with unit channel stride. TABLE: OQ is the table [2, N, 2*F2]
    # (cos plane, then sin plane soq_h further), B = 1, and Q, K, OK are not read.
    # Grid: (B * tiles_per_batch,), tile -> (b, positions); 64-bit offsets throughout.
    tile = tl.program_id(0)
    b = tl.cast(tile // tiles_per_batch, tl.int64)
    ns = tl.cast(tile % tiles_per_batch, tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = ns < n_pos
    x_rows = X + b * stride_xb + ns * stride_xn  # [BLOCK_N] pointers to this tile's positions
    for k0 in range(0, n_freq, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        c, s = cos_sin_tile(x_rows, nmask, stride_xm, WR, ks, ks < n_freq, M)
        if TABLE:
            _store_pairs(OQ, 0, ns, nmask, k0, n_freq, soq_n, c, c, INTERPRET, BLOCK_N, BLOCK_K)
            _store_pairs(OQ, soq_h, ns, nmask, k0, n_freq, soq_n, s, s, INTERPRET, BLOCK_N,
                         BLOCK_K)  # fmt: skip
        else:
            _rotate_heads(Q, OQ, b * sq_b, b * soq_b, heads_q, sq_h, sq_n, sq_d, soq_h, soq_n,
                          ns, nmask, k0, n_freq, c, s, INTERPRET, BLOCK_N, BLOCK_K)  # fmt: skip
            _rotate_heads(K, OK, b * sk_b, b * sok_b, heads_k, sk_h, sk_n, sk_d, sok_h, sok_n,
                          ns, nmask, k0, n_freq, c, s, INTERPRET, BLOCK_N, BLOCK_K)  # fmt: skip
    if not TABLE:
        _copy_tail(Q, OQ, b * sq_b, b * soq_b, heads_q, sq_h, sq_n, sq_d, soq_h, soq_n, ns,
                   nmask, 2 * n_freq, head_dim, BLOCK_N, BLOCK_P)  # fmt: skip
        _copy_tail(K, OK, b * sk_b, b * sok_b, heads_k, sk_h, sk_n, sk_d, sok_h, sok_n, ns,
                   nmask, 2 * n_freq, head_dim, BLOCK_N, BLOCK_P)  # fmt: skip


@triton.jit
def _rotary_bwd_kernel(
    X, WR, Q, K, GQ, GK, DQ, DK, DX, WS,
    n_pos, n_freq, head_dim, heads_q, heads_k, tiles_per_batch, n_tiles,
    stride_xb, stride_xn, stride_xm,
    sq_b, sq_h, sq_n, sq_d, sk_b, sk_h, sk_n, sk_d,
    sgq_b, sgq_h, sgq_n, sgq_d, sgk_b, sgk_h, sgk_n, sgk_d,
    sdq_b, sdq_h, sdq_n, sdk_b, sdk_h, sdk_n, stride_ws,
    M: tl.constexpr, TABLE: tl.constexpr, NEED_Q: tl.constexpr, NEED_K: tl.constexpr,
    NEED_X: tl.constexpr, NEED_WR: tl.constexpr, INTERPRET: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
):  # fmt: skip
    # As the forward; GQ, GK the gradients of OQ, OK (any strides), DQ, DK [B, H, N, D]
    # with unit channel stride. TABLE: GQ is the gradient of the table [2, N, 2*F2]
    # (sin plane sgq_h further), B = 1. DX [B, N, M] contiguous float32 (per batch row;
    # the launcher sums it over b for positions shared by the batch). WS [P, F2 * M]
    # float32, uninitialised: this program's dwr partial sums. Grid: (P,), programs walk
    # the tiles pid, pid + P, ...
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    ws = WS + tl.cast(pid, tl.int64) * stride_ws
    NEED_PHASE: tl.constexpr = NEED_X or NEED_WR
    ms = tl.arange(0, BLOCK_M)
    for tile in range(pid, n_tiles, nprog):
        # The workspace read-modify-writes below must see the previous tile's, which
        # other threads of this program may have made; the first tile (tile = pid)
        # writes every column of the row once and reads nothing.
        tl.debug_barrier()
        accumulate = tile >= nprog
        b = tl.cast(tile // tiles_per_batch, tl.int64)
        ns = tl.cast(tile % tiles_per_batch, tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = ns < n_pos
        x_rows = X + b * stride_xb + ns * stride_xn
        dx_acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, n_freq, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < n_freq
            c, s = cos_sin_tile(x_rows, nmask, stride_xm, WR, ks, kmask, M)
            if TABLE:
                # A frequency's two channels hold the same cos (sin): gradients add up.
                gce, gco = _pair_tile(GQ, 0, ns, nmask, k0, n_freq, sgq_n, sgq_d, BLOCK_N,
                                      BLOCK_K)  # fmt: skip
                gse, gso = _pair_tile(GQ, sgq_h, ns, nmask, k0, n_freq, sgq_n, sgq_d, BLOCK_N,
                                      BLOCK_K)  # fmt: skip
                dphi = (gse + gso) * c - (gce + gco) * s
            else:
                cross = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
                dot = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
                if NEED_Q or NEED_PHASE:
                    cross, dot = _rotate_grads(
                        Q, GQ, DQ, b * sq_b, b * sgq_b, b * sdq_b, heads_q, sq_h, sq_n, sq_d,
                        sgq_h, sgq_n, sgq_d, sdq_h, sdq_n, ns, nmask, k0, n_freq, c, s, cross,
                        dot, NEED_Q, NEED_PHASE, INTERPRET, BLOCK_N, BLOCK_K,
                    )  # fmt: skip
                if NEED_K or NEED_PHASE:
                    cross, dot = _rotate_grads(
                        K, GK, DK, b * sk_b, b * sgk_b, b * sdk_b, heads_k, sk_h, sk_n, sk_d,
                        sgk_h, sgk_n, sgk_d, sdk_h, sdk_n, ns, nmask, k0, n_freq, c, s, cross,
                        dot, NEED_K, NEED_PHASE, INTERPRET, BLOCK_N, BLOCK_K,
                    )  # fmt: skip
                dphi = c * cross - s * dot
            if NEED_PHASE:
                # Padded rows and frequencies read zeros above: dphi = 0 there.
                dx_acc = phase_chain_rule(
                    dphi, x_rows, nmask, stride_xm, WR, ks, kmask, dx_acc, ms, ws, accumulate,
                    M, NEED_X, NEED_WR,
                )  # fmt: skip
        if NEED_X:
            dx_ptrs = DX + (b * n_pos + ns)[:, None] * M + ms[None, :]
            tl.store(dx_ptrs, dx_acc, mask=nmask[:, None] & (ms < M)[None, :])
        if not TABLE:
            if NEED_Q:
                _copy_tail(GQ, DQ, b * sgq_b, b * sdq_b, heads_q, sgq_h, sgq_n, sgq_d, sdq_h,
                           sdq_n, ns, nmask, 2 * n_freq, head_dim, BLOCK_N, BLOCK_P)  # fmt: skip
            if NEED_K:
                _copy_tail(GK, DK, b * sgk_b, b * sdk_b, heads_k, sgk_h, sgk_n, sgk_d, sdk_h,
                           sdk_n, ns, nmask, 2 * n_freq, head_dim, BLOCK_N, BLOCK_P)  # fmt: skip


# ------------------------------------------------------------------------ launchers


def blocks(n_pos: int, n_freq: int) -> tuple[dict, dict]:
    """(block sizes, launch options), a fixed rule (part of the backward's summation
    order, so never timing-dependent).

    GPU: 16 positions x 32 frequencies (64 channels: 128 B of bf16 per row, coalesced),
    16 frequencies for head_dim <= 32, 4 warps. Chosen by compiling for sm_90 (triton
    3.9, no GPU) and reading registers: at this size the forward needs 80-96 registers
    and the backward 167, without spilling; 32 x 32 spills ~400 B in both (255
    registers), so do 64 x 8 and 32 x 32 with 8 warps in the backward. GPU timings:
    pending. The interpreter pays per program and per loop iteration: few programs,
    large blocks."""
    if INTERPRET:
        return {"BLOCK_N": pow2(n_pos, 16, 64), "BLOCK_K": pow2(n_freq, 16, 64), "BLOCK_P": 64}, {}
    return gpu_blocks(n_freq), {"num_warps": 4}


def gpu_blocks(n_freq: int) -> dict:
    """The GPU's block sizes (see ``blocks``; the tests also run them in the interpreter)."""
    return {"BLOCK_N": 16, "BLOCK_K": 32 if n_freq > 16 else 16, "BLOCK_P": 64}


def _strides(t: torch.Tensor, n: int) -> tuple:
    return tuple(t.stride())[:n]


def rotary_table_fwd(x: torch.Tensor, wr: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """x [..., M] (floating) -> [2, ..., F] in out_dtype: cos, then sin, each on two
    neighbouring channels."""
    M, F2 = x.shape[-1], wr.shape[0]
    rows = rows_view(x, M)
    R = rows.shape[0]
    out = torch.empty((2, R, 2 * F2), dtype=out_dtype, device=x.device)
    if R:
        bl, opts = blocks(R, F2)
        tiles = triton.cdiv(R, bl["BLOCK_N"])
        with device_guard(x):
            _rotary_fwd_kernel[(tiles,)](
                rows, wr.contiguous(), out, out, out, out,
                R, F2, 2 * F2, 0, 0, tiles,
                0, rows.stride(0), rows.stride(1),
                *(0,) * 8, 0, out.stride(0), out.stride(1), 0, 0, 0,
                M=M, TABLE=True, INTERPRET=INTERPRET, enable_fp_fusion=False, **bl, **opts,
            )  # fmt: skip
    return out.view(2, *x.shape[:-1], 2 * F2)


def _launch_bwd(x3, wr, q, k, gq, gk, dq, dk, dx, n_pos, heads, table: bool, needs):
    """The backward kernel over x3 [B or 1, N, M] for B * cdiv(N, BLOCK_N) tiles; returns
    dwr (float32) or None. q..dk: [B, H, N, D] views (or, for the table, q = gq = the
    table's gradient [2, N, F] and the rest unused)."""
    need_q, need_k, need_x, need_wr = needs
    B = gq.shape[0] if not table else 1
    M, F2 = x3.shape[-1], wr.shape[0]
    bl, opts = blocks(n_pos, F2)
    tiles_per_batch = triton.cdiv(n_pos, bl["BLOCK_N"])
    n_tiles = B * tiles_per_batch
    # Without dwr every tile is independent: one program each. With it, P programs whose
    # count depends only on the device (the summation order must not change).
    programs = min(n_tiles, max_programs(x3.device)) if need_wr else n_tiles
    ws = torch.empty((programs, F2 * M if need_wr else 1), dtype=torch.float32, device=x3.device)
    head_d = q.shape[-1] if not table else 2 * F2
    q_str = _strides(q, 4) if not table else (0,) * 4
    k_str = _strides(k, 4) if not table else (0,) * 4
    gq_str = _strides(gq, 4) if not table else (0, *gq.stride())
    gk_str = _strides(gk, 4) if not table else (0,) * 4
    dq_str = _strides(dq, 3) if need_q else (0,) * 3
    dk_str = _strides(dk, 3) if need_k else (0,) * 3
    x_b = x3.stride(0) if x3.shape[0] > 1 else 0
    with device_guard(x3):
        _rotary_bwd_kernel[(programs,)](
            x3, wr, q, k, gq, gk, dq if need_q else ws, dk if need_k else ws,
            dx if need_x else ws, ws,
            n_pos, F2, head_d, heads[0], heads[1], tiles_per_batch, n_tiles,
            x_b, x3.stride(1), x3.stride(2),
            *q_str, *k_str, *gq_str, *gk_str, *dq_str, *dk_str, ws.stride(0),
            M=M, TABLE=table, NEED_Q=need_q, NEED_K=need_k, NEED_X=need_x, NEED_WR=need_wr,
            INTERPRET=INTERPRET, BLOCK_M=triton.next_power_of_2(M), enable_fp_fusion=False,
            **bl, **opts,
        )  # fmt: skip
        if not need_wr:
            return None
        dwr = torch.empty(wr.shape, dtype=wr.dtype, device=wr.device)
        block = 1024
        sum_partials_kernel[(triton.cdiv(wr.numel(), block),)](
            ws, dwr, programs, wr.numel(), ws.stride(0), BLOCK=block, INTERPRET=INTERPRET
        )
    return dwr


def rotary_table_bwd(grad, x, wr, need_x: bool, need_wr: bool):
    """(dx, dwr) of rotary_table_fwd for grad [2, ..., F]; None where not needed."""
    M, F2 = x.shape[-1], wr.shape[0]
    rows = rows_view(x, M)
    R = rows.shape[0]
    if R == 0 or not (need_x or need_wr):
        dx = torch.zeros_like(x) if need_x else None
        return dx, (torch.zeros_like(wr) if need_wr else None)
    g = grad.reshape(2, R, 2 * F2)
    wr = wr.contiguous()
    dx = torch.empty((R, M), dtype=torch.float32, device=x.device) if need_x else None
    x3 = rows.unsqueeze(0)
    dwr = _launch_bwd(x3, wr, g, g, g, g, None, None, dx, R, (0, 0), True,
                      (False, False, need_x, need_wr))  # fmt: skip
    return (None if dx is None else dx.to(x.dtype).view(x.shape)), dwr


def rotary_apply_fwd(q, k, x, wr, layout: str):
    """(q', k') in q's dtype, contiguous in the layout of q and k; x floating."""
    oq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ok = torch.empty(k.shape, dtype=q.dtype, device=k.device)
    qh, kh, oqh, okh = (heads_first(t, layout) for t in (q, k, oq, ok))
    x3 = batch_positions(x)
    B, _, N, D = qh.shape
    F2, M = wr.shape
    if B * N == 0:
        return oq, ok
    bl, opts = blocks(N, F2)
    tiles_per_batch = triton.cdiv(N, bl["BLOCK_N"])
    with device_guard(q):
        _rotary_fwd_kernel[(B * tiles_per_batch,)](
            x3, wr.contiguous(), qh, kh, oqh, okh,
            N, F2, D, qh.shape[1], kh.shape[1], tiles_per_batch,
            x3.stride(0) if x3.shape[0] > 1 else 0, x3.stride(1), x3.stride(2),
            *_strides(qh, 4), *_strides(kh, 4), *_strides(oqh, 3), *_strides(okh, 3),
            M=M, TABLE=False, INTERPRET=INTERPRET, enable_fp_fusion=False, **bl, **opts,
        )  # fmt: skip
    return oq, ok


def rotary_apply_bwd(gq, gk, q, k, x, wr, layout: str, needs) -> list:
    """[dq, dk, dx, dwr] of rotary_apply_fwd; None where needs[i] is False."""
    need_q, need_k, need_x, need_wr = (bool(n) for n in needs)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device) if need_q else None
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device) if need_k else None
    qh, kh, gqh, gkh = (heads_first(t, layout) for t in (q, k, gq, gk))
    x3 = batch_positions(x)
    B, _, N, _ = qh.shape
    if B * N == 0 or not any(needs):
        dx = torch.zeros_like(x) if need_x else None
        return [dq, dk, dx, torch.zeros_like(wr) if need_wr else None]
    dx_b = None
    if need_x:  # per batch row, float32
        dx_b = torch.empty((B, N, x.shape[-1]), dtype=torch.float32, device=x.device)
    dqh = heads_first(dq, layout) if need_q else None
    dkh = heads_first(dk, layout) if need_k else None
    heads = (qh.shape[1], kh.shape[1])
    dwr = _launch_bwd(x3, wr.contiguous(), qh, kh, gqh, gkh, dqh, dkh, dx_b, N, heads, False,
                      (need_q, need_k, need_x, need_wr))  # fmt: skip
    dx = None
    if need_x:  # positions shared by the batch: their gradient sums over it (fixed order)
        dx = (dx_b if x.dim() == 3 else dx_b.sum(0)).to(x.dtype)
    return [dq, dk, dx, dwr]
