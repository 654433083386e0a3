"""The pytest-benchmark suite (benchmarks/test_bench.py) runs: its tiny case, in a
subprocess, as a user runs it; and the suite's test command does not collect it."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("pytest_benchmark", reason="pytest-benchmark is in the test extra")

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_tiny_benchmark_runs_with_floors_and_errors(tmp_path):
    """`pytest benchmarks/ --benchmark-only -k tiny` (without torch.compile, tens of
    seconds on 2 cores): every group holds eager and ours, with the floor and the error
    against the float64 spec in extra_info."""
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable, "-m", "pytest", "benchmarks/", "--benchmark-only", "-q",
        "-p", "no:cacheprovider", "-k", "tiny and not compile",
        "--benchmark-max-time=0.02", "--benchmark-min-rounds=3", "--benchmark-warmup=off",
        f"--benchmark-json={out}",
    ]  # fmt: skip
    # as a user runs it: not inside this suite's worker (pytest-benchmark turns itself off
    # in a process that PYTEST_XDIST_WORKER says is an xdist worker)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    groups: dict = {}
    for b in report["benchmarks"]:
        groups.setdefault(b["group"], {})[b["extra_info"]["impl"]] = b
    assert len(groups) == 2, sorted(groups)  # fwd and fwd+bwd
    for group, impls in groups.items():
        assert "eager" in impls and {"torch", "cpp"} & set(impls), (group, sorted(impls))
        for impl, b in impls.items():
            info = b["extra_info"]
            assert info["floor_ms"] > 0 and info["floor_bytes"] > 0, (group, impl, info)
            assert info["pct_of_floor"] > 0, (group, impl, info)
            assert info["max_err_vs_spec"] < 1e-6, (group, impl, info)
            assert b["stats"]["median"] > 0


def test_the_suite_does_not_collect_the_benchmarks():
    """`pytest -q` at the root collects tests/ only (pyproject's testpaths): the
    benchmarks run only when asked for."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - the package supports 3.9, CI runs 3.11
        pytest.skip("tomllib is Python 3.11+")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    paths = config["tool"]["pytest"]["ini_options"]["testpaths"]
    assert paths == ["tests"], paths
    bench = sorted(p.name for p in (ROOT / "benchmarks").glob("test_*.py"))
    assert bench == ["test_bench.py"], bench
    assert not any((ROOT / "tests").rglob("test_bench.py"))
