"""Phase tiles shared by the LFF and rotary kernels (lff_forward.py, lff_backward_*.py,
lff_gemm_kernels.py, rotary.py): the cos / sin of a tile of phases x . wr (wr contiguous,
or any strides) and the chain rule back through them."""

from __future__ import annotations

import triton
import triton.language as tl

from ._partial_sums import add_to
from ._phase import accumulate_phase, phase_term, sincos_turns, turns_hi_lo


@triton.jit
def cos_sin_tile(x_rows, rmask, stride_xm, WR, ks, kmask, M: tl.constexpr):
    """cos and sin of x[rows] . wr[ks]^T: x_rows [BLOCK_R] pointers to the rows' first
    coordinates (X + rows * stride_xr; coordinate m at + m * stride_xm), WR [F/2, M]
    contiguous.

    Returns two [BLOCK_R, BLOCK_K] float32 tensors. Padded rows / frequencies read 0
    (phase 0, cos 1): callers mask them out of every store and zero their weights.
    """
    return cos_sin_strided(x_rows, rmask, stride_xm, WR, ks, kmask, M, 1, M)


@triton.jit
def cos_sin_strided(x_rows, rmask, stride_xm, W, ks, kmask, stride_wk, stride_wm, M: tl.constexpr):
    """cos_sin_tile for frequencies W [F/2, M] with any strides (frequency k, coordinate m
    at W + k * stride_wk + m * stride_wm): the same arithmetic."""
    for m in tl.static_range(M):
        x = tl.load(x_rows + m * stride_xm, mask=rmask, other=0.0).to(tl.float32)
        w = tl.load(W + ks * stride_wk + m * stride_wm, mask=kmask, other=0.0).to(tl.float32)
        t_hi, t_lo = turns_hi_lo(w)
        if m == 0:
            hi, lo = phase_term(x[:, None], t_hi[None, :], t_lo[None, :])
        else:
            hi, lo = accumulate_phase(hi, lo, x[:, None], t_hi[None, :], t_lo[None, :])
    return sincos_turns(hi, lo)


@triton.jit
def phase_chain_rule(
    gphase, x_rows, rmask, stride_xm, WR, ks, kmask, dx_acc, ms, ws_wr, accumulate,
    M: tl.constexpr, NEED_X: tl.constexpr, NEED_WR: tl.constexpr,
):  # fmt: skip
    """The chain rule through phase = x . wr for one tile of d loss / d phase [BR, BK]
    (rows x_rows of X, as cos_sin_tile's, frequencies ``ks`` of WR [F2, M] contiguous): returns
    dx_acc [BR, BLOCK_M] + gphase @ wr[ks], and adds sum_rows gphase * x[:, m] to this
    program's workspace partials ws_wr[k * M + m] (add_to). Padded rows and frequencies
    must have gphase = 0. Shared by the LFF and rotary backward kernels."""
    return phase_chain_rule_strided(
        gphase, x_rows, rmask, stride_xm, WR, ks, kmask, M, 1, dx_acc, ms, ws_wr, accumulate,
        M, NEED_X, NEED_WR,
    )  # fmt: skip


@triton.jit
def phase_chain_rule_strided(
    gphase, x_rows, rmask, stride_xm, W, ks, kmask, stride_wk, stride_wm, dx_acc, ms, ws_wr,
    accumulate, M: tl.constexpr, NEED_X: tl.constexpr, NEED_WR: tl.constexpr,
):  # fmt: skip
    """phase_chain_rule for frequencies W with any strides (as cos_sin_strided's); the
    workspace partials stay contiguous, ws_wr[k * M + m]."""
    for m in tl.static_range(M):
        if NEED_X:
            w = tl.load(W + ks * stride_wk + m * stride_wm, mask=kmask, other=0.0).to(tl.float32)
            col = tl.sum(gphase * w[None, :], axis=1)
            dx_acc += tl.where(ms[None, :] == m, col[:, None], 0.0)
        if NEED_WR:
            x = tl.load(x_rows + m * stride_xm, mask=rmask, other=0.0)
            part = tl.sum(gphase * x.to(tl.float32)[:, None], axis=0)
            add_to(ws_wr + ks * M + m, part, kmask, accumulate)
    return dx_acc
