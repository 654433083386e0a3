"""Helpers shared by the GPU benchmark scripts (lff_gpu.py, floater_gpu.py, gpu_ceilings.py).

Timing follows the project's method (benchmarks/README.md, "How GPU figures are
measured"): on CUDA, device events through
``triton.testing.do_bench`` (median with 20th / 80th percentiles, L2 flushed between
runs) or, for calls too long for do_bench's many repetitions, CUDA events around a few
calls; on the CPU (the scripts' --dry-run), wall clock. Peak memory from
``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``. Results are written
as JSON atomically (a new file renamed over the old one), so a run killed at its time
limit leaves the last complete file behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bench(fn, device: str, rep_ms: int) -> tuple[float, float, float]:
    """(median, p20, p80) milliseconds: do_bench on CUDA; on the CPU one warm-up and three
    wall-clock runs (median, fastest, slowest)."""
    if device == "cuda":
        from triton.testing import do_bench

        res = do_bench(fn, warmup=max(25, rep_ms // 4), rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
        return tuple(float(v) for v in res)
    fn()
    samples = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    samples.sort()
    return samples[1], samples[0], samples[2]


def timed_calls(fn, device: str, warmups: int, repeats: int) -> dict:
    """Time ``repeats`` calls one by one (after ``warmups`` untimed ones): for calls long
    enough that a few runs suffice. CUDA events around each call (they include the
    host-side gaps of launch-bound code, like a wall clock would), wall clock on the CPU.
    Peak memory is taken during the first timed call. Returns ms (median), ms_p20 / ms_p80
    (20th / 80th percentiles, see ``quantiles``), runs, peak_bytes and the last call's
    result."""
    result = None
    for _ in range(warmups):
        result = fn()
    sync(device)
    runs: list[float] = []
    peak = None
    for i in range(max(1, repeats)):
        if device == "cuda":
            if i == 0:
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = fn()
            end.record()
            end.synchronize()
            runs.append(start.elapsed_time(end))
            if i == 0:
                peak = int(torch.cuda.max_memory_allocated() - base)
        else:
            t0 = time.perf_counter()
            result = fn()
            runs.append((time.perf_counter() - t0) * 1e3)
    return {**quantiles(runs), "runs": runs, "peak_bytes": peak, "result": result}


def quantiles(runs: list[float]) -> dict:
    """Median and 20th / 80th percentiles as ``python -m posenc_fast bench`` computes them
    (posenc_fast.cli._timing: 10-quantiles, inclusive method, interpolated between runs;
    one run gives that run thrice)."""
    from posenc_fast.cli._timing import _quantiles

    ms, p20, p80 = _quantiles(runs)
    return {"ms": ms, "ms_p20": p20, "ms_p80": p80}


def peak_bytes(fn, device: str) -> int | None:
    """Most bytes allocated at once during fn(), above what was allocated before (CUDA;
    None on the CPU): posenc_fast.cli._timing.peak_bytes_cuda."""
    if device != "cuda":
        return None
    from posenc_fast.cli._timing import peak_bytes_cuda

    return int(peak_bytes_cuda(fn))


def ceilings(
    device: str, bench_fn, fill: bool = False, dry_run: bool = False, fp32: bool = False
) -> dict:
    """The machine's own ceilings: device-to-device copy bandwidth (bytes read + written),
    optionally a write-only fill, the dense bf16 matmul rate (random data) and optionally
    the fp32 one (IEEE fp32, TF32 off as torch's default: what fp32 kernels compete with).
    ``bench_fn(fn) -> (median, p20, p80)`` ms. On the CPU nothing is measured (dry runs)."""
    if device != "cuda":
        out = {"copy_GBps": None, "bf16_mm_TFLOPs": None, "note": "dry run: not measured"}
        if fill:
            out["fill_GBps"] = None
        if fp32:
            out["fp32_mm_TFLOPs"] = None
        if dry_run:
            out["dry_run_code_path"] = _tiny_ceiling_path()
        return out
    n = 2**30  # 2 GiB of bf16 copied: far beyond the L2
    buffers = [torch.randn(n, device=device, dtype=torch.bfloat16)]
    buffers.append(torch.empty_like(buffers[0]))
    ms = bench_fn(lambda: buffers[1].copy_(buffers[0]))[0]
    out = {"copy_GBps": 2 * n * 2 / (ms * 1e-3) / 1e9}
    if fill:  # write-only: 2 GiB written, nothing read
        ms = bench_fn(lambda: buffers[1].fill_(1.0))[0]
        out["fill_GBps"] = n * 2 / (ms * 1e-3) / 1e9
    buffers.clear()
    k = 8192
    mats = [torch.randn(k, k, device=device, dtype=torch.bfloat16) for _ in range(2)]
    ms = bench_fn(lambda: mats[0] @ mats[1])[0]
    out["bf16_mm_TFLOPs"] = 2 * k**3 / (ms * 1e-3) / 1e12
    if fp32:
        mats = [m.float() for m in mats]
        ms = bench_fn(lambda: mats[0] @ mats[1])[0]
        out["fp32_mm_TFLOPs"] = 2 * k**3 / (ms * 1e-3) / 1e12
    return out


def _tiny_ceiling_path() -> str:
    """The ceilings' operations at a tiny size on the CPU, so a dry run exercises them."""
    a = torch.randn(1024, dtype=torch.bfloat16)
    b = torch.empty_like(a)
    b.copy_(a)
    b.fill_(1.0)
    m = torch.randn(16, 16, dtype=torch.bfloat16)
    _ = m @ m
    return "copy, fill and matmul ran at a tiny size on the CPU"


def add_git_sha_argument(parser) -> None:
    """--git-sha: the commit of a tree without .git (a copy sent to a GPU machine;
    benchmarks/gpu_validate.sh passes it)."""
    parser.add_argument(
        "--git-sha", default="", help="the tree's commit, recorded where it has no .git"
    )


def environment(git_sha: str = "") -> dict:
    """posenc_fast.cli._environment.describe() (GPU name, driver, CUDA, torch, triton, git
    SHA ...). Where the tree has no .git (a copy sent to a GPU machine), the SHA is
    ``git_sha`` when given (the scripts' --git-sha)."""
    try:
        from posenc_fast.cli._environment import describe

        env = describe()
    except Exception as exc:  # the CLI is another module's; never fail the run on it
        env = {"torch": torch.__version__, "describe_error": repr(exc)}
    if env.get("git_sha", "unknown") == "unknown" and git_sha:
        env["git_sha"] = f"{git_sha} (--git-sha)"
    return env


@contextlib.contextmanager
def forced_floater_layout(layout: str | None):
    """The CUDA FLOATER integrator's layout forced within the block ("mode,C,Sg[,resident
    [,staged]]", through the CUDA module's set_development_options: csrc/README.md); None
    or "": the automatic choice, nothing changed."""
    if not layout:
        yield
        return
    from posenc_fast import _extension

    cuda = _extension.load("cuda")
    if cuda is None:
        raise RuntimeError(f"a forced layout needs the CUDA module: {_extension.reasons('cuda')}")
    before = cuda.set_development_options(floater_layout=layout)["floater_layout"]
    try:
        yield
    finally:
        cuda.set_development_options(floater_layout=before)


def default_out(name: str, env: dict) -> str:
    """benchmarks/results/<name>_<gpu>_<sha>.json"""
    sha = str(env.get("git_sha", "unknown"))[:12]
    gpu = str(env.get("gpu", "cpu-dry-run")).replace(" ", "-")
    return os.path.join(RESULTS, f"{name}_{gpu}_{sha}.json")


def write_json(report: dict, path: str) -> None:
    """Atomically: a run killed mid-write keeps the previous complete file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1, default=str)
    os.replace(tmp, path)
