"""Triton kernels compiled ahead for a GPU that is not here (tools/triton_ahead.py): the
launcher calls a run makes are recorded from outside the package, replayed on `meta`
tensors for sm_90 without a GPU, and a second process finds every kernel and launcher in
the cache; a moved cache is relocated; an install with another Triton is told apart. The
GPU machine's side (its hits and misses) is the GPU run's summary."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "triton_ahead.py")
sys.path.insert(0, os.path.join(ROOT, "tools"))
import triton_ahead as ahead  # noqa: E402

sys.path.pop(0)


def _python(code_or_args, env_extra, cwd, interpret: bool):
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("POSENC_FAST_TRITON_", "TRITON_AHEAD_"))
    }
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


def test_every_launcher_module_is_recorded():
    """Every public ``*_fwd`` / ``*_bwd`` function of posenc_fast.triton_kernels lives in a
    module the recorder wraps (a new launcher module must join LAUNCHER_MODULES)."""
    pytest.importorskip("triton")
    import importlib
    import pkgutil

    import posenc_fast.triton_kernels as kernels

    found = set()
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"{kernels.__name__}.{info.name}")
        if ahead.launcher_names(module):
            found.add(info.name)
    assert found == set(ahead.LAUNCHER_MODULES)


# Every op's Triton path, forward and backward, on tiny CPU tensors under the interpreter:
# LFF's two plans, the tables, the fused add and its backward, the rotary table and its
# application.
_EVERY_OP = """
import os, torch, posenc_fast as pf
x = torch.rand(5, 2, 2, requires_grad=True)
wr = torch.randn(8, 2, requires_grad=True)
w1, b1 = torch.randn(16, 16, requires_grad=True), torch.zeros(16, requires_grad=True)
w2, b2 = torch.randn(16, 8, requires_grad=True), torch.zeros(8, requires_grad=True)
for plan in ("fused", "gemm"):
    os.environ["POSENC_FAST_LFF_PLAN"] = plan
    pf.lff(x, wr, w1, b1, w2, b2, backend="triton").sum().backward()
pos = torch.rand(6, requires_grad=True)
pf.sinusoidal(pos, 8, backend="triton").sum().backward()
xs = torch.randn(2, 6, 8, requires_grad=True)
pf.SinusoidalPE(8, backend="triton")(xs).sum().backward()
pts, w = torch.rand(1, 7, 2, requires_grad=True), torch.randn(8, 2, requires_grad=True)
table = pf.lff_rotary(pts, w, backend="triton")
sum(t.sum() for t in (table if isinstance(table, tuple) else (table,))).backward()
q, k = torch.randn(1, 2, 7, 16, requires_grad=True), torch.randn(1, 2, 7, 16, requires_grad=True)
sum(t.sum() for t in pf.apply_lff_rotary(q, k, pts, w, backend="triton")).backward()
"""


def test_every_op_reaches_a_recorded_launcher(tmp_path):
    """Each launcher of every launcher module is recorded where an op's Triton path calls
    it (from outside the package: the hooks wrap the launcher modules when they are
    imported), once per distinct call, outermost launchers only."""
    pytest.importorskip("triton")
    records = tmp_path / "records.jsonl"
    run = _python(
        [TOOL, "run", "--record", str(records), "--", sys.executable, "-c", _EVERY_OP],
        {"POSENC_FAST_TRITON_AUTOTUNE": "0"},
        ROOT,
        interpret=True,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    recorded = {r["launcher"] for r in ahead.read_records([str(records)])}
    import importlib

    want = {
        f"triton_kernels.{m}:{n}"
        for m in ahead.LAUNCHER_MODULES
        for n in ahead.launcher_names(importlib.import_module(f"posenc_fast.triton_kernels.{m}"))
    }
    assert recorded == want, recorded ^ want


def test_hooks_installed_in_process_wrap_loaded_modules(tmp_path):
    """install_hooks patches launcher modules already imported, and the wrapper is the
    launcher (same result, same name)."""
    pytest.importorskip("triton")
    import subprocess as sp

    code = (
        "import sys, torch; sys.path.insert(0, 'tools'); import triton_ahead as a\n"
        "from posenc_fast.triton_kernels import encodings as e\n"
        "plain = e.encoding_fwd(torch.arange(5), 'sinusoidal', 1e4, None, torch.float32, dim=8)\n"
        f"a.install_hooks(record={str(tmp_path / 'r.jsonl')!r})\n"
        "assert e.encoding_fwd.__name__ == 'encoding_fwd'\n"
        "got = e.encoding_fwd(torch.arange(5), 'sinusoidal', 1e4, None, torch.float32, dim=8)\n"
        "assert torch.equal(plain, got)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRITON_AHEAD_")}
    env["TRITON_INTERPRET"] = "1"
    run = sp.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    (rec,) = ahead.read_records([str(tmp_path / "r.jsonl")])
    assert rec["launcher"] == "triton_kernels.encodings:encoding_fwd" and rec["kwargs"]["dim"] == 8


def test_meta_tensors_stand_for_the_target_through_the_public_api(tmp_path):
    """Within compiling_for, a public call on `meta` tensors with backend="triton" reaches
    the launcher and compiles for sm_90 (the dispatcher's device test and the launchers'
    device questions answered for the target); afterwards `meta` is refused again."""
    pytest.importorskip("triton")
    code = (
        "import os, sys, torch; sys.path.insert(0, 'tools'); import triton_ahead as a\n"
        "import posenc_fast as pf\n"
        "from posenc_fast.triton_kernels import _launch\n"
        "pos = torch.arange(40, device='meta')\n"
        "with a.compiling_for(90, 132, launchers=False, name='GPU X') as c:\n"
        "    os.environ['POSENC_FAST_TRITON_AUTOTUNE'] = '0'\n"
        "    assert _launch.device_name(pos.device) == 'GPU X'\n"
        "    pf.sinusoidal(pos, 16, backend='triton')\n"
        "assert [k['kernel'] for k in c.kernels.values()] == ['_encoding_fwd_kernel'], c.kernels\n"
        "assert _launch.device_name(pos.device) == 'cpu (Triton interpreter)'\n"
        "try:\n"
        "    pf.sinusoidal(pos, 16, backend='triton')\n"
        "except pf.BackendError as exc:\n"
        "    assert 'meta' in str(exc)\n"
        "else:\n"
        "    raise AssertionError('meta accepted after compiling_for')\n"
    )
    run = _python(code, {"TRITON_CACHE_DIR": str(tmp_path / "cache")}, ROOT, interpret=False)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A recorded run (the sinusoidal table and its fused add through the public API,
    under the interpreter), then its kernels compiled for sm_90 into a fresh cache."""
    tmp = tmp_path_factory.mktemp("ahead")
    records = tmp / "records.jsonl"
    code = (
        "import torch, posenc_fast as pf\n"
        "pos = torch.arange(40)\n"
        "for _ in range(2):\n"  # the same call twice: one record
        "    pf.sinusoidal(pos, 16, backend='triton')\n"
        "x = torch.randn(2, 40, 16, dtype=torch.bfloat16)\n"
        "pf.SinusoidalPE(16, backend='triton')(x)\n"
    )
    run = _python(
        [TOOL, "run", "--record", str(records), "--", sys.executable, "-c", code],
        {"POSENC_FAST_TRITON_AUTOTUNE": "0"},
        ROOT,
        interpret=True,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    cache = tmp / "cache"
    compiled = _compile(records, cache, tmp / "manifest.json")
    return {"tmp": tmp, "records": records, "cache": cache, "first": compiled}


def _compile(records, cache, manifest, **env):
    args = [TOOL, "compile", str(records), "--arch", "90"]
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
    # the table, then the fused add: two distinct calls of the one forward launcher
    assert launchers == ["triton_kernels.encodings:encoding_fwd"] * 2, launchers
    add = recs[1]
    x = add["kwargs"]["x"]["tensor"]
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


def test_an_autotuned_call_compiles_every_configuration_it_may_offer(prepared):
    """A call recorded while the autotuners tuned compiles every configuration the
    autotuner may offer on sm_90 (the GPU run then times them without compiling); the
    same call recorded with POSENC_FAST_TRITON_AUTOTUNE=0 compiles only the first."""
    tmp = prepared["tmp"]
    rec = json.loads(prepared["records"].read_text().splitlines()[0])
    tuned_calls = tmp / "tuned_calls.jsonl"
    tuned_calls.write_text(json.dumps({**rec, "autotune": True}) + "\n")
    every = _compile(tuned_calls, tmp / "c1", tmp / "every.json")
    fwd = [k for k in every["kernels"] if k["kernel"] == "_encoding_fwd_kernel"]
    from posenc_fast.triton_kernels import encodings

    assert 1 < len(fwd) <= len(encodings._FWD_CONFIGS)
    first = [k for k in prepared["first"]["kernels"] if k["kernel"] == "_encoding_fwd_kernel"]
    assert len(first) == 2  # one configuration for each of the two recorded calls


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
