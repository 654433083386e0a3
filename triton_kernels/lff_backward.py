"""Learnable Fourier features + grouped MLP, backward: the entry ``lff_bwd``, which takes
one of two paths by the size of the weights: the fused kernel (lff_backward_fused.py), or
the split-K path (lff_backward_split_k.py) when one program's partial sums would not stay
in L2. Both are deterministic: fixed block sizes and summation orders, no atomics."""

from __future__ import annotations

import torch
import triton

from . import _configs
from . import lff_backward_fused as fused
from . import lff_backward_split_k as large
from ._launch import INTERPRET, device_guard, dot_precision, pow2, rows_view, tl_dtype
from ._partial_sums import sum_parts_into, workspace_parts
from .lff_forward import split_features

# The split-K path takes over when the fused kernel's per-program partial sums (4 bytes
# per needed weight-gradient element) exceed this: beyond it the workspace rows leave L2
# and their read-modify-write per row tile dominates. The canonical H=32 case stays fused.
_SPLIT_K_BYTES = 256 * 1024


def lff_bwd(grad, x, wr, w1, b1, w2, b2, activation: str, needs) -> list:
    """Gradients (dx, dwr, dw1, db1, dw2, db2) of lff_fwd; None where needs[i] is False.

    grad [..., G * width] in the forward's output dtype (the MLP compute dtype); x is
    floating, as in lff_fwd. Returned gradients have the dtypes of their inputs."""
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

    parts, total = workspace_parts(
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
    blocks, options = (None, None) if split_k else fused.choose_blocks(R, F2, H, width, meta, arch)
    flags = dict(NEED_X=need_x, NEED_WR=need_wr, NEED_B1=need_b1, NEED_B2=need_b2)
    args = (rows, wr, w1, b1, w2, g, dx, (F2, H, width), meta, blocks, options)
    with device_guard(x):
        if split_k:
            large.split_k(out, args, flags, need_w1, need_w2, b2, arch, device)
        else:
            programs = fused.programs(R, blocks, total, device)
            # programs <= tiles: every program has a first tile, which writes its row.
            ws = torch.empty((programs, max(1, total)), dtype=torch.float32, device=device)
            offsets = {idx: off for idx, _, off in parts}
            fused.run(args, ws, offsets, 0, R, True, None, None,
                      dict(flags, NEED_W1=need_w1, NEED_W2=need_w2))  # fmt: skip
            sum_parts_into(out, ws, parts, programs)
    return out
