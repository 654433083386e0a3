"""Graceful degradation, each case simulated in fresh processes so that
this one is untouched:

- triton missing: ``sys.modules["triton"] = None`` before anything imports it;
- the compiled extension missing: a copy of the package without the binary;
- the extension built for another torch: a copy whose build metadata names another torch
  (beside a file that is not a loadable binary: loading it would fail loudly);
- a GPU older than the kernels support: torch.cuda reports a compute capability 7.0 device
  (the triton backend asks posenc_fast._dispatch.device_capability).

For each: ``import posenc_fast`` works, ``python -m posenc_fast info`` explains, "auto" falls
back to the torch backend with exactly one warning, and naming the backend raises a
BackendError that lists every backend's reasons.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

import posenc_fast

PACKAGE = Path(posenc_fast.__file__).resolve().parent
KERNELS = PACKAGE.parent / "triton_kernels"

# Runs in the simulated process: the checks common to every case, as JSON on the last line.
CHECKS = r"""
import json, sys, warnings
import torch
import posenc_fast as pf
import _helpers
from posenc_fast._dispatch import Problem

case = sys.argv[1]
out = {"package": pf.__file__, "reasons": pf.available_backends(verbose=True)}


def record(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = fn()
    return value, [str(w.message) for w in caught if str(w.message).startswith("posenc_fast")]


def explicit(fn):
    try:
        fn()
    except pf.BackendError as exc:
        return str(exc)
    return None


g = torch.Generator().manual_seed(0)
x, wr = torch.randn(6, 2, 2, generator=g), torch.randn(4, 2, generator=g)
p = torch.rand(5, generator=g) * 30

# CPU calls of the LFF and the encodings never depend on what is missing here: "auto"
# runs the C++ kernels where the extension loads, else the torch backend.
(y, y2), w = record(lambda: (pf.lff(x, wr), pf.sinusoidal(p, 8)))
cpu = "torch" if _helpers.environment_reasons("cpp") else "cpp"
out["cpu_lff_ok"] = torch.equal(y, pf.lff(x, wr, backend=cpu))
out["cpu_enc_ok"] = torch.equal(y2, pf.sinusoidal(p, 8, backend=cpu))
out["cpu_lff_warnings"] = w

if case in ("extension-missing", "extension-other-torch"):
    S, d, H, L = 2, 3, 4, 3
    args = [torch.randn(S, d, generator=g), torch.randn(d + 1, H, generator=g),
            torch.randn(H, generator=g), torch.randn(H + 1, d, generator=g),
            torch.randn(d, generator=g), torch.tensor([0.1, 0.2, 0.4])]
    run = lambda backend="auto": pf.floater(*args, substeps=2, backend=backend)
    (a, b), w = record(lambda: (run(), run()))
    expected = run("torch")
    out["auto_ok"] = torch.equal(a, expected) and torch.equal(b, expected)
    out["auto_warnings"] = w
    out["explicit"] = explicit(lambda: run("cpp"))
    out["binary_loaded"] = "posenc_fast._C" in sys.modules
else:
    # The GPU cases: dispatch decisions for CUDA tensors (this machine has none to run).
    # A GPU of compute capability 9.0 (old-gpu's sitecustomize says 7.0): every backend
    # that asks, e.g. a "cuda" backend where the extension was built with CUDA, gets one.
    torch.cuda.is_available = lambda: True
    if case != "old-gpu":
        torch.cuda.get_device_capability = lambda device=None: (9, 0)
    lff = Problem("lff", "cuda", torch.bfloat16,
                  {"pos_dim": 2, "fourier_dim": 64, "hidden_dim": 32, "group_out_dim": 64},
                  {"activation": "gelu"}, {"x": torch.float32})
    enc = Problem("encoding", "cuda", torch.float16, {"dim": 64}, {"kind": "dft"},
                  {"positions": torch.float32})
    choices, w = record(lambda: [_helpers.chosen(q, "auto") for q in (lff, enc, lff, enc)])
    out["auto_choices"] = choices
    out["auto_warnings"] = w
    out["explicit"] = explicit(lambda: _helpers.chosen(lff, "triton"))
print(json.dumps(out))
"""

OLD_GPU = """
import torch
from types import SimpleNamespace
props = SimpleNamespace(name="Simulated V100", major=7, minor=0, total_memory=16 * 2**30)
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
torch.cuda.get_device_capability = lambda device=None: (7, 0)
torch.cuda.get_device_properties = lambda device=None: props
torch.cuda.get_device_name = lambda device=None: props.name
"""

TRITON_MISSING = """
import sys
sys.modules["triton"] = None  # "import triton" now raises ModuleNotFoundError
"""


def _copy_package(root: Path, binary: bool, metadata) -> None:
    """posenc_fast as a user would have it installed, without the compiled binary (or with
    a file that is not one), and with the given build metadata (None: none)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.pyd", "_build_info*.json")
    shutil.copytree(PACKAGE, root / "posenc_fast", ignore=ignore)
    shutil.copytree(KERNELS, root / "posenc_fast" / "triton_kernels", ignore=ignore)
    # the C++ sources, as every wheel and sdist carries them (for the first-use build)
    shutil.copytree(PACKAGE.parent / "csrc", root / "posenc_fast" / "csrc")
    if binary:
        name = "_C" + sysconfig.get_config_var("EXT_SUFFIX")
        (root / "posenc_fast" / name).write_bytes(b"not a shared object")
    if metadata is not None:
        (root / "posenc_fast" / "_build_info.json").write_text(json.dumps(metadata))


def _simulate(tmp_path: Path, case: str):
    """(checks as a dict, `python -m posenc_fast info` stdout), both from fresh processes."""
    site = tmp_path / "site"
    site.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    env.pop("POSENC_FAST_BACKEND", None)
    env.pop("POSENC_FAST_DISABLE_EXTENSION", None)
    if case.startswith("extension-"):  # an empty cache, no first-use build: it stays so
        env.update(POSENC_FAST_BUILD="none", POSENC_FAST_CACHE=str(tmp_path / "cache"))
    if case == "triton-missing":
        (site / "sitecustomize.py").write_text(TRITON_MISSING)
        env["TRITON_INTERPRET"] = "1"  # the interpreter would run it, were triton there
    elif case == "old-gpu":
        (site / "sitecustomize.py").write_text(OLD_GPU)
    elif case == "extension-missing":
        _copy_package(site, binary=False, metadata=None)
    elif case == "extension-other-torch":
        meta = {
            "built": True,
            "torch_version": "1.13.0+simulated",
            "python_abi": sysconfig.get_config_var("EXT_SUFFIX"),
            "python_version": "3",
        }
        _copy_package(site, binary=True, metadata=meta)
    env["PYTHONPATH"] = os.pathsep.join((str(site), str(Path(__file__).resolve().parents[1])))
    # Both processes at once (each spends most of its time importing torch).
    commands = ([sys.executable, "-c", CHECKS, case], [sys.executable, "-m", "posenc_fast", "info"])
    procs = [
        subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         cwd=tmp_path)
        for c in commands
    ]  # fmt: skip
    (checks_out, checks_err), (info_out, info_err) = (p.communicate(timeout=300) for p in procs)
    assert procs[0].returncode == 0, checks_err[-3000:]
    assert procs[1].returncode == 0, info_err[-3000:]
    result = json.loads(checks_out.strip().splitlines()[-1])
    if case.startswith("extension"):  # the simulation really ran on the copy
        assert result["package"].startswith(str(site)), result["package"]
    return result, info_out


def _backend_line(info: str, name: str) -> str:
    lines = [ln for ln in info.splitlines() if ln.startswith(f"  {name} ")]
    assert lines, info
    return lines[0]


def _common(result, info, backend, reason):
    # import worked and CPU work of the LFF and the encodings is untouched (it falls back
    # from "cpp" to "torch" when the extension is missing)
    assert result["cpu_lff_ok"] and result["cpu_enc_ok"]
    if backend != "cpp":
        assert result["cpu_lff_warnings"] == [], result["cpu_lff_warnings"]
    # the reason, in the API and in `info`
    assert any(reason in r for r in result["reasons"][backend]), result["reasons"]
    assert reason in _backend_line(info, backend) and "unavailable" in _backend_line(info, backend)
    # auto: exactly one warning in the process, naming the backend and the reason (from the
    # first call that would have used it: for "cpp", the CPU LFF call)
    warned = result["cpu_lff_warnings"] + result["auto_warnings"]
    assert len(warned) == 1, warned
    assert f"backend {backend!r} is unavailable" in warned[0] and reason in warned[0]
    assert "python -m posenc_fast info" in warned[0]
    # explicit: a BackendError listing every backend's reasons
    msg = result["explicit"]
    assert msg is not None, f"backend={backend!r} did not raise BackendError"
    assert f"backend {backend!r} cannot run" in msg and f"  {backend}: " in msg and reason in msg
    for name in ("reference", "torch", "triton", "cuda", "cpp"):
        assert f"  {name}: " in msg, msg


def test_triton_missing(tmp_path):
    result, info = _simulate(tmp_path, "triton-missing")
    _common(result, info, "triton", "triton is not importable (ModuleNotFoundError")
    assert result["auto_choices"] == ["torch"] * 4
    assert "triton unavailable (ModuleNotFoundError)" in info  # the versions line


def test_extension_missing(tmp_path):
    result, info = _simulate(tmp_path, "extension-missing")
    reason = (
        "the C++ extension (posenc_fast._C) is not built for this torch and "
        "POSENC_FAST_BUILD=none forbids building it on first use: run `python -m posenc_fast build`"
    )
    _common(result, info, "cpp", reason)
    assert result["auto_ok"] and not result["binary_loaded"]
    assert f"cpu   posenc_fast._C: unavailable: {reason}" in info


def test_extension_built_for_another_torch(tmp_path):
    result, info = _simulate(tmp_path, "extension-other-torch")
    reason = (
        f"the extension was built for torch 1.13.0+simulated, this process runs torch "
        f"{torch.__version__}: rebuild it"
    )
    _common(result, info, "cpp", reason)
    assert result["auto_ok"]
    assert not result["binary_loaded"], "a binary built for another torch must not be loaded"


def test_gpu_older_than_the_kernels_support(tmp_path):
    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.skip("triton is not installed here: its GPU check cannot be reached")
    result, info = _simulate(tmp_path, "old-gpu")
    reason = "needs a GPU of compute capability >= 8.0 (bf16 tensor cores), this one is 7.0"
    _common(result, info, "triton", reason)
    assert result["auto_choices"] == ["torch"] * 4
    assert "GPU Simulated V100 (sm_70)" in info
