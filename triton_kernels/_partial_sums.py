"""The deterministic weight-gradient sums shared by the LFF and rotary backward kernels:
per-program workspace rows (add_to), summed in a fixed order by a second kernel
(sum_partials_kernel, sum_partials)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import INTERPRET, sm_count
from ._round import round_to


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
