"""Rotary embeddings of positions on grids: q and k rotated by the angles x . W, fused,
forward and backward (``rotary_fwd``, ``rotary_bwd``), and the cos / sin table
(``rotary_table_fwd``, ``rotary_table_bwd``). Formulas: posenc_fast/ops/rotary/reference.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import INTERPRET, device_guard, pow2
from ._partial_sums import max_programs, sum_partials_kernel
from ._phase_tiles import cos_sin_strided, phase_chain_rule_strided
from ._round import round_to

# One kernel per direction (constexpr TABLE: the table variant). Channel pair i of token n
# in frequency group g turns by x[n] . W[g, i]: G = 1 when the heads share W [F/2, M] (k may
# then have fewer heads), G = heads for W [H, F/2, M]. A program owns BLOCK_N tokens of one
# batch row (a tile) and, per group and chunk of BLOCK_K frequencies:
#     cos, sin of x[b, n] . W[g, k]  (float32, error-free reduction of _phase.py)  [BN, BK]
#     TABLE:    store them, each on both channels of its pair
#     forward:  every head of the group in q, then k: load the pairs as two [BN, BK] tiles,
#               rotate, round once, store
#     backward: the gradient rotated back into dq / dk, and the phase gradient
#               cos * sum_h (g_b a - g_a b) - sin * sum_h (g_b b + g_a a)   [BN, BK]
#               -> dx += dphase @ W[g] (registers), dW[g] += dphase^T @ x (workspace)
# HALF: pairs (i, i + F/2), two loads; else (2i, 2i + 1), one load split in registers.
# Channels F..D-1 and the first `prefix` tokens (own tiles, after the rotating ones) are
# copied. Inputs may have any strides (LightGlue's q: channel stride 3), outputs are
# contiguous in the caller's layout. Shared positions are reread per batch row.
# dW without atomics (as lff_backward.py): P programs walk tiles pid, pid + P, ... into
# their own float32 workspace row [P, G * F/2 * M], summed in the fixed order 0..P-1 by a
# second kernel; block sizes follow a fixed rule, so the order is reproducible.
# Bytes and operations per token: benchmarks/NOTES.md, "Kernel notes", rotary.py.


def heads_first(t: torch.Tensor, layout: str) -> torch.Tensor:
    """q or k as a [B, heads, N, D] view: "bhnd" as it is, "bnhd" transposed."""
    return t if layout == "bhnd" else t.transpose(1, 2)


def batch_positions(x: torch.Tensor) -> torch.Tensor:
    """x [B, N, M] as it is, [N, M] (shared by the batch) as a [1, N, M] view."""
    return x if x.dim() == 3 else x.unsqueeze(0)


def _freq_strides(freqs: torch.Tensor) -> tuple:
    """(groups, stride of a group, of a frequency, of a coordinate) of W [F/2, M] (one
    group, shared by the heads) or [H, F/2, M] (one per head)."""
    if freqs.dim() == 2:
        return (1, 0, *freqs.stride())
    return (freqs.shape[0], *freqs.stride())


@triton.jit
def _pair_tile(
    T, base, ns, nmask, k0, n_freq, stride_n, stride_d,
    HALF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The pairs of frequencies k = k0..k0+BLOCK_K-1 of rows ns: (first, second) channel,
    float32 [BLOCK_N, BLOCK_K] each, 0 where masked. Interleaved: channels (2k, 2k+1), one
    [BN, 2 BK] load split in registers; HALF: channels k and k + F/2, two loads."""
    if HALF:
        ks = k0 + tl.arange(0, BLOCK_K)
        mask = nmask[:, None] & (ks < n_freq)[None, :]
        ptrs = T + base + ns[:, None] * stride_n + ks[None, :] * stride_d
        first = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        second = tl.load(ptrs + n_freq * stride_d, mask=mask, other=0.0).to(tl.float32)
    else:
        cols = 2 * k0 + tl.arange(0, 2 * BLOCK_K)
        mask = nmask[:, None] & (cols < 2 * n_freq)[None, :]
        ptrs = T + base + ns[:, None] * stride_n + cols[None, :] * stride_d
        t = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        first, second = tl.split(tl.reshape(t, (BLOCK_N, BLOCK_K, 2)))
    return first, second


@triton.jit
def _store_pairs(
    T, base, ns, nmask, k0, n_freq, stride_n, first, second,
    HALF: tl.constexpr, INTERPRET: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The inverse of _pair_tile into T (unit channel stride), rounded once to T's dtype."""
    if HALF:
        ks = k0 + tl.arange(0, BLOCK_K)
        mask = nmask[:, None] & (ks < n_freq)[None, :]
        ptrs = T + base + ns[:, None] * stride_n + ks[None, :]
        tl.store(ptrs, round_to(first, T.dtype.element_ty, INTERPRET), mask=mask)
        tl.store(ptrs + n_freq, round_to(second, T.dtype.element_ty, INTERPRET), mask=mask)
    else:
        cols = 2 * k0 + tl.arange(0, 2 * BLOCK_K)
        mask = nmask[:, None] & (cols < 2 * n_freq)[None, :]
        value = tl.reshape(tl.join(first, second), (BLOCK_N, 2 * BLOCK_K))
        ptrs = T + base + ns[:, None] * stride_n + cols[None, :]
        tl.store(ptrs, round_to(value, T.dtype.element_ty, INTERPRET), mask=mask)


@triton.jit
def _copy_tail(
    SRC, DST, src_base, dst_base, n_heads, s_h, s_n, s_d, d_h, d_n, ns, nmask, first, last,
    BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    """DST[h, n, c] = SRC[h, n, c] for every head and channel first <= c < last (the
    channels beyond the rotary ones, or whole prefix tokens; DST has unit channel stride)."""
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
    SRC, DST, src_base, dst_base, h0, n_heads, s_h, s_n, s_d, d_h, d_n, ns, nmask, k0, n_freq,
    c, s, HALF: tl.constexpr, INTERPRET: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Forward, heads h0..h0+n_heads-1: pairs (a, b) -> (a cos - b sin, b cos + a sin)."""
    for h in range(h0, h0 + n_heads):
        hh = tl.cast(h, tl.int64)
        a, b = _pair_tile(SRC, src_base + hh * s_h, ns, nmask, k0, n_freq, s_n, s_d, HALF,
                          BLOCK_N, BLOCK_K)  # fmt: skip
        _store_pairs(DST, dst_base + hh * d_h, ns, nmask, k0, n_freq, d_n, a * c - b * s,
                     b * c + a * s, HALF, INTERPRET, BLOCK_N, BLOCK_K)  # fmt: skip


@triton.jit
def _rotate_grads(
    T, G, D, t_base, g_base, d_base, h0, n_heads, t_h, t_n, t_d, g_h, g_n, g_d, d_h, d_n,
    ns, nmask, k0, n_freq, c, s, cross, dot,
    NEED_T: tl.constexpr, NEED_PHASE: tl.constexpr, HALF: tl.constexpr,
    INTERPRET: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Backward over heads h0..h0+n_heads-1: D = the gradient rotated back (the transpose
    of the rotation), and (cross, dot) += (g_b a - g_a b, g_b b + g_a a) for the phase."""
    for h in range(h0, h0 + n_heads):
        hh = tl.cast(h, tl.int64)
        ga, gb = _pair_tile(G, g_base + hh * g_h, ns, nmask, k0, n_freq, g_n, g_d, HALF,
                            BLOCK_N, BLOCK_K)  # fmt: skip
        if NEED_T:
            _store_pairs(D, d_base + hh * d_h, ns, nmask, k0, n_freq, d_n, ga * c + gb * s,
                         gb * c - ga * s, HALF, INTERPRET, BLOCK_N, BLOCK_K)  # fmt: skip
        if NEED_PHASE:
            a, b = _pair_tile(T, t_base + hh * t_h, ns, nmask, k0, n_freq, t_n, t_d, HALF,
                              BLOCK_N, BLOCK_K)  # fmt: skip
            cross += gb * a - ga * b
            dot += gb * b + ga * a
    return cross, dot


@triton.jit
def _rotary_fwd_kernel(
    X, W, Q, K, OQ, OK,
    n_pos, prefix, n_freq, head_dim, n_groups, heads_q, heads_k, tiles_per_batch, n_rot_tiles,
    copy_tiles_per_batch, plane,
    stride_xb, stride_xn, stride_xm, stride_wg, stride_wk, stride_wm,
    sq_b, sq_h, sq_n, sq_d, sk_b, sk_h, sk_n, sk_d,
    soq_b, soq_h, soq_n, sok_b, sok_h, sok_n,
    M: tl.constexpr, TABLE: tl.constexpr, HALF: tl.constexpr, INTERPRET: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    # X [Bx, N', M] positions of the rotated tokens, any strides (stride_xb = 0: shared by
    # the batch). W [G, F2, M], any strides (stride_wg = 0 when G = 1). Apply: Q
    # [B, G * heads_q, prefix + N', D], K [B, G * heads_k, prefix + N', D], any strides; OQ,
    # OK their shapes with unit channel stride. TABLE: OQ = OK the table [2, Bx, G, N', 2 F2]
    # (unit channel stride; the sin plane `plane` elements after the cos plane), Q, K
    # unread, prefix 0.
    # Grid: (n_rot_tiles + B * copy_tiles_per_batch,): tile < n_rot_tiles -> (batch row b,
    # BLOCK_N tokens of x); the others copy BLOCK_N prefix tokens of batch row b whole.
    # 64-bit offsets throughout.
    tile = tl.program_id(0)
    if tile < n_rot_tiles:
        b = tl.cast(tile // tiles_per_batch, tl.int64)
        ns = tl.cast(tile % tiles_per_batch, tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = ns < n_pos
        # x's row n is token prefix + n of q and k: a scalar offset of their bases
        pre = tl.cast(prefix, tl.int64)
        q_in, q_out = b * sq_b + pre * sq_n, b * soq_b + pre * soq_n
        k_in, k_out = b * sk_b + pre * sk_n, b * sok_b + pre * sok_n
        x_rows = X + b * stride_xb + ns * stride_xn  # [BLOCK_N] pointers to the positions
        # (group, chunk of frequencies) pairs in one flat loop: a nested loop over the
        # groups held the inner loop's hoisted addresses longer (more registers on sm_90)
        chunks = tl.cdiv(n_freq, BLOCK_K)
        for j in range(0, n_groups * chunks):
            g = j // chunks
            k0 = (j % chunks) * BLOCK_K
            gg = tl.cast(g, tl.int64)
            w = W + gg * stride_wg
            ks = k0 + tl.arange(0, BLOCK_K)
            c, s = cos_sin_strided(x_rows, nmask, stride_xm, w, ks, ks < n_freq, stride_wk,
                                   stride_wm, M)  # fmt: skip
            if TABLE:
                _store_pairs(OQ, b * soq_b + gg * soq_h, ns, nmask, k0, n_freq, soq_n, c, c,
                             HALF, INTERPRET, BLOCK_N, BLOCK_K)  # fmt: skip
                _store_pairs(OK, plane + b * sok_b + gg * sok_h, ns, nmask, k0, n_freq, sok_n, s,
                             s, HALF, INTERPRET, BLOCK_N, BLOCK_K)  # fmt: skip
            else:
                _rotate_heads(Q, OQ, q_in, q_out, g * heads_q, heads_q, sq_h, sq_n, sq_d, soq_h,
                              soq_n, ns, nmask, k0, n_freq, c, s, HALF, INTERPRET, BLOCK_N,
                              BLOCK_K)  # fmt: skip
                _rotate_heads(K, OK, k_in, k_out, g * heads_k, heads_k, sk_h, sk_n, sk_d, sok_h,
                              sok_n, ns, nmask, k0, n_freq, c, s, HALF, INTERPRET, BLOCK_N,
                              BLOCK_K)  # fmt: skip
        if not TABLE:
            _copy_tail(Q, OQ, q_in, q_out, n_groups * heads_q, sq_h, sq_n, sq_d, soq_h, soq_n, ns,
                       nmask, 2 * n_freq, head_dim, BLOCK_N, BLOCK_P)  # fmt: skip
            _copy_tail(K, OK, k_in, k_out, n_groups * heads_k, sk_h, sk_n, sk_d, sok_h, sok_n, ns,
                       nmask, 2 * n_freq, head_dim, BLOCK_N, BLOCK_P)  # fmt: skip
    elif not TABLE:
        t = tile - n_rot_tiles
        b = tl.cast(t // copy_tiles_per_batch, tl.int64)
        ns = tl.cast(t % copy_tiles_per_batch, tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = ns < prefix
        _copy_tail(Q, OQ, b * sq_b, b * soq_b, n_groups * heads_q, sq_h, sq_n, sq_d, soq_h,
                   soq_n, ns, nmask, 0, head_dim, BLOCK_N, BLOCK_P)  # fmt: skip
        _copy_tail(K, OK, b * sk_b, b * sok_b, n_groups * heads_k, sk_h, sk_n, sk_d, sok_h,
                   sok_n, ns, nmask, 0, head_dim, BLOCK_N, BLOCK_P)  # fmt: skip


@triton.jit
def _rotary_bwd_kernel(
    X, W, Q, K, GQ, GK, DQ, DK, DX, WS,
    n_pos, prefix, n_freq, head_dim, n_groups, heads_q, heads_k, tiles_per_batch, n_rot_tiles,
    copy_tiles_per_batch, plane, n_tiles,
    stride_xb, stride_xn, stride_xm, stride_wg, stride_wk, stride_wm,
    sq_b, sq_h, sq_n, sq_d, sk_b, sk_h, sk_n, sk_d,
    sgq_b, sgq_h, sgq_n, sgq_d, sgk_b, sgk_h, sgk_n, sgk_d,
    sdq_b, sdq_h, sdq_n, sdk_b, sdk_h, sdk_n, stride_ws,
    M: tl.constexpr, TABLE: tl.constexpr, HALF: tl.constexpr, NEED_Q: tl.constexpr,
    NEED_K: tl.constexpr, NEED_X: tl.constexpr, NEED_W: tl.constexpr, INTERPRET: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
):  # fmt: skip
    # As the forward; GQ, GK the gradients of OQ, OK (any strides), DQ, DK [B, H, N, D]
    # with unit channel stride. TABLE: GQ = GK the table's gradient [2, Bx, G, N', 2 F2]
    # (any strides; the sin plane `plane` elements after the cos plane). DX [Bx, N', M]
    # contiguous float32 (per batch row; the launcher sums it over b for positions shared
    # by the batch). WS [P, G * F2 * M]
    # float32, uninitialised: this program's dW partial sums. Grid: (P,), programs walk
    # the tiles pid, pid + P, ...; with NEED_W, P <= n_rot_tiles (every program's first
    # tile rotates, and writes its whole workspace row).
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    ws = WS + tl.cast(pid, tl.int64) * stride_ws
    NEED_PHASE: tl.constexpr = NEED_X or NEED_W
    ms = tl.arange(0, BLOCK_M)
    for tile in range(pid, n_tiles, nprog):
        # The workspace read-modify-writes below must see the previous tile's, which
        # other threads of this program may have made; the first tile (tile = pid)
        # writes every column of the row once and reads nothing.
        tl.debug_barrier()
        accumulate = tile >= nprog
        if tile < n_rot_tiles:
            b = tl.cast(tile // tiles_per_batch, tl.int64)
            ns = tl.cast(tile % tiles_per_batch, tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
            nmask = ns < n_pos
            pre = tl.cast(prefix, tl.int64)
            q_base, gq_base = b * sq_b + pre * sq_n, b * sgq_b + pre * sgq_n
            k_base, gk_base = b * sk_b + pre * sk_n, b * sgk_b + pre * sgk_n
            dq_base, dk_base = b * sdq_b + pre * sdq_n, b * sdk_b + pre * sdk_n
            x_rows = X + b * stride_xb + ns * stride_xn
            dx_acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            chunks = tl.cdiv(n_freq, BLOCK_K)
            for j in range(0, n_groups * chunks):  # (group, chunk): as the forward
                g = j // chunks
                k0 = (j % chunks) * BLOCK_K
                gg = tl.cast(g, tl.int64)
                w = W + gg * stride_wg
                ks = k0 + tl.arange(0, BLOCK_K)
                kmask = ks < n_freq
                c, s = cos_sin_strided(x_rows, nmask, stride_xm, w, ks, kmask, stride_wk,
                                       stride_wm, M)  # fmt: skip
                if TABLE:
                    # A frequency's two channels hold the same cos (sin): gradients add up.
                    gca, gcb = _pair_tile(GQ, b * sgq_b + gg * sgq_h, ns, nmask, k0, n_freq,
                                          sgq_n, sgq_d, HALF, BLOCK_N, BLOCK_K)  # fmt: skip
                    gsa, gsb = _pair_tile(GK, plane + b * sgk_b + gg * sgk_h, ns, nmask, k0,
                                          n_freq, sgk_n, sgk_d, HALF, BLOCK_N,
                                          BLOCK_K)  # fmt: skip
                    dphi = (gsa + gsb) * c - (gca + gcb) * s
                else:
                    cross = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
                    dot = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
                    if NEED_Q or NEED_PHASE:
                        cross, dot = _rotate_grads(
                            Q, GQ, DQ, q_base, gq_base, dq_base, g * heads_q, heads_q, sq_h,
                            sq_n, sq_d, sgq_h, sgq_n, sgq_d, sdq_h, sdq_n, ns, nmask, k0, n_freq,
                            c, s, cross, dot, NEED_Q, NEED_PHASE, HALF, INTERPRET, BLOCK_N,
                            BLOCK_K,
                        )  # fmt: skip
                    if NEED_K or NEED_PHASE:
                        cross, dot = _rotate_grads(
                            K, GK, DK, k_base, gk_base, dk_base, g * heads_k, heads_k, sk_h,
                            sk_n, sk_d, sgk_h, sgk_n, sgk_d, sdk_h, sdk_n, ns, nmask, k0, n_freq,
                            c, s, cross, dot, NEED_K, NEED_PHASE, HALF, INTERPRET, BLOCK_N,
                            BLOCK_K,
                        )  # fmt: skip
                    dphi = c * cross - s * dot
                if NEED_PHASE:
                    # Padded rows and frequencies read zeros above: dphi = 0 there.
                    dx_acc = phase_chain_rule_strided(
                        dphi, x_rows, nmask, stride_xm, w, ks, kmask, stride_wk, stride_wm,
                        dx_acc, ms, ws + gg * (n_freq * M), accumulate, M, NEED_X, NEED_W,
                    )  # fmt: skip
            if NEED_X:
                dx_ptrs = DX + (b * n_pos + ns)[:, None] * M + ms[None, :]
                tl.store(dx_ptrs, dx_acc, mask=nmask[:, None] & (ms < M)[None, :])
            if not TABLE:
                if NEED_Q:
                    _copy_tail(GQ, DQ, gq_base, dq_base, n_groups * heads_q, sgq_h, sgq_n, sgq_d,
                               sdq_h, sdq_n, ns, nmask, 2 * n_freq, head_dim, BLOCK_N,
                               BLOCK_P)  # fmt: skip
                if NEED_K:
                    _copy_tail(GK, DK, gk_base, dk_base, n_groups * heads_k, sgk_h, sgk_n, sgk_d,
                               sdk_h, sdk_n, ns, nmask, 2 * n_freq, head_dim, BLOCK_N,
                               BLOCK_P)  # fmt: skip
        elif not TABLE:
            # a prefix tile: the gradient of a copied token is copied back
            t = tile - n_rot_tiles
            b = tl.cast(t // copy_tiles_per_batch, tl.int64)
            ns = tl.cast(t % copy_tiles_per_batch, tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
            nmask = ns < prefix
            if NEED_Q:
                _copy_tail(GQ, DQ, b * sgq_b, b * sdq_b, n_groups * heads_q, sgq_h, sgq_n, sgq_d,
                           sdq_h, sdq_n, ns, nmask, 0, head_dim, BLOCK_N, BLOCK_P)  # fmt: skip
            if NEED_K:
                _copy_tail(GK, DK, b * sgk_b, b * sdk_b, n_groups * heads_k, sgk_h, sgk_n, sgk_d,
                           sdk_h, sdk_n, ns, nmask, 0, head_dim, BLOCK_N, BLOCK_P)  # fmt: skip


# ------------------------------------------------------------------------ launchers


def blocks(n_pos: int, n_freq: int, half: bool = False) -> tuple[dict, dict]:
    """(block sizes, launch options), a fixed rule (part of the backward's summation
    order, so never timing-dependent).

    GPU: 16 tokens x 32 frequencies for interleaved pairs (64 channels: 128 B of bf16 per
    row), 16 frequencies for head_dim <= 32 and for halves (two runs of 16 channels, 32 B
    each), 4 warps. Chosen by compiling for sm_90 (compile_report, no GPU) and reading
    registers: interleaved, the forward needs ~96 registers and the backward 128-160 (bf16;
    fp32 more), without spilling; halves at 32 frequencies took 168 and 255 (spilling),
    at 16 96 and 128-204. The interpreter pays per program and per loop iteration: few
    programs, large blocks."""
    if INTERPRET:
        return {"BLOCK_N": pow2(n_pos, 16, 64), "BLOCK_K": pow2(n_freq, 16, 64), "BLOCK_P": 64}, {}
    return gpu_blocks(n_freq, half), {"num_warps": 4}


def gpu_blocks(n_freq: int, half: bool = False) -> dict:
    """The GPU's block sizes (see ``blocks``; the tests also run them in the interpreter)."""
    return {"BLOCK_N": 16, "BLOCK_K": 32 if n_freq > 16 and not half else 16, "BLOCK_P": 64}


def _strides(t: torch.Tensor, n: int) -> tuple:
    return tuple(t.stride())[:n]


def _table_rows(x: torch.Tensor, per_head: bool) -> torch.Tensor:
    """x [..., M] as the kernels' [Bx, N, M]: every row one batch row of one token for
    shared frequencies ([1, R, M]: the table is [R, F] per plane), [prod(...), N, M] for
    frequencies per head (the table's heads axis sits between the batch and N)."""
    M = x.shape[-1]
    if per_head:
        return x.reshape(-1, x.shape[-2], M)
    return x.reshape(1, -1, M)


def _table_shape(x: torch.Tensor, freqs: torch.Tensor) -> tuple:
    """[2, *x.shape[:-1], F] for shared frequencies, [2, *x.shape[:-2], H, N, F] per head."""
    F = 2 * freqs.shape[-2]
    if freqs.dim() == 2:
        return (2, *x.shape[:-1], F)
    return (2, *x.shape[:-2], freqs.shape[0], x.shape[-2], F)


def rotary_table_fwd(x, freqs, pairs: str, out_dtype: torch.dtype) -> torch.Tensor:
    """The cos / sin table of x [..., M] (floating) and W = freqs [F/2, M] or [H, F/2, M]
    (any strides): [2, *x.shape[:-1], F] or [2, *x.shape[:-2], H, N, F] in out_dtype, each
    frequency on both channels of its pair ("interleaved" or "half")."""
    per_head = freqs.dim() == 3
    x3 = _table_rows(x, per_head)
    Bx, N, M = x3.shape
    G, swg, swk, swm = _freq_strides(freqs)
    F2 = freqs.shape[-2]
    out = torch.empty((2, Bx, G, N, 2 * F2), dtype=out_dtype, device=x.device)
    if Bx * N:
        half = pairs == "half"
        bl, opts = blocks(N, F2, half)
        tiles = triton.cdiv(N, bl["BLOCK_N"])
        o = out.stride()
        with device_guard(x):
            _rotary_fwd_kernel[(Bx * tiles,)](
                x3, freqs, out, out, out, out,
                N, 0, F2, 2 * F2, G, 0, 0, tiles, Bx * tiles, 1, o[0],
                x3.stride(0), x3.stride(1), x3.stride(2), swg, swk, swm,
                *(0,) * 8, *o[1:4], *o[1:4],
                M=M, TABLE=True, HALF=half, INTERPRET=INTERPRET,
                enable_fp_fusion=False, **bl, **opts,
            )  # fmt: skip
    return out.view(_table_shape(x, freqs))


def _launch_bwd(x3, freqs, q, k, gq, gk, dq, dk, dx, n_pos, prefix, heads, half, table, needs):
    """The backward kernel over x3 [Bx, N', M] for B * cdiv(N', BLOCK_N) rotating tiles and
    B * cdiv(prefix, BLOCK_N) prefix tiles; returns dW (float32 sums rounded to freqs'
    dtype, freqs' shape) or None. q..dk: [B, H, N, D] views (or, for the table, every one
    the table's gradient [2, Bx, G, N', F]); heads (per group of q, of k)."""
    need_q, need_k, need_x, need_w = needs
    B = x3.shape[0] if table else gq.shape[0]
    M, F2 = x3.shape[-1], freqs.shape[-2]
    G, swg, swk, swm = _freq_strides(freqs)
    bl, opts = blocks(n_pos, F2, half)
    tiles_per_batch = triton.cdiv(n_pos, bl["BLOCK_N"])
    copy_tiles = triton.cdiv(prefix, bl["BLOCK_N"])
    n_rot = B * tiles_per_batch
    n_tiles = n_rot + B * copy_tiles
    # Without dW every tile is independent: one program each. With it, P programs whose
    # count depends only on the device (the summation order must not change), each
    # starting on a rotating tile.
    programs = min(n_rot, max_programs(x3.device)) if need_w else n_tiles
    ws = torch.empty((programs, G * F2 * M if need_w else 1), dtype=torch.float32,
                     device=x3.device)  # fmt: skip
    plane = 0
    if table:
        q_str = k_str = (0,) * 4
        plane, *gq_str = gq.stride()
        gk_str = gq_str
        head_d = 2 * F2
    else:
        q_str, k_str, gq_str, gk_str = (_strides(t, 4) for t in (q, k, gq, gk))
        head_d = q.shape[-1]
    dq_str = _strides(dq, 3) if need_q else (0,) * 3
    dk_str = _strides(dk, 3) if need_k else (0,) * 3
    x_b = x3.stride(0) if x3.shape[0] > 1 else 0
    with device_guard(x3):
        _rotary_bwd_kernel[(programs,)](
            x3, freqs, q, k, gq, gk, dq if need_q else ws, dk if need_k else ws,
            dx if need_x else ws, ws,
            n_pos, prefix, F2, head_d, G, heads[0], heads[1], tiles_per_batch, n_rot,
            max(copy_tiles, 1), plane, n_tiles,
            x_b, x3.stride(1), x3.stride(2), swg, swk, swm,
            *q_str, *k_str, *gq_str, *gk_str, *dq_str, *dk_str, ws.stride(0),
            M=M, TABLE=table, HALF=half, NEED_Q=need_q, NEED_K=need_k, NEED_X=need_x,
            NEED_W=need_w, INTERPRET=INTERPRET, BLOCK_M=triton.next_power_of_2(M),
            enable_fp_fusion=False, **bl, **opts,
        )  # fmt: skip
        if not need_w:
            return None
        dw = torch.empty(freqs.shape, dtype=freqs.dtype, device=freqs.device)
        block = 1024
        sum_partials_kernel[(triton.cdiv(dw.numel(), block),)](
            ws, dw, programs, dw.numel(), ws.stride(0), BLOCK=block, INTERPRET=INTERPRET
        )
    return dw


def rotary_table_bwd(grad, x, freqs, pairs: str, need_x: bool, need_freqs: bool):
    """(dx, dfreqs) of rotary_table_fwd for grad of the table's shape (any strides); None
    where not needed."""
    per_head = freqs.dim() == 3
    x3 = _table_rows(x, per_head)
    Bx, N, M = x3.shape
    if Bx * N == 0 or not (need_x or need_freqs):
        dx = torch.zeros_like(x) if need_x else None
        return dx, (torch.zeros_like(freqs) if need_freqs else None)
    F2 = freqs.shape[-2]
    g = grad.reshape(2, Bx, freqs.shape[0] if per_head else 1, N, 2 * F2)
    dx = torch.empty((Bx, N, M), dtype=torch.float32, device=x.device) if need_x else None
    dw = _launch_bwd(x3, freqs, g, g, g, g, None, None, dx, N, 0, (0, 0),
                     pairs == "half", True, (False, False, need_x, need_freqs))  # fmt: skip
    return (None if dx is None else dx.to(x.dtype).view(x.shape)), dw


def rotary_fwd(q, k, x, freqs, pairs: str, layout: str, prefix: int):
    """(q', k') in q's dtype, contiguous in the layout of q and k: the first ``prefix``
    tokens copied, the others rotated by the angles x . W (x [N - prefix, M] or
    [B, N - prefix, M], floating; W = freqs [F/2, M] or [H, F/2, M], any strides)."""
    oq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ok = torch.empty(k.shape, dtype=q.dtype, device=k.device)
    qh, kh, oqh, okh = (heads_first(t, layout) for t in (q, k, oq, ok))
    x3 = batch_positions(x)
    B, Hq, N, D = qh.shape
    n_pos = N - prefix
    if B * N == 0:
        return oq, ok
    G, swg, swk, swm = _freq_strides(freqs)
    F2, M = freqs.shape[-2:]
    half = pairs == "half"
    bl, opts = blocks(n_pos, F2, half)
    tiles_per_batch = triton.cdiv(n_pos, bl["BLOCK_N"])
    copy_tiles = triton.cdiv(prefix, bl["BLOCK_N"])
    n_rot = B * tiles_per_batch
    with device_guard(q):
        _rotary_fwd_kernel[(n_rot + B * copy_tiles,)](
            x3, freqs, qh, kh, oqh, okh,
            n_pos, prefix, F2, D, G, Hq // G, kh.shape[1] // G, tiles_per_batch, n_rot,
            max(copy_tiles, 1), 0,
            x3.stride(0) if x3.shape[0] > 1 else 0, x3.stride(1), x3.stride(2), swg, swk, swm,
            *_strides(qh, 4), *_strides(kh, 4), *_strides(oqh, 3), *_strides(okh, 3),
            M=M, TABLE=False, HALF=half, INTERPRET=INTERPRET,
            enable_fp_fusion=False, **bl, **opts,
        )  # fmt: skip
    return oq, ok


def rotary_bwd(gq, gk, q, k, x, freqs, pairs: str, layout: str, prefix: int, needs) -> list:
    """[dq, dk, dx, dfreqs] of rotary_fwd; None where needs[i] is False."""
    need_q, need_k, need_x, need_w = (bool(n) for n in needs)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device) if need_q else None
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device) if need_k else None
    qh, kh, gqh, gkh = (heads_first(t, layout) for t in (q, k, gq, gk))
    x3 = batch_positions(x)
    B, Hq, N, _ = qh.shape
    n_pos = N - prefix
    if n_pos == 0 or B == 0:  # nothing rotated: no dx, dW; copies only
        need_x, need_w = False, False
    dx = torch.zeros_like(x) if needs[2] and not need_x else None
    dw = torch.zeros_like(freqs) if needs[3] and not need_w else None
    if B * N == 0 or not (need_q or need_k or need_x or need_w):
        return [dq, dk, dx, dw]
    dx_b = None
    if need_x:  # per batch row, float32
        dx_b = torch.empty((B, n_pos, x.shape[-1]), dtype=torch.float32, device=x.device)
    dqh = heads_first(dq, layout) if need_q else None
    dkh = heads_first(dk, layout) if need_k else None
    G = freqs.shape[0] if freqs.dim() == 3 else 1
    heads = (Hq // G, kh.shape[1] // G)
    got = _launch_bwd(x3, freqs, qh, kh, gqh, gkh, dqh, dkh, dx_b, n_pos, prefix, heads,
                      pairs == "half", False, (need_q, need_k, need_x, need_w))  # fmt: skip
    if need_w:
        dw = got
    if need_x:  # positions shared by the batch: their gradient sums over it (fixed order)
        dx = (dx_b if x.dim() == 3 else dx_b.sum(0)).to(x.dtype)
    return [dq, dk, dx, dw]
