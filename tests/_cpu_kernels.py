"""What the tests of the C++ CPU kernels (csrc/lff, csrc/encodings, csrc/rotary:
tests/lff/test_cpp_fourier.py, tests/rotary/test_cpp_rotary.py) share: their skip marks,
the instruction sets and thread counts they run under, and the Triton interpreter they
compare with."""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import DEVICE

from posenc_fast import _extension

EXT = _extension.load()
pytestmark = [
    pytest.mark.skipif(
        EXT is None, reason="; ".join(_extension.reasons()) or "the extension is missing"
    ),
    pytest.mark.skipif(DEVICE != "cpu", reason="CPU kernels"),
]
ISAS = ("generic", "avx2", "avx512")


def isas_here() -> list[str]:
    best = EXT.build_info()["cpu_isa_best"]
    return list(ISAS[: ISAS.index(best) + 1])


@contextlib.contextmanager
def cpu_isa(name: str):
    EXT.set_cpu_isa(name)
    try:
        yield
    finally:
        EXT.set_cpu_isa("auto")


@contextlib.contextmanager
def threads(n: int):
    """n threads, used even if a busy machine would make the kernels fall back to one
    (csrc/cpu/parallel.h: a late-starting team thread)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    teams = EXT.set_development_options(always_team=True)["always_team"]
    try:
        yield
    finally:
        EXT.set_development_options(always_team=teams)
        torch.set_num_threads(before)


def assert_every_isa_agrees(run) -> None:
    """run() (a list of tensors) on every instruction set of this CPU: the same bits."""
    here = isas_here()
    if len(here) < 2:
        pytest.skip(f"this CPU runs only {here}")
    results = {}
    for isa in here:
        with cpu_isa(isa):
            assert EXT.cpu_isa() == isa
            results[isa] = run()
    first = results[here[-1]]
    for isa in here[:-1]:
        for i, (a, b) in enumerate(zip(first, results[isa])):
            assert torch.isfinite(a).all()
            assert torch.equal(a, b), f"output {i}: {isa} differs from {here[-1]}"
