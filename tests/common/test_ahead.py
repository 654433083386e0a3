"""Triton kernels compiled ahead for a GPU that is not here (triton_kernels/ahead.py): the
launcher calls a run makes are recorded, replayed on `meta` tensors for sm_90 without a GPU,
and a second process finds every kernel and launcher in the cache; a moved cache is
relocated; an install with another Triton is told apart. The GPU machine's side (its hits
and misses) is the GPU run's summary."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile

import pytest
import torch
from posenc_fast.triton_kernels import ahead

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _python(code_or_args, env_extra, cwd, interpret: bool):
    env = {k: v for k, v in os.environ.items() if not k.startswith("POSENC_FAST_TRITON_")}
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env.update(env_extra)
    args = ["-c", code_or_args] if isinstance(code_or_args, str) else code_or_args
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(5, 3, 4),
        lambda: torch.randn(6, 8).t(),  # transposed
        lambda: torch.randn(40)[3:35].view(4, 8),  # an offset: 12 bytes, not 16-aligned
        lambda: torch.randn(2, 1, 5).expand(2, 7, 5),  # stride 0
        lambda: torch.zeros(0, 4),
        lambda: torch.arange(10),
        lambda: torch.randn(3, dtype=torch.bfloat16).requires_grad_(True),
    ],
)
def test_a_recorded_tensor_comes_back_with_its_layout(make):
    t = make()
    back = ahead.decode(json.loads(json.dumps(ahead.encode(t))), "meta")
    assert back.device.type == "meta"
    assert (back.shape, back.stride(), back.storage_offset(), back.dtype) == (
        t.shape,
        t.stride(),
        t.storage_offset(),
        t.dtype,
    )
    assert back.requires_grad == t.requires_grad
    # what Triton specialises on: 16-byte alignment of the pointer (meta storage starts at 0)
    assert (back.data_ptr() % 16 == 0) == (t.storage_offset() * t.element_size() % 16 == 0)


def test_other_arguments_come_back_as_they_were():
    args = [None, True, 3, 2.5, "gelu", torch.float16, [True, False], (1, 2)]
    assert ahead.decode(json.loads(json.dumps(ahead.encode(args)))) == args
    with pytest.raises(TypeError, match="cannot record"):
        ahead.encode(object())


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A recorded run (the sinusoidal table and its fused add through the public API,
    under the interpreter), then its kernels compiled for sm_90 into a fresh cache."""
    tmp = tmp_path_factory.mktemp("ahead")
    records = tmp / "records.jsonl"
    run = _python(
        "import torch, posenc_fast as pf\n"
        "pos = torch.arange(40)\n"
        "for _ in range(2):\n"  # the same call twice: one record
        "    pf.sinusoidal(pos, 16, backend='triton')\n"
        "x = torch.randn(2, 40, 16, dtype=torch.bfloat16)\n"
        "pf.SinusoidalPE(16, backend='triton')(x)\n",
        {"POSENC_FAST_TRITON_RECORD": str(records), "POSENC_FAST_TRITON_AUTOTUNE": "0"},
        ROOT,
        interpret=True,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    cache = tmp / "cache"
    compiled = _compile(records, cache, tmp / "manifest.json")
    return {"tmp": tmp, "records": records, "cache": cache, "first": compiled}


def _compile(records, cache, manifest, **env):
    args = ["-m", "posenc_fast.triton_kernels.ahead", "compile", str(records), "--arch", "90"]
    run = _python(
        [*args, "--manifest", str(manifest)],
        {"TRITON_CACHE_DIR": str(cache), **env},
        ROOT,
        interpret=False,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return json.loads(manifest.read_text())


def test_each_distinct_launcher_call_is_recorded_once(prepared):
    lines = prepared["records"].read_text().splitlines()
    recs = [json.loads(ln) for ln in lines]
    launchers = [r["launcher"] for r in recs]
    assert launchers.count("triton_kernels.encodings:encoding_fwd") == 1, launchers
    assert "triton_kernels.encodings:encoding_add_fwd" in launchers
    add = next(r for r in recs if r["launcher"].endswith("encoding_add_fwd"))
    x = next(a["tensor"] for a in add["args"] if isinstance(a, dict) and "tensor" in a)
    assert x["shape"] == [2, 40, 16] and x["dtype"] == "bfloat16"
    assert all(r["autotune"] is False for r in recs)


def test_recorded_calls_compile_for_sm90_without_a_gpu(prepared):
    m = prepared["first"]
    assert m["failures"] == []
    assert m["identity"]["arch"] == 90 and m["compiled"] >= 2
    assert {k["module"] for k in m["kernels"]} == {"posenc_fast.triton_kernels.encodings"}
    assert m["launchers"] == len(m["kernels"])
    files = [f for _, _, names in os.walk(prepared["cache"]) for f in names]
    assert len([f for f in files if f.endswith(".cubin")]) == len(m["kernels"])


def test_a_packed_cache_unpacked_elsewhere_has_every_kernel(prepared):
    """Packed (binaries and metadata only), unpacked in another folder and relocated, as
    the GPU run does: another process compiling the same calls finds every kernel."""
    tmp = prepared["tmp"]
    archive = tmp / "cache.tar.gz"
    counts = ahead.pack(str(prepared["cache"]), str(archive))
    moved = tmp / "moved"
    moved.mkdir()
    with tarfile.open(archive) as tar:
        tar.extractall(moved, filter="data")
    kept = [f for _, _, files in os.walk(moved) for f in files]
    assert len(kept) == counts["files"] and not [f for f in kept if f.endswith((".ptx", ".llir"))]
    first = prepared["first"]
    assert ahead.relocate(str(moved)) >= len(first["kernels"])
    groups = [
        json.loads((moved / os.path.relpath(d, moved) / f).read_text())
        for d, _, files in os.walk(moved)
        for f in files
        if f.startswith("__grp__")
    ]
    assert all(p.startswith(str(moved)) for g in groups for p in g["child_paths"].values())
    shutil.rmtree(prepared["cache"])  # nothing may still point there
    again = _compile(prepared["records"], moved, tmp / "again.json")
    assert again["failures"] == []
    assert again["compiled"] == 0 and again["already_cached"] == first["compiled"]


def test_a_measured_choice_is_launched_without_tuning(prepared):
    """An autotuned call compiles every configuration it may offer on sm_90, and only the
    one tuned.json names for its key when the table has it (what the next GPU run uses
    instead of timing; the key is the one the autotuner's choice is recorded under)."""
    tmp = prepared["tmp"]
    rec = next(
        json.loads(ln)
        for ln in prepared["records"].read_text().splitlines()
        if '"triton_kernels.encodings:encoding_fwd"' in ln
    )
    tuned_calls = tmp / "tuned_calls.jsonl"
    tuned_calls.write_text(json.dumps({**rec, "autotune": True}) + "\n")
    choices = tmp / "choices.jsonl"
    every = _compile(
        tuned_calls, tmp / "c1", tmp / "every.json", POSENC_FAST_TRITON_RECORD=str(choices)
    )
    fwd = [k for k in every["kernels"] if k["kernel"] == "_encoding_fwd_kernel"]
    assert len(fwd) > 1  # every configuration the autotuner may offer
    (choice,) = [json.loads(ln) for ln in choices.read_text().splitlines() if '"tuned"' in ln]
    assert choice["measured"] is False and ahead.merge_tuned([choice], {}) == 0
    table = {}
    assert ahead.merge_tuned([{**choice, "measured": True, "config": "other"}], table) == 1
    # another configuration than the one the first compile "chose"
    import triton
    from posenc_fast.triton_kernels import _configs, encodings

    names = [
        _configs.describe(triton.Config({"BLOCK_R": br, "BLOCK_K": bk}, num_warps=w, num_stages=2))
        for br, bk, w in encodings._FWD_CONFIGS
    ]
    assert choice["config"] in names
    other = next(n for n in reversed(names) if n != choice["config"])
    table["sm_90"]["encoding_fwd"][choice["key"]] = other
    (tmp / "tuned.json").write_text(json.dumps(table))
    one = _compile(
        tuned_calls, tmp / "c2", tmp / "one.json", POSENC_FAST_TRITON_TUNED=str(tmp / "tuned.json")
    )
    assert [k["kernel"] for k in one["kernels"]].count("_encoding_fwd_kernel") == 1


def test_check_tells_another_triton_apart(prepared, tmp_path):
    path = prepared["tmp"] / "manifest.json"
    assert ahead.check(str(path), 90) == []
    m = json.loads(path.read_text())
    m["identity"]["triton_key"] = "another"
    other = tmp_path / "other.json"
    other.write_text(json.dumps(m))
    why = ahead.check(str(other), 90)
    assert len(why) == 1 and why[0].startswith("triton_key")
    assert any(w.startswith("arch") for w in ahead.check(str(path), 80))


def test_the_gpu_benchmarks_name_every_case_they_time():
    """What the preparation compiles for the benchmarks: every case of the proof's scripts
    (the calls themselves compile kernels; the preparation runs them)."""
    bench = os.path.join(ROOT, "benchmarks")
    lff = [n for n, _ in ahead.benchmark_calls([os.path.join(bench, "lff_gpu.py")])]
    mod = sys.modules["_posenc_bench_lff_gpu"]
    cases = [f"{n} {plan}" for n in mod.CASES for plan in ("fused", "gemm")]
    assert lff == [f"lff_gpu:{n}" for n in (*cases, *mod.ENC_CASES)]
    rot = [n for n, _ in ahead.benchmark_calls([os.path.join(bench, "rotary.py")])]
    rmod = sys.modules["_posenc_bench_rotary"]
    assert len(rot) == len(rmod.CASES) * 2 * 2  # two dtypes, fwd and fwd+bwd
