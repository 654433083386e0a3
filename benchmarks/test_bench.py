"""pytest-benchmark over the cases of ``python -m posenc_fast bench``.

    pytest benchmarks/ --benchmark-only                     # the CPU cases (bench --quick's)
    pytest benchmarks/ --benchmark-only -k tiny             # one tiny case, seconds
    pytest benchmarks/ --benchmark-only -k "lff and fwd"    # any selection by name
    pytest benchmarks/ --benchmark-only -k "rotary and mixed"  # a rotary family (axial, mixed,
                                                            # dinov3, nd) vs timm's eager code
    POSENC_FAST_BENCH_FULL=1 pytest benchmarks/ --benchmark-only   # bench's full CPU set
    pytest benchmarks/ --benchmark-only --benchmark-save=base       # then --benchmark-compare

The cases are bench's own (posenc_fast/cli/_cases.py: the same factories, inputs and
baselines), one group per op, size and mode; each test records its floor and its error
against the float64 spec in ``extra_info``, and a posenc_fast backend outside the
package's tolerances fails. CI runs the tiny case (tests/common/test_benchmarks.py).
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

pytest.importorskip("pytest_benchmark", reason="pytest-benchmark is in the test extra")

from posenc_fast.cli import _cases, _floors, _timing
from posenc_fast.cli.bench import (
    COMPILE_MODES,
    DEFAULT_COMPILE_TIMEOUT,
    DEFAULT_OPS,
    MODES,
    CompileTimeout,
    _forward,
    _impls,
    _joined,
    _runner,
    bench_cases,
    time_box,
)
from posenc_fast.tolerances import mismatch

QUICK = not os.environ.get("POSENC_FAST_BENCH_FULL")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# How the tolerances of posenc_fast/tolerances.py name each op's outputs
KINDS = {"lff": "lff", "floater": "floater", "rotary": "rotary"}
FLOOR_MIN_TIME = 0.05  # s per floor measurement (bandwidth, each GEMM shape)


@functools.cache
def all_cases() -> tuple:
    """(name prefix, BenchCase) for every case: the tiny one (bench's own sinusoidal case
    factory at 64 positions), then bench's cases per device, rotary included (LightGlue's
    and the grid families' at ViT-B/16 224 px, or bench's full set)."""
    out = [("tiny", _cases.encoding_case("sinusoidal", 64, 16, "cpu"))]
    for device in DEVICES:
        out += [(device, case) for case in bench_cases(QUICK, device, [*DEFAULT_OPS, "rotary"])]
    return tuple(out)


def _names(case) -> list[str]:
    """The implementations of bench's _impls (with "compile", bench's default), by name
    only: torch.compile is not called (nor dynamo imported) while pytest collects."""
    return ["eager", *case.baselines, "compile", *case.backends]


def _impl(case, name: str):
    """bench's implementation ``name`` of the case (torch.compile only when asked for)."""
    return _impls(case, (name,) if name in COMPILE_MODES else ())[name]


def _params():
    params = []
    for index, (prefix, case) in enumerate(all_cases()):
        label = case.label.replace(" ", "_")
        for mode in MODES:
            for name in _names(case):
                params.append(
                    pytest.param(index, mode, name, id=f"{prefix}-{case.op}-{label}-{mode}-{name}")
                )
    return params


def _device(case) -> str:
    return case.args[0].device.type


@pytest.fixture(scope="session")
def machines(request) -> dict:
    """device -> bench's floor measurements (_floors.measure) for the GEMM shapes of the
    selected tests' cases, measured once, before any of them runs."""
    shapes: dict = {}
    for item in request.session.items:
        spec = getattr(item, "callspec", None)
        if spec is None or "index" not in spec.params:
            continue
        case = all_cases()[spec.params["index"]][1]
        for work in case.work.values():
            shapes.setdefault(_device(case), set()).update(work.shapes())
    out = {}
    for device, gemm_shapes in shapes.items():
        timer = _timing.time_cuda if device == "cuda" else _timing.time_cpu
        out[device] = _floors.measure(device, gemm_shapes, timer, FLOOR_MIN_TIME)
    return out


@pytest.mark.parametrize("index,mode,name", _params())
def test_bench(benchmark, machines, index, mode, name):
    prefix, case = all_cases()[index]
    device = _device(case)
    if name in COMPILE_MODES:
        torch._dynamo.reset()  # compiled afresh per case (bench's _Run.case says why)
    impl = _impl(case, name)
    run = _runner(case, impl, mode)
    try:  # warm-up: compilation and lazy initialisation stay out of the timings
        with time_box(DEFAULT_COMPILE_TIMEOUT if name in COMPILE_MODES else None):
            run()
    except CompileTimeout as exc:
        torch._dynamo.reset()
        pytest.skip(f"torch.compile {name}: {exc}")
    out = _forward(case, impl)
    spec = _joined(case.spec()).to(out.device)
    error = float((out - spec).abs().max()) if out.shape == spec.shape else None
    machine = machines[device]
    work = case.work.get(mode)
    floor = _floors.floor_ms(work, machine)
    benchmark.group = f"{prefix} {case.op} {case.label} [{mode}]"
    benchmark.extra_info.update(
        {
            "op": case.op,
            "case": case.label,
            "mode": mode,
            "impl": name,
            "device": device,
            "threads": torch.get_num_threads(),
            "floor_ms": floor,
            "floor_bytes": work.bytes if work else 0,
            "floor_gflop": work.flops / 1e9 if work else 0.0,
            "bandwidth_gbps": machine["bandwidth_gbps"],
            "gemm_gflops": machine["gemm_gflops"],
            "max_err_vs_spec": error,
        }
    )
    if device == "cuda":

        def timed():
            run()
            torch.cuda.synchronize()

        benchmark(timed)
    else:
        benchmark(run)
    if floor and benchmark.stats is not None:
        median_ms = benchmark.stats.stats.median * 1e3
        benchmark.extra_info["pct_of_floor"] = 100.0 * floor / median_ms
    if name in case.backends:  # ours: within the package's tolerances of the spec
        dtype = getattr(torch, case.sizes.get("dtype", "float32"))
        kind = KINDS.get(case.op, "encoding")
        scale = spec.abs().max().item() if kind == "rotary" else None
        assert not mismatch(out, spec, dtype, kind, scale), mismatch(out, spec, dtype, kind, scale)
