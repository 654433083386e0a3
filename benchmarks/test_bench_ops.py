"""pytest-benchmark microbenchmarks: every implementation of one op and size in one table.

    python -m pytest benchmarks/test_bench_ops.py --benchmark-only            # CPU, quick sizes
    POSENC_FAST_BENCH_FULL=1 python -m pytest benchmarks/test_bench_ops.py --benchmark-only
    POSENC_FAST_BENCH_DEVICE=cuda python -m pytest benchmarks/test_bench_ops.py --benchmark-only

The cases (inputs, baselines, backends) are the ones of ``python -m posenc_fast bench``
(posenc_fast/cli/_cases.py): one setup factory per op, shared. Groups are
"<op> <sizes> [<mode>]", so pytest-benchmark prints the eager baseline (the op as users
write it), torch.compile of it and each backend of one op and size side by side. Timings
are reported, never asserted.
"""

import os

import pytest
import torch

from posenc_fast.cli import _cases
from posenc_fast.cli.bench import _impls, _runner

DEVICE = os.environ.get("POSENC_FAST_BENCH_DEVICE", "cpu")
QUICK = not os.environ.get("POSENC_FAST_BENCH_FULL")
OPS = ["lff", "sinusoidal", "dft"]


def _params():
    if DEVICE == "cuda" and not torch.cuda.is_available():
        return []
    out = []
    for case in _cases.cases(QUICK, DEVICE, OPS):
        for mode in ("fwd", "fwd+bwd"):
            for impl in _impls(case):
                out.append(
                    pytest.param(case, mode, impl, id=f"{case.op}-{case.size}-{mode}-{impl}")
                )
    return out


@pytest.mark.parametrize("case,mode,impl", _params())
def test_bench(benchmark, case, mode, impl):
    benchmark.group = f"{case.op} {case.label} [{mode}]"
    run = _runner(case, _impls(case)[impl], mode)
    run()  # warm-up: compilation and lazy initialisation stay out of the timings
    if DEVICE == "cuda":

        def timed():
            run()
            torch.cuda.synchronize()

        benchmark(timed)
    else:
        benchmark(run)
