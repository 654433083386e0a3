"""Which kernel configurations may be compiled where: the one rule set that the launchers
(pruning their autotuners, choosing the backward's fixed configuration) and the compile
report (tools/triton_compile_report.py, per GPU architecture) share."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, Optional

import triton
import triton.language as tl

from ._env import parse_version

# A configuration (its constexprs ``meta``, num_warps, num_stages) is refused, with a
# reason, when (1) the installed Triton is known to *abort the process* compiling it for
# that architecture (an assertion in Triton's C++ compiler, which Python cannot catch: see
# DEFECTS), or (2) ``shared_bound`` exceeds the target's ``shared_limit``. A configuration
# that merely raises while compiling is dropped from the autotuner's choice with one warning
# (``guard_autotuner``). The rules are pure functions of the Triton version and ``arch``
# (10 * major + minor), so they are tested without a GPU.

# Architectures the compile report covers: A100, A10/A40/RTX 30, L4/L40/RTX 40, H100/H200,
# B200, RTX 50.
REPORT_ARCHS = (80, 86, 89, 90, 100, 120)

# Largest shared memory one block may use (opt-in), bytes, per compute capability.
_SHARED_LIMIT = {
    80: 163 * 1024,
    86: 99 * 1024,
    87: 163 * 1024,
    89: 99 * 1024,
    90: 227 * 1024,
    100: 227 * 1024,
    103: 227 * 1024,
    120: 99 * 1024,
    121: 99 * 1024,
}


def shared_limit(arch: int) -> int:
    """Per-block shared memory limit of ``arch``; unknown architectures get the smallest
    limit of the listed ones (conservative)."""
    return _SHARED_LIMIT.get(arch, min(_SHARED_LIMIT.values()))


TRITON = parse_version(triton.__version__)


def _uses_tensor_cores(meta: Mapping) -> bool:
    """Whether the kernel's tl.dot runs on tensor cores: bf16 / fp16 operands, or float32
    with TF32 allowed ("ieee" float32 uses FMA instructions)."""
    if not meta.get("MLP", False):
        return False
    return meta.get("COMPUTE") != tl.float32 or meta.get("PRECISION") == "tf32"


def _warpgroups_split_columns(meta: Mapping, num_warps: int) -> bool:
    """Hopper's warpgroup MMA takes 64 rows per group of 4 warps; with fewer rows than
    16 * num_warps (e.g. 64 rows, 8 warps) the warpgroups split the columns instead
    (below 64 rows Triton uses Ampere's mma.sync, which has no such layout)."""
    rows = meta.get("BLOCK_R", 0)
    return _uses_tensor_cores(meta) and 64 <= rows < 16 * num_warps


@dataclass(frozen=True)
class Defect:
    """Configurations that some Triton versions cannot compile for some architectures."""

    kernels: Optional[tuple[str, ...]]  # None: every kernel
    triton_below: tuple[int, int]  # seen with every supported Triton older than this
    min_arch: int
    applies: Callable[[Mapping, int], bool]  # (meta, num_warps)
    reason: str


def _always(meta: Mapping, num_warps: int) -> bool:
    return True


# Seen by compile_report --probe-refused (each refused configuration compiled in a child
# process) with Triton 3.1.0, 3.2.0, 3.3.1, 3.6.0 and 3.9.0, for sm_80 .. sm_120.
DEFECTS = (
    Defect(
        kernels=None,
        triton_below=(3, 3),
        min_arch=100,
        applies=_always,
        reason=(
            "Triton {triton} does not support sm_{arch} (Blackwell targets came with Triton "
            '3.3): a matmul aborts the process ("computeCapability not supported"), and its '
            "ptxas does not know the architecture"
        ),
    ),
    Defect(
        kernels=("lff_fwd", "lff_bwd"),
        triton_below=(3, 3),
        min_arch=90,
        applies=_warpgroups_split_columns,
        reason=(
            "Triton {triton} aborts the process compiling it for sm_{arch} (an assertion: "
            '"mma -> mma layout conversion is only supported on Ampere" in 3.1, '
            "LinearLayout::reshapeOuts in 3.2): the hidden layer passes between two "
            "warpgroup-MMA layouts whose warps split the columns (BLOCK_R < 16 * num_warps); "
            "fine from Triton 3.3"
        ),
    ),
)


def _defect(kernel: Optional[str], meta: Mapping, num_warps: int, arch: int, version) -> str:
    for d in DEFECTS:
        if (
            (d.kernels is None or kernel in d.kernels)
            and version < d.triton_below
            and arch >= d.min_arch
            and d.applies(meta, num_warps)
        ):
            return d.reason.format(triton="{}.{}".format(*version), arch=arch)
    return ""


def target_reason(arch: int, triton_version: Optional[tuple[int, int]] = None) -> str:
    """Why the installed Triton cannot compile any kernel for ``arch`` ("" if it can): the
    triton backend's environment reason on such a GPU."""
    version = TRITON if triton_version is None else triton_version
    return _defect(None, {}, 4, arch, version)


def shared_bound(kernel: str, meta: Mapping, num_warps: int, num_stages: int, arch: int = 0) -> int:
    """An upper bound, in bytes, of the shared memory a configuration allocates.

    Triton keeps the tl.dot operands it loads (``num_stages`` deep when pipelined) and
    scratch for float32 layout conversions; a buffer lives through its loop, so the bound is
    the largest of the two matmul loops and the hidden layer's conversion, plus 20 % and
    1 kB. Fitted to Triton 3.1 / 3.9 and checked by tools/triton_compile_report.py. On
    ``arch`` >= 90, where the warpgroups split the columns, the conversion counts twice."""
    br, bk = meta.get("BLOCK_R", 1), meta.get("BLOCK_K", 1)
    bh, bd = meta.get("BLOCK_H", 1), meta.get("BLOCK_D", 1)
    stages = max(1, num_stages)
    if kernel in ("lff_fwd", "lff_bwd") and meta.get("MLP", False):
        e = 4 if meta.get("COMPUTE") == tl.float32 else 2  # operand bytes
        first = e * stages * 2 * bk * bh + 4 * br * bk  # w1 chunks; cos/sin conversion
        # With 64-frequency blocks Triton 3.9 keeps each pipelined w1 chunk twice and the
        # wr chunk per stage, beside the features in the operand layout.
        if bk >= 64:
            first = max(first, stages * (4 * e * bk * bh + 4 * meta.get("M", 4) * bk) + 3 * br * bk)
        second = e * stages * bh * bd + 4 * br * bd + e * br * bh  # w2; y conversion; h
        hidden = 4 * br * bh + e * stages * bh * bd
        if arch >= 90 and _warpgroups_split_columns(meta, num_warps):
            hidden += 4 * br * bh
        if kernel == "lff_bwd":  # dY chunks and the transposed operands as well
            second += e * stages * br * bd + e * br * bh
            first += e * br * bk + e * bk * bh
        need = max(first, second, hidden)
    elif kernel == "lff_bwd_wgrad":  # split-K dw2 = h^T dY / dw1 = r^T ga (lff_backward.py)
        br, bi, bj = meta.get("BLOCK_R", 1), meta.get("BLOCK_I", 1), meta.get("BLOCK_J", 1)
        e = 4 if meta.get("COMPUTE") == tl.float32 else 2
        # The B tile (dY or ga), pipelined; then the A side: h^T tiles (pipelined) for dw2,
        # the recomputed cos and sin tiles (float32, converted to the operand layout) for
        # dw1; and the float32 accumulator(s) converted for the workspace update.
        operands = e * stages * br * bj
        if meta.get("FEATURES", False):
            operands += 2 * (4 * br * bi + e * br * bi)
        else:
            operands += e * stages * bi * br
        need = max(operands, 4 * bi * bj)
    elif kernel == "lff_bwd_phase":  # gr = ga w1^T, then the phase chain (lff_backward.py)
        br, bk, bh = meta.get("BLOCK_R", 1), meta.get("BLOCK_K", 1), meta.get("BLOCK_H", 1)
        e = 4 if meta.get("COMPUTE") == tl.float32 else 2
        # ga and the two w1^T tiles, pipelined; gr converted to the features' layout
        need = e * stages * (br * bh + 2 * bh * bk) + 4 * br * bk
    elif kernel == "lff_gemm_phase":  # gr and the features, loaded as [BR, BK] tiles
        need = 4 * 4 * br * bk
    elif kernel == "lff_gemm_act":  # one float32 [BR, BH] tile (db1's column sums)
        need = 4 * br * meta.get("BLOCK_H", 1)
    elif kernel.startswith("rotary"):  # float32 tiles converted between layouts: cos and
        # sin [BLOCK_N, BLOCK_K] to the channel pairs' layout, a pair tile [BLOCK_N, 2 BLOCK_K]
        need = 4 * 4 * meta.get("BLOCK_N", 1) * bk
    else:  # no matmul: conversions of one [BLOCK_R, BLOCK_K or BLOCK_D] float32 tile
        need = 4 * br * max(bk, bd)
    return int(need * 1.2) + 1024


def refusal(
    kernel: str,
    meta: Mapping,
    num_warps: int,
    num_stages: int,
    arch: int,
    triton_version: Optional[tuple[int, int]] = None,
) -> Optional[str]:
    """Why this configuration must not be compiled for ``arch`` with ``triton_version``
    (default: the installed Triton); None if it may."""
    if triton_version is None:
        triton_version = TRITON
    defect = _defect(kernel, meta, num_warps, arch, triton_version)
    if defect:
        return defect
    need, limit = shared_bound(kernel, meta, num_warps, num_stages, arch), shared_limit(arch)
    if need > limit:
        return f"needs up to {need} B of shared memory, sm_{arch} has {limit} B per block"
    return None


# ---------------------------------------------------------------- at run time, on a GPU


def device_arch(device) -> int:
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def prune(kernel: str, configs, meta: Mapping, arch: int) -> tuple[list, list[str]]:
    """(the triton.Config entries that may be offered, the reasons for the others)."""
    kept, why = [], []
    for c in configs:
        full = {**meta, **c.kwargs}
        reason = refusal(kernel, full, c.num_warps, c.num_stages, arch)
        if reason is None:
            kept.append(c)
        else:
            why.append(f"{describe(c)}: {reason}")
    return kept, why


def describe(config) -> str:
    blocks = " ".join(f"{k.replace('BLOCK_', 'B')}{v}" for k, v in config.kwargs.items())
    return f"{blocks} w{config.num_warps} s{config.num_stages}"


# Configurations dropped in this process because compiling them raised:
# (kernel, configuration) -> the exception, as text.
_dropped: dict[tuple[str, str], str] = {}


def dropped() -> dict[tuple[str, str], str]:
    return dict(_dropped)


def guard_autotuner(tuner, kernel: str):
    """Make ``tuner`` (a triton.autotune object) drop a configuration whose compilation or
    trial launch raises, instead of failing the call: its time becomes infinite (Triton
    itself does this only for OutOfResources and a few compiler errors), the reason is
    kept in ``dropped()`` and warned once. Returns the tuner."""
    bench = tuner._bench

    def guarded(*args, config, **meta):
        try:
            return bench(*args, config=config, **meta)
        except Exception as exc:
            key = (kernel, describe(config))
            if key not in _dropped:
                _dropped[key] = f"{type(exc).__name__}: {str(exc)[-300:]}"
                warnings.warn(
                    f"posenc_fast: Triton {triton.__version__} could not compile or launch "
                    f"{kernel} configuration {key[1]} ({_dropped[key]}); it is left out of "
                    "the autotuner's choice",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return [math.inf, math.inf, math.inf]

    tuner._bench = guarded
    return tuner
