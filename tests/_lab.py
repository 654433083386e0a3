"""The CPU benchmark lab's modules (benchmarks/cpu_lab.py and the _contention and
_reliability beside it), imported by path for the tests, under the names the lab itself
imports them by."""

from __future__ import annotations

import importlib.util
import os
import sys

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def module(name: str):
    """benchmarks/<name>.py as the module ``name`` (once per process)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(BENCHMARKS, f"{name}.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod  # before running it: cpu_lab imports the others by name
        spec.loader.exec_module(mod)
    return sys.modules[name]


contention = module("_contention")
reliability = module("_reliability")
cpu_lab = module("cpu_lab")
while BENCHMARKS in sys.path:  # (cpu_lab puts its folder there: its neighbours are loaded)
    sys.path.remove(BENCHMARKS)
