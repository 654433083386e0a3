"""The command line: info, verify (including its failure path), and the bench machinery."""

import json
import os
import subprocess
import sys
from argparse import Namespace

import pytest
import torch

from posenc_fast.cli import _cases, bench, verify


def _run_cli(*args, env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run(
        [sys.executable, "-m", "posenc_fast", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def test_info_lists_every_backend_and_why():
    out = _run_cli("info", env_extra={"TRITON_INTERPRET": "0"})
    assert out.returncode == 0, out.stderr
    for name in ("reference", "torch", "triton", "cuda", "cpp"):
        assert f"  {name}" in out.stdout
    # without a GPU and without the interpreter, triton says why it is unavailable
    assert "triton     unavailable: no CUDA device and TRITON_INTERPRET is not set" in out.stdout
    js = _run_cli("info", "--json", env_extra={"TRITON_INTERPRET": "0"})
    data = json.loads(js.stdout)
    assert data["backends"]["torch"] == [] and data["backends"]["triton"]
    assert data["environment"]["torch"] == torch.__version__


def test_verify_passes_and_prints_seed(capsys):
    code = verify.run(Namespace(device="cpu", seed=1234, ops="encoding"))
    out = capsys.readouterr().out
    assert code == 0, out
    assert "seed 1234" in out and "PASS  encoding  torch" in out


def test_verify_fails_on_a_wrong_backend(monkeypatch, capsys):
    from posenc_fast.backends import torch_backend

    orig = torch_backend.TorchBackend.encoding_forward

    def off_by_a_little(*args, **kwargs):
        return orig(*args, **kwargs) + 1e-3

    monkeypatch.setattr(
        torch_backend.TorchBackend, "encoding_forward", staticmethod(off_by_a_little)
    )
    code = verify.run(Namespace(device="cpu", seed=5, ops="encoding"))
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL  encoding  torch" in out and "exceed" in out


def test_verify_reports_a_raising_backend_and_goes_on(monkeypatch, capsys):
    """A backend that raises (e.g. an interpreter bug) is a FAIL line with the error, exit
    status 1, and every other backend / dtype is still checked."""
    from posenc_fast.backends import torch_backend

    def broken(*args, **kwargs):
        raise RuntimeError("simulated kernel failure\nits last line")

    monkeypatch.setattr(torch_backend.TorchBackend, "encoding_forward", staticmethod(broken))
    code = verify.run(Namespace(device="cpu", seed=5, ops="encoding"))
    out = capsys.readouterr().out
    assert code == 1, out
    failed = [ln for ln in out.splitlines() if ln.startswith("FAIL  encoding  torch")]
    assert len(failed) == 4, out  # float32, float64, bfloat16, float16: it went on
    assert "raised RuntimeError: its last line" in out


def test_verify_rejects_unknown_op(capsys):
    assert verify.run(Namespace(device="cpu", seed=1, ops="nope")) == 2


def test_bench_machinery_table_json_plot(tmp_path):
    cases = [
        _cases.encoding_case("sinusoidal", 64, 8, "cpu"),
        _cases.encoding_case("sinusoidal", 256, 8, "cpu"),
        _cases.lff_case(32, 2, 1, 8, 4, 6, "cpu"),
        _cases.encoding_add_case("dft", 2, 16, 8, "cpu"),
    ]
    results = bench.measure(cases, ["fwd", "fwd+bwd"], "cpu", min_time=0.01, compile_baseline=False)
    impls = {r["impl"] for r in results}
    assert {"reference", "torch"} <= impls
    for r in results:
        assert not r["error"], r
        assert r["ms"] > 0 and r["ms_p20"] <= r["ms"] <= r["ms_p80"]
        assert r["speedup_vs_reference"] > 0 and r["peak_bytes"] >= 0
    text = bench.table(results)
    assert "sinusoidal  N=64 dim=8 float32  [fwd]" in text and "vs compile" in text
    png = tmp_path / "bench.png"
    bench.plot(results, str(png))
    assert png.stat().st_size > 1000


def test_peak_memory_counts_temporaries():
    from posenc_fast.cli._timing import peak_bytes_cpu

    def work():
        a = torch.ones(1 << 20)  # 4 MiB
        b = a * 2  # 4 MiB more while a is alive
        del a
        return b.sum()

    peak = peak_bytes_cpu(work)
    assert 8 * 2**20 <= peak < 9 * 2**20


@pytest.mark.slow
def test_bench_cli_end_to_end_with_compile_baseline(tmp_path, monkeypatch):
    """The real CLI path, torch.compile baseline included, on a shrunken size set."""
    small = [_cases.encoding_case("dft", 128, 8, "cpu")]
    monkeypatch.setattr(_cases, "cases", lambda quick, device, ops: small)
    path = tmp_path / "r.json"
    args = Namespace(
        device="cpu",
        quick=True,
        ops="dft",
        modes="fwd",
        json=str(path),
        plot=None,
        no_compile=False,
        max_autotune=False,
        min_time=0.01,
    )
    assert bench.run(args) == 0
    data = json.loads(path.read_text())
    assert data["environment"]["git_sha"] and data["environment"]["torch"] == torch.__version__
    by_impl = {r["impl"]: r for r in data["results"]}
    assert {"reference", "compile", "torch"} <= set(by_impl)
    assert by_impl["compile"]["speedup_vs_compile"] == pytest.approx(1.0)
