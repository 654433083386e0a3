"""Learnable Fourier features + grouped MLP as cuBLAS products and Triton elementwise
kernels: the "gemm" plan, for compute-bound shapes (lff_forward.py's one fused pass is
the "fused" plan; posenc_fast/ops/lff/plan.py chooses between them)."""

from __future__ import annotations

import math

import torch
import triton

from . import _gemm_sizes
from . import lff_gemm_kernels as k
from ._launch import INTERPRET, device_guard, pow2, rows_view
from ._partial_sums import max_programs, sum_partials
from .lff_forward import split_features

# Rows are processed in chunks of C rows (``_gemm_sizes.chunk_rows``: a fixed function of
# the shapes and the dtype: bounded buffers, a fixed summation order). Per chunk,
# r = [cos || sin] / sqrt(F) rounded to the compute dtype (as the fused kernels), and:
#
#     forward                                       backward (features recomputed from x)
#     features  x -> r            Triton            features  x -> r              Triton
#     a  = b1 + r w1              cuBLAS (addmm)    a  = b1 + r w1                cuBLAS
#     h  = act(a), in place       Triton            gh = dY w2^T                  cuBLAS
#     y  = b2 + h w2 -> output    cuBLAS (addmm)    h, ga = gh act'(a), db1       Triton
#                                                   [dw2; db2] += [h | 1]^T dY    cuBLAS
#                                                   dw1 += r^T ga                 cuBLAS
#                                                   gr = ga w1^T                  cuBLAS
#                                                   dx, dwr from gr, r, x         Triton
#
# Precision: the products accumulate in float32 and write the compute dtype, as eager
# PyTorch does (float32 operands in IEEE float32 unless torch allows TF32). The weight
# gradients are summed over chunks in float32 (_mm_float32). relu with a half-precision MLP
# adds the features' rounding errors as a second K block (r_lo, [w1; w1]), as the fused
# kernel does, so that a keeps float32's sign.
#
# Determinism: cuBLAS is bitwise reproducible given a fixed workspace
# (CUBLAS_WORKSPACE_CONFIG, which torch.use_deterministic_algorithms requires: the plan
# choice avoids this plan otherwise); the Triton reductions use fixed programs and orders;
# no atomics. Nothing reads tensor values on the host: the plan is CUDA-graph capturable.

# Launch configurations on the GPU (fixed: the reductions' order depends on them); no
# spills on sm_80 / sm_90. The streaming kernels take 8 warps so that their registers leave
# room for several blocks per SM. Under the interpreter: few, large programs.
_GPU = {
    "features": ({"BLOCK_R": 64, "BLOCK_K": 32}, {"num_warps": 4}),
    "act_fwd": ({"BLOCK_R": 64, "BLOCK_H": 64}, {"num_warps": 8}),
    "act_bwd": ({"BLOCK_R": 32, "BLOCK_H": 64}, {"num_warps": 8}),
    "phase": ({"BLOCK_R": 64, "BLOCK_K": 32}, {"num_warps": 8}),
}


def config(kernel: str, F2: int = 0, H: int = 0, rows: int = 0) -> tuple[dict, dict]:
    """(block sizes, launch options) of one elementwise kernel."""
    if INTERPRET:
        if kernel in ("features", "phase"):
            return {"BLOCK_R": pow2(rows, 16, 64), "BLOCK_K": pow2(F2, 16, 64)}, {}
        return {"BLOCK_R": pow2(rows, 16, 64), "BLOCK_H": pow2(H, 16, 64)}, {}
    blocks, options = _GPU[kernel]
    if "BLOCK_H" in blocks:
        blocks = dict(blocks, BLOCK_H=min(blocks["BLOCK_H"], pow2(H)))
    return blocks, options


def _mm_dtype_available() -> bool:
    """torch.mm(a, b, out_dtype=torch.float32) for half-precision operands (CUDA)."""
    return hasattr(torch.ops.aten.mm, "dtype_out")


def _mm_float32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out (float32) = a @ b accumulated in float32, for operands of any float dtype."""
    if a.dtype == torch.float32:
        return torch.mm(a, b, out=out)
    if a.is_cuda and _mm_dtype_available():
        return torch.mm(a, b, out_dtype=torch.float32, out=out)
    if not a.is_cuda:  # the CPU (CI): products of half values are exact in float32
        return torch.mm(a.float(), b.float(), out=out)
    # torch < 2.9 on CUDA: the chunk's product rounded once to the compute dtype
    return out.copy_(torch.mm(a, b))


class _Sum:
    """A float32 sum of per-chunk products, in chunk order: the first chunk's product is
    written into the sum, later ones into a scratch buffer and added."""

    def __init__(self, shape, device):
        self.total = torch.empty(shape, dtype=torch.float32, device=device)
        self.scratch = None
        self.started = False

    def add_mm(self, a: torch.Tensor, b: torch.Tensor) -> None:
        if not self.started:
            _mm_float32(a, b, self.total)
            self.started = True
            return
        if self.scratch is None:
            self.scratch = torch.empty_like(self.total)
        self.total.add_(_mm_float32(a, b, self.scratch))

    def result(self) -> torch.Tensor:
        return self.total if self.started else self.total.zero_()


def _features(rows, wr, out, F2, split, inv_sqrt_f):
    n = rows.shape[0]
    blocks, options = config("features", F2=F2, rows=n)
    grid = (triton.cdiv(n, blocks["BLOCK_R"]), triton.cdiv(F2, blocks["BLOCK_K"]))
    k._features_kernel[grid](
        rows,
        wr,
        out,
        n,
        F2,
        rows.stride(0),
        rows.stride(1),
        out.stride(0),
        inv_sqrt_f,
        M=rows.shape[1],
        SPLIT=split,
        INTERPRET=INTERPRET,
        **blocks,
        **options,
        enable_fp_fusion=False,
    )


def _weights(w1, b1, w2, b2, compute, split):
    """The MLP's weights in the compute dtype (converted once per call; autocast), w1
    stacked [w1; w1] for the split features."""
    w1c, b1c, w2c = (t.to(compute).contiguous() for t in (w1, b1, w2))
    b2c = b2.to(compute) if b2 is not None else None
    w1k = torch.cat([w1c, w1c], 0) if split else w1c
    return w1c, w1k, b1c, w2c, b2c


def gemm_fwd(x, wr, w1, b1, w2, b2, activation: str, out_dtype: torch.dtype) -> torch.Tensor:
    """x [..., G, M] -> [..., G * Dg] in out_dtype, the MLP computed in out_dtype (as
    lff_forward.lff_fwd; the MLP is required)."""
    G, M = x.shape[-2], x.shape[-1]
    rows = x.reshape(-1, M)
    R, F2, H, Dg = rows.shape[0], wr.shape[0], w1.shape[1], w2.shape[1]
    out = torch.empty((R, Dg), dtype=out_dtype, device=x.device)
    result = out.view(*x.shape[:-2], G * Dg)
    if R == 0 or Dg == 0:
        return result
    split = split_features(activation, out_dtype)
    _, w1k, b1c, w2c, b2c = _weights(w1, b1, w2, b2, out_dtype, split)
    wr = wr.contiguous()
    C = _gemm_sizes.chunk_rows(R, F2, H, out_dtype.itemsize, False, split)
    feats = torch.empty((C, (4 if split else 2) * F2), dtype=out_dtype, device=x.device)
    hidden = torch.empty((C, H), dtype=out_dtype, device=x.device)
    inv_sqrt_f = 1.0 / math.sqrt(2 * F2)
    blocks, options = config("act_fwd", H=H, rows=C)
    with device_guard(x):
        for r0 in range(0, R, C):
            n = min(C, R - r0)
            f, h = feats[:n], hidden[:n]
            _features(rows[r0 : r0 + n], wr, f, F2, split, inv_sqrt_f)
            torch.addmm(b1c, f, w1k, out=h)
            grid = (triton.cdiv(n, blocks["BLOCK_R"]), triton.cdiv(H, blocks["BLOCK_H"]))
            k._act_fwd_kernel[grid](
                h,
                n,
                H,
                h.stride(0),
                ACT=activation,
                INTERPRET=INTERPRET,
                **blocks,
                **options,
                enable_fp_fusion=False,
            )
            torch.addmm(b2c, h, w2c, out=out[r0 : r0 + n])
    return result


def _programs(n_tiles: int, device) -> int:
    """Programs of a row-walking reduction kernel: two per SM, at most one per tile."""
    return max(1, min(n_tiles, max_programs(device)))


def gemm_bwd(grad, x, wr, w1, b1, w2, b2, activation: str, needs) -> list:
    """Gradients (dx, dwr, dw1, db1, dw2, db2) of gemm_fwd (the same as lff_bwd's, to
    float32 summation order and the products' rounding); None where needs[i] is False."""
    need_x, need_wr, need_w1, need_b1, need_w2, need_b2 = (bool(n) for n in needs)
    M = x.shape[-1]
    rows = x.reshape(-1, M)
    R, F2, H, Dg = rows.shape[0], wr.shape[0], w1.shape[1], w2.shape[1]
    device = x.device
    out: list = [None] * 6
    need_phase = need_x or need_wr
    need_ga = need_phase or need_w1 or need_b1
    need_a = need_ga or need_w2  # (db2 alone needs no hidden layer)
    if not (need_phase or need_w1 or need_b1 or need_w2 or need_b2):
        return out
    dx = torch.empty((R, M), dtype=x.dtype, device=device) if need_x else None
    if dx is not None:
        out[0] = dx.view(x.shape)
    if R == 0:
        for idx, need, ref in ((1, need_wr, wr), (2, need_w1, w1), (3, need_b1, b1),
                               (4, need_w2, w2), (5, need_b2, b2)):  # fmt: skip
            if need:
                out[idx] = torch.zeros_like(ref)
        return out

    compute = grad.dtype
    split = split_features(activation, compute)
    g = rows_view(grad, Dg, R)
    w1c, w1k, b1c, w2c, _ = _weights(w1, b1, w2, None, compute, split)
    wr = wr.contiguous()
    C = _gemm_sizes.chunk_rows(R, F2, H, compute.itemsize, True, split)
    F = 2 * F2
    inv_sqrt_f = 1.0 / math.sqrt(F)

    feats = torch.empty((C, (4 if split else 2) * F2), dtype=compute, device=device)
    # a, then h in place; with dw2, the columns H.. hold [1, 0, ...]: the product with dY
    # gives db2 in row H of [dw2; db2] (a multiple of 8 columns: rows 16-byte aligned for
    # cuBLAS)
    ones = need_w2 and need_b2
    width_h = (H + 8) // 8 * 8 if ones else H
    hbuf = torch.empty((C, width_h), dtype=compute, device=device)
    if ones:
        hbuf[:, H:].zero_()
        hbuf[:, H].fill_(1.0)
    ghbuf = torch.empty((C, H), dtype=compute, device=device) if need_ga else None
    grbuf = torch.empty((C, F), dtype=compute, device=device) if need_phase else None

    dw2 = _Sum((width_h, Dg), device) if need_w2 else None
    db2 = _Sum((1, Dg), device) if need_b2 and not ones else None
    dw1 = _Sum((F, H), device) if need_w1 else None
    act_blocks, act_options = config("act_bwd", H=H, rows=C)
    h_blocks = triton.cdiv(H, act_blocks["BLOCK_H"])
    p_act = _programs(triton.cdiv(C, act_blocks["BLOCK_R"]), device)
    ws_b1 = torch.empty((p_act, H), dtype=torch.float32, device=device) if need_b1 else None
    ph_blocks, ph_options = config("phase", F2=F2, rows=C)
    p_phase = _programs(triton.cdiv(C, ph_blocks["BLOCK_R"]), device)
    ws_wr = torch.empty((p_phase, F2 * M), dtype=torch.float32, device=device)
    column = torch.ones((C, 1), dtype=compute, device=device) if db2 is not None else None

    with device_guard(x):
        for r0 in range(0, R, C):
            n = min(C, R - r0)
            fresh = 1 if r0 == 0 else 0
            xr, gy = rows[r0 : r0 + n], g[r0 : r0 + n]
            f, a = feats[:n], hbuf[:n, :H]
            if need_a:
                _features(xr, wr, f, F2, split, inv_sqrt_f)
                torch.addmm(b1c, f, w1k, out=a)
            if need_ga:
                gh = ghbuf[:n]
                torch.mm(gy, w2c.T, out=gh)
                tiles = triton.cdiv(n, act_blocks["BLOCK_R"])
                k._act_bwd_kernel[(h_blocks, p_act)](
                    a,
                    gh,
                    a,
                    gh,
                    ws_b1 if ws_b1 is not None else gh,
                    n,
                    H,
                    tiles,
                    a.stride(0),
                    gh.stride(0),
                    a.stride(0),
                    gh.stride(0),
                    ws_b1.stride(0) if ws_b1 is not None else 0,
                    fresh,
                    ACT=activation,
                    STORE_H=need_w2,
                    NEED_B1=need_b1,
                    INTERPRET=INTERPRET,
                    **act_blocks,
                    **act_options,
                    enable_fp_fusion=False,
                )
            elif need_w2:
                blocks, options = config("act_fwd", H=H, rows=n)
                grid = (triton.cdiv(n, blocks["BLOCK_R"]), triton.cdiv(H, blocks["BLOCK_H"]))
                k._act_fwd_kernel[grid](
                    a,
                    n,
                    H,
                    a.stride(0),
                    ACT=activation,
                    INTERPRET=INTERPRET,
                    **blocks,
                    **options,
                    enable_fp_fusion=False,
                )
            if dw2 is not None:
                dw2.add_mm(hbuf[:n].T, gy)
            if db2 is not None:
                db2.add_mm(column[:n].T, gy)
            if dw1 is not None:
                dw1.add_mm(f[:, :F].T, ghbuf[:n])
            if need_phase:
                gr = grbuf[:n]
                torch.mm(ghbuf[:n], w1c.T, out=gr)
                tiles = triton.cdiv(n, ph_blocks["BLOCK_R"])
                k._phase_grad_kernel[(min(p_phase, tiles),)](
                    xr,
                    wr,
                    gr,
                    f,
                    dx[r0 : r0 + n] if dx is not None else ws_wr,
                    ws_wr,
                    n,
                    F2,
                    tiles,
                    xr.stride(0),
                    xr.stride(1),
                    gr.stride(0),
                    f.stride(0),
                    ws_wr.stride(0),
                    fresh,
                    M=M,
                    NEED_X=need_x,
                    NEED_WR=need_wr,
                    BLOCK_M=triton.next_power_of_2(M),
                    INTERPRET=INTERPRET,
                    **ph_blocks,
                    **ph_options,
                    enable_fp_fusion=False,
                )

    if need_w2:
        total = dw2.result()
        out[4] = total[:H].to(w2.dtype)
        if ones:
            out[5] = total[H].to(b2.dtype, copy=True)
    if db2 is not None:
        out[5] = db2.result()[0].to(b2.dtype, copy=True)
    if need_w1:
        out[2] = dw1.result().to(w1.dtype)
    if need_b1:
        out[3] = sum_partials(ws_b1, b1, p_act)
    if need_wr:
        out[1] = sum_partials(ws_wr, wr, p_phase)
    return out
