"""FLOATER's part of ``python -m posenc_fast verify`` (cli/verify.py) and ``bench``
(cli/_cases.py)."""

import importlib.util
import json
import os
from argparse import Namespace

import pytest
import torch
from conftest import backend_params

from posenc_fast.cli import _cases, _inputs, bench, verify


@pytest.mark.parametrize("backend", backend_params("floater"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_verify_check_passes(backend, dtype, device):
    res = verify.check_floater(backend, dtype, device, seed=17)
    assert res.cases == len(_inputs.FLOATER_CASES) + 1
    assert not res.failures, res.failures[:3]
    assert 0 < res.fwd_err < 1e-4 and 0 < res.grad_err < 1e-4


def test_verify_check_catches_a_wrong_backend(monkeypatch, device):
    """The check must be able to fail: a backend integrating with one substep too few."""
    from posenc_fast.ops.floater.registry import FLOATER

    forward = FLOATER["torch"].forward

    def wrong(p0, w1, b1, w2, b2, times, options):
        fewer = options._replace(substeps=max(1, options.substeps - 1))
        return forward(p0, w1, b1, w2, b2, times, fewer)

    monkeypatch.setattr(FLOATER["torch"], "forward", wrong)
    res = verify.check_floater("torch", torch.float64, device, seed=3)
    assert res.failures


def test_bench_case_implementations_agree(device):
    """Every implementation of a bench case (backends, torchdiffeq odeint and
    odeint_adjoint, the plain loop) integrates the same problem on the same steps."""
    pytest.importorskip("torchdiffeq")
    case = _cases.floater_case(8, 4, device)
    assert "torch" in case.backends
    assert {"torchdiffeq", "torchdiffeq-adjoint"} <= set(case.baselines)
    assert _cases.agreement(case) == ""
    adjoint = case.baselines["torchdiffeq-adjoint"]
    out = adjoint.fn()
    grads = torch.autograd.grad(out, adjoint.leaves, torch.ones_like(out))  # it runs backwards
    assert all(g is not None and g.abs().sum() > 0 for g in grads)


def test_bench_sizes():
    cases = _cases.floater_cases(quick=False, device="cpu")
    assert sorted((c.sizes["L"], c.sizes["d"]) for c in cases) == [
        (64, 16),
        (64, 128),
        (512, 16),
        (512, 128),
    ]
    assert all(c.op == "floater" and c.sizes["method"] == "rk38" for c in cases)


def _bench_args(**kw):
    args = dict(device="cpu", quick=True, ops="floater", modes="fwd", floater_sizes=None,
                json=None, plot=None, no_compile=True, max_autotune=False,
                compile_timeout=300.0, min_time=0.01, threads="1")  # fmt: skip
    args.update(kw)
    return Namespace(**args)


def test_bench_floater_sizes_option(tmp_path):
    """``bench --floater-sizes`` (which replaced benchmarks/floater_cpu.py's --sizes and
    --length) runs exactly the given (L, d = H) cases; the renderer's FLOATER table reads
    the JSON it writes."""
    assert bench.floater_sizes_from("8x4, 6x3") == [(8, 4), (6, 3)]
    assert bench.floater_sizes_from(None) is None
    for bad in ("8", "8x", "0x4", "8x4x2", "ax4"):
        with pytest.raises(ValueError, match="LxD"):
            bench.floater_sizes_from(bad)
    assert [c.sizes["L"] for c in _cases.floater_cases(True, "cpu", [(8, 4)])] == [8]
    path = tmp_path / "floater.json"
    assert bench.run(_bench_args(floater_sizes="8x4,6x3", json=str(path))) == 0
    data = json.loads(path.read_text())
    rows = data["results"]
    assert {(r["sizes"]["L"], r["sizes"]["d"], r["sizes"]["H"]) for r in rows} == {
        (8, 4, 4),
        (6, 3, 3),
    }
    assert all(r["op"] == "floater" and r["mode"] == "fwd" for r in rows)
    impls = {r["impl"] for r in rows}
    assert {"eager", "torch"} <= impls and "compile" not in impls
    assert all(r["error"] or r["max_err_vs_spec"] < 1e-4 for r in rows)
    # the renderer of the benchmark tables (benchmarks/render_cpu_table.py)
    path_r = os.path.join(
        os.path.dirname(__file__), "..", "..", "benchmarks", "render_cpu_table.py"
    )
    spec = importlib.util.spec_from_file_location("render_cpu_table", path_r)
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    table = render.op_table(data, "floater")
    assert "| 1 | S=12 L=8 d=4 H=4 K=5 rk38 float32 | fwd |" in table
    assert ("cpp vs torch" in table) == ("cpp" in impls)
    assert "FLOATER, median ms" in render.render(data)
    assert render.op_table({"results": [r for r in rows if r["op"] != "floater"]}, "floater") == ""


def test_bench_floater_sizes_needs_floater(capsys):
    assert bench.run(_bench_args(ops="lff", floater_sizes="8x4")) == 2
    assert "--floater-sizes needs floater" in capsys.readouterr().err
    assert bench.run(_bench_args(floater_sizes="8by4")) == 2
