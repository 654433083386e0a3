"""The compiled extension (csrc/): loader behaviour, the C++ CPU FLOATER kernels against the
float64 reference loop (posenc_fast/ops/floater/reference.py), determinism, bad inputs to the
low-level ops.

The shared FLOATER matrix (tests/floater/test_floater*.py) covers the "cpp" backend through the
public API once the extension is built; this file tests the extension itself and runs
without it too (the kernel tests are then skipped, the loader tests still run).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from posenc_fast import _dispatch, _extension
from posenc_fast.cli import info as info_cli
from posenc_fast.cli._inputs import FloaterCase, floater_inputs
from posenc_fast.ops.floater import FloaterOptions
from posenc_fast.ops.floater import reference as ref
from posenc_fast.ops.floater.registry import FLOATER
from posenc_fast.tolerances import assert_close

ROOT = Path(__file__).resolve().parents[2]
EXT = _extension.load()
needs_ext = pytest.mark.skipif(
    EXT is None, reason="; ".join(_extension.reasons()) or "extension missing"
)

METHODS = ("euler", "midpoint", "rk4", "rk38")
ACTIVATIONS = ("relu", "tanh", "gelu", "identity")


def ops():
    return torch.ops.posenc_fast


@pytest.fixture(params=["avx512", "avx2", "generic"])
def cpu_isa(request):
    """Run a test with each instruction-set variant of the kernels this CPU can execute."""
    if EXT is None:
        pytest.skip("extension missing")
    best = EXT.build_info()["cpu_isa_best"]
    order = ["generic", "avx2", "avx512"]
    if order.index(request.param) > order.index(best):
        pytest.skip(f"CPU lacks {request.param}")
    EXT.set_cpu_isa(request.param)
    yield request.param
    EXT.set_cpu_isa("auto")


# ---------------------------------------------------------------------------------------
# Loader and build behaviour (no compiled extension needed)
# ---------------------------------------------------------------------------------------


@pytest.mark.skipif(
    os.environ.get("POSENC_FAST_REQUIRE_EXTENSION", "") in ("", "0"),
    reason="POSENC_FAST_REQUIRE_EXTENSION not set (CI sets it: the cpp backend must be tested)",
)
def test_extension_required_is_available():
    assert EXT is not None, "; ".join(_extension.reasons())
    assert "cpp" in _dispatch.available_backends()


def test_import_does_not_load_or_build_the_extension():
    code = (
        "import sys, posenc_fast, posenc_fast.ops.floater\n"
        "assert 'posenc_fast._C' not in sys.modules, 'imported eagerly'\n"
        "assert 'posenc_fast._C_cuda' not in sys.modules, 'imported eagerly'\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_disabled_extension_is_reported_and_import_works():
    code = (
        "import posenc_fast, json\n"
        "r = posenc_fast.available_backends(verbose=True)\n"
        "print(json.dumps({'cpp': r['cpp'], 'cuda': r['cuda']}))\n"
    )
    env = dict(os.environ, POSENC_FAST_DISABLE_EXTENSION="1")
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert any("POSENC_FAST_DISABLE_EXTENSION" in s for s in got["cpp"])
    assert got["cuda"]


@pytest.fixture
def package(monkeypatch, tmp_path):
    """The package's own build replaced by what a test writes into a folder, an empty cache
    and no first-use build (tests/common/test_extension_build.py tests those)."""
    folder = tmp_path / "package"
    folder.mkdir()
    monkeypatch.setattr(_extension, "PACKAGE_DIR", folder)
    monkeypatch.delenv("POSENC_FAST_DISABLE_EXTENSION", raising=False)
    monkeypatch.setenv("POSENC_FAST_BUILD", "none")
    monkeypatch.setenv("POSENC_FAST_CACHE", str(tmp_path / "cache"))
    return folder


def _fake_binary(folder: Path) -> Path:
    fake = folder / f"_C{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    fake.write_bytes(b"not a shared object")  # loading it would fail loudly
    return fake


def _record(folder: Path, **fields) -> None:
    (folder / "_build_info.json").write_text(json.dumps(fields))


def test_missing_extension_reason(package):
    (why,) = _extension._try_load("cpu")["reasons"]
    assert "not built" in why and "python -m posenc_fast build" in why


def test_failed_build_reason(package):
    _record(package, built=False, error="RuntimeError: Error compiling objects for extension")
    reasons = _extension._try_load("cpu")["reasons"]
    assert "was not built at install time" in reasons[0] and "Error compiling" in reasons[0]


def test_torch_mismatch_is_reported_not_loaded(package):
    fake = _fake_binary(package)
    _record(package, built=True, torch_version="1.0.0+old")
    (why, _no_build) = _extension._try_load("cpu")["reasons"]
    assert why.startswith(f"{fake}: ")
    assert "1.0.0+old" in why and torch.__version__ in why and "rebuild" in why


def test_binary_without_metadata_is_not_loaded(package):
    _fake_binary(package)
    (why, _no_build) = _extension._try_load("cpu")["reasons"]
    assert "no build record" in why


@pytest.fixture
def extension_unavailable(monkeypatch):
    """Pretend the extension is missing in this process; restore afterwards."""
    saved = {part: dict(state) for part, state in _extension._state.items()}
    for state in _extension._state.values():
        state.update(tried=True, module=None, reasons=["test: extension hidden"], origin=None)
    monkeypatch.setattr(_dispatch, "_warned", set())
    monkeypatch.delenv(_dispatch.ENV_VAR, raising=False)
    yield
    for part, state in saved.items():
        _extension._state[part].clear()
        _extension._state[part].update(state)


def test_auto_falls_back_with_one_warning(extension_unavailable):
    from posenc_fast.ops.floater import floater

    args = floater_inputs(FloaterCase(2, 3, 4, 3), torch.float32, "cpu", seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = floater(*args, substeps=2, method="rk4", activation="tanh")
        b = floater(*args, substeps=2, method="rk4", activation="tanh")
    mine = [w for w in caught if "'cpp'" in str(w.message)]
    assert len(mine) == 1, [str(w.message) for w in caught]
    assert "test: extension hidden" in str(mine[0].message)
    ref = floater(*args, substeps=2, method="rk4", activation="tanh", backend="torch")
    torch.testing.assert_close(a, ref)
    torch.testing.assert_close(b, ref)


def test_unavailable_backend_explains(extension_unavailable):
    assert _dispatch.BACKENDS["cpp"].environment_reasons() == ["test: extension hidden"]
    assert _dispatch.BACKENDS["cuda"].environment_reasons() == ["test: extension hidden"]
    with pytest.raises(RuntimeError, match="test: extension hidden"):
        FLOATER["cpp"].forward(
            *floater_inputs(FloaterCase(1, 2, 2, 1), torch.float32, "cpu", 0),
            FloaterOptions(1, "rk4", "relu"),
        )


def test_extension_info_shape():
    info = _extension.extension_info()
    assert set(info) == {"cpu", "cuda"}
    # the CLI adds the backends' view (the extension's loader never imports the dispatcher)
    assert set(info_cli._extension_info()["backends"]) == {"cpp", "cuda"}
    for part in ("cpu", "cuda"):
        assert set(info[part]) >= {"module", "available", "reasons", "build_metadata"}
        assert info[part]["available"] == (not info[part]["reasons"])
    assert info["cpu"]["module"] == "posenc_fast._C"
    assert info["cuda"]["module"] == "posenc_fast._C_cuda"
    assert info["cpu"]["available"] == (EXT is not None)
    if EXT is not None:
        assert info["cpu"]["build_info"]["torch_version"] == torch.__version__.split("+")[0]
        assert info["cpu"]["cpu_isa"] in ("generic", "avx2", "avx512")


def _load_setup_module():
    spec = importlib.util.spec_from_file_location("posenc_fast_setup", ROOT / "setup.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # setup() runs only under __main__
    return mod


def test_setup_build_none_gives_pure_python(monkeypatch):
    setup_mod = _load_setup_module()
    monkeypatch.setenv("POSENC_FAST_BUILD", "none")
    assert setup_mod._extension_setup() == {}


@pytest.mark.slow
def test_pure_python_wheel_builds_without_the_extension(tmp_path):
    """POSENC_FAST_BUILD=none: a wheel with no binary, built in this environment."""
    env = dict(os.environ, POSENC_FAST_BUILD="none")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-build-isolation",
        "--no-deps",
        "-w",
        str(tmp_path),
        str(ROOT),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    import zipfile

    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "posenc_fast/ops/floater/api.py" in names or "posenc_fast/__init__.py" in names
    assert not [n for n in names if n.endswith((".so", ".pyd"))], names
    assert "py3-none-any" in wheel.name
    # the sources travel with it, for the first-use build (posenc_fast/_extension.py)
    assert {"posenc_fast/csrc/module.cpp", "posenc_fast/csrc/cpu/isa.h"} <= set(names)
    assert "posenc_fast/csrc/lff/lff_cpu.cpp" in names


def test_sdist_carries_every_extension_source(tmp_path):
    """An sdist must be able to build the extension: every source setup.py compiles and
    every header under csrc/ is in it (MANIFEST.in)."""
    import shutil
    import tarfile

    from posenc_fast import _build_config

    # From a copy of the checkout's files: setuptools would otherwise reuse the file list
    # of an earlier build (posenc_fast.egg-info/SOURCES.txt) and hide a missing rule.
    src = tmp_path / "src"
    listed = ["git", "ls-files", "--cached", "--others", "--exclude-standard"]
    for name in subprocess.run(listed, capture_output=True, text=True, cwd=ROOT).stdout.split():
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    env = dict(os.environ, POSENC_FAST_BUILD="none")
    cmd = [sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=src)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (sdist,) = tmp_path.glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        members = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    headers = [str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*.h")]
    wanted = [*_build_config.SOURCES["cpu"], *_build_config.SOURCES["cuda"], *headers]
    assert headers and not [f for f in wanted if f not in members], sorted(members)


# ---------------------------------------------------------------------------------------
# C++ CPU kernels against the float64 reference loop
# ---------------------------------------------------------------------------------------

# (S, d, H, L, substeps): odd sizes, single state / dimension / hidden unit, chunks of 4
# states with remainders, and one case above the L2 threshold (regions split over columns).
SHAPES = [
    (1, 1, 1, 1, 1),
    (3, 5, 7, 4, 2),
    (5, 2, 9, 3, 3),
    (9, 33, 17, 3, 1),
    (13, 16, 32, 2, 2),
]
BIG = (6, 300, 270, 2, 1)


def _check_against_loop(S, d, H, L, n, method, act, dtype, seed, repeat=False):
    args = floater_inputs(FloaterCase(S, d, H, L, repeat_time=repeat), dtype, "cpu", seed)
    out = ops().floater_integrate(*args, n, method, act)
    leaves = [a.detach().to(torch.float64).requires_grad_() for a in args]
    want = ref.floater(*leaves, n, method, act)
    assert out.dtype == dtype and out.shape == (S, L, d)
    assert_close(out, want, dtype, "floater", what=f"forward {method} {act}")
    g = torch.Generator().manual_seed(seed + 7)
    grad = torch.randn(want.shape, generator=g, dtype=torch.float64)
    ref_grads = torch.autograd.grad(want, leaves, grad)
    got = ops().floater_integrate_backward(grad.to(dtype), out, *args, n, method, act, [True] * 6)
    for name, gg, rg in zip(("p0", "w1", "b1", "w2", "b2", "times"), got, ref_grads):
        assert_close(gg, rg, dtype, "grad", what=f"d{name} {method} {act}")


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_cpu_kernels_match_loop(cpu_isa, dtype, method, activation):
    for i, (S, d, H, L, n) in enumerate(SHAPES):
        _check_against_loop(S, d, H, L, n, method, activation, dtype, seed=100 + i, repeat=i == 1)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_cpu_kernels_split_regions(cpu_isa, dtype):
    S, d, H, L, n = BIG
    _check_against_loop(S, d, H, L, n, "rk4", "gelu", dtype, seed=5)


@needs_ext
def test_backward_recompute_path_matches():
    """With no memory to keep an interval's stage values, the backward recomputes each step
    from stored starting states: the same adjoint bitwise (dp0, dtimes); the weight
    gradients are summed step by step instead of per interval (rounding differs)."""
    args = floater_inputs(FloaterCase(5, 7, 6, 4), torch.float64, "cpu", seed=12)
    out = ops().floater_integrate(*args, 3, "rk4", "gelu")
    grad = torch.randn_like(out)
    kept = ops().floater_integrate_backward(grad, out, *args, 3, "rk4", "gelu", [True] * 6)
    old = EXT.set_backward_keep_budget(0)
    try:
        recomputed = ops().floater_integrate_backward(
            grad, out, *args, 3, "rk4", "gelu", [True] * 6
        )
        _check_against_loop(5, 7, 6, 4, 3, "rk38", "tanh", torch.float32, seed=13)
    finally:
        EXT.set_backward_keep_budget(old)
    for i, (a, b) in enumerate(zip(kept, recomputed)):
        if i in (0, 5):
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_times_not_starting_at_zero_and_repeated(dtype):
    args = floater_inputs(FloaterCase(4, 6, 5, 5, repeat_time=True), dtype, "cpu", seed=11)
    assert args[5][0] > 0 and args[5][1] == args[5][0]
    out = ops().floater_integrate(*args, 3, "rk38", "tanh")
    want = ref.floater(*[a.double() for a in args], 3, "rk38", "tanh")
    assert_close(out, want, dtype, "floater")
    torch.testing.assert_close(out[:, 1], out[:, 0], rtol=0, atol=0)  # zero-length interval


@needs_ext
def test_first_sample_at_zero_returns_p0():
    args = floater_inputs(FloaterCase(3, 4, 5, 3), torch.float64, "cpu", seed=2)
    args[5][0] = 0.0  # interval 0 has length zero
    out = ops().floater_integrate(*args, 4, "rk4", "gelu")
    torch.testing.assert_close(out[:, 0], args[0], rtol=0, atol=0)


@needs_ext
@pytest.mark.parametrize(
    "shape", [(0, 3, 4, 5), (2, 3, 4, 0), (2, 3, 0, 4)], ids=["S0", "L0", "H0"]
)
def test_empty_sizes(shape):
    S, d, H, L = shape
    args = floater_inputs(FloaterCase(S, d, H, L), torch.float64, "cpu", seed=3)
    out = ops().floater_integrate(*args, 2, "rk4", "relu")
    assert out.shape == (S, L, d)
    want = ref.floater(*args, 2, "rk4", "relu")
    torch.testing.assert_close(out, want)
    grads = ops().floater_integrate_backward(
        torch.ones_like(out), out, *args, 2, "rk4", "relu", [True] * 6
    )
    for g, a in zip(grads, args):
        assert g.shape == a.shape
    if L == 0:
        assert all(float(g.abs().sum()) == 0 for g in grads)


@needs_ext
def test_needs_selects_outputs():
    args = floater_inputs(FloaterCase(3, 4, 5, 3), torch.float32, "cpu", seed=4)
    out = ops().floater_integrate(*args, 2, "rk4", "relu")
    grad = torch.randn_like(out)
    full = ops().floater_integrate_backward(grad, out, *args, 2, "rk4", "relu", [True] * 6)
    needs = [False, True, False, False, True, True]
    part = FLOATER["cpp"].backward(grad, out, *args, FloaterOptions(2, "rk4", "relu"), needs)
    for n, p, f in zip(needs, part, full):
        if n:
            torch.testing.assert_close(p, f, rtol=0, atol=0)
        else:
            assert p is None


@needs_ext
@pytest.mark.parametrize("shape", [(13, 16, 32, 5, 2), BIG], ids=["chunked", "split"])
def test_deterministic_and_thread_count_independent(shape, cpu_teams):
    # Teams really run, even on a busy machine (csrc/cpu/parallel.h: contention fallback).
    S, d, H, L, n = shape
    args = floater_inputs(FloaterCase(S, d, H, L), torch.float32, "cpu", seed=6)
    grad = torch.randn((S, L, d), generator=torch.Generator().manual_seed(1))
    threads = torch.get_num_threads()
    results = []
    try:
        for t in (threads, threads, 1):
            torch.set_num_threads(t)
            out = ops().floater_integrate(*args, n, "rk4", "gelu")
            grads = ops().floater_integrate_backward(grad, out, *args, n, "rk4", "gelu", [True] * 6)
            results.append([out, *grads])
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for x, y in zip(results[0], other):
            assert torch.equal(x, y)


@needs_ext
@pytest.mark.parametrize("method", ["rk38", "midpoint", "euler"])
def test_team_results_independent_of_team_size(method, cpu_teams):
    """Large dynamics run on a team of threads, each owning columns of every layer (packed
    weight panels, swept in alternating order): teams of 1, 2 and 3 members (uneven
    splits, partial vectors at d = 300) give bitwise the same results, with the stage
    values kept or recomputed, and match the loop."""
    S, d, H, L, n = 5, 300, 270, 3, 2
    args = floater_inputs(FloaterCase(S, d, H, L), torch.float32, "cpu", seed=21)
    grad = torch.randn((S, L, d), generator=torch.Generator().manual_seed(2))
    threads = torch.get_num_threads()
    results = {}
    try:
        for budget in (None, 0):
            old = EXT.set_backward_keep_budget(budget) if budget is not None else None
            try:
                for t in (1, 2, 3):
                    torch.set_num_threads(t)
                    out = ops().floater_integrate(*args, n, method, "tanh")
                    grads = ops().floater_integrate_backward(
                        grad, out, *args, n, method, "tanh", [True] * 6
                    )
                    results[budget, t] = [out, *grads]
            finally:
                if old is not None:
                    EXT.set_backward_keep_budget(old)
    finally:
        torch.set_num_threads(threads)
    for (budget, t), res in results.items():
        for x, y in zip(results[budget, 1], res):
            assert torch.equal(x, y), (budget, t)
    _check_against_loop(S, d, H, L, n, method, "tanh", torch.float32, seed=21)


@needs_ext
def test_inputs_unchanged_and_noncontiguous_inputs():
    args = floater_inputs(FloaterCase(5, 6, 7, 4), torch.float64, "cpu", seed=8)
    copies = [a.clone() for a in args]
    # non-contiguous views of the same values
    w1_t = args[1].t().contiguous().t()
    p0_s = torch.stack([args[0], args[0]], dim=1)[:, 0]
    assert not w1_t.is_contiguous() and not p0_s.is_contiguous()
    out = ops().floater_integrate(p0_s, w1_t, *args[2:], 2, "midpoint", "tanh")
    out_c = ops().floater_integrate(*args, 2, "midpoint", "tanh")
    torch.testing.assert_close(out, out_c, rtol=0, atol=0)
    grads = ops().floater_integrate_backward(
        out.transpose(0, 1).contiguous().transpose(0, 1),
        out,
        *args,
        2,
        "midpoint",
        "tanh",
        [True] * 6,
    )
    assert len(grads) == 6
    for a, c in zip(args, copies):
        assert torch.equal(a, c)


@needs_ext
def test_float32_activations_accuracy(cpu_isa):
    """The vectorised float32 tanh / GELU of the CPU kernels against float64 math on the
    same float32 inputs: one Euler step of size 1 from p = (z, 0) with dynamics that copy
    act(z) into the second component, so out[:, 0, 1] = act(z) exactly as computed."""
    z = torch.linspace(-12, 12, 20001, dtype=torch.float32)
    p0 = torch.stack([z, torch.zeros_like(z)], dim=1)
    w1 = torch.tensor([[1.0], [0.0], [0.0]])  # z = p[0]
    b1 = torch.zeros(1)
    w2 = torch.tensor([[0.0, 1.0], [0.0, 0.0]])  # k = (0, a)
    b2 = torch.zeros(2)
    times = torch.tensor([1.0])
    for act, fn in (
        ("tanh", torch.tanh),
        ("gelu", lambda x: 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))),
    ):
        got = ops().floater_integrate(p0, w1, b1, w2, b2, times, 1, "euler", act)[:, 0, 1].double()
        ref = fn(z.double())
        err = (got - ref).abs() - (2e-7 + 3e-7 * ref.abs())
        assert float(err.max()) <= 0, (
            f"{act}: worst excess {float(err.max()):.3g} at z={float(z[err.argmax()])}"
        )


# ---------------------------------------------------------------------------------------
# Bad inputs to the low-level ops: the argument is named
# ---------------------------------------------------------------------------------------


@needs_ext
@pytest.mark.parametrize(
    ("mutate", "exc", "match"),
    [
        (lambda a: a.__setitem__(1, a[1][:-1]), ValueError, "w1 must have shape"),
        (lambda a: a.__setitem__(2, a[2][:-1]), ValueError, "b1 must have shape"),
        (lambda a: a.__setitem__(3, a[3][:, :-1]), ValueError, "w2 must have shape"),
        (lambda a: a.__setitem__(4, a[4][:-1]), ValueError, "b2 must have shape"),
        (
            lambda a: a.__setitem__(5, a[5].reshape(1, -1)),
            ValueError,
            "times must have 1 dimensions",
        ),
        (lambda a: a.__setitem__(0, a[0][0]), ValueError, "p0 must have shape"),
        (lambda a: a.__setitem__(1, a[1].double()), TypeError, "w1 must have the dtype of p0"),
        (lambda a: a.__setitem__(0, a[0].half()), TypeError, "p0 must be float32 or float64"),
    ],
    ids=["w1", "b1", "w2", "b2", "times", "p0-rank", "dtype", "half"],
)
def test_bad_inputs_name_the_argument(mutate, exc, match):
    args = list(floater_inputs(FloaterCase(2, 3, 4, 3), torch.float32, "cpu", seed=9))
    mutate(args)
    with pytest.raises(exc, match=match):
        ops().floater_integrate(*args, 2, "rk4", "relu")


@needs_ext
def test_bad_options():
    args = floater_inputs(FloaterCase(2, 3, 4, 3), torch.float32, "cpu", seed=9)
    with pytest.raises(ValueError, match="substeps must be >= 1"):
        ops().floater_integrate(*args, 0, "rk4", "relu")
    with pytest.raises(ValueError, match="method must be one of"):
        ops().floater_integrate(*args, 1, "dopri5", "relu")
    with pytest.raises(ValueError, match="activation must be one of"):
        ops().floater_integrate(*args, 1, "rk4", "swish")
    out = ops().floater_integrate(*args, 1, "rk4", "relu")
    with pytest.raises(ValueError, match="needs must have 6 entries"):
        ops().floater_integrate_backward(out, out, *args, 1, "rk4", "relu", [True])
    with pytest.raises(ValueError, match="grad must have shape"):
        ops().floater_integrate_backward(out[:, :1], out, *args, 1, "rk4", "relu", [True] * 6)
    with pytest.raises(ValueError, match="cpu isa must be one of"):
        EXT.set_cpu_isa("sse9")


@pytest.mark.parametrize(
    "value,warns",
    [("baseline", True), ("AVX2", True), ("avx2", False), ("generic", False), ("auto", False)],
)
def test_unknown_cpu_isa_variable_is_reported(monkeypatch, value, warns):
    """The kernels read POSENC_FAST_CPU_ISA once and ignore a name they do not know: the
    load says so instead of silence."""
    monkeypatch.setenv(_extension.ISA_ENV, value)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _extension.check_isa_env()
    messages = [str(w.message) for w in seen if _extension.ISA_ENV in str(w.message)]
    assert bool(messages) == warns, messages
    if warns:
        assert repr(value) in messages[0] and "ignored" in messages[0]


@needs_ext
def test_isa_names_are_the_kernels_names():
    try:
        for name in _extension.ISA_NAMES:
            EXT.set_cpu_isa(name)  # accepted (the C++ refuses a name it does not know)
    finally:
        EXT.set_cpu_isa("auto")


@needs_ext
def test_opcheck_low_level_ops():
    args = floater_inputs(FloaterCase(3, 4, 5, 3), torch.float64, "cpu", seed=10)
    torch.library.opcheck(ops().floater_integrate.default, (*args, 2, "rk4", "gelu"))
    out = ops().floater_integrate(*args, 2, "rk4", "gelu")
    torch.library.opcheck(
        ops().floater_integrate_backward.default,
        (torch.ones_like(out), out, *args, 2, "rk4", "gelu", [True] * 6),
    )


@needs_ext
def test_backend_declaration():
    sup = FLOATER["cpp"].support
    assert sup.devices == ("cpu",)
    assert set(sup.options["method"]) == set(METHODS)
    assert set(sup.options["activation"]) == set(ACTIVATIONS)
    assert _dispatch.BACKENDS["cpp"].environment_reasons() == []
    assert "cpp" in _dispatch.available_backends()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_backend_reasons_on_a_gpu_machine():
    reasons = _dispatch.BACKENDS["cuda"].environment_reasons()
    if EXT is not None and _extension.has_cuda() and os.environ.get(_dispatch.CUDA_GATE_ENV):
        assert reasons == []
    else:
        assert reasons
