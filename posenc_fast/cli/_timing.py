"""Timing (median, p20, p80 in ms) and peak memory for ``bench``: the most bytes tensors
held at once during one call above those before it (CPU: from the profiler's records)."""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch


def _quantiles(samples: list[float]) -> tuple[float, float, float]:
    s = sorted(samples)
    if len(s) == 1:
        return s[0], s[0], s[0]
    q = statistics.quantiles(s, n=10, method="inclusive")
    return statistics.median(s), q[1], q[7]  # median, p20, p80


def time_cpu(
    fn: Callable[[], object], min_time: float, max_runs: int = 1000
) -> tuple[float, float, float]:
    fn()  # warm-up (also triggers lazy initialisation and compilation)
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < 3 or (time.perf_counter() - start < min_time and len(samples) < max_runs):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return _quantiles(samples)


def time_cuda(fn: Callable[[], object], min_time: float) -> tuple[float, float, float]:
    try:
        from triton.testing import do_bench

        rep_ms = max(25, int(min_time * 1e3))
        res = do_bench(fn, warmup=max(10, rep_ms // 4), rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
        return tuple(float(v) for v in res)  # type: ignore[return-value]
    except ImportError:
        pass
    fn()
    torch.cuda.synchronize()
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < 5 or (time.perf_counter() - start < min_time and len(samples) < 1000):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b))
    return _quantiles(samples)


@contextlib.contextmanager
def _quiet_native_stderr():
    """Silence fd 2 for the block: Kineto prints 'USDT: profiler_start/stop' on every profile."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def peak_bytes_cpu(fn: Callable[[], object]) -> int:
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_native_stderr():
        prof.start()
    try:
        fn()
    finally:
        with _quiet_native_stderr():
            prof.stop()
    records = []
    for e in prof.events():
        if e.name == "[memory]":
            records.append((e.time_range.start, e.cpu_memory_usage))
        elif e.self_cpu_memory_usage:
            records.append((e.time_range.start, e.self_cpu_memory_usage))
    records.sort(key=lambda r: r[0])
    live = peak = 0
    for _, delta in records:
        live += delta
        peak = max(peak, live)
    return peak


def peak_bytes_cuda(fn: Callable[[], object]) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base
