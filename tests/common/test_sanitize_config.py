"""tools/sanitized_extension.py: the ASan + UBSan build of the CPU part that
tools/check_sanitizers.sh tests against. It is the package's build (its sources and flags,
posenc_fast/_build_config.py) with the sanitizers instead of -O3, in a folder of its own,
says what it is in build_info(), and refuses to load where the ASan runtime did not come
first (a library built with ASan aborts such a process)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from posenc_fast import _build_config as cfg
from posenc_fast import _extension

ROOT = Path(__file__).resolve().parents[2]


def _tool():
    path = ROOT / "tools" / "sanitized_extension.py"
    spec = importlib.util.spec_from_file_location("sanitized_extension", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_flags_are_the_packages_with_the_sanitizers_for_O3():
    cxx, ld = _tool().flags()
    assert "-O3" not in cxx and "-O1" in cxx and "-g" in cxx and "-fno-omit-frame-pointer" in cxx
    assert "-fsanitize=address,undefined" in cxx and "-fno-sanitize-recover=undefined" in cxx
    assert "-DPF_SANITIZERS=address_undefined" in cxx  # build_info()["sanitize"]
    for flag in cfg.CXX_FLAGS:
        assert flag == "-O3" or flag in cxx, flag
    assert ld == [*cfg.LD_FLAGS, "-fsanitize=address,undefined"]


def test_its_folder_is_not_the_package_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("POSENC_FAST_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("POSENC_FAST_SANITIZE_CACHE", str(tmp_path / "sanitize"))
    folder = _tool().build_dir()
    assert folder.parent == tmp_path / "sanitize"
    assert not str(folder).startswith(str(_extension.cache_root()))


def test_without_the_asan_runtime_nothing_is_loaded():
    """A library built with ASan aborts the process when imported without its runtime
    loaded first: the tool refuses, saying how to preload it."""
    tool = _tool()
    problem = tool.runtime_problem()
    if problem is None:
        pytest.skip("this process runs with the ASan runtime (tools/check_sanitizers.sh)")
    assert "LD_PRELOAD" in problem and "libasan" in problem
    with pytest.raises(SystemExit, match="did not preload the ASan runtime"):
        tool.load()
