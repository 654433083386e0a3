"""The elementwise Triton kernels of the LFF "gemm" plan (lff_gemm.py): everything between
the cuBLAS products that is not a product."""

from __future__ import annotations

import triton
import triton.language as tl

from ._mlp import activation, activation_grad
from ._partial_sums import add_to
from ._phase_tiles import cos_sin_tile, phase_chain_rule
from ._round import round_to

#     features  x -> [cos || sin] / sqrt(F) in the compute dtype          (forward, backward)
#     act_fwd   a -> act(a), in place                                      (forward)
#     act_bwd   (a, gh) -> h = act(a), ga = gh * act'(a), db1 partials     (backward)
#     phase     (gr, features, x) -> dx, dwr partials                       (backward)
#
# Every kernel computes what the fused kernels compute at the same point, with the same
# helpers, so both plans round the same values the same way; only the products' outputs
# (a, gh, gr) are rounded to the compute dtype where cuBLAS writes them. Row reductions
# (db1, dwr) are deterministic: fixed programs owning float32 workspace rows, summed in
# _partial_sums.sum_partials_kernel's fixed order. No atomics.


@triton.jit
def _features_kernel(
    X,
    WR,
    OUT,
    n_rows,
    n_freq,
    stride_xr,
    stride_xm,
    stride_or,
    inv_sqrt_f,
    M: tl.constexpr,
    SPLIT: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # X [R, M] any strides (any float dtype); WR [F2, M] contiguous; OUT [R, 2*F2] (SPLIT:
    # [R, 4*F2]) with row stride stride_or, unit columns, the compute dtype. Columns: cos
    # [0, F2), sin [F2, 2*F2), rounded once from float32 c / sqrt(F) exactly as the fused
    # kernel's first matmul operands (hidden_preactivation); SPLIT adds their rounding
    # errors (the relu-with-half-precision second term) at [2*F2, 4*F2), so that one
    # product with [w1; w1] accumulates hi + lo in float32 as the fused kernel does.
    # Grid: (cdiv(R, BLOCK_R), cdiv(F2, BLOCK_K)).
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    rmask = rows < n_rows
    kmask = ks < n_freq
    c, s = cos_sin_tile(X + rows * stride_xr, rmask, stride_xm, WR, ks, kmask, M)
    DTYPE: tl.constexpr = OUT.dtype.element_ty
    fc = c * inv_sqrt_f
    fs = s * inv_sqrt_f
    rc = round_to(fc, DTYPE, INTERPRET)
    rs = round_to(fs, DTYPE, INTERPRET)
    out = OUT + rows[:, None] * stride_or + ks[None, :]
    mask = rmask[:, None] & kmask[None, :]
    tl.store(out, rc, mask=mask)
    tl.store(out + n_freq, rs, mask=mask)
    if SPLIT:
        tl.store(out + 2 * n_freq, round_to(fc - rc.to(tl.float32), DTYPE, INTERPRET), mask=mask)
        tl.store(out + 3 * n_freq, round_to(fs - rs.to(tl.float32), DTYPE, INTERPRET), mask=mask)


@triton.jit
def _act_fwd_kernel(
    A,
    n_rows,
    hidden,
    stride_a,
    ACT: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # A [R, H] (row stride stride_a, unit columns, the compute dtype), in place:
    # a -> act(a) evaluated in float32 and rounded once. Grid: (cdiv(R, BR), cdiv(H, BH)).
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (rows < n_rows)[:, None] & (hs < hidden)[None, :]
    ptrs = A + rows[:, None] * stride_a + hs[None, :]
    a = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, round_to(activation(a, ACT), A.dtype.element_ty, INTERPRET), mask=mask)


@triton.jit
def _act_bwd_kernel(
    A,
    GH,
    HOUT,
    GA,
    WS,
    n_rows,
    hidden,
    n_tiles,
    stride_a,
    stride_gh,
    stride_h,
    stride_ga,
    stride_ws,
    ws_fresh,
    ACT: tl.constexpr,
    STORE_H: tl.constexpr,
    NEED_B1: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # A [R, H] pre-activations and GH [R, H] = dY w2^T (the compute dtype, row strides
    # stride_a / stride_gh, unit columns) -> HOUT = act(a) (STORE_H) and GA = gh * act'(a),
    # each rounded once to its dtype; HOUT may alias A and GA alias GH (each element is
    # read before it is written, by the same program). db1 (NEED_B1): sum over rows of
    # the float32 ga (before rounding, as the fused kernel's), this program's share into
    # its workspace row WS[p, hs] (stored when ws_fresh, else added: the previous chunk's).
    # Grid: (cdiv(H, BH), P); program (j, p) walks the row tiles p, p + P, ... in order.
    hs = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    pid = tl.program_id(1)
    nprog = tl.num_programs(1)
    hmask = hs < hidden
    db1 = tl.zeros([BLOCK_H], dtype=tl.float32)
    for tile in range(pid, n_tiles, nprog):
        rows = tl.cast(tile, tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        mask = (rows < n_rows)[:, None] & hmask[None, :]
        a = tl.load(A + rows[:, None] * stride_a + hs[None, :], mask=mask, other=0.0)
        a = a.to(tl.float32)
        gh = tl.load(GH + rows[:, None] * stride_gh + hs[None, :], mask=mask, other=0.0)
        ga = gh.to(tl.float32) * activation_grad(a, ACT)  # 0 where masked (gh = 0)
        if STORE_H:
            h = round_to(activation(a, ACT), HOUT.dtype.element_ty, INTERPRET)
            tl.store(HOUT + rows[:, None] * stride_h + hs[None, :], h, mask=mask)
        tl.store(
            GA + rows[:, None] * stride_ga + hs[None, :],
            round_to(ga, GA.dtype.element_ty, INTERPRET),
            mask=mask,
        )
        if NEED_B1:
            db1 += tl.sum(ga, axis=0)
    if NEED_B1:
        add_to(WS + pid.to(tl.int64) * stride_ws + hs, db1, hmask, ws_fresh == 0)


@triton.jit
def _phase_grad_kernel(
    X,
    WR,
    GR,
    RF,
    DX,
    WS,
    n_rows,
    n_freq,
    n_tiles,
    stride_xr,
    stride_xm,
    stride_gr,
    stride_rf,
    stride_ws,
    ws_fresh,
    M: tl.constexpr,
    NEED_X: tl.constexpr,
    NEED_WR: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    # The chain rule below the features: GR [R, 2*F2] = d loss / d features (= ga w1^T,
    # cos columns then sin columns), RF [R, >= 2*F2] the features [cos || sin] / sqrt(F)
    # (the compute dtype; the 1/sqrt(F) rides along), row strides stride_gr / stride_rf:
    #     gphase = gr_sin * cos / sqrt(F) - gr_cos * sin / sqrt(F)      d loss / d phase
    #     dx = gphase @ wr (DX [R, M] contiguous),  dwr partial = gphase^T x (WS rows)
    # X [R, M] any strides, WR [F2, M] contiguous. WS [P, stride_ws] float32, this
    # program's dwr partials (first tile stores unless ws_fresh = 0, as the fused
    # kernel's). Grid: (P,), P <= tiles; program p walks tiles p, p + P, ...
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    ws = WS + pid.to(tl.int64) * stride_ws
    ms = tl.arange(0, BLOCK_M)
    for tile in range(pid, n_tiles, nprog):
        tl.debug_barrier()  # this tile's workspace read-modify-writes see the previous ones
        accumulate = (tile >= nprog) | (ws_fresh == 0)
        rows = tl.cast(tile, tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < n_rows
        x_rows = X + rows * stride_xr
        dx_acc = tl.zeros([BLOCK_R, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, n_freq, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < n_freq
            mask = rmask[:, None] & kmask[None, :]
            g_ptrs = GR + rows[:, None] * stride_gr + ks[None, :]
            f_ptrs = RF + rows[:, None] * stride_rf + ks[None, :]
            gr_c = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
            gr_s = tl.load(g_ptrs + n_freq, mask=mask, other=0.0).to(tl.float32)
            fc = tl.load(f_ptrs, mask=mask, other=0.0).to(tl.float32)
            fs = tl.load(f_ptrs + n_freq, mask=mask, other=0.0).to(tl.float32)
            gphase = gr_s * fc - gr_c * fs  # 0 where masked
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
