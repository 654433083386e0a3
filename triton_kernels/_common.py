"""Kernel pieces shared by the LFF and rotary kernels (lff_forward.py, lff_backward_*.py,
rotary.py): the cos / sin of a tile of phases x . wr (wr contiguous, or any strides), the
chain rule back through them, and the deterministic weight-gradient sums (per-program
workspace rows, summed in a fixed order by a second kernel)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import INTERPRET, sm_count
from ._phase import accumulate_phase, phase_term, sincos_turns, turns_hi_lo
from ._round import round_to


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
def add_to(ptrs, value, mask, accumulate):
    """*ptrs += value, for a workspace row owned by this program alone; *ptrs = 0 + value
    when not ``accumulate`` (the program's first tile: the row is uninitialised). A
    uniform branch, not a masked load: the select on the mask cost registers (a spill)."""
    if accumulate:
        tl.store(ptrs, tl.load(ptrs, mask=mask, other=0.0) + value, mask=mask)
    else:
        tl.store(ptrs, 0.0 + value, mask=mask)


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


@triton.jit
def sum_partials_kernel(
    WS, OUT, n_parts, n_cols, stride_ws, BLOCK: tl.constexpr, INTERPRET: tl.constexpr
):
    # WS [P, stride_ws] float32 (already offset to one gradient's columns) -> OUT [NCOL]
    # (the weight's dtype), OUT[c] = sum_p WS[p, c] added in float32 in the fixed order
    # p = 0, 1, ..., P-1 (deterministic), rounded once. Grid: (cdiv(NCOL, BLOCK),).
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for p in range(0, n_parts):
        acc += tl.load(WS + tl.cast(p, tl.int64) * stride_ws + cols, mask=mask, other=0.0)
    tl.store(OUT + cols, round_to(acc, OUT.dtype.element_ty, INTERPRET), mask=mask)


def max_programs(device: torch.device) -> int:
    """Programs of the backward: two per SM (each walks its share of the row tiles);
    2 under the interpreter. Part of the summation order, so fixed per device."""
    return 2 * sm_count(device)


def sum_partials(ws: torch.Tensor, ref: torch.Tensor, n_parts: int, offset: int = 0):
    """A new tensor shaped and typed like ``ref``: the sum of the first n_parts rows of
    the float32 workspace ``ws`` over the columns [offset, offset + ref.numel()), added in
    the fixed order 0, 1, ..., n_parts - 1 (sum_partials_kernel) and rounded once."""
    block = 4096 if INTERPRET else 1024
    result = torch.empty(ref.shape, dtype=ref.dtype, device=ws.device)
    grid = (triton.cdiv(ref.numel(), block),)
    sum_partials_kernel[grid](
        ws[:, offset:],
        result,
        n_parts,
        ref.numel(),
        ws.stride(0),
        BLOCK=block,
        INTERPRET=INTERPRET,
        enable_fp_fusion=False,
    )
    return result


def workspace_parts(items) -> tuple[list, int]:
    """[(index in the result, reference tensor, workspace offset)] of the needed
    gradients among ``items`` (index, need, reference), and the total columns."""
    parts, offset = [], 0
    for idx, need, ref in items:
        if need:
            parts.append((idx, ref, offset))
            offset += ref.numel()
    return parts, offset


def sum_parts_into(out: list, ws: torch.Tensor, parts, n_parts: int) -> None:
    """out[idx] = sum_partials of each of ``parts`` (workspace_parts): one small launch
    per gradient, each into its own tensor (outputs of a custom op must not alias)."""
    for idx, ref, off in parts:
        out[idx] = sum_partials(ws, ref, n_parts, off)
