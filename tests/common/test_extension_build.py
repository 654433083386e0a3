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
import platform
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
from posenc_fast import _extension, _extension_build, _extension_cache
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
    monkeypatch.setattr(_extension_cache, "read_build_info", lambda part="cpu": records.get(part))
    monkeypatch.setattr(_extension_cache, "binary_path", lambda part="cpu": binaries.get(part))
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


# ---------------------------------------------------------------------------------------
# Shipping the sources, and what a build is tied to
# ---------------------------------------------------------------------------------------


def test_every_source_folder_ships_as_package_data():
    """Wheels and sdists carry csrc/ as posenc_fast/csrc (pyproject.toml): every folder
    with sources is a listed package whose package-data patterns cover all its files that
    the sources hash covers, so an installed package can compile what a checkout compiles."""
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"]["posenc_fast.csrc"] == "csrc"
    for folder in sorted({p.parent for p in (ROOT / "csrc").rglob("*") if p.is_file()}):
        rel = folder.relative_to(ROOT / "csrc")
        package = ".".join(("posenc_fast", "csrc", *rel.parts))
        assert package in config["packages"], f"{folder} is not shipped: add {package}"
        patterns = config["package-data"][package]
        for f in folder.iterdir():
            if f.suffix in cfg.SOURCE_SUFFIXES:
                assert f"*{f.suffix}" in patterns, f"{f} is not shipped ({package}: {patterns})"


def _sources(root: Path, body: str = "int one() { return 1; }\n") -> Path:
    """A source root with csrc/module.cpp (what marks a source tree) and one more file."""
    (root / "csrc" / "sub").mkdir(parents=True)
    (root / "csrc" / "module.cpp").write_text(body)
    (root / "csrc" / "sub" / "k.h").write_text("#pragma once\n")
    (root / "csrc" / "README.md").write_text("not compiled: not hashed\n")
    return root


def test_sources_hash_follows_the_sources(tmp_path):
    a = _sources(tmp_path / "a")
    b = _sources(tmp_path / "b")
    assert cfg.sources_hash(a) == cfg.sources_hash(b) and len(cfg.sources_hash(a)) == 64
    (b / "csrc" / "README.md").write_text("edited")
    assert cfg.sources_hash(a) == cfg.sources_hash(b)
    (b / "csrc" / "sub" / "k.h").write_text("#pragma once\n// edited\n")
    assert cfg.sources_hash(a) != cfg.sources_hash(b)
    assert cfg.sources_hash(tmp_path / "nothing") is None
    assert _extension_cache.sources_hash() == cfg.sources_hash(_extension_cache.source_root())


def test_abi_tag_names_what_a_binary_is_tied_to():
    tag = _extension_cache.current_abi_tag()
    assert tag.startswith(f"torch{torch.__version__}-cxx11abi")
    assert sys.implementation.cache_tag in tag and platform.machine() in tag
    assert cfg.abi_tag("2.5.1+cu124", False) != cfg.abi_tag("2.5.1+cu124", True)
    key = _extension_cache.cache_key()
    assert key.startswith(tag) and _extension_cache.sources_hash()[:16] in key


def _record_now(**changes) -> dict:
    record = {
        "built": True,
        "torch_version": torch.__version__,
        "python_abi": sysconfig.get_config_var("EXT_SUFFIX"),
        "abi_tag": _extension_cache.current_abi_tag(),
        "sources_hash": _extension_cache.sources_hash(),
    }
    record.update(changes)
    return record


def test_stale_binaries_are_refused_with_the_reason():
    assert _extension_cache.mismatch(_record_now()) == []
    fake = "torch2.13.0+cpu-cxx11abi0-cpython-311-x86_64"
    (why,) = _extension_cache.mismatch(_record_now(abi_tag=fake))
    assert f"ABI tag {fake} (recorded at build time)" in why
    assert _extension_cache.current_abi_tag() in why and "python -m posenc_fast build" in why
    (why,) = _extension_cache.mismatch(_record_now(sources_hash="0" * 64))
    assert "built from other sources (hash 000000000000)" in why
    (why,) = _extension_cache.mismatch(_record_now(torch_version="2.5.1"))
    assert why.startswith("the extension was built for torch 2.5.1, this process runs")
    # records of older builds carry neither field: the torch and Python checks decide
    assert _extension_cache.mismatch(_record_now(abi_tag=None, sources_hash=None)) == []


# ---------------------------------------------------------------------------------------
# The first-use build: cache, lock, refusals (a tiny extension compiled for real)
# ---------------------------------------------------------------------------------------

TINY = """#include <Python.h>
static struct PyModuleDef tiny = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&tiny); }
"""


@pytest.fixture
def tiny(monkeypatch, tmp_path):
    """A source tree whose "extension" is a one-line Python module (seconds to compile,
    through the real child process, ninja and torch.utils.cpp_extension), an empty cache
    in tmp_path, and the plan that builds the tiny module instead of csrc/'s."""
    root = _sources(tmp_path / "src", TINY)
    monkeypatch.setattr(_extension_cache, "source_root", lambda: root)
    monkeypatch.setenv("POSENC_FAST_CACHE", str(tmp_path / "cache"))
    for var in ("POSENC_FAST_NO_BUILD", "POSENC_FAST_DEBUG", "POSENC_FAST_BUILD_WAIT"):
        monkeypatch.delenv(var, raising=False)
    plan = cfg.plan_build(
        torch_version=torch.__version__,
        torch_cuda_version=torch.version.cuda,
        no_cuda="test",
        cxx11_abi=getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", None),
        source_root=root,
    )
    plan["cpu"].update(sources=["csrc/module.cpp"], cxx=["-O0"])
    return root, plan


def _build(plan, **kw):
    return _extension_build.build_part("cpu", first_use=True, plan=plan, **kw)


def test_first_use_build_compiles_once_into_the_cache(tiny, capfd):
    root, plan = tiny
    path, why = _build(plan)
    assert why == "" and path is not None, why
    target = _extension_cache.cache_dir("cpu")
    assert path.parent == target and path.name == f"_C{sysconfig.get_config_var('EXT_SUFFIX')}"
    assert target.parent.name == _extension_cache.cache_key()
    record = json.loads((target / cfg.BUILD_INFO).read_text())
    assert record["built"] is True and record["abi_tag"] == _extension_cache.current_abi_tag()
    assert record["sources_hash"] == cfg.sources_hash(root) and record["build_seconds"] >= 0
    # nothing but the binary and its record: the objects and temporary folders are gone
    assert sorted(p.name for p in target.iterdir()) == sorted([path.name, cfg.BUILD_INFO])
    assert not [p for p in target.parent.iterdir() if p.name.startswith(".")]
    err = capfd.readouterr().err
    assert err.count("posenc_fast: building the C++ extension (posenc_fast._C)") == 1
    assert "posenc_fast: [1/2] compiled module.cpp" in err and "[2/2] linked" in err
    assert "posenc_fast: built the C++ extension (posenc_fast._C) in" in err
    # a second time: found, not compiled
    again, _ = _build(plan)
    assert again == path and "building" not in capfd.readouterr().err


def test_concurrent_first_use_builds_compile_once(tiny, capfd):
    """Three threads (each its own open file, so flock treats them like processes) ask at
    once: one compiles, the others wait for the lock and take its result."""
    import threading

    _root, plan = tiny
    results = []
    threads = [threading.Thread(target=lambda: results.append(_build(plan))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    paths = {path for path, _why in results}
    assert len(results) == 3 and len(paths) == 1 and None not in paths, results
    err = capfd.readouterr().err
    assert err.count("posenc_fast: building the C++ extension") == 1, err
    assert "another process is building the C++ extension" in err


def test_a_held_lock_is_waited_for_then_given_up(tiny, monkeypatch):
    import fcntl

    _root, plan = tiny
    monkeypatch.setenv("POSENC_FAST_BUILD_WAIT", "1")
    target = _extension_cache.cache_dir("cpu")
    target.parent.mkdir(parents=True)
    with open(target.parent / "cpu.lock", "a+") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)  # another process, mid-build
        path, why = _build(plan)
    assert path is None
    assert "another process has been building the C++ extension" in why
    assert "POSENC_FAST_BUILD_WAIT" in why


def test_failed_build_is_remembered_until_an_explicit_build(tiny, capfd):
    root, plan = tiny
    (root / "csrc" / "module.cpp").write_text("this is not C++\n")
    path, why = _build(plan)
    assert path is None and "building the C++ extension (posenc_fast._C) failed" in why
    assert "error:" in why and "python -m posenc_fast build" in why
    failed = _extension_cache.cache_dir("cpu").parent / "cpu.failed.json"
    assert json.loads(failed.read_text())["built"] is False
    assert not _extension_cache.cache_dir("cpu").exists()
    capfd.readouterr()
    # other processes (first use) do not spend the time again ...
    path, why = _build(plan)
    assert path is None and "failed at" in why and "building" not in capfd.readouterr().err
    # ... an explicit build does (here with the sources fixed: same key, for the test)
    (root / "csrc" / "module.cpp").write_text(TINY)
    path, why = _extension_build.build_part("cpu", plan=plan)
    assert path is not None and not failed.exists(), why


def test_where_building_is_forbidden_or_impossible(monkeypatch, tmp_path):
    """POSENC_FAST_NO_BUILD, an unwritable cache, no compiler, no sources: no build, and a
    reason that says how to build (the dispatcher turns it into one warning)."""
    monkeypatch.setenv("POSENC_FAST_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("POSENC_FAST_NO_BUILD", "1")
    path, why = _extension_build.first_use_build("cpu")
    assert path is None and "POSENC_FAST_NO_BUILD forbids building it on first use" in why
    assert "python -m posenc_fast build" in why
    monkeypatch.delenv("POSENC_FAST_NO_BUILD")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("POSENC_FAST_CACHE", str(blocker / "cache"))  # under a file: unwritable
    path, why = _extension_build.first_use_build("cpu")
    assert path is None and f"the build cache {blocker / 'cache'} is not writable" in why
    assert "POSENC_FAST_CACHE" in why
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    path, why = _extension_build.first_use_build("cpu")
    assert path is None and "no C++ compiler found ('no-such-compiler-here' from CXX)" in why
    monkeypatch.delenv("CXX")
    monkeypatch.setattr(_extension_cache, "source_root", lambda: None)
    path, why = _extension_build.first_use_build("cpu")
    assert path is None and "carries no C++ sources" in why


def test_ninja_progress_lines():
    line = "[3/10] c++ -MMD -MF lff_cpu.o.d -O3 -c /x/csrc/lff/lff_cpu.cpp -o lff_cpu.o\n"
    assert _extension_build.ninja_step(line) == "[3/10] compiled lff_cpu.cpp"
    assert _extension_build.ninja_step("[10/10] c++ a.o b.o -shared -o _C.so") == "[10/10] linked"
    assert _extension_build.ninja_step("Emitting ninja build file /x/build.ninja...") is None


# ---------------------------------------------------------------------------------------
# End to end: a plain `pip install` in a fresh venv, as a new user does it
# ---------------------------------------------------------------------------------------

# One LFF call on the cpp backend, checked against the float64 reference; prints where
# the binary came from. The call is what triggers the first-use build.
LFF_CALL = """
import json, sys, time, warnings
import torch
import posenc_fast as pf
from posenc_fast import _extension
from posenc_fast.tolerances import tol
g = torch.Generator().manual_seed(int(sys.argv[1]))
x = torch.rand(37, 2, 2, generator=g)
pe = pf.LearnableFourierFeatures(2, 64, 32, 48, groups=2, gamma=10.0)
start = time.perf_counter()
with warnings.catch_warnings(record=True) as caught, torch.no_grad():
    warnings.simplefilter("always")
    args = (x, pe.wr, pe.w1, pe.b1, pe.w2, pe.b2)
    y = pf.lff(*args, activation="gelu")  # auto: the cpp backend on the CPU, if it loads
    ref = pf.lff(*[a.double() for a in args], activation="gelu", backend="reference")
seconds = time.perf_counter() - start
state = _extension._state["cpu"]
mine = [str(w.message) for w in caught if "posenc_fast" in str(w.message)]
t = tol(torch.float32, "lff")
ok = bool(((y.double() - ref).abs() <= t.atol + t.rtol * ref.abs()).all())
print(json.dumps({"source": state["source"], "path": state["origin"], "seconds": seconds,
                  "reasons": _extension.reasons(), "warnings": mine, "close": ok}))
"""


def _fresh_venv(tmp_path: Path) -> Path:
    """A venv with nothing but torch (the pin of constraints.txt: this machine's local CPU
    wheel, no multi-GB download) and posenc_fast from a plain, isolated `pip install` of a
    clean copy of this checkout (no binary in it: what a user's clone has)."""
    src = tmp_path / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "_build_info*.json", "*.egg-info")
    for name in ("setup.py", "pyproject.toml", "README.md", "MANIFEST.in", "constraints.txt"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("csrc", "posenc_fast", "triton_kernels"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    pip = [
        str(venv / "bin" / "python"),
        "-m",
        "pip",
        "install",
        "-q",
        "-c",
        str(src / "constraints.txt"),
    ]
    for target in (["torch==2.13.0"], [str(src)]):
        r = subprocess.run(pip + target, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return venv


def _run_lff(venv: Path, env: dict, seed: int, wait: bool = True):
    cmd = [str(venv / "bin" / "python"), "-c", LFF_CALL, str(seed)]
    proc = subprocess.Popen(cmd, env=env, cwd=venv, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    return _finish(proc) if wait else proc


def _finish(proc) -> tuple[dict, str]:
    out, err = proc.communicate(timeout=1800)
    assert proc.returncode == 0, err[-4000:]
    return json.loads(out.strip().splitlines()[-1]), err


def _plain_venv(tmp_path: Path) -> Path:
    """The venv of the plain-install test: POSENC_FAST_PLAIN_VENV names one that
    tools/check_oldest_torch.sh made (the oldest torch, then a plain `pip install` of this
    checkout: CI runs the test there, so that its -O0 build is the one that check needs
    anyway), or "fresh" makes one here (torch of constraints.txt; ~10-15 min on 2 cores)."""
    where = os.environ.get("POSENC_FAST_PLAIN_VENV")
    if not where:
        pytest.skip(
            "a plain install and its real first-use build: tools/check_oldest_torch.sh runs "
            "this test in its venv (CI does); POSENC_FAST_PLAIN_VENV=fresh makes a venv here"
        )
    return _fresh_venv(tmp_path) if where == "fresh" else Path(where)


def _compiler_without_debug_info(tmp_path: Path, env: dict) -> str:
    """A $CXX that runs the caller's compiler ($CXX, else c++) with -g0 last: the debug
    build's -O0 without its debug information, which this test does not use and which is
    ~45% of its compile time (two of the sources timed at -O0 -g and -O0 on CI's kind of
    machine: 111 s and 60 s). It also checks that first-use builds honour $CXX."""
    wrapper = tmp_path / "cxx-without-debug-info" / "c++"
    wrapper.parent.mkdir()
    called = wrapper.parent / "called"  # the test asserts the build ran through it
    wrapper.write_text(f'#!/bin/sh\n: > "{called}"\nexec {env.get("CXX") or "c++"} "$@" -g0\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def _venv_torch_cuda(venv: Path) -> str | None:
    out = subprocess.run([str(venv / "bin" / "python"), "-c",
                          "import torch; print(torch.version.cuda or '')"],
                         capture_output=True, text=True, timeout=300, check=True)  # fmt: skip
    return out.stdout.strip() or None


@pytest.mark.slow
def test_plain_pip_install_builds_on_first_use_then_reuses(tmp_path):
    """The first-use build as a user meets it, in a fresh venv with a plain `pip install
    <repo>` (_plain_venv): the wheel carries the sources and no binary; two processes
    started together both use the cpp backend after one first-use build (the other waits
    for it); a later process reuses the cache without building; a CUDA part that cannot be
    built leaves the cpp backend working and `info` saying why; a cached build with another
    ABI tag is refused with the reason in `info`; POSENC_FAST_NO_BUILD=1 gives the torch
    fallback with one warning. The build is at -O0 (POSENC_FAST_DEBUG=1) without debug
    information (_compiler_without_debug_info) for time, into
    POSENC_FAST_PLAIN_CACHE (empty; default a temporary folder), left valid at the end for
    the caller's `verify`. (The same CUDA failure through setup.py: the tests above, with
    the compilers mocked.)"""
    venv = _plain_venv(tmp_path)
    site = next((venv / "lib").glob("python3*/site-packages/posenc_fast"))
    assert (site / "csrc" / "lff" / "lff_cpu.cpp").is_file()
    assert (site / "csrc" / "floater" / "floater_cuda_team.cuh").is_file()
    assert not list(site.glob("_C*.so")), "a plain isolated install must not ship a binary"
    cache = Path(os.environ.get("POSENC_FAST_PLAIN_CACHE") or tmp_path / "cache")
    assert not cache.exists() or not any(cache.iterdir()), f"{cache} must start empty"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("POSENC_FAST_", "PYTHON"))}
    env.update(POSENC_FAST_CACHE=str(cache), POSENC_FAST_DEBUG="1",
               MAX_JOBS=os.environ.get("MAX_JOBS", "2"))  # fmt: skip
    env["CXX"] = _compiler_without_debug_info(tmp_path, env)
    env.pop("TRITON_INTERPRET", None)

    # two processes at once, nothing built yet: one builds, the other waits for it
    results = [_finish(p) for p in [_run_lff(venv, env, seed, wait=False) for seed in (1, 2)]]
    errs = "".join(err for _, err in results)
    assert errs.count("posenc_fast: building the C++ extension (posenc_fast._C)") == 1, errs
    assert errs.count("posenc_fast: built the C++ extension (posenc_fast._C) in") == 1, errs
    assert "compiled lff_cpu.cpp" in errs, errs  # ninja's progress, one line per step
    for got, _err in results:
        assert got["source"] == "cache" and got["reasons"] == [] and got["warnings"] == []
        assert got["close"], got
    assert (Path(env["CXX"]).parent / "called").exists(), "the build did not run $CXX"
    cached = Path(results[0][0]["path"])
    assert cached.parent.parent.parent == cache and cached.is_file()

    # a later process: the cache, no build
    got, err = _run_lff(venv, env, 3)
    assert got["source"] == "cache" and got["path"] == str(cached) and "building" not in err

    # a CUDA part that cannot be built leaves the cpp backend working, and says why. Where
    # the venv's torch has no CUDA (the CPU wheel) a forced CUDA build fails as it naturally
    # does there (torch ships no CUDA headers); where its CUDA's major version is not the
    # toolkit's (the oldest torch's CUDA 12 beside CUDA 13 here), the plain build skips it
    # with that reason. The CPU part is reused from the cache.
    toolkit = cfg.find_cuda_toolkit()
    torch_cuda = _venv_torch_cuda(venv)
    release = cfg.nvcc_release(cfg.nvcc_version(toolkit["root"])) if toolkit["root"] else None
    if toolkit["root"] is not None and (torch_cuda is None or (
        release and release.split(".")[0] != torch_cuda.split(".")[0]
    )):  # fmt: skip
        args = ["--cuda", "yes"] if torch_cuda is None else []
        build = subprocess.run([str(venv / "bin" / "python"), "-m", "posenc_fast", "build",
                                *args], env=env, cwd=venv, capture_output=True, text=True,
                               timeout=1800)  # fmt: skip
        assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
        assert f"posenc_fast._C: ready: {cached}" in build.stdout, build.stdout
        if torch_cuda is None:
            assert "posenc_fast._C_cuda: build failed: building the CUDA part" in build.stdout
            why = "building the CUDA part of the extension (posenc_fast._C_cuda) failed at"
        else:
            assert "posenc_fast._C_cuda: not built:" in build.stdout, build.stdout
            assert "torch builds no extension against another major version" in build.stdout
            why = "a CUDA toolkit of the same major version"  # info: how to get it built
        got, err = _run_lff(venv, env, 6)
        assert got["source"] == "cache" and got["reasons"] == [] and got["close"], got
        assert "building" not in err  # neither part is retried on first use
        info = subprocess.run([str(venv / "bin" / "python"), "-m", "posenc_fast", "info"],
                              env=env, cwd=venv, capture_output=True, text=True,
                              timeout=300)  # fmt: skip
        assert info.returncode == 0, info.stderr[-3000:]
        assert "cpu   posenc_fast._C: available" in info.stdout, info.stdout
        assert "cuda  posenc_fast._C_cuda: unavailable: " in info.stdout, info.stdout
        assert why in info.stdout, info.stdout

    # a stale build (another ABI tag recorded): refused, with the reason, never loaded
    record_path = cached.parent / cfg.BUILD_INFO
    original = record_path.read_text()
    record = json.loads(original)
    record["abi_tag"] = "torch2.13.0+cpu-cxx11abi0-cpython-311-fake"
    record_path.write_text(json.dumps(record))
    try:
        _stale_and_no_build(venv, env, tmp_path, cached)
    finally:
        record_path.write_text(original)  # the cache stays valid for the caller's verify


def _stale_and_no_build(venv: Path, env: dict, tmp_path: Path, cached: Path):
    stale_env = dict(env, POSENC_FAST_NO_BUILD="1")
    got, _ = _run_lff(venv, stale_env, 4)
    assert got["source"] is None and len(got["warnings"]) == 1, got
    assert (
        "ABI tag torch2.13.0+cpu-cxx11abi0-cpython-311-fake (recorded at build time)"
        in (got["reasons"][0])
    )
    info = subprocess.run([str(venv / "bin" / "python"), "-m", "posenc_fast", "info"],
                          env=stale_env, cwd=venv, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert info.returncode == 0, info.stderr[-3000:]
    assert f"ignored: {cached}: the extension's ABI tag" in info.stdout, info.stdout

    # POSENC_FAST_NO_BUILD=1 and an empty cache: the torch fallback, exactly one warning
    got, err = _run_lff(venv, dict(stale_env, POSENC_FAST_CACHE=str(tmp_path / "empty")), 5)
    assert got["source"] is None and "building" not in err
    (warning,) = got["warnings"]
    assert "backend 'cpp' is unavailable" in warning and "POSENC_FAST_NO_BUILD" in warning
    assert "python -m posenc_fast build" in warning
    assert got["close"], got


@pytest.mark.parametrize("version, stops", [("76.1.0", True), ("77.0.3", False)])
def test_a_setuptools_too_old_for_the_license_field_stops_the_build_in_one_line(version, stops):
    """`pip install --no-build-isolation` uses the environment's setuptools: before 77 it
    cannot read pyproject.toml's license string, and says so cryptically. setup.py says it
    first, in one line naming the version it needs."""
    code = (
        "import setuptools, sys, runpy\n"
        f"setuptools.__version__ = {version!r}\n"
        "sys.argv = ['setup.py', '--version']\n"
        "runpy.run_path('setup.py', run_name='__main__')\n"
    )
    env = {**os.environ, "POSENC_FAST_SKIP_EXTENSION": "1"}
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    if stops:
        assert run.returncode == 1
        assert run.stderr.strip().splitlines() == [
            f"posenc_fast: building needs setuptools>=77 (this environment has {version}): "
            "`pip install 'setuptools>=77'` first, or install without --no-build-isolation"
        ]
    else:
        assert run.returncode == 0, run.stderr[-2000:]
