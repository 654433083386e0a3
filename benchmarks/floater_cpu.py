"""Issue 5's CPU benchmark: the C++ FLOATER integrator ("cpp") against the torch backend
and torchdiffeq on the same step grid.

    python benchmarks/floater_cpu.py                  # L = 512, d = H in {64, 512} (~5-10 min)
    python benchmarks/floater_cpu.py --sizes 64 --repeats 3 --length 128   # quick look

Problem (per case): S = 12 states, d = H, L sample times i * 0.01, 5 steps of the 3/8
rule per interval ("rk38" = torchdiffeq's fixed-grid "rk4", so torchdiffeq integrates the
very same steps), ReLU, float32; the inputs of floater_suite.bench_inputs (those of
``python -m posenc_fast bench`` and floater_gpu.py). Modes, each timed on its own:
    fwd      the integration without autograd (inference)
    fwd+bwd  the integration with gradients to p0 and the weights, then backward
    bwd      fwd+bwd minus fwd (medians), reported for convenience
Implementations: "cpp" (posenc_fast, compiled extension), "torch" (posenc_fast's pure
PyTorch backend), "torchdiffeq" (odeint, method "rk4", grid_constructor = our grid;
gradients by autograd through its steps). Correctness first: every implementation is
compared with the float64 reference loop before timing. Reported: median seconds with
20th / 80th percentiles of --repeats runs (wall clock, perf_counter; interpolated as in
``python -m posenc_fast bench``: _gpu_common.timed_calls), speed-ups of cpp
over each baseline, threads, and the machine's load average before and after (this
kind of machine is shared: a high load makes every figure slower and noisier). JSON
goes to benchmarks/results/floater_cpu.json with versions and the git SHA.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _gpu_common  # noqa: E402  (benchmarks/, beside this script)
import torch  # noqa: E402

from posenc_fast.cli import floater_suite  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
S_STATES = floater_suite.BENCH_STATES
SUBSTEPS = floater_suite.BENCH_SUBSTEPS
METHOD = "rk38"
ACTIVATION = "relu"  # floater_suite's torchdiffeq dynamics are the ReLU ones


def implementations(leaves, times):
    from posenc_fast.ops.floater import floater

    impls = {}
    for name in ("cpp", "torch"):
        impls[name] = lambda name=name: floater(
            *leaves, times, SUBSTEPS, METHOD, ACTIVATION, backend=name
        )
    # times[0] = 0: the state at the first sample time is p0, as in our contract
    odeint = floater_suite._torchdiffeq_baselines(*leaves, times, SUBSTEPS).get("torchdiffeq")
    if odeint is not None:
        impls["torchdiffeq"] = lambda: odeint().transpose(0, 1)  # [L, S, d] -> [S, L, d]
    return impls


def reference(leaves, times):
    from posenc_fast.ops.floater import reference as ref

    with torch.no_grad():
        return ref.floater(
            *[t.detach().double() for t in leaves], times.double(), SUBSTEPS, METHOD, ACTIVATION
        )


def timed(fn, repeats, warmup=1):
    """_gpu_common.timed_calls on the CPU (wall clock), in seconds: median, p20 / p80 (the
    20th / 80th percentiles, _gpu_common.quantiles) and the runs in call order."""
    t = _gpu_common.timed_calls(fn, "cpu", warmup, repeats)
    return {
        "median": t["ms"] / 1e3,
        "p20": t["ms_p20"] / 1e3,
        "p80": t["ms_p80"] / 1e3,
        "runs": [r / 1e3 for r in t["runs"]],
    }


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            return next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None
            )
    except OSError:
        return None


def environment():
    """_gpu_common.environment() (versions, git SHA, threads ...) and what this benchmark
    adds: the CPU model, the core count and the extension's build (its SIMD level)."""
    from posenc_fast import _extension

    info = _extension.extension_info()
    env = _gpu_common.environment()
    env.update(
        {
            "machine": platform.machine(),
            "cpu_model": _cpu_model(),
            "cores": os.cpu_count(),
            "extension": info["cpu"].get("build_info"),
            "cpu_isa": info["cpu"].get("cpu_isa"),
        }
    )
    return env


def run_case(d, L, repeats, dtype=torch.float32):
    S = S_STATES
    *weights, times = floater_suite.bench_inputs(S, d, L, dtype, "cpu", seed=d + L)
    leaves = [t.requires_grad_(True) for t in weights]
    impls = implementations(leaves, times)
    want = reference(leaves, times)
    result = {
        "S": S,
        "d": d,
        "H": d,
        "L": L,
        "substeps": SUBSTEPS,
        "method": METHOD,
        "dtype": str(dtype)[6:],
    }
    result["steps"] = L * SUBSTEPS
    result["impls"] = {}
    for name, fn in impls.items():
        with torch.no_grad():
            got = fn()
        err = float((got.double() - want).abs().max())
        scale = float(want.abs().max())
        entry = {"max_abs_err_vs_float64": err, "max_abs_ref": scale}
        entry["fwd"] = timed(lambda fn=fn: _no_grad(fn), repeats)

        def fwd_bwd(fn=fn):
            for t in leaves:
                t.grad = None
            out = fn()
            out.backward(torch.ones_like(out))

        entry["fwd+bwd"] = timed(fwd_bwd, repeats)
        entry["bwd"] = {"median": entry["fwd+bwd"]["median"] - entry["fwd"]["median"]}
        result["impls"][name] = entry
        print(
            f"  d={d:4d} {name:12s} "
            + "  ".join(
                f"{m} {entry[m]['median'] * 1e3:9.1f} ms" for m in ("fwd", "fwd+bwd", "bwd")
            )
            + f"  (max err {err:.1e} of {scale:.2g})",
            flush=True,
        )
    cpp = result["impls"].get("cpp")
    if cpp:
        result["speedup_of_cpp"] = {
            name: {m: e[m]["median"] / cpp[m]["median"] for m in ("fwd", "fwd+bwd", "bwd")}
            for name, e in result["impls"].items()
            if name != "cpp"
        }
    return result


def _no_grad(fn):
    with torch.no_grad():
        return fn()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="64,512", help="d = H values, comma separated")
    ap.add_argument("--length", type=int, default=512, help="L, sample times")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--threads",
        default="",
        help="torch.set_num_threads values, comma separated (default: torch's)",
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "floater_cpu.json"))
    args = ap.parse_args(argv)
    thread_counts = [int(t) for t in args.threads.split(",") if t] or [torch.get_num_threads()]
    from posenc_fast import _extension

    if _extension.load() is None:
        print(
            "the C++ extension is unavailable: " + "; ".join(_extension.reasons()), file=sys.stderr
        )
        return 1
    report = {
        "benchmark": "floater_cpu",
        "environment": environment(),
        "load_before": os.getloadavg(),
        "cases": [],
    }
    for threads in thread_counts:
        torch.set_num_threads(threads)
        print(
            f"FLOATER CPU benchmark: S={S_STATES}, L={args.length}, "
            f"{SUBSTEPS} {METHOD} steps per interval, float32, {threads} thread(s)"
        )
        for d in (int(s) for s in args.sizes.split(",")):
            case = run_case(d, args.length, args.repeats)
            case["threads"] = threads
            report["cases"].append(case)
            for name, sp in case.get("speedup_of_cpp", {}).items():
                print(
                    f"  d={d:4d} cpp speed-up over {name:12s} "
                    + "  ".join(f"{m} {v:6.2f}x" for m, v in sp.items())
                )
    report["load_after"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(
        f"load average before {report['load_before']}, after {report['load_after']}; "
        f"wrote {args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
