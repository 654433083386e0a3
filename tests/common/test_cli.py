"""The command line: info, verify (including its failure path), and the bench machinery."""

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from argparse import Namespace

import pytest
import torch

from posenc_fast.cli import _baselines, _cases, _inputs, bench, verify
from posenc_fast.ops.encodings import reference as enc_ref
from posenc_fast.ops.lff import reference as lff_ref
from posenc_fast.tolerances import PHASE_ATOL, assert_close


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
    from posenc_fast.ops.encodings.registry import ENCODING

    orig = ENCODING["torch"].forward

    def off_by_a_little(*args, **kwargs):
        return orig(*args, **kwargs) + 1e-3

    monkeypatch.setattr(ENCODING["torch"], "forward", off_by_a_little)
    code = verify.run(Namespace(device="cpu", seed=5, ops="encoding"))
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL  encoding  torch" in out and "exceed" in out


def test_verify_reports_a_raising_backend_and_goes_on(monkeypatch, capsys):
    """A backend that raises (e.g. an interpreter bug) is a FAIL line with the error, exit
    status 1, and every other backend / dtype is still checked."""
    from posenc_fast.ops.encodings.registry import ENCODING

    def broken(*args, **kwargs):
        raise RuntimeError("simulated kernel failure\nits last line")

    monkeypatch.setattr(ENCODING["torch"], "forward", broken)
    code = verify.run(Namespace(device="cpu", seed=5, ops="encoding"))
    out = capsys.readouterr().out
    assert code == 1, out
    failed = [ln for ln in out.splitlines() if ln.startswith("FAIL  encoding  torch")]
    assert len(failed) == 4, out  # float32, float64, bfloat16, float16: it went on
    assert "raised RuntimeError: its last line" in out


def test_verify_checks_sine_nd_and_catches_a_wrong_add(monkeypatch, capsys):
    code = verify.run(Namespace(device="cpu", seed=7, ops="encoding_nd"))
    out = capsys.readouterr().out
    assert code == 0, out
    assert "PASS  encoding_nd torch   float32" in out

    from posenc_fast.ops.encodings.registry import ENCODING_ND

    orig = ENCODING_ND["torch"].forward

    def swapped_axes(x, coords, kind, base):  # axis 0 and 1 exchanged
        return orig(x, coords.flip(-1), kind, base)

    monkeypatch.setattr(ENCODING_ND["torch"], "forward", swapped_axes)
    code = verify.run(Namespace(device="cpu", seed=7, ops="encoding_nd"))
    out = capsys.readouterr().out
    assert code == 1, out
    assert "FAIL  encoding_nd torch   float32" in out and "fused add" in out


def test_verify_rejects_unknown_op(capsys):
    assert verify.run(Namespace(device="cpu", seed=1, ops="nope")) == 2


def test_bench_machinery_table_json_plot(tmp_path):
    cases = [
        _cases.encoding_case("sinusoidal", 64, 8, "cpu"),
        _cases.encoding_case("sinusoidal", 256, 8, "cpu"),
        _cases.lff_case(32, 2, 1, 8, 4, 6, "cpu"),
        _cases.encoding_add_case("dft", 2, 16, 8, "cpu"),
    ]
    settings = [bench.Setting(1), bench.Setting(2)]
    report = bench.measure(cases, ["fwd", "fwd+bwd"], "cpu", 0.01, (), settings)
    results = report["results"]
    assert [s["threads"] for s in report["settings"]] == [1, 2]
    for s in report["settings"]:
        m = s["machine"]
        assert m["bandwidth_gbps"] > 0 and set(m["gemm_gflops"]) == {"8x4", "4x6"}
    per_case = [1 + len(c.baselines) + len(c.backends) for c in cases]  # eager, others, ours
    assert len(results) == 2 * 2 * sum(per_case)  # settings x modes x implementations
    assert {"eager", "eager-cached", "torch"} <= {r["impl"] for r in results}
    for r in results:
        assert not r["error"], r
        assert r["ms"] > 0 and r["ms_p20"] <= r["ms"] <= r["ms_p80"]
        assert r["speedup_vs_eager"] > 0 and r["peak_bytes"] >= 0
        assert r["floor_ms"] > 0 and r["pct_of_floor"] > 0
        # every implementation computes the same function: small errors, recorded
        assert r["max_err_vs_spec"] < 1e-4 and r["max_diff_vs_ours"] < 1e-4
    lff_fwd = next(r for r in results if r["op"] == "lff" and r["mode"] == "fwd")
    assert lff_fwd["floor_gflop"] == pytest.approx(2 * 32 * (8 * 4 + 4 * 6) / 1e9)
    text = bench.table(report)
    assert "=== 1 thread(s)" in text and "=== 2 thread(s)" in text
    assert "sinusoidal  N=64 dim=8 float32  [fwd]  floor" in text and "vs eager" in text
    md = _render_module().render({"environment": {}, **report})
    assert "#### 1 thread" in md and "#### 2 threads" in md
    assert "| LFF N=32 M=2 G=1 F=8 H=4 D=6 | fwd+bwd |" in md
    assert "| CPU goal | this run |" in md
    assert "| torch backend >= 1.0x eager (every size, fwd and fwd+bwd) | " in md
    assert "cpp >= 2x eager" in md  # goals of a backend missing here: "pending"
    png = tmp_path / "bench.png"
    bench.plot(results, str(png))
    assert png.stat().st_size > 1000


def _render_module():
    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "render_cpu_table.py")
    spec = importlib.util.spec_from_file_location("render_cpu_table", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_settings_from_flags():
    assert bench.settings_from("1,2") == [bench.Setting(1), bench.Setting(2)]
    assert bench.settings_from(None) == [bench.Setting(torch.get_num_threads())]
    with pytest.raises(ValueError, match="positive"):
        bench.settings_from("0,2")


def test_bench_command_line_has_no_lab_options():
    """The lab's options (contention, the floors' history) are benchmarks/cpu_lab.py's."""
    from posenc_fast.cli import _parser

    args = _parser().parse_args(["bench", "--quick"])
    assert not hasattr(args, "contention") and not hasattr(args, "history")
    with pytest.raises(SystemExit):
        _parser().parse_args(["bench", "--contention"])


def test_a_setting_context_holds_during_its_timings():
    """A setting's context (the lab's busy process) is entered around its timings and what
    it yields is recorded with the setting."""
    import contextlib

    seen = []

    @contextlib.contextmanager
    def around():
        seen.append("in")
        yield {"busy_pid": 1}
        seen.append("out")

    case = _cases.encoding_case("sinusoidal", 64, 8, "cpu")
    report = bench.measure([case], ["fwd"], "cpu", 0.01, (), [bench.Setting(1, True, around)])
    assert seen == ["in", "out"]
    assert report["settings"][0]["busy_pid"] == 1 and report["settings"][0]["contention"]
    assert all(r["contention"] for r in report["results"])


def test_time_box_interrupts_a_long_compilation():
    with pytest.raises(bench.CompileTimeout, match="0.2 s"), bench.time_box(0.2):
        while True:  # stands for a max-autotune compilation that does not finish
            time.sleep(0.01)
    with bench.time_box(5.0):
        pass  # no alarm left behind


def _phase_tol(max_phase: float) -> float:
    """float32 tolerance of an eager form: the features' 1e-6 plus the float32 rounding
    of its phases (a few ulps of the largest phase), which the eager forms carry."""
    return PHASE_ATOL + 4 * torch.finfo(torch.float32).eps * max_phase


def test_eager_baselines_compute_the_spec():
    """The baselines compute the same function as our ops: against the float64 reference
    on fresh inputs with moderate phases (at large phases they carry float32 rounding)."""
    case = _inputs.LffCase((97,), 2, 2, 64, 16, 24)
    x, wr, w1, b1, w2, b2 = _inputs.lff_inputs(case, torch.float32, "cpu", seed=5)
    got = _baselines.EagerLFF.from_weights(wr, w1, b1, w2, b2)(x)
    assert_close(got, lff_ref.lff(x, wr, w1, b1, w2, b2), torch.float32, "lff", what="LFF")

    g = _inputs.generator(6)
    p = _inputs.rand((300,), g, -8.0, 8.0)
    x3 = _inputs.randn((2, 40, 24), g)
    for kind, ref in (("sinusoidal", enc_ref.sinusoidal), ("dft", enc_ref.dft)):
        table = _baselines.table_module(kind, 24)
        err = (table(p).double() - ref(p, 24)).abs().max()
        assert err <= _phase_tol(8.0 * math.pi), (kind, err)
        want = x3.double() + ref(torch.arange(40), 24)
        for add in (
            _baselines.EagerAdd(table),
            _baselines.EagerCachedAdd(table, 64, torch.float32),
        ):
            err = (add(x3).double() - want).abs().max()
            assert err <= _phase_tol(40.0 * math.pi), (kind, type(add).__name__, err)


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
        floater_sizes=None,
        json=str(path),
        plot=None,
        no_compile=False,
        max_autotune=False,
        compile_timeout=300.0,
        min_time=0.01,
        threads="1",
    )
    assert bench.run(args) == 0
    data = json.loads(path.read_text())
    assert data["environment"]["git_sha"] and data["environment"]["torch"] == torch.__version__
    assert data["settings"][0]["threads"] == 1 and data["settings"][0]["machine"]["fill_gbps"] > 0
    by_impl = {(r["impl"], r["contention"]): r for r in data["results"]}
    assert {("eager", False), ("compile", False), ("torch", False)} <= set(by_impl)
    assert by_impl[("compile", False)]["speedup_vs_compile"] == pytest.approx(1.0)
    assert "reliability" not in data  # the lab's (benchmarks/cpu_lab.py)
