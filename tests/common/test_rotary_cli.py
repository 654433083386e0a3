"""Rotary LFF in ``python -m posenc_fast bench --ops rotary`` (which took over the CPU mode
of benchmarks/rotary.py) and benchmarks/rotary.py's dry run (its GPU script)."""

import importlib.util
import json
import os
from argparse import Namespace

import torch

from posenc_fast.cli import _cases, bench

BENCHMARKS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")


def _module(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCHMARKS, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _bench_args(**kw):
    args = dict(device="cpu", quick=True, ops="rotary", modes="fwd,fwd+bwd",
                floater_sizes=None, json=None, plot=None, no_compile=True,
                max_autotune=False, compile_timeout=300.0, min_time=0.01, threads="1",
                families=None)  # fmt: skip
    args.update(kw)
    return Namespace(**args)


def test_rotary_cases_are_the_former_scripts():
    """LightGlue's and the ViT's sizes; --quick: LightGlue's in float32; the full set also
    in bfloat16 (benchmarks/RESULTS.md's table); "all" leaves rotary out (it runs when named)."""
    assert _cases.ROTARY_SIZES == {
        "lightglue-512": (1, 512, 4, 64),
        "lightglue-2048": (1, 2048, 4, 64),
        "vit-1024": (8, 1024, 12, 64),
    }
    quick = _cases.cases(True, "cpu", ["rotary"])
    assert [(c.op, c.sizes["N"], c.sizes["dtype"]) for c in quick[:2]] == [
        ("rotary", 512, "float32"),
        ("rotary", 2048, "float32"),
    ]
    # then the families (timm's Eva models, FLUX) at ViT-B/16's 224 px, batch 8
    assert [(c.sizes["family"], c.sizes["B"], c.sizes["N"]) for c in quick[2:]] == [
        ("axial", 8, 197), ("mixed", 8, 197), ("dinov3", 8, 201), ("nd", 8, 196),
    ]  # fmt: skip
    full = _cases.cases(False, "cpu", ["rotary"])
    families = {(c.sizes["family"], c.sizes["grid_name"]) for c in full[6:]}
    assert ("nd", "video") in families and ("mixed", "vit448") in families
    assert len(full) == 6 + 12 and all(c.sizes["dtype"] == "float32" for c in full[6:])
    case = quick[0]
    q, k, x = case.args
    assert q.shape == k.shape == (1, 4, 512, 64) and q.stride(-1) == 3  # sliced from qkv
    assert x.shape == (1, 512, 2) and set(case.baselines) == {"eager-rotate"}
    assert "rotary" in bench.KNOWN_OPS and "rotary" not in bench.DEFAULT_OPS


def test_bench_rotary_rows(tmp_path, monkeypatch):
    """A tiny ``bench --ops rotary``: JSON rows like the other ops', every implementation
    (LightGlue's eager code, its cached-table rotation, ours) close to the float64 spec
    in both modes; the renderer's rotary table reads them. No timing is asserted."""
    monkeypatch.setattr(
        _cases, "ROTARY_SIZES", {"lightglue-512": (1, 24, 2, 8), "lightglue-2048": (2, 16, 3, 8)}
    )
    monkeypatch.setattr(_cases, "ROTARY_GRIDS", {"vit224": (2, (3, 4))})
    path = tmp_path / "rotary.json"
    assert bench.run(_bench_args(json=str(path))) == 0
    data = json.loads(path.read_text())
    rows = data["results"]
    assert {r["case"] for r in rows} == {
        "lightglue-512 B=1 N=24 heads=2 head_dim=8 float32",
        "lightglue-2048 B=2 N=16 heads=3 head_dim=8 float32",
        *(f"{f} vit224 B=2 grid=3x4 prefix={p} heads=12 head_dim=64 float32"
          for f, p in (("axial", 1), ("mixed", 1), ("dinov3", 5), ("nd", 0))),
    }  # fmt: skip
    impls = {r["impl"] for r in rows}
    assert {"eager", "eager-rotate", "torch"} <= impls and "compile" not in impls
    per_case = 2 + len(_cases.rotary_case("lightglue-512", "cpu").backends)
    per_family = 1 + len(_cases.rotary_family_case("nd", "vit224", "cpu").backends)
    assert len(rows) == 2 * (2 * per_case + 4 * per_family)  # modes x cases x implementations
    for r in rows:
        assert r["op"] == "rotary" and r["mode"] in ("fwd", "fwd+bwd") and r["threads"] == 1
        assert not r["error"], r
        assert r["ms"] > 0 and r["peak_bytes"] >= 0 and r["floor_ms"] > 0
        assert r["sizes"]["M"] == (3 if r["sizes"]["family"] == "nd" else 2)
        assert r["sizes"]["dtype"] == "float32"
        assert r["max_err_vs_spec"] < 1e-5 and r["max_diff_vs_ours"] < 1e-5, r
    render = _module("render_cpu_table")
    table = render.op_table(data, "rotary")
    assert "| 1 | lightglue-512 B=1 N=24 heads=2 head_dim=8 float32 | fwd+bwd |" in table
    assert ("cpp vs eager-rotate" in table) == ("cpp" in impls)
    md = render.render(data)
    assert "Rotary LFF (LightGlue), median ms" in md
    # the families against their goals (no compile here: its columns are empty)
    families = render.rotary_family_table(data)
    assert families.count("\n") == 2 + 4 - 1 and "| 1 | mixed | vit224 B=2 grid=3x4" in families
    assert "Rotary families against their goals" in md
    # the CPU goals are the LFF and table ops': rotary rows decide none of them
    assert "| torch backend >= 1.0x eager (every size, fwd and fwd+bwd) | pending" in md


def test_bench_rotary_bfloat16_case():
    """bfloat16 q and k: ours in bfloat16, LightGlue's eager code in float32 (its table is),
    both against the same spec."""
    case = _cases.rotary_case("x", "cpu", torch.bfloat16, sizes=(1, 8, 2, 8))
    accuracy = bench._Accuracy(case)
    eager = bench._impls(case, ())["eager"]
    assert case.eager(*case.args)[0].dtype == torch.float32
    assert accuracy.of(eager)["max_err_vs_spec"] < 1e-5
    ours = accuracy.ours
    assert float((ours - accuracy.spec).abs().max()) < 0.05  # bfloat16 rounding of q', k'
    grads = bench._runner(case, case.backends["torch"], "fwd+bwd")()
    assert [g.shape for g in grads] == [t.shape for t in case.backends["torch"].leaves]


def test_rotary_script_is_the_gpu_one(tmp_path, monkeypatch, capsys):
    """benchmarks/rotary.py: --dry-run (the GPU pipeline's dry run) writes the JSON that
    summarize_gpu.py's rotary() reads; a CPU timing run points to bench instead."""
    monkeypatch.syspath_prepend(BENCHMARKS)
    rotary = _module("rotary")
    assert rotary.main(["--device", "cpu"]) == 2
    assert "bench --ops rotary" in capsys.readouterr().err
    out = tmp_path / "rotary_gpu.json"
    assert rotary.main(["--dry-run", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["benchmark"] == "rotary" and report["dry_run"]
    res, family = report["results"]
    assert res["case"] == "dry-run" and res["dtype"] == "float32"
    # a tiny RoPE-Mixed case: timm's eager rotation, its compile-free run, ours
    assert family["case"] == "dry-run-mixed" and family["sizes"]["family"] == "mixed"
    assert {"eager", "torch"} <= set(family["impls"]) and report["not_run"] == []
    assert all(e["max_abs_err_vs_float64"] < 1e-5 for e in family["impls"].values())
    assert "fwd+bwd" not in res["impls"]["eager-rotate"]
    assert res["impls"]["eager"]["fwd+bwd"]["ms"] > 0
    summary = _module("summarize_gpu").rotary(report)
    assert {r["impl"] for r in summary["rows"]} >= {"eager", "eager-rotate", "torch"}
    assert all(r["max_abs_err"] < 1e-5 for r in summary["rows"])
    assert summary["rows"][0]["speedups"] is None  # eager: a baseline
    assert rotary.main(["--dry-run", "--out", str(out), "--time-budget", "0"]) == 0
    assert json.loads(out.read_text())["not_run"][-1] == "dry-run-mixed float32"


def test_bench_rejects_unknown_ops(capsys):
    assert bench.run(_bench_args(ops="rotary,nope")) == 2
    assert "rotary" in capsys.readouterr().err
    assert bench.run(_bench_args(families="axial,nope")) == 2
    assert "--families" in capsys.readouterr().err


def test_bench_families_select_rotary_cases():
    sel = bench.select(_bench_args(families="mixed,nd"))
    assert [c.sizes["family"] for c in sel.cases] == ["mixed", "nd"]
    assert len(bench.select(_bench_args()).cases) == 2 + 4  # LightGlue's and the families'
