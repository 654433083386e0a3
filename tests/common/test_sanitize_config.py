"""POSENC_FAST_SANITIZE: the sanitized build of the CPU part (tools/check_sanitizers.sh) is
asked for in one place (posenc_fast/_build_config.py), built under a cache key of its own,
recorded, and loaded only where it is asked for and its runtime came first."""

from __future__ import annotations

import pytest
import torch

from posenc_fast import _build_config as cfg
from posenc_fast import _extension_cache


@pytest.mark.parametrize(
    ("raw", "names"),
    [("", ()), ("0", ()), ("off", ()), ("address,undefined", ("address", "undefined")),
     ("undefined, address", ("address", "undefined")), ("address", ("address",))],
)  # fmt: skip
def test_sanitizers_are_read_from_the_variable(raw, names):
    assert cfg.sanitizers({cfg.SANITIZE_ENV: raw}) == (names, None)


def test_unknown_sanitizer_is_refused_with_its_name():
    names, problem = cfg.sanitizers({cfg.SANITIZE_ENV: "address,memory"})
    assert names == () and "'memory'" in problem and cfg.SANITIZE_ENV in problem


def test_flags_and_plan():
    assert cfg.cxx_flags() == ["-O3", "-fopenmp", "-ffp-contract=fast", "-Wno-psabi"]
    flags = cfg.cxx_flags(sanitize=("address", "undefined"))
    assert "-O3" not in flags and "-O1" in flags and "-fno-omit-frame-pointer" in flags
    assert "-fsanitize=address,undefined" in flags and "-fno-sanitize-recover=undefined" in flags
    assert cfg.cpu_ldflags(("address",)) == ["-fopenmp", "-fsanitize=address"]
    plan = cfg.plan_build(torch_version="2.13.0", torch_cuda_version=None, sanitize=("address",))
    assert plan["cpu"]["record"]["sanitize"] == ["address"]
    assert plan["cpu"]["ldflags"] == ["-fopenmp", "-fsanitize=address"]
    assert "-fsanitize=address" not in plan["cuda"]["cxx"]  # the CPU part only
    plain = cfg.plan_build(torch_version="2.13.0", torch_cuda_version=None)
    assert plain["cpu"]["record"]["sanitize"] == [] and plain["cpu"]["ldflags"] == ["-fopenmp"]


def test_sanitized_builds_have_their_own_cache_key(monkeypatch):
    monkeypatch.delenv(cfg.SANITIZE_ENV, raising=False)
    plain = _extension_cache.cache_key()
    monkeypatch.setenv(cfg.SANITIZE_ENV, "undefined,address")
    assert _extension_cache.cache_key() == f"{plain}-address-undefined"


def test_a_binary_built_otherwise_is_not_loaded(monkeypatch):
    info = {"torch_version": torch.__version__, "sanitize": ["address", "undefined"]}
    monkeypatch.delenv(cfg.SANITIZE_ENV, raising=False)
    assert any("built with address,undefined" in r for r in _extension_cache.mismatch(info))
    monkeypatch.setenv(cfg.SANITIZE_ENV, "address,undefined")
    assert not any("sanitizer" in r or "built with" in r for r in _extension_cache.mismatch(info))
    assert any(
        "built with no sanitizer" in r for r in _extension_cache.mismatch({**info, "sanitize": []})
    )


def test_without_the_asan_runtime_nothing_is_loaded(monkeypatch):
    """A library built with ASan aborts the process when imported without its runtime
    loaded first: the loader refuses, saying how to preload it."""
    monkeypatch.setenv(cfg.SANITIZE_ENV, "address,undefined")
    problem = _extension_cache.sanitize_problem()
    if problem is None:
        pytest.skip("this process runs with the ASan runtime (tools/check_sanitizers.sh)")
    assert "LD_PRELOAD" in problem and "libasan" in problem
    monkeypatch.setenv(cfg.SANITIZE_ENV, "thread")
    assert "'thread'" in _extension_cache.sanitize_problem()
