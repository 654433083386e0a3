"""Building the extension: setup.py's ahead-of-time build (two modules, posenc_fast._C for
the CPU and posenc_fast._C_cuda for CUDA, so that the CPU part never depends on the CUDA
part), the first-use build into the user cache, and what a build is tied to.

torch.utils.cpp_extension does the building; what is tested here is what posenc_fast does
around it: POSENC_FAST_BUILD, a CUDA failure that keeps the CPU part (torch's own CUDA
version check raising, on a fake toolkit; setup.py's build command with the compiler
replaced), the build records, the cache folder and its fast path, the lock that makes
concurrent first uses build once (torch's, through our use of it), the remembered failure,
and a plain `pip install` end to end (a fresh venv: tools/check_oldest_torch.sh runs it).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import platform
import shutil
import stat
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from posenc_fast import _build_config as cfg
from posenc_fast import _extension
from posenc_fast._dispatch import BACKENDS

ROOT = Path(__file__).resolve().parents[2]


def _toolkit(root: Path, release: str = "13.0") -> Path:
    """A fake CUDA toolkit: the header, and an nvcc that reports its release."""
    (root / "include").mkdir(parents=True)
    (root / "include" / "cuda_runtime.h").write_text("/* fake */\n")
    nvcc = root / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    line = f"Cuda compilation tools, release {release}, V{release}.88"
    nvcc.write_text(f"#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'; echo '{line}'\n")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return root


# ---------------------------------------------------------------------------------------
# setup.py: POSENC_FAST_BUILD, and a CUDA failure keeps the CPU part
# ---------------------------------------------------------------------------------------


def _load_setup_module():
    spec = importlib.util.spec_from_file_location("posenc_fast_setup", ROOT / "setup.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # setup() runs only under __main__
    return mod


@pytest.mark.parametrize(
    ("choice", "torch_cuda", "toolkit", "want"),
    [
        ("auto", None, True, ["posenc_fast._C"]),  # torch without CUDA
        ("auto", "13.0", False, ["posenc_fast._C"]),  # torch finds no toolkit
        ("auto", "13.0", True, ["posenc_fast._C", "posenc_fast._C_cuda"]),
        ("cpu", "13.0", True, ["posenc_fast._C"]),
        ("cuda", None, True, ["posenc_fast._C", "posenc_fast._C_cuda"]),  # attempted anyway
        ("cuda", "13.0", False, ["posenc_fast._C"]),  # torch cannot even name its libraries
        ("none", "13.0", True, []),
    ],
)
def test_build_choice_decides_the_modules_without_asking_a_gpu(
    monkeypatch, tmp_path, choice, torch_cuda, toolkit, want
):
    """POSENC_FAST_BUILD, torch's CUDA and the toolkit torch found (its CUDA_HOME) decide;
    never a GPU (an isolated build, or a machine without one, has none to ask)."""

    def boom(*a, **k):
        raise AssertionError("setup.py must not probe a GPU")

    for name in ("is_available", "device_count", "get_device_capability"):
        monkeypatch.setattr(torch.cuda, name, boom)
    monkeypatch.setattr(torch.version, "cuda", torch_cuda)
    home = str(_toolkit(tmp_path / "cuda")) if toolkit else None
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", home)
    monkeypatch.setenv(cfg.BUILD_ENV, choice)
    kwargs = _load_setup_module()._extension_setup()
    assert [e.name for e in kwargs.get("ext_modules", [])] == want


def test_an_unknown_build_choice_is_refused_with_its_name(monkeypatch):
    monkeypatch.setenv(cfg.BUILD_ENV, "yes")
    with pytest.raises(RuntimeError, match=r"POSENC_FAST_BUILD='yes' is not one of auto, cpu"):
        _load_setup_module()._extension_setup()
    assert cfg.build_choice({cfg.BUILD_ENV: " CPU "}) == ("cpu", None)
    assert cfg.build_choice({}) == ("auto", None)


def _run_build_ext(monkeypatch, tmp_path, torch_cuda: str, fails: str = "", choice="cuda",
                   require=False):  # fmt: skip
    """setup.py's build_ext with a fake CUDA 13.0 toolkit as torch's CUDA_HOME and torch
    pretending to be built with CUDA ``torch_cuda``. The compiler is replaced (a compiled
    binary is an empty file; the module named ``fails`` fails to compile, as torch reports
    it): what is under test is what the command does around it. Returns (modules built,
    records, warnings)."""
    from setuptools import Distribution
    from setuptools.command.build_ext import build_ext as setuptools_build_ext

    monkeypatch.setattr(torch.version, "cuda", torch_cuda)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(_toolkit(tmp_path / "cuda-13.0")))
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    monkeypatch.setenv(cfg.BUILD_ENV, choice)
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
        for part, name in cfg.RECORDS.items()
    }
    mine = [str(w.message) for w in caught if str(w.message).startswith("posenc_fast")]
    return built, records, mine


@pytest.mark.parametrize("choice", ["auto", "cuda"])
def test_torch_cuda_version_check_failure_installs_the_cpu_part(monkeypatch, tmp_path, choice):
    """torch's BuildExtension raises before building any extension where the toolkit's
    CUDA major version is not torch's (13.0 against cu124): the CPU part is built all the
    same, with one warning, and the CUDA part's record says why."""
    built, records, warned = _run_build_ext(monkeypatch, tmp_path, "12.4", choice=choice)
    assert built == ["posenc_fast._C"]
    assert records["cpu"]["built"] is True and records["cpu"]["binary"].startswith("_C.")
    assert records["cpu"]["abi_tag"] == cfg.abi_tag(torch)
    assert records["cpu"]["sources_hash"] == cfg.sources_hash(ROOT)
    cuda = records["cuda"]
    assert cuda["built"] is False and cuda["cuda_archs"] == "9.0"
    # torch's own message, formatted: the toolkit's version against torch's
    assert "RuntimeError" in cuda["error"] and "13.0" in cuda["error"] and "12.4" in cuda["error"]
    assert len(warned) == 1, warned
    assert "the CUDA part of the extension (posenc_fast._C_cuda) is not built" in warned[0]
    assert "Installing the C++ CPU part without it" in warned[0]
    assert "13.0" in warned[0] and "12.4" in warned[0]


def test_cuda_compile_failure_installs_the_cpu_part(monkeypatch, tmp_path):
    built, records, warned = _run_build_ext(monkeypatch, tmp_path, "13.0", "_C_cuda")
    assert built == ["posenc_fast._C"] and records["cpu"]["built"] is True
    assert records["cuda"]["built"] is False
    assert records["cuda"]["error"] == "RuntimeError: Error compiling objects for extension"
    assert len(warned) == 1 and "Error compiling objects" in warned[0], warned


def test_a_cuda_part_not_attempted_says_why_in_its_record(monkeypatch, tmp_path):
    built, records, warned = _run_build_ext(monkeypatch, tmp_path, None, choice="auto")
    assert built == ["posenc_fast._C"] and warned == []
    assert records["cuda"]["built"] is False
    assert records["cuda"]["error"] == f"torch {torch.__version__} is built without CUDA"


REQUIRED_FAILURES = [("12.4", "", "12.4"), ("13.0", "_C_cuda", "Error compiling")]


@pytest.mark.parametrize(
    ("torch_cuda", "fails", "match"), REQUIRED_FAILURES, ids=["version", "compile"]
)
def test_cuda_failure_fails_the_install_when_required(
    monkeypatch, tmp_path, torch_cuda, fails, match
):
    with pytest.raises(RuntimeError, match=match) as raised:
        _run_build_ext(monkeypatch, tmp_path, torch_cuda, fails, require=True)
    assert "POSENC_FAST_REQUIRE_EXTENSION=1 makes this an error" in str(raised.value)
    record = json.loads((tmp_path / "lib" / "posenc_fast" / cfg.RECORDS["cuda"]).read_text())
    assert record["built"] is False


@pytest.mark.parametrize("require", [False, True], ids=["default", "required"])
def test_cpu_failure_fails_the_install(monkeypatch, tmp_path, require):
    """pip must not report success having lost the CPU part: its failure is fatal (the CUDA
    module is not even attempted after it)."""
    with pytest.raises(RuntimeError, match=r"building the C\+\+ CPU part") as raised:
        _run_build_ext(monkeypatch, tmp_path, "13.0", "_C", require=require)
    assert "POSENC_FAST_BUILD=none" in str(raised.value)
    record = json.loads((tmp_path / "lib" / "posenc_fast" / cfg.RECORDS["cpu"]).read_text())
    assert record["built"] is False and "Error compiling" in record["error"]


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
    env = {**os.environ, cfg.BUILD_ENV: "none"}
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
            if f.suffix in (".cpp", ".cu", ".h", ".cuh"):
                assert f"*{f.suffix}" in patterns, f"{f} is not shipped ({package}: {patterns})"


def test_the_source_lists_name_every_source():
    """Every .cpp and .cu under csrc/ is compiled into one of the two parts (and only
    CUDA-named files into the CUDA part)."""
    found = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "csrc").rglob("*.c[pu]*"))
    found = [f for f in found if f.endswith((".cpp", ".cu"))]
    listed = [*cfg.SOURCES["cpu"], *cfg.SOURCES["cuda"]]
    assert sorted(listed) == found
    assert all("cuda" in s for s in cfg.SOURCES["cuda"])
    assert not any("cuda" in s for s in cfg.SOURCES["cpu"])


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
    assert _extension.sources_hash() == cfg.sources_hash(_extension.source_root())


def test_the_cache_folder_names_what_a_build_is_tied_to(monkeypatch, tmp_path):
    tag = cfg.abi_tag(torch)
    assert tag.startswith(f"torch{torch.__version__}-cxx11abi")
    assert sys.implementation.cache_tag in tag and platform.machine() in tag
    monkeypatch.setenv("POSENC_FAST_CACHE", str(tmp_path))
    folder = _extension.cache_dir("cpu")
    assert folder == tmp_path / f"{tag}-src{_extension.sources_hash()[:16]}" / "posenc_fast_C"
    assert _extension.cache_dir("cuda").name == "posenc_fast_C_cuda"


def _record_now(**changes) -> dict:
    record = {
        "built": True,
        "torch_version": torch.__version__,
        "abi_tag": cfg.abi_tag(torch),
        "sources_hash": _extension.sources_hash(),
    }
    record.update(changes)
    return record


def test_stale_binaries_are_refused_with_the_reason():
    assert _extension.stale(_record_now()) == []
    fake = "torch2.13.0+cpu-cxx11abi0-cpython-311-x86_64"
    (why,) = _extension.stale(_record_now(abi_tag=fake))
    assert f"ABI tag {fake} (recorded at build time)" in why
    assert cfg.abi_tag(torch) in why and "python -m posenc_fast build" in why
    (why,) = _extension.stale(_record_now(sources_hash="0" * 64))
    assert "built from other sources (hash 000000000000)" in why
    (why,) = _extension.stale(_record_now(torch_version="2.5.1"))
    assert why.startswith("the extension was built for torch 2.5.1, this process runs")
    (why,) = _extension.stale(None)
    assert "no build record" in why
    (why,) = _extension.stale(_record_now(built=False, error="boom"))
    assert "its build failed (boom)" in why


# ---------------------------------------------------------------------------------------
# Loading: each part on its own
# ---------------------------------------------------------------------------------------


@pytest.fixture
def fake_package(monkeypatch, tmp_path):
    """The package's own build replaced by what a test writes into a folder; an empty cache
    and no first-use build."""
    package = tmp_path / "package"
    package.mkdir()
    monkeypatch.setattr(_extension, "PACKAGE_DIR", package)
    monkeypatch.setenv("POSENC_FAST_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(cfg.BUILD_ENV, "none")
    monkeypatch.delenv(_extension.DISABLE_ENV, raising=False)
    return package


def test_cuda_part_not_built_or_failed_is_reported(fake_package, parts_state):
    parts_state("cpu", object(), [])
    what = "the CUDA part of the extension (posenc_fast._C_cuda)"
    for error in ("torch X is built without CUDA", "RuntimeError: Error compiling objects"):
        record = {"built": False, "torch_version": torch.__version__, "error": error}
        (fake_package / cfg.RECORDS["cuda"]).write_text(json.dumps(record))
        got = _extension._try_load("cuda")
        assert got["ignored"] == [f"{what} was not built at install time: {error}"]
        assert got["reasons"][0] == got["ignored"][0] and len(got["reasons"]) == 2


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


def test_cuda_part_needs_the_cpu_part(fake_package, parts_state):
    parts_state("cpu", None, ["cpu reason"])
    name = "_C_cuda" + importlib.machinery.EXTENSION_SUFFIXES[0]
    (fake_package / name).write_bytes(b"not a shared object")  # loading it would fail loudly
    (fake_package / cfg.RECORDS["cuda"]).write_text(json.dumps(_record_now()))
    assert _extension._try_load("cuda")["reasons"] == [
        "the CUDA part of the extension (posenc_fast._C_cuda) needs the C++ extension "
        "(posenc_fast._C), which is unavailable"
    ]


# ---------------------------------------------------------------------------------------
# The build into the cache: torch.utils.cpp_extension.load on a tiny extension
# ---------------------------------------------------------------------------------------

# A Python module with the build_info() the loader checks (seconds to compile).
TINY = """#include <Python.h>
static PyObject* build_info(PyObject*, PyObject*) {
  return Py_BuildValue("{s:i}", "ops_version", OPS_VERSION);
}
static PyMethodDef methods[] = {{"build_info", build_info, METH_NOARGS, nullptr},
                                {nullptr, nullptr, 0, nullptr}};
static struct PyModuleDef tiny = {PyModuleDef_HEAD_INIT, "tiny", nullptr, -1, methods};
PyMODINIT_FUNC PyInit_posenc_fast_C(void) { return PyModule_Create(&tiny); }
""".replace("OPS_VERSION", str(_extension.OPS_VERSION))


@pytest.fixture
def tiny(monkeypatch, tmp_path):
    """A source tree whose CPU part is a tiny module (compiled for real by torch's load:
    ninja, its lock, its import), an empty cache in tmp_path; the module the loader
    registers is restored afterwards."""
    root = _sources(tmp_path / "src", TINY)
    monkeypatch.setattr(_extension, "source_root", lambda: root)
    monkeypatch.setattr(_extension, "PACKAGE_DIR", tmp_path / "package")
    monkeypatch.delenv(_extension.DISABLE_ENV, raising=False)
    monkeypatch.setitem(cfg.SOURCES, "cpu", ("csrc/module.cpp",))
    monkeypatch.setattr(cfg, "CXX_FLAGS", ["-O0"])
    monkeypatch.setenv("POSENC_FAST_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(cfg.BUILD_ENV, "auto")
    monkeypatch.delenv("CXX", raising=False)
    # torch renames a second build of one name in a process (posenc_fast_C_v1): each test
    # is a process of its own as far as torch knows
    monkeypatch.setattr(
        cpp_extension, "JIT_EXTENSION_VERSIONER", type(cpp_extension.JIT_EXTENSION_VERSIONER)()
    )
    name = _extension.module_name("cpu")
    monkeypatch.setitem(sys.modules, name, sys.modules.get(name))
    return root


def _built_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.suffix in (".so", ".json"))


def test_first_use_build_compiles_once_into_the_cache(tiny, capfd):
    module, why = _extension._build("cpu", _extension.cache_dir("cpu"))
    assert module is not None, why
    directory = _extension.cache_dir("cpu")
    assert _built_files(directory) == [cfg.RECORDS["cpu"], "posenc_fast_C.so"]
    record = json.loads((directory / cfg.RECORDS["cpu"]).read_text())
    assert record["built"] is True and record["abi_tag"] == cfg.abi_tag(torch)
    assert record["sources_hash"] == cfg.sources_hash(tiny) and record["how"] == "first use"
    out, err = capfd.readouterr()
    assert out == ""  # the build's output goes to stderr: a program's stdout is its own
    assert err.count("posenc_fast: building the C++ extension (posenc_fast._C)") == 1
    assert "module.cpp -o module.o" in err  # torch's verbose output: ninja's commands
    assert "posenc_fast: the C++ extension (posenc_fast._C) ready after" in err

    # a later process imports the binary itself: torch's load (its compiler checks and
    # ninja run) is not called, and nothing is printed
    def no_build(*a, **k):
        raise AssertionError("the cached build must load without torch's load()")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpp_extension, "load", no_build)
        got = _extension._try_load("cpu")
    assert got["source"] == "cache" and got["origin"] == str(directory / "posenc_fast_C.so")
    assert capfd.readouterr().err == ""


# A process of its own building the tiny tree of the fixture below (argv: its source root)
BUILD_TINY = """
import json, sys
from pathlib import Path
from posenc_fast import _build_config as cfg, _extension
root = Path(sys.argv[1])
_extension.source_root = lambda: root
_extension.PACKAGE_DIR = root / "package"
cfg.SOURCES["cpu"] = ("csrc/module.cpp",)
cfg.CXX_FLAGS = ["-O0"]
module, why = _extension._build("cpu", _extension.cache_dir("cpu"))
print(json.dumps({"loaded": module is not None, "why": why}))
"""


def test_concurrent_first_use_builds_compile_once(tiny):
    """Three processes ask at once: one compiles, the others wait for it (torch's lock)
    and load its result."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", BUILD_TINY, str(tiny)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _err in outs]
    assert all(r["loaded"] for r in results), results
    err = "".join(e for _out, e in outs)
    assert err.count("module.cpp -o module.o") == 1, err  # ninja compiled it once
    assert not (_extension.cache_dir("cpu") / "lock").exists()


def test_a_held_lock_is_waited_for_and_said(tiny, capfd):
    """A process that finds torch's lock held (another build, or one killed hard) waits,
    says so and where the lock is; when it is released, it loads what was built."""
    directory = _extension.cache_dir("cpu")
    directory.mkdir(parents=True)
    (directory / "lock").write_text("")
    results = []
    waiter = threading.Thread(target=lambda: results.append(_extension._build("cpu", directory)))
    waiter.start()
    time.sleep(2)
    assert waiter.is_alive() and not results
    err = capfd.readouterr().err
    assert "waiting for another process's build of the C++ extension" in err
    assert f"{directory / 'lock'} behind: delete it when no build runs" in err
    (directory / "lock").unlink()  # the other "process" ends without a binary
    waiter.join()
    ((module, why),) = results
    assert module is None and "building the C++ extension (posenc_fast._C) failed" in why


def test_failed_build_is_remembered_until_an_explicit_build(tiny, parts_state, capfd, monkeypatch):
    (tiny / "csrc" / "module.cpp").write_text("this is not C++\n")
    directory = _extension.cache_dir("cpu")
    parts_state("cpu", None, [])
    for state in _extension._state.values():
        state.update(_extension._fresh_state())
    assert _extension.load("cpu") is None
    (why,) = _extension.reasons("cpu")
    assert why.startswith("building the C++ extension (posenc_fast._C) failed (RuntimeError: ")
    assert "python -m posenc_fast build" in why
    assert "error:" in capfd.readouterr().err  # the compiler's messages, on stderr
    record = json.loads((directory / cfg.RECORDS["cpu"]).read_text())
    assert record["built"] is False and "Error building extension" in record["error"]
    # other processes (first use) do not spend the time again ...
    _extension._state["cpu"]["tried"] = False
    assert _extension.load("cpu") is None
    (why,) = _extension.reasons("cpu")
    assert "failed at" in why and "it shows the compiler's messages" in why
    assert "building" not in capfd.readouterr().err
    # ... an explicit build does (here with the sources fixed: the same folder, for the
    # test; in a new process, as torch's loader sees it)
    (tiny / "csrc" / "module.cpp").write_text(TINY)
    monkeypatch.setattr(
        cpp_extension, "JIT_EXTENSION_VERSIONER", type(cpp_extension.JIT_EXTENSION_VERSIONER)()
    )
    for state in _extension._state.values():
        state.update(_extension._fresh_state())
    result = _extension.build(cuda=False)
    assert result["cpu"]["path"] == str(directory / "posenc_fast_C.so"), result
    assert json.loads((directory / cfg.RECORDS["cpu"]).read_text())["built"] is True


def test_where_building_is_forbidden_or_impossible(monkeypatch, tmp_path):
    """POSENC_FAST_BUILD=none, an unwritable cache, no compiler, no sources: no build, and
    a reason that says how to build (the dispatcher turns it into one warning)."""
    monkeypatch.setattr(_extension, "PACKAGE_DIR", tmp_path / "package")
    monkeypatch.delenv(_extension.DISABLE_ENV, raising=False)
    monkeypatch.setenv("POSENC_FAST_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(cfg.BUILD_ENV, "none")
    (why,) = _extension._try_load("cpu")["reasons"]
    assert "POSENC_FAST_BUILD=none forbids building it on first use" in why
    assert "python -m posenc_fast build" in why
    monkeypatch.setenv(cfg.BUILD_ENV, "sometimes")
    (why,) = _extension._try_load("cpu")["reasons"]
    assert "POSENC_FAST_BUILD='sometimes' is not one of auto, cpu, cuda, none: no build" in why
    monkeypatch.setenv(cfg.BUILD_ENV, "auto")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("POSENC_FAST_CACHE", str(blocker / "cache"))  # under a file: unwritable
    (why,) = _extension._try_load("cpu")["reasons"]
    assert f"the build cache {blocker / 'cache'} is not writable" in why
    assert "POSENC_FAST_CACHE" in why
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    (why,) = _extension._try_load("cpu")["reasons"]
    assert "no C++ compiler found ('no-such-compiler-here' from CXX)" in why
    monkeypatch.delenv("CXX")
    monkeypatch.setattr(_extension, "source_root", lambda: None)
    (why,) = _extension._try_load("cpu")["reasons"]
    assert "carries no C++ sources" in why


def test_the_cuda_part_is_built_on_first_use_only_when_asked(monkeypatch, parts_state, tmp_path):
    parts_state("cpu", object(), [])
    monkeypatch.setattr(_extension, "PACKAGE_DIR", tmp_path / "package")
    monkeypatch.setenv("POSENC_FAST_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(_extension.DISABLE_ENV, raising=False)
    monkeypatch.setenv(cfg.BUILD_ENV, "auto")
    (why,) = _extension._try_load("cuda")["reasons"]
    assert why.startswith("the CUDA part of the extension (posenc_fast._C_cuda) is not built: ")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    (why,) = _extension._try_load("cuda")["reasons"]
    assert "`python -m posenc_fast build` builds it" in why and "POSENC_FAST_BUILD=cuda" in why


def test_build_skips_the_cuda_part_where_torch_says_so(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    assert _extension._cuda_skip() == f"torch {torch.__version__} is built without CUDA"
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    assert "finds no CUDA toolkit (set CUDA_HOME)" in _extension._cuda_skip()
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", "/somewhere")
    assert _extension._cuda_skip() is None


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


def _quick_compiler(tmp_path: Path, env: dict) -> str:
    """A $CXX that runs the caller's compiler ($CXX, else c++) with -O0 -g0 last: a build
    that compiles in a third of -O3's time (this test checks how the build is run, not the
    kernels' speed). It also checks that first-use builds honour $CXX (torch's choice)."""
    wrapper = tmp_path / "quick-cxx" / "c++"
    wrapper.parent.mkdir()
    called = wrapper.parent / "called"  # the test asserts the build ran through it
    wrapper.write_text(f'#!/bin/sh\n: > "{called}"\nexec {env.get("CXX") or "c++"} "$@" -O0 -g0\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def _venv_python(venv: Path, env: dict, *args: str, timeout: int = 1800):
    return subprocess.run([str(venv / "bin" / "python"), *args], env=env, cwd=venv,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


@pytest.mark.slow
def test_plain_pip_install_builds_on_first_use_then_reuses(tmp_path):
    """The first-use build as a user meets it, in a fresh venv with a plain `pip install
    <repo>` (_plain_venv): the wheel carries the sources and no binary; two processes
    started together both use the cpp backend after one first-use build (the other waits
    for it); a later process reuses the cache without building; `build` of a CUDA part
    that cannot be built leaves the cpp backend working and `info` saying why; a binary in
    the package recorded for another torch is refused with the reason in `info`;
    POSENC_FAST_BUILD=none gives the torch fallback with one warning. The build is at -O0
    (_quick_compiler) for time, into POSENC_FAST_PLAIN_CACHE (empty; default a temporary
    folder), left valid at the end for the caller's `verify`."""
    venv = _plain_venv(tmp_path)
    site = next((venv / "lib").glob("python3*/site-packages/posenc_fast"))
    assert (site / "csrc" / "lff" / "lff_cpu.cpp").is_file()
    assert (site / "csrc" / "floater" / "floater_cuda_team.cuh").is_file()
    assert not list(site.glob("_C*.so")), "a plain isolated install must not ship a binary"
    cache = Path(os.environ.get("POSENC_FAST_PLAIN_CACHE") or tmp_path / "cache")
    assert not cache.exists() or not any(cache.iterdir()), f"{cache} must start empty"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("POSENC_FAST_", "PYTHON"))}
    env.update(POSENC_FAST_CACHE=str(cache), MAX_JOBS=os.environ.get("MAX_JOBS", "2"))
    env["CXX"] = _quick_compiler(tmp_path, env)
    env.pop("TRITON_INTERPRET", None)

    # two processes at once, nothing built yet: one builds, the other waits for it
    results = [_finish(p) for p in [_run_lff(venv, env, seed, wait=False) for seed in (1, 2)]]
    errs = "".join(err for _, err in results)
    assert errs.count("lff_cpu.cpp -o lff_cpu.o") == 1, errs  # compiled once, with progress
    assert "posenc_fast: the C++ extension (posenc_fast._C) ready after" in errs, errs
    for got, _err in results:
        assert got["source"] == "cache" and got["reasons"] == [] and got["warnings"] == []
        assert got["close"], got
    assert (Path(env["CXX"]).parent / "called").exists(), "the build did not run $CXX"
    cached = Path(results[0][0]["path"])
    assert cached.parent.parent.parent == cache and cached.is_file()
    assert results[1][0]["path"] == str(cached)

    # a later process: the cache, no build
    got, err = _run_lff(venv, env, 3)
    assert got["source"] == "cache" and got["path"] == str(cached) and "building" not in err

    # a CUDA part that cannot be built (the CPU torch of constraints.txt: --cuda yes; the
    # oldest torch's CUDA build where no GPU is seen and TORCH_CUDA_ARCH_LIST is unset, or
    # no toolkit is found) leaves the cpp backend working, and `info` says why
    torch_cuda = _venv_python(venv, env, "-c", "import torch; print(torch.version.cuda)")
    args = ["--cuda", "yes"] if torch_cuda.stdout.strip() == "None" else []
    build = _venv_python(venv, env, "-m", "posenc_fast", "build", *args)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    assert f"posenc_fast._C: ready: {cached}" in build.stdout, build.stdout
    cuda_line = [ln for ln in build.stdout.splitlines() if ln.startswith("posenc_fast._C_cuda:")]
    assert cuda_line and ("build failed: " in cuda_line[0] or "not built: " in cuda_line[0])
    got, err = _run_lff(venv, env, 6)
    assert got["source"] == "cache" and got["reasons"] == [] and got["close"], got
    assert "building" not in err  # neither part is retried on first use
    info = _venv_python(venv, env, "-m", "posenc_fast", "info", timeout=300)
    assert info.returncode == 0, info.stderr[-3000:]
    assert "cpu   posenc_fast._C: available" in info.stdout, info.stdout
    assert "cuda  posenc_fast._C_cuda: unavailable: " in info.stdout, info.stdout

    # a binary in the package built for another torch: refused, with the reason, never
    # loaded (the cache's build is used instead)
    binary = site / f"_C{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    shutil.copy2(cached, binary)
    record = json.loads((cached.parent / cfg.RECORDS["cpu"]).read_text())
    record["torch_version"] = "1.13.0+stale"
    (site / cfg.RECORDS["cpu"]).write_text(json.dumps(record))
    try:
        _stale_and_no_build(venv, env, tmp_path)
    finally:
        for path in (binary, site / cfg.RECORDS["cpu"]):
            path.unlink(missing_ok=True)  # the install stays plain for the caller's verify


def _stale_and_no_build(venv: Path, env: dict, tmp_path: Path):
    got, _ = _run_lff(venv, env, 4)
    assert got["source"] == "cache" and got["reasons"] == [] and got["warnings"] == [], got
    info = _venv_python(venv, env, "-m", "posenc_fast", "info", timeout=300)
    assert info.returncode == 0, info.stderr[-3000:]
    assert "the extension was built for torch 1.13.0+stale, this process runs torch" in (
        info.stdout
    ), info.stdout

    # POSENC_FAST_BUILD=none and an empty cache: the torch fallback, exactly one warning
    none = dict(env, POSENC_FAST_BUILD="none", POSENC_FAST_CACHE=str(tmp_path / "empty"))
    got, err = _run_lff(venv, none, 5)
    assert got["source"] is None and "building" not in err
    (warning,) = got["warnings"]
    assert "backend 'cpp' is unavailable" in warning and "POSENC_FAST_BUILD=none" in warning
    assert "python -m posenc_fast build" in warning and "1.13.0+stale" in warning
    assert got["close"], got
