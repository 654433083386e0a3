"""Floors measured in the same run as the timings (docs/performance.md): max(bytes / the
faster of fill and copy, GEMM flops / torch.mm's rate at that (k, n)); sin / cos not counted."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

FILL_BYTES = {"cpu": 256 * 2**20, "cuda": 2 * 2**30}
GEMM_ROWS = 4096


@dataclass(frozen=True)
class Work:
    """The least work of one call: bytes moved (inputs read once, outputs written once) and
    GEMMs (rows, k, n) for [rows, k] x [k, n] in ``gemm_dtype`` (bf16 for autocast cases)."""

    bytes: int = 0
    gemms: tuple[tuple[int, int, int], ...] = ()
    gemm_dtype: torch.dtype = torch.float32

    @property
    def flops(self) -> int:
        return sum(2 * r * k * n for r, k, n in self.gemms)

    def shapes(self) -> set:
        """The (k, n, dtype) whose rate the floor needs."""
        return {(k, n, self.gemm_dtype) for _, k, n in self.gemms}


def gemm_key(k: int, n: int, dtype: torch.dtype = torch.float32) -> str:
    suffix = "" if dtype == torch.float32 else f" {str(dtype)[6:]}"
    return f"{k}x{n}{suffix}"


def _bandwidth(device: str, timer: Callable, min_time: float) -> tuple[float, float]:
    """(fill GB/s, copy GB/s) of a large buffer: bytes written, bytes read + written."""
    n = FILL_BYTES.get(device, FILL_BYTES["cpu"]) // 4
    dst = torch.empty(n, device=device)
    src = torch.randn(n, device=device)
    dst.fill_(0.5)  # touch every page before timing
    fill_ms, _, _ = timer(lambda: dst.fill_(1.0), min_time)
    copy_ms, _, _ = timer(lambda: dst.copy_(src), min_time)
    return 4 * n / fill_ms / 1e6, 2 * 4 * n / copy_ms / 1e6


def measure(device: str, gemm_shapes, timer: Callable, min_time: float) -> dict:
    """Bandwidth and GEMM rates of ``gemm_shapes`` ((k, n, dtype)) on ``device``, as a dict."""
    fill, copy = _bandwidth(device, timer, min_time)
    rates = {}
    for k, n, dtype in sorted(set(gemm_shapes), key=str):
        a = torch.randn(GEMM_ROWS, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        c = torch.empty(GEMM_ROWS, n, device=device, dtype=dtype)
        ms, _, _ = timer(lambda a=a, b=b, c=c: torch.mm(a, b, out=c), min_time)
        rates[gemm_key(k, n, dtype)] = 2 * GEMM_ROWS * k * n / ms / 1e6
    return {
        "fill_gbps": fill,
        "copy_gbps": copy,
        "bandwidth_gbps": max(fill, copy),
        "gemm_gflops": rates,
        "gemm_rows": GEMM_ROWS,
    }


def floor_ms(work: Work | None, machine: dict) -> float | None:
    """max(bytes / bandwidth, GEMM time) in ms, or None when nothing is counted."""
    if work is None or (not work.bytes and not work.gemms):
        return None
    memory = work.bytes / machine["bandwidth_gbps"] / 1e6
    rates = machine["gemm_gflops"]
    compute = sum(
        2 * r * k * n / rates[gemm_key(k, n, work.gemm_dtype)] / 1e6 for r, k, n in work.gemms
    )
    return max(memory, compute)
