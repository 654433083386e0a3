"""The Triton kernels compile for the H200 (sm_90) -- checked without a GPU -- and the
GPU benchmark script's dry run works.

The interpreter (which runs every other test in CI) executes kernels as Python and
accepts code the compiler rejects; this runs Triton's own compiler and the ptxas bundled
with the triton wheel on the GPU configurations (posenc_fast.triton_kernels.compile_report
--quick), in a subprocess because the interpreter must be off there.
"""

import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

_PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(_PTXAS), reason="triton's bundled ptxas is missing")
def test_kernels_compile_for_sm90_without_approximate_trig(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    proc = subprocess.run(
        [sys.executable, "-m", "posenc_fast.triton_kernels.compile_report", "--quick"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, report[-4000:]
    compiled = [line for line in proc.stdout.splitlines() if line.startswith("ok  ")]
    # lff forward and backward (3 shapes each, plus relu's SPLIT pair), features-only
    # pair, reduction, encodings (2 forward variants, 2 backward): 15 kernels
    assert len(compiled) >= 15, report[-4000:]
    assert "wgmma" in proc.stdout, "the bf16 MLP should use Hopper's warpgroup MMA"


@pytest.mark.slow
def test_gpu_benchmark_script_dry_run(tmp_path):
    """benchmarks/lff_gpu.py must run unchanged on the H200: its CPU dry run (interpreter,
    tiny sizes) exercises every code path but the CUDA-only timing and ceilings."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "dry.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(root, "benchmarks", "lff_gpu.py"), "--dry-run",
         "--cases", "canonical", "--modes", "fwd,bwd", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    import json

    rows = json.loads(out.read_text())["results"]
    triton_rows = [r for r in rows if r["impl"] == "triton"]
    assert {r["mode"] for r in triton_rows} == {"fwd", "bwd"}
    assert all(r["correctness"]["check"] == "ok" and "ms" in r for r in triton_rows), triton_rows
