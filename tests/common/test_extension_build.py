"""Building the extension as two modules (posenc_fast._C for the CPU, posenc_fast._C_cuda for
CUDA) so that the CPU part never depends on the CUDA part: finding the toolkit, deciding
whether to build CUDA, and what a failed CUDA build leaves behind.

The decisions are tested on fake toolkits in temporary directories (a CUDA toolkit is a
directory with include/cuda_runtime.h and bin/nvcc); the CUDA failure where torch raises
inside build_extensions() before building anything (its CUDA version check) runs setup.py's
build command with the compiler replaced; one end-to-end build compiles the CPU part for real
while the CUDA part, forced on a torch without CUDA, fails as it naturally does there.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import warnings
from pathlib import Path

import pytest
import torch

from posenc_fast import _build_config as cfg
from posenc_fast import _extension
from posenc_fast._dispatch import BACKENDS

ROOT = Path(__file__).resolve().parents[2]


def _script(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def _toolkit(root: Path, release: str = "13.0") -> Path:
    """A fake CUDA toolkit: the header, and an nvcc that reports its release."""
    (root / "include").mkdir(parents=True)
    (root / "include" / "cuda_runtime.h").write_text("/* fake */\n")
    line = f"Cuda compilation tools, release {release}, V{release}.88"
    _script(root / "bin" / "nvcc", f"echo 'nvcc: NVIDIA (R) Cuda compiler driver'; echo '{line}'")
    return root


def _wrapper(bindir: Path, target: Path) -> Path:
    """An nvcc on PATH that is a script outside the toolkit (like /usr/local/bin/nvcc)."""
    return _script(bindir / "nvcc", f'exec "{target}" "$@"')


# ---------------------------------------------------------------------------------------
# Finding the toolkit
# ---------------------------------------------------------------------------------------


def test_nvcc_wrapper_outside_the_toolkit_is_not_taken_for_one(tmp_path):
    real = _toolkit(tmp_path / "cuda-13.0")
    _wrapper(tmp_path / "usr-local" / "bin", real / "bin" / "nvcc")
    env = {"PATH": str(tmp_path / "usr-local" / "bin")}
    found = cfg.find_cuda_toolkit(env, default=str(tmp_path / "nothing-here"))
    assert found["root"] is None
    assert "not inside a CUDA toolkit" in found["how"] and "cuda_runtime.h" in found["how"]
    assert str(tmp_path / "usr-local" / "bin" / "nvcc") in found["how"]
    assert found["problems"]
    # torch would guess the directory above the wrapper: it has no CUDA headers
    assert not (tmp_path / "usr-local" / "include" / "cuda_runtime.h").exists()
    decision = cfg.cuda_decision("2.9.0+cu130", "13.0", found, None)
    assert decision["build"] is False and decision["warn"] is True
    assert "not inside a CUDA toolkit" in decision["why"]


def test_wrapper_then_default_toolkit_symlinks_resolved(tmp_path):
    real = _toolkit(tmp_path / "cuda-13.0")
    (tmp_path / "cuda").symlink_to(real)
    _wrapper(tmp_path / "usr-local" / "bin", real / "bin" / "nvcc")
    env = {"PATH": str(tmp_path / "usr-local" / "bin")}
    found = cfg.find_cuda_toolkit(env, default=str(tmp_path / "cuda"))
    assert found["root"] == os.path.realpath(real)
    assert "is not inside a CUDA toolkit" in found["how"]  # says why the wrapper was passed over


def test_nvcc_symlink_into_a_toolkit_is_resolved(tmp_path):
    real = _toolkit(tmp_path / "opt" / "cuda-12.8", release="12.8")
    (tmp_path / "usr-bin").mkdir()
    (tmp_path / "usr-bin" / "nvcc").symlink_to(real / "bin" / "nvcc")
    found = cfg.find_cuda_toolkit({"PATH": str(tmp_path / "usr-bin")}, default="/nonexistent")
    assert found["root"] == os.path.realpath(real)
    assert "->" in found["how"]
    assert cfg.nvcc_release(cfg.nvcc_version(found["root"])) == "12.8"


def test_cuda_home_and_cuda_path_are_respected(tmp_path):
    good = _toolkit(tmp_path / "good")
    other = _toolkit(tmp_path / "other")
    empty = tmp_path / "empty"
    empty.mkdir()
    path = str(other / "bin")  # a valid nvcc on PATH loses to an explicit variable
    found = cfg.find_cuda_toolkit({"CUDA_HOME": str(good), "PATH": path}, default=str(other))
    assert found["root"] == os.path.realpath(good) and found["how"].startswith("CUDA_HOME=")
    found = cfg.find_cuda_toolkit({"CUDA_PATH": str(good), "PATH": path}, default=str(other))
    assert found["root"] == os.path.realpath(good) and found["how"].startswith("CUDA_PATH=")
    # set but wrong: that is the answer, with the variable named, not a guess elsewhere
    found = cfg.find_cuda_toolkit({"CUDA_HOME": str(empty), "PATH": path}, default=str(other))
    assert found["root"] is None
    assert f"CUDA_HOME={empty} is not a CUDA toolkit" in found["how"]
    assert "cuda_runtime.h" in found["how"]


def test_no_toolkit_at_all_is_quiet(tmp_path):
    found = cfg.find_cuda_toolkit({"PATH": str(tmp_path)}, default=str(tmp_path / "none"))
    assert found["root"] is None and found["problems"] == []
    assert "no CUDA toolkit found (set CUDA_HOME)" in found["how"]
    decision = cfg.cuda_decision("2.9.0+cu128", "12.8", found, None)
    assert decision == {"build": False, "why": found["how"], "warn": False}


# ---------------------------------------------------------------------------------------
# Deciding
# ---------------------------------------------------------------------------------------


def test_cuda_decision(tmp_path):
    found = cfg.find_cuda_toolkit({"CUDA_HOME": str(_toolkit(tmp_path / "t"))})
    no_cuda = cfg.cuda_decision("2.13.0+cpu", None, found, "13.0")
    assert no_cuda == {
        "build": False,
        "why": "torch 2.13.0+cpu is built without CUDA",
        "warn": False,
    }
    mismatch = cfg.cuda_decision("2.6.0+cu124", "12.4", found, "13.0")
    assert mismatch["build"] is False and mismatch["warn"] is True
    assert "CUDA 13.0" in mismatch["why"] and "CUDA 12.4" in mismatch["why"]
    assert "CUDA 12.x toolkit" in mismatch["why"]
    minor = cfg.cuda_decision("2.9.0+cu128", "12.8", found, "12.9")
    assert minor["build"] is True and minor["warn"] is False
    assert "toolkit CUDA 12.9" in minor["why"]


def test_default_cuda_archs():
    older = "8.0;8.6;8.9;9.0+PTX"
    newer = "8.0;8.6;8.9;9.0;10.0;12.0+PTX"
    assert cfg.default_cuda_archs("13.0", "13.0") == newer
    assert cfg.default_cuda_archs("12.8", "12.8") == newer
    assert cfg.default_cuda_archs("12.8", None) == newer  # forced build, torch without CUDA
    assert cfg.default_cuda_archs("12.4", "12.4") == older  # nvcc 12.4 knows no sm_100
    assert cfg.default_cuda_archs("12.8", "12.4") == older  # torch cu124 rejects "10.0"
    assert cfg.default_cuda_archs(None, "12.8") == older


def test_plan_build_forces_and_skips(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")  # plan_build sets it: restored
    env = {"CUDA_HOME": str(_toolkit(tmp_path / "t", release="12.4"))}
    kw = {"torch_version": "2.6.0+cu126", "torch_cuda_version": "12.6", "environ": env}
    plan = cfg.plan_build(**kw)
    assert plan["cuda"]["build"] is True and plan["cuda"]["archs"] == "9.0"
    assert plan["cuda"]["record"]["cuda_home"] == os.path.realpath(env["CUDA_HOME"])
    assert plan["cuda"]["record"]["cuda_toolkit"].endswith("V12.4.88")
    assert '-DPOSENC_FAST_CUDA_ARCHS="9.0"' in plan["cuda"]["cxx"]
    assert plan["cpu"]["sources"] == list(cfg.CPU_SOURCES)
    assert plan["cpu"]["record"]["module"] == "posenc_fast._C"
    skipped = cfg.plan_build(**kw, no_cuda="POSENC_FAST_NO_CUDA is set")
    assert skipped["cuda"]["build"] is False
    assert skipped["cuda"]["record"]["attempted"] is False
    assert skipped["cuda"]["record"]["cuda_decision"] == "POSENC_FAST_NO_CUDA is set"
    kw["torch_cuda_version"] = None
    forced = cfg.plan_build(**kw, force_cuda="POSENC_FAST_FORCE_CUDA is set")
    assert forced["cuda"]["build"] is True
    assert forced["cuda"]["record"]["cuda_decision"] == (
        "POSENC_FAST_FORCE_CUDA is set, although torch 2.6.0+cu126 is built without CUDA"
    )


def test_torch_guess_replaced_by_our_toolkit(tmp_path, monkeypatch):
    from torch.utils import cpp_extension

    real = _toolkit(tmp_path / "cuda-13.0")
    usr_local = tmp_path / "usr-local"
    _wrapper(usr_local / "bin", real / "bin" / "nvcc")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(usr_local))  # torch's wrong guess
    monkeypatch.setenv("CUDA_HOME", str(real))
    note = cfg.use_toolkit(cpp_extension, cfg.find_cuda_toolkit())
    assert os.path.realpath(real) == cpp_extension.CUDA_HOME
    assert f"torch guessed CUDA_HOME={usr_local}" in note
    assert cfg.use_toolkit(cpp_extension, cfg.find_cuda_toolkit()) is None  # agrees now


def test_toolkit_of_the_machine_is_found_where_there_is_one():
    """Where this machine has a CUDA toolkit in /usr/local/cuda or named by CUDA_HOME, it is
    found with its headers whatever nvcc is on PATH (here and on the GPU machine: a wrapper
    script, /usr/local/bin/nvcc): the case of CI's compile check."""
    named = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if not named and not Path("/usr/local/cuda/include/cuda_runtime.h").exists():
        pytest.skip("no CUDA toolkit in /usr/local/cuda and no CUDA_HOME on this machine")
    found = cfg.find_cuda_toolkit()
    assert found["root"] is not None, found["how"]
    assert (Path(found["root"]) / "include" / "cuda_runtime.h").is_file()
    assert cfg.nvcc_release(cfg.nvcc_version(found["root"])) is not None


# ---------------------------------------------------------------------------------------
# Loading: each part on its own
# ---------------------------------------------------------------------------------------


def _load_with_records(monkeypatch, records, binaries):
    monkeypatch.setattr(_extension, "_read_build_info", lambda part="cpu": records.get(part))
    monkeypatch.setattr(_extension, "_binary_path", lambda part="cpu": binaries.get(part))
    monkeypatch.delenv("POSENC_FAST_DISABLE_EXTENSION", raising=False)


def test_cuda_part_not_built_or_failed_is_reported(monkeypatch):
    def cuda_reasons(**record):
        record.update(torch_version=torch.__version__, python_abi=None, built=False)
        _load_with_records(monkeypatch, {"cuda": record}, {})
        module, reasons, _ = _extension._try_load("cuda")
        assert module is None
        return reasons

    what = "the CUDA part of the extension (posenc_fast._C_cuda)"
    why = "torch X is built without CUDA"
    assert cuda_reasons(attempted=False, cuda_decision=why) == [f"{what} was not built: {why}"]
    error = (
        "RuntimeError: Error building extension '_C_cuda': [3/3] c++ module_cuda.o -o _C_cuda.so\n"
        "/usr/bin/ld: cannot find -lc10_cuda: No such file or directory\n"
        "collect2: error: ld returned 1 exit status\nninja: build stopped: subcommand failed."
    )
    assert cuda_reasons(attempted=True, error=error) == [
        f"building {what} failed at install time "
        "(/usr/bin/ld: cannot find -lc10_cuda: No such file or directory)"
    ]
    # without the compiler's output (setup.py's builds print it instead): the message
    error = "RuntimeError: Error compiling objects for extension"
    assert cuda_reasons(attempted=True, error=error) == [
        f"building {what} failed at install time ({error})"
    ]


def test_long_build_errors_keep_the_compiler_error():
    """A JIT build's error carries the whole compiler output: the record keeps its first
    compiler error and its end; the reason shows that error."""
    noise = "".join(f"[{i}/9] c++ -c file{i}.cpp -o file{i}.o\n" for i in range(300))
    error = (
        "RuntimeError: Error building extension '_C_cuda': " + noise
        + "csrc/x.cpp:3:10: fatal error: c10/cuda/impl/cuda_cmake_macros.h: No such file\n"
        + noise + "ninja: build stopped: subcommand failed."
    )  # fmt: skip
    kept = cfg.error_record(error)
    assert len(kept) <= 4000 and kept.endswith("ninja: build stopped: subcommand failed.")
    want = "csrc/x.cpp:3:10: fatal error: c10/cuda/impl/cuda_cmake_macros.h: No such file"
    assert cfg.error_summary(kept) == want == cfg.error_summary(error)
    assert cfg.error_summary("RuntimeError: Error compiling objects for extension") == (
        "RuntimeError: Error compiling objects for extension"
    )


@pytest.fixture
def parts_state(monkeypatch):
    """Set each part's loader state for a test; restored afterwards."""
    saved = {part: dict(state) for part, state in _extension._state.items()}

    def set_state(part, module, reasons):
        _extension._state[part].update(tried=True, module=module, reasons=reasons, origin=None)

    yield set_state
    for part, state in saved.items():
        _extension._state[part].clear()
        _extension._state[part].update(state)


def test_cuda_backend_refusal_names_the_cuda_part(parts_state):
    parts_state("cpu", object(), [])
    parts_state("cuda", None, ["building the CUDA part failed at install time (why)"])
    assert BACKENDS["cpp"].environment_reasons() == []
    assert BACKENDS["cuda"].environment_reasons() == [
        "building the CUDA part failed at install time (why)"
    ]
    parts_state("cpu", None, ["cpu reason"])
    assert BACKENDS["cuda"].environment_reasons() == ["cpu reason"]  # the ops live there


def test_cuda_part_needs_the_cpu_part(monkeypatch, tmp_path, parts_state):
    parts_state("cpu", None, ["cpu reason"])
    fake = tmp_path / "_C_cuda.so"
    fake.write_bytes(b"not a shared object")  # loading it would fail loudly
    record = {"built": True, "torch_version": torch.__version__, "python_abi": None}
    _load_with_records(monkeypatch, {"cuda": record}, {"cuda": fake})
    module, reasons, _ = _extension._try_load("cuda")
    assert module is None
    assert reasons == [
        "the CUDA part of the extension (posenc_fast._C_cuda) needs the C++ extension "
        "(posenc_fast._C), which is unavailable"
    ]


# ---------------------------------------------------------------------------------------
# setup.py: a CUDA failure keeps the CPU part
# ---------------------------------------------------------------------------------------


def _load_setup_module():
    spec = importlib.util.spec_from_file_location("posenc_fast_setup", ROOT / "setup.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # setup() runs only under __main__
    return mod


def _run_build_ext(
    monkeypatch, tmp_path, require: bool, torch_cuda: str, fails: str = "", force: bool = True
):
    """setup.py's build_ext with a fake CUDA 13.0 toolkit and torch pretending to be built
    with CUDA ``torch_cuda``. The compiler is replaced (a compiled binary is an empty file;
    the module named ``fails`` fails to compile, as torch reports it): what is under test is
    what the command does around it. Returns (modules built, records, warnings)."""
    from setuptools import Distribution
    from setuptools.command.build_ext import build_ext as setuptools_build_ext
    from torch.utils import cpp_extension

    toolkit = _toolkit(tmp_path / "cuda-13.0")
    monkeypatch.setattr(torch.version, "cuda", torch_cuda)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", cpp_extension.CUDA_HOME)
    monkeypatch.setenv("CUDA_HOME", str(toolkit))
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    monkeypatch.setenv("POSENC_FAST_FORCE_CUDA", "1" if force else "0")
    for var in ("POSENC_FAST_NO_CUDA", "POSENC_FAST_SKIP_EXTENSION", "POSENC_FAST_DEBUG"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("POSENC_FAST_REQUIRE_EXTENSION", "1" if require else "0")
    built = []

    def fake_compile_and_link(self, ext):
        if fails and ext.name == f"posenc_fast.{fails}":
            raise RuntimeError("Error compiling objects for extension")
        built.append(ext.name)
        path = Path(self.get_ext_fullpath(ext.name))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")

    monkeypatch.setattr(setuptools_build_ext, "build_extension", fake_compile_and_link)
    with warnings.catch_warnings(record=True) as at_plan:
        warnings.simplefilter("always")
        kwargs = _load_setup_module()._extension_setup()
    # pip executes setup.py several times per install: warnings belong to the build itself
    assert not [w for w in at_plan if str(w.message).startswith("posenc_fast")]
    want = ["posenc_fast._C", "posenc_fast._C_cuda"] if force else None
    assert want is None or [e.name for e in kwargs["ext_modules"]] == want
    dist = Distribution({"name": "posenc-fast", **kwargs})
    cmd = dist.get_command_obj("build_ext")
    cmd.build_lib = str(tmp_path / "lib")
    cmd.build_temp = str(tmp_path / "temp")
    cmd.ensure_finalized()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cmd.run()
    records = {
        part: json.loads((tmp_path / "lib" / "posenc_fast" / name).read_text())
        for part, (_stem, name) in cfg.PARTS.items()
    }
    mine = [str(w.message) for w in caught if str(w.message).startswith("posenc_fast")]
    return built, records, mine


def _cuda_record(tmp_path) -> dict:
    return json.loads((tmp_path / "lib" / "posenc_fast" / cfg.CUDA_BUILD_INFO).read_text())


def test_cuda_version_check_failure_installs_the_cpu_part(monkeypatch, tmp_path):
    """torch raises inside build_extensions() before building any extension (toolkit 13.0,
    torch cu124): the CPU part is built all the same."""
    built, records, warned = _run_build_ext(monkeypatch, tmp_path, False, "12.4")
    assert built == ["posenc_fast._C"]
    assert records["cpu"]["built"] is True and records["cpu"]["binary"].startswith("_C.")
    cuda = records["cuda"]
    assert cuda["built"] is False and cuda["attempted"] is True
    # torch's own message, formatted: the toolkit's version against torch's
    assert "RuntimeError" in cuda["error"] and "13.0" in cuda["error"] and "12.4" in cuda["error"]
    assert len(warned) == 1, warned
    assert "the CUDA part of the extension (posenc_fast._C_cuda) is not built" in warned[0]
    assert "Installing the C++ CPU part without it" in warned[0]
    assert "13.0" in warned[0] and "12.4" in warned[0]


def test_toolkit_mismatch_found_at_plan_time_warns_once_at_build(monkeypatch, tmp_path):
    """Without POSENC_FAST_FORCE_CUDA the mismatch (toolkit 13.0, torch cu124) is found
    before building: the CUDA module is not attempted, the CPU part is built, and the one
    warning comes from the build, not from each execution of setup.py."""
    built, records, warned = _run_build_ext(monkeypatch, tmp_path, False, "12.4", force=False)
    assert built == ["posenc_fast._C"] and records["cpu"]["built"] is True
    assert records["cuda"]["built"] is False
    assert len(warned) == 1, warned
    assert "13.0" in warned[0] and "12.4" in warned[0]


def test_cuda_compile_failure_installs_the_cpu_part(monkeypatch, tmp_path):
    built, records, warned = _run_build_ext(monkeypatch, tmp_path, False, "13.0", "_C_cuda")
    assert built == ["posenc_fast._C"] and records["cpu"]["built"] is True
    assert records["cuda"]["built"] is False
    assert records["cuda"]["error"] == "RuntimeError: Error compiling objects for extension"
    assert len(warned) == 1 and "Error compiling objects" in warned[0], warned


REQUIRED_FAILURES = [("12.4", "", "12.4"), ("13.0", "_C_cuda", "Error compiling")]


@pytest.mark.parametrize(
    ("torch_cuda", "fails", "match"), REQUIRED_FAILURES, ids=["version", "compile"]
)
def test_cuda_failure_fails_the_install_when_required(
    monkeypatch, tmp_path, torch_cuda, fails, match
):
    with pytest.raises(RuntimeError, match=match) as raised:
        _run_build_ext(monkeypatch, tmp_path, True, torch_cuda, fails)
    assert "POSENC_FAST_REQUIRE_EXTENSION=1 makes this an error" in str(raised.value)
    assert _cuda_record(tmp_path)["built"] is False


@pytest.mark.parametrize("require", [False, True], ids=["default", "required"])
def test_cpu_failure_fails_the_install(monkeypatch, tmp_path, require):
    """pip must not report success having lost the CPU part: its failure is fatal (the CUDA
    module is not even attempted after it)."""
    with pytest.raises(RuntimeError, match=r"building the C\+\+ CPU part") as raised:
        _run_build_ext(monkeypatch, tmp_path, require, "13.0", "_C")
    assert "POSENC_FAST_SKIP_EXTENSION=1" in str(raised.value)
    record = json.loads((tmp_path / "lib" / "posenc_fast" / cfg.BUILD_INFO).read_text())
    assert record["built"] is False and "Error compiling" in record["error"]


@pytest.mark.slow
def test_failed_cuda_build_leaves_a_working_cpp_backend(tmp_path):
    """End to end, with the real compilers: a copy of the sources, the CUDA part forced on
    this torch (POSENC_FAST_FORCE_CUDA=1). Where torch has no CUDA (CI: the CPU wheel) the
    CUDA part fails as it naturally does there (no CUDA libraries of torch to compile and
    link against); the CPU part is built (-O0: POSENC_FAST_DEBUG=1, for time), installed
    and loaded, the "cpp" backend runs, and info reports why "cuda" is unavailable.
    (POSENC_FAST_REQUIRE_EXTENSION=1 turning this into a failed install: the tests above.)"""
    if torch.version.cuda is not None:
        pytest.skip("torch has CUDA here: a forced CUDA build may succeed")
    if cfg.find_cuda_toolkit()["root"] is None:
        pytest.skip("no CUDA toolkit here: the CUDA part would fail before compiling anything")
    src = tmp_path / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "_build_info*.json")
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("csrc", "posenc_fast", "triton_kernels"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    env = {k: v for k, v in os.environ.items() if not k.startswith("POSENC_FAST_")}
    env.update(
        POSENC_FAST_FORCE_CUDA="1",
        POSENC_FAST_DEBUG="1",
        TORCH_CUDA_ARCH_LIST="8.0",
        MAX_JOBS=env.get("MAX_JOBS", "2"),
    )
    build = [sys.executable, "setup.py", "build_ext", "--inplace"]
    r = subprocess.run(build, cwd=src, env=env, capture_output=True, text=True, timeout=900)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    assert log.count("the CUDA part of the extension (posenc_fast._C_cuda) is not built") == 1
    pkg = src / "posenc_fast"
    assert (pkg / f"_C{sysconfig.get_config_var('EXT_SUFFIX')}").is_file()
    assert not list(pkg.glob("_C_cuda*.so"))
    cuda = json.loads((pkg / cfg.CUDA_BUILD_INFO).read_text())
    assert cuda["built"] is False and cuda["attempted"] is True and cuda["error"]

    check = (
        "import json, torch, posenc_fast as pf\n"
        "from posenc_fast import _extension\n"
        "g = torch.Generator().manual_seed(0)\n"
        "S, d, H = 3, 4, 5\n"
        "args = [torch.randn(S, d, generator=g), torch.randn(d + 1, H, generator=g),\n"
        "        torch.randn(H, generator=g), torch.randn(H + 1, d, generator=g),\n"
        "        torch.randn(d, generator=g), torch.tensor([0.1, 0.3, 0.4])]\n"
        "a = pf.floater(*args, substeps=2, backend='cpp')\n"
        "b = pf.floater(*args, substeps=2, backend='torch')\n"
        "torch.testing.assert_close(a, b)\n"
        "r = pf.available_backends(verbose=True)\n"
        "print(json.dumps({'file': _extension.__file__, 'cpp': r['cpp'], 'cuda': r['cuda']}))\n"
    )
    run_env = dict(env, PYTHONPATH=str(src))
    for k in ("POSENC_FAST_FORCE_CUDA", "POSENC_FAST_DEBUG"):
        run_env.pop(k)
    r = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, env=run_env,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["file"].startswith(str(src)), got
    assert got["cpp"] == []
    assert got["cuda"] and "building the CUDA part of the extension" in got["cuda"][0]
    info = subprocess.run([sys.executable, "-m", "posenc_fast", "info"], cwd=tmp_path,
                          env=run_env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert info.returncode == 0, info.stderr[-3000:]
    assert "cpu   posenc_fast._C: available" in info.stdout
    assert "cuda  posenc_fast._C_cuda: unavailable: building the CUDA part" in info.stdout
