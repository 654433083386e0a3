"""The Triton kernels compile for the A100 (sm_80) and the H100/H200 (sm_90) -- checked
without a GPU -- and the GPU benchmark script's dry run works.

The interpreter (which runs every other test in CI) executes kernels as Python and
accepts code the compiler rejects; the compile test runs Triton's own compiler and the
ptxas bundled with the triton wheel on the GPU configurations, in a subprocess because the
interpreter must be off there. It takes minutes of CPU and its answer depends only on
triton_kernels/ and the Triton version, so the suite leaves it to tools/checked_sources.py
(the check "triton"), which runs it whenever those changed since its last recorded pass;
POSENC_FAST_COMPILE_TEST=1 runs it here. The full report (every configuration, sm_80 ..
sm_120) is `python tools/triton_compile_report.py`.
"""

import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(_PTXAS), reason="triton's bundled ptxas is missing")
@pytest.mark.skipif(
    os.environ.get("POSENC_FAST_COMPILE_TEST") != "1",
    reason="minutes of CPU: `python tools/checked_sources.py run triton` runs it when "
    "triton_kernels/ or Triton changed (CI does); POSENC_FAST_COMPILE_TEST=1 runs it here",
)
def test_kernels_compile_for_sm80_and_sm90_without_approximate_trig(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    report_json = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "triton_compile_report.py"), "--quick",
         "--arch", "80,90", "--json", str(report_json)],
        capture_output=True, text=True, env=env, timeout=900,
    )  # fmt: skip
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, report[-4000:]
    import json

    archs = json.loads(report_json.read_text())["archs"]
    assert set(archs) == {"sm_80", "sm_90"}
    for arch, result in archs.items():
        # lff forward and backward (4 shapes each, plus relu's SPLIT pair), features-only
        # pair, reduction, encodings (2 forward variants, 2 backward): 17 kernels
        assert len(result["compiled"]) >= 17 and not result["failed"], (arch, report[-4000:])
        assert f"{arch}: {len(result['compiled'])} compiled" in proc.stdout
    sm90 = proc.stdout.split("== sm_90")[1]
    assert "wgmma" in sm90, "the bf16 MLP should use Hopper's warpgroup MMA"


@pytest.mark.slow
def test_gpu_benchmark_script_dry_run(tmp_path):
    """benchmarks/lff_gpu.py must run unchanged on the H200: its CPU dry run (interpreter,
    tiny sizes) exercises every code path but the CUDA-only timing and ceilings."""
    out = tmp_path / "dry.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "lff_gpu.py"), "--dry-run",
         "--cases", "canonical", "--modes", "fwd,bwd", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    import json

    rows = json.loads(out.read_text())["results"]
    # auto (with the plan it chose) and both plans, each checked against float64 and timed
    # (a plan that is auto's choice carries auto's figures)
    for impl in ("auto", "fused", "gemm"):
        got = [r for r in rows if r["impl"] == impl]
        assert {r["mode"] for r in got} == {"fwd", "bwd"}, impl
        assert all(r["correctness"]["check"] == "ok" and "ms" in r for r in got), got
    auto = [r for r in rows if r["impl"] == "auto"]
    assert all(r["plan"] in ("fused", "gemm") and r["plan_why"] for r in auto), auto
