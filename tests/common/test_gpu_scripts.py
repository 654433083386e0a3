"""The H200 session's scripts work before they reach the GPU: benchmarks/floater_gpu.py,
benchmarks/gpu_validate.sh and benchmarks/summarize_gpu.py, through their CPU dry runs
(tiny sizes, the C++ backend as the subject, no build, no CUDA graphs)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "benchmarks")
SCRIPT = os.path.join(BENCH, "gpu_validate.sh")
GATE = "POSENC_FAST_CUDA_UNVALIDATED"


def _module(name):
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # before running it: dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _env(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "POSENC_FAST_TEST_DEVICE")}
    env.update({"OUT": str(tmp_path), "PYTHON": sys.executable})
    env.update(extra)
    return env


def _run(args, tmp_path, timeout=120, **extra):
    return subprocess.run(
        ["bash", SCRIPT, *args],
        cwd=ROOT,
        env=_env(tmp_path, **extra),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _stages(tmp_path) -> list[dict]:
    path = tmp_path / "stages.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []


# ---------------------------------------------------------------- floater_gpu.py


def test_floater_gpu_dry_run(tmp_path, monkeypatch):
    """Every implementation (graphed loop run eagerly) measured on two lengths, the
    second estimated from the first; the baselines integrate the same problem as the
    subject; the subject passes its float64 check; every goal has a value."""
    monkeypatch.delenv(GATE, raising=False)  # main() sets it; restored afterwards
    fg = _module("floater_gpu")
    out = tmp_path / "f.json"
    assert fg.main(["--dry-run", "--lengths", "5,9", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["complete"] and report["dry_run"] and report["environment"]["git_sha"]
    assert [c["L"] for c in report["cases"]] == [5, 9]
    subject = report["subject"]
    for case in report["cases"]:
        assert all(c["check"] == "ok" for c in case["checks"].values()), case["checks"]
        rows = case["rows"]
        assert not [r for r in rows if "ms" not in r], [r for r in rows if "ms" not in r]
        impls = {(r["impl"], r["mode"], r["method"]) for r in rows}
        for impl in ("torch", "graph", "torchdiffeq", "adjoint"):
            assert {(impl, "fwd", "rk38"), (impl, "bwd", "rk38")} <= impls
        assert {(subject, m, meth) for m in ("fwd", "bwd") for meth in ("rk38", "rk4")} <= impls
        for r in rows:
            if r["impl"] != subject:
                # the continuous adjoint's gradients differ from the discrete ones a bit
                assert r["vs_subject"]["max_rel_diff"] < 1e-3, r
        assert all(g["value"] is not None for g in case["goals"].values()), case["goals"]
    second = report["cases"][1]["rows"]
    assert any("measured at L=5" in r.get("estimate", {}).get("from", "") for r in second)


def test_floater_gpu_guard_skips_and_records(tmp_path, monkeypatch):
    """A limit below every estimate: each baseline is skipped with its reason and
    estimate (never timed, never guessed), and the goals that need them are pending."""
    monkeypatch.delenv(GATE, raising=False)
    fg = _module("floater_gpu")
    out = tmp_path / "f.json"
    argv = ["--dry-run", "--lengths", "5", "--methods", "rk38", "--out", str(out)]
    assert fg.main([*argv, "--max-seconds-per-impl", "1e-9"]) == 0
    report = json.loads(out.read_text())
    case = report["cases"][0]
    baseline_rows = [r for r in case["rows"] if r["impl"] in fg.BASELINES]
    want = [m for m in fg.MEASUREMENTS if m[0] in report["config"]["impls"]]
    assert len(baseline_rows) == len(want) and all("ms" not in r for r in baseline_rows)
    assert all("--max-seconds-per-impl" in r["skipped"] for r in baseline_rows), baseline_rows
    assert all("probe on 3 sample times" in r["estimate"]["from"] for r in baseline_rows)
    goals = case["goals"]
    assert goals["fwd_vs_torchdiffeq"]["value"] is None and goals["fwd_vs_torchdiffeq"]["pending"]
    assert goals["bwd_over_fwd"]["value"] is not None  # the subject alone
    # no time left: skipped before any probe runs
    assert fg.main([*argv, "--time-budget", "1e-9", "--impls", "cuda,torchdiffeq"]) == 0
    rows = json.loads(out.read_text())["cases"][0]["rows"]
    skipped = [r for r in rows if r["impl"] == "torchdiffeq"]
    assert skipped and all(r["skipped"].startswith("time budget") for r in skipped)
    assert all("estimate" not in r for r in skipped)


def test_graphed_loop_matches_the_reference():
    """The graphed baseline's loop (run eagerly here) integrates exactly the package's
    problem: the float64 reference on the same inputs."""
    import torch

    from posenc_fast.ops.floater import reference as ref
    from posenc_fast.ops.floater.torch_impl import TABLEAUX

    fg = _module("floater_gpu")
    g = torch.Generator().manual_seed(0)
    S, d, H, L, K = 3, 4, 5, 6, 2
    p0, b1, b2 = (
        torch.randn(S, d, generator=g),
        torch.randn(H, generator=g),
        torch.randn(d, generator=g),
    )
    w1, w2 = torch.randn(d + 1, H, generator=g) / 2, torch.randn(H + 1, d, generator=g) / 2
    times = torch.arange(L, dtype=torch.float64) * 0.1
    for method in ("rk38", "rk4", "midpoint", "euler"):
        stage_t, steps = fg.stage_schedule(times.tolist(), K, TABLEAUX[method])
        args = [t.double() for t in (p0, w1, b1, w2, b2)]
        got = fg.plain_loop(
            *args, torch.tensor(stage_t, dtype=torch.float64), steps, K, TABLEAUX[method]
        )
        want = ref.floater(*args, times, K, method, "relu")
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- summarize_gpu.py


def test_summarize_merges_calls_and_judges_goals(tmp_path):
    sg = _module("summarize_gpu")
    a, b = tmp_path / "call1", tmp_path / "call2"
    a.mkdir()
    b.mkdir()
    (a / "stages.jsonl").write_text('{"stage": "tests", "status": "ok", "seconds": 300}\n')
    (b / "stages.jsonl").write_text('{"stage": "floater", "status": "timeout", "seconds": 400}\n')
    (a / "tests_junit.xml").write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1" time="2.5">'
        '<testcase classname="t" name="a"/><testcase classname="t" name="b">'
        '<failure message="boom"/></testcase><testcase classname="t" name="c">'
        '<skipped message="needs 40 GB"/></testcase></testsuite></testsuites>'
    )
    (b / "compile_report.txt").write_text("ok  k1 wgmma\nok  k2 no mma\nBAD k3  APPROX TRIG\n")
    goals = {
        "fwd_vs_torchdiffeq": {"value": 55.0, "met": True},
        "bwd_vs_adjoint": {"value": None, "pending": "skipped"},
    }
    floater = {
        "benchmark": "benchmarks/floater_gpu.py",
        "subject": "cuda",
        "complete": False,
        "environment": {"gpu": "NVIDIA H200", "git_sha": "abc"},
        "cases": [
            {
                "case": "L=256 S=12 d=H=64",
                "L": 256,
                "rows": [{"impl": "cuda", "mode": "fwd", "method": "rk38", "ms": 1.5}],
                "checks": {"rk38": {"check": "ok"}},
                "goals": goals,
            }
        ],
    }
    (b / "floater_gpu.json").write_text(json.dumps(floater))
    canonical, compute = {"case": "canonical", "N": 1}, {"case": "compute", "N": 1}
    lff_rows = [
        dict(canonical, mode="fwd", impl="triton", ms=0.5, dtype="torch.bfloat16",
             pct_of_floor=90.0, speedup_vs_eager=12.0, speedup_vs_compile=1.5),
        dict(canonical, mode="fwd", impl="compile", ms=0.75),
        dict(canonical, mode="fwd+bwd", impl="triton", ms=1.0, peak_bytes=100),
        dict(canonical, mode="fwd+bwd", impl="eager", ms=3.0, peak_bytes=300),
        dict(compute, mode="bwd", impl="auto", plan="gemm", ms=8.0, speedup_vs_compile=0.8,
             peak_bytes=100),
        dict(compute, mode="bwd", impl="fused", ms=12.0),
        dict(compute, mode="bwd", impl="compile", ms=6.4, peak_bytes=400),
    ]  # fmt: skip
    (a / "lff_gpu.json").write_text(
        json.dumps({"benchmark": "benchmarks/lff_gpu.py", "results": lff_rows})
    )
    (a / "ceilings.json").write_text(
        json.dumps({"benchmark": "gpu_ceilings", "ceilings": {"copy_GBps": 4300.0}})
    )
    (a / "broken.json").write_text("{ truncated")
    out_json, out_md = tmp_path / "s.json", tmp_path / "s.md"
    assert sg.main([str(a), str(b), "--json", str(out_json), "--md", str(out_md)]) == 0
    s = json.loads(out_json.read_text())
    assert [r["stage"] for r in s["stages"]] == ["tests", "floater"]
    t = s["tests"][0]
    assert (t["passed"], t["failures"], t["skipped"]) == (1, 1, 1) and "boom" in t["failed"][0]
    assert s["compile_report"]["compiled_ok"] == 2 and len(s["compile_report"]["approx_trig"]) == 1
    assert s["environment"]["gpu"] == "NVIDIA H200"
    fwd = next(r for r in s["lff"]["rows"] if r["mode"] == "fwd")
    assert fwd["goals"] == {"pct_of_floor": {"value": 90.0, "goal": ">= 85", "met": True}}
    bwd = next(r for r in s["lff"]["rows"] if r["case"] == "compute")
    assert bwd["plan"] == "gemm" and bwd["plans"] == {"fused": 12.0}
    assert bwd["goals"]["vs_compile"]["met"] is False  # 0.8x < 1.2x
    assert bwd["memory_vs_compile"] == 4.0 and bwd["goals"]["memory_vs_compile"]["met"]
    mem = next(r for r in s["lff"]["rows"] if r["mode"] == "fwd+bwd")
    assert mem["memory_vs_eager"] == 3.0 and mem["goals"]["memory_vs_eager"]["met"]
    md = out_md.read_text()
    assert "55.00" in md and "pending" in md and "did not finish" in md and "4300 GB/s" in md


# ---------------------------------------------------------------- gpu_validate.sh


def test_gpu_validate_arguments(tmp_path):
    assert _run([], tmp_path).returncode == 2
    proc = _run(["--dry-run", "bogus"], tmp_path)
    assert proc.returncode == 2 and "unknown stage or preset 'bogus'" in proc.stderr
    assert _run(["--frobnicate"], tmp_path).returncode == 2
    proc = _run(["--list"], tmp_path)
    assert proc.returncode == 0
    assert "preset call2: build ceilings floater summary" in proc.stdout
    proof = "build verify tests ceilings lff floater rotary sanitize summary"
    assert f"preset proof: {proof}" in proc.stdout
    assert "--dry-run" in _run(["--help"], tmp_path).stdout
    # something missing: said before any stage starts
    proc = _run(["--dry-run", "build"], tmp_path, PYTHON="false")
    assert proc.returncode == 2 and "Python module 'torch' is missing" in proc.stdout
    # no time left: every stage is skipped and recorded, and the run fails
    proc = _run(["--dry-run", "build", "summary"], tmp_path, GPU_VALIDATE_DEADLINE="0")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert [(r["stage"], r["status"]) for r in _stages(tmp_path)] == [
        ("build", "skipped"),
        ("summary", "skipped"),
    ]


def test_gpu_validate_failed_stage_is_reported(tmp_path):
    """A stage that fails is recorded as failed and makes the run fail (here: summary of
    an empty folder)."""
    proc = _run(["--dry-run", "summary"], tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert _stages(tmp_path)[0]["status"] == "failed"
    assert "not ok: summary" in proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_validate_dry_run_every_stage(tmp_path):
    """Every stage in its CPU form, in one invocation, as the presets chain them, and the
    files each leaves outside the proof's scratch folder. (The proof's dry run, the test
    above, covers build verify tests ceilings lff floater rotary sanitize summary in its
    own form; running them twice cost CI ~2 minutes, so the stages only `all` and the
    other presets have run here with the shared ones that their files and the summary
    need.)"""
    order = ["build", "tests", "tests-large", "verify", "ceilings", "floater", "lff", "rotary",
             "bench", "compile", "sanitize", "summary"]  # fmt: skip
    assert _run(["--list"], tmp_path).stdout.count(f"preset all: {' '.join(order)}") == 1
    proc = _run(["--dry-run", "build", "tests-large", "floater", "rotary", "bench", "compile",
                 "sanitize", "summary"], tmp_path, timeout=300)  # fmt: skip
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    stages = _stages(tmp_path)
    assert [r["stage"] for r in stages] == [s for s in order if s not in
                                            ("tests", "verify", "ceilings", "lff")]  # fmt: skip
    assert all(r["status"] == "ok" and r["dry_run"] for r in stages), stages
    for name in ("tests_large_junit.xml", "floater_gpu.json", "rotary_gpu.json",
                 "bench_cli.json", "compile_report.txt", "sanitize.json", "summary.json",
                 "summary.md", "gpu_validate.log"):  # fmt: skip
        assert (tmp_path / name).exists(), name
    assert "unpacked: _build_info.json" in log  # the build's pack / unpack path
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["floater"]["complete"] and len(summary["floater"]["cases"]) == 2
    assert {t["file"] for t in summary["tests"]} == {"tests_large_junit.xml"}
    assert all(t["failures"] == 0 and t["passed"] > 0 for t in summary["tests"])
    assert "stage summary: ok" in (tmp_path / "gpu_validate.log").read_text()
    rotary_rows = summary["rotary"]["rows"]
    assert summary["rotary"]["dry_run"] and {r["impl"] for r in rotary_rows} >= {"eager", "torch"}
    assert all(r["max_abs_err"] < 1e-5 for r in rotary_rows), rotary_rows
    assert "Rotary LFF" in (tmp_path / "summary.md").read_text()
    assert summary["sanitize"]["dry_run"] and summary["sanitize"]["clean"], summary["sanitize"]
    # gpu_sanitize.py's workloads ran on the CPU, each checked against the reference
    report = json.loads((tmp_path / "sanitize.json").read_text())
    assert [(r["tool"], r["workload"]) for r in report["runs"]] == [
        ("memcheck", "kernels"), ("racecheck", "floater"), ("synccheck", "floater"),
    ]  # fmt: skip
    ran = report["runs"][0]["ran"]
    for name in ("triton lff", "triton sinusoidal", "triton dft", "triton rotary", "floater"):
        assert any(name in r for r in ran), (name, ran)
    assert "compute-sanitizer (dry run" in (tmp_path / "summary.md").read_text()


# ---------------------------------------------------------------- gpu_sanitize.py

MEMCHECK_CLEAN = "========= COMPUTE-SANITIZER\n   ran: x\n========= ERROR SUMMARY: 0 errors\n"
MEMCHECK_BAD = """========= COMPUTE-SANITIZER
========= Invalid __global__ read of size 4 bytes
=========     at lff_fwd_kernel+0x1b0 in lff_forward.py:120
=========     by thread (37,0,0) in block (2,0,0)
========= ERROR SUMMARY: 1 error
"""
RACECHECK_BAD = """========= Error: Race reported between Write access at block_gemm+0x90
=========     and Read access at block_gemm+0x120 [16 hazards]
========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)
"""
REFUSED = "========= Error: Device not supported\n========= ERROR SUMMARY: 0 errors\n"


def test_gpu_sanitize_reads_compute_sanitizer_output():
    gs = _module("gpu_sanitize")
    clean = gs.parse_output(MEMCHECK_CLEAN)
    assert clean["errors"] == 0 and gs.verdict(0, clean) == "clean"
    bad = gs.parse_output(MEMCHECK_BAD)
    assert bad["errors"] == 1 and gs.verdict(86, bad) == "errors"
    assert any("Invalid __global__ read" in ln for ln in bad["report"])
    race = gs.parse_output(RACECHECK_BAD + "========= ERROR SUMMARY: 1 error\n")
    assert race["hazards"] == 1 and gs.verdict(86, race) == "errors"
    refused = gs.parse_output(REFUSED)
    assert refused["unsupported"] and gs.verdict(1, refused) == "unavailable"
    # a workload that failed under the sanitizer (rc != 0) is not clean, whatever it printed
    assert gs.verdict(1, gs.parse_output(MEMCHECK_CLEAN)) == "errors"


# The files the proof brings back: a device call returns at most 8.
PROOF_FILES = {
    "gpu_validate.log", "tests_junit.xml", "ceilings.json", "lff_gpu.json", "floater_gpu.json",
    "rotary_gpu.json", "summary.json", "summary.md",
}  # fmt: skip


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_validate_dry_run_proof(tmp_path):
    """The GPU run's one command in its CPU form: every stage of the proof in order, its own
    420 s deadline (one rerun fits a session's 15 minutes), at most 8 files in OUT (stage
    records, verify output and the Triton logs in the scratch folder, carried home by
    summary.json), and the test selection still finding every kind of test it names."""
    out, work = tmp_path / "out", tmp_path / "work"
    proc = _run(["--dry-run", "proof"], out, timeout=400, GPU_VALIDATE_WORK=str(work))
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    assert "deadline 420 s" in log
    files = {p.name for p in out.iterdir()}
    assert files == PROOF_FILES, files
    stages = [json.loads(ln) for ln in (work / "stages.jsonl").read_text().splitlines()]
    assert [r["stage"] for r in stages] == [
        "build", "verify", "tests", "ceilings", "lff", "floater", "rotary", "sanitize", "summary",
    ]  # fmt: skip
    assert all(r["status"] == "ok" and r["dry_run"] for r in stages), stages
    limits = {r["stage"]: r["limit_s"] for r in stages}
    # the stages after the build fit the deadline with the summary's 30 s and the carried
    # build's install (11 s on the first H200 run) to spare
    assert sum(v for k, v in limits.items() if k not in ("build", "summary")) + 30 + 15 <= 420
    for term in ("gradcheck", "determinis", "2_31", "compile_fullgraph", "export"):
        count = re.search(rf"proof tests '-k {term}': (\d+) tests", log)
        assert count and int(count.group(1)) > 0, term
    summary = json.loads((out / "summary.json").read_text())
    # the stage records made it into the summary (all but the summary's own)
    assert [r["stage"] for r in summary["stages"]][:8] == [r["stage"] for r in stages][:8]
    assert summary["sanitize"]["dry_run"], summary.get("sanitize")  # home from the scratch folder
    verify = summary["verify"]
    assert verify["complete"] and verify["passed"] > 0 and verify["failed"] == 0, verify
    assert {r["op"] for r in verify["rows"]} == {"floater"}
    lff_cases = {r["case"] for r in summary["lff"]["rows"]}
    assert {"compute", "compute-fp32", "sinusoidal-add", "dft-add"} <= lff_cases, lff_cases
    assert "**verify**" in (out / "summary.md").read_text()
    # the Triton accounting: no prepared cache here, and every launcher call recorded for
    # the next preparation (the dry run's LFF stage runs the kernels interpreted)
    triton = summary["triton"]
    assert triton["cache_check"].startswith("no Triton cache carried"), triton
    calls = [json.loads(r) for r in triton["records"]]
    assert any(c.get("launcher", "").endswith(":lff_fwd") for c in calls), calls[:3]
    assert "**Triton cache**" in (out / "summary.md").read_text()


def test_summarize_reads_verify_output(tmp_path):
    """verify's PASS / FAIL / SKIP lines become summary["verify"], failures with their detail."""
    (tmp_path / "verify.txt").write_text(
        "posenc_fast verify: device cuda, seed 123 (replay with --seed 123)\n"
        "PASS  lff       triton  float32  6 cases  max fwd err 1.0e-06  (1.0 s)\n"
        "FAIL  floater   cuda    float32  3 cases  max fwd err 1.0e-01  (1.0 s)\n"
        "      case 2: max abs err 0.1 > atol\n"
        "SKIP  lff       cpp     unavailable: the C++ extension is not built\n"
        "1 mismatching op/backend/dtype combination(s); seed 123\n"
    )  # fmt: skip
    summarize = _module("summarize_gpu")
    s = summarize.summarize([str(tmp_path)])
    v = s["verify"]
    assert (v["passed"], v["failed"], v["seed"], v["complete"]) == (1, 1, "123", True)
    assert v["failures"] == [
        "FAIL  floater   cuda    float32  3 cases  max fwd err 1.0e-01  (1.0 s)",
        "case 2: max abs err 0.1 > atol",
    ]  # fmt: skip
    assert len(v["skipped"]) == 1
    md = summarize.markdown(s)
    assert "1 passed, 1 failed" in md and "floater/cuda" in md


def test_summarize_verify_parts_complete_only_when_every_part_closed(tmp_path):
    """gpu_validate.sh concatenates verify's op groups (run side by side): a part cut at
    the stage's limit (no closing line) leaves the whole incomplete."""
    head = "posenc_fast verify: device cuda, seed 7 (replay with --seed 7)\n"
    line = "PASS  {op}  triton  float32  6 cases  max fwd err 1.0e-06  (1.0 s)\n"
    done = "all backends agree with the reference\n"
    summarize = _module("summarize_gpu")
    for parts, complete in (([True, True], True), ([True, False], False)):
        text = "".join(head + line.format(op=f"op{i}") + (done if c else "")
                       for i, c in enumerate(parts))  # fmt: skip
        (tmp_path / "verify.txt").write_text(text)
        v = summarize.summarize([str(tmp_path)])["verify"]
        assert (v["passed"], v["complete"]) == (2, complete)
