"""Issue 5's CPU benchmark: the C++ FLOATER integrator ("cpp") against the torch backend
and torchdiffeq on the same step grid.

    python benchmarks/floater_cpu.py                  # L = 512, d = H in {64, 512} (~5-10 min)
    python benchmarks/floater_cpu.py --sizes 64 --repeats 3 --length 128   # quick look

Problem (per case): S = 12 states, d = H, L sample times i * 0.01, 5 steps of the 3/8
rule per interval ("rk38" = torchdiffeq's fixed-grid "rk4", so torchdiffeq integrates the
very same steps), ReLU, float32. Modes, each timed on its own:
    fwd      the integration without autograd (inference)
    fwd+bwd  the integration with gradients to p0 and the weights, then backward
    bwd      fwd+bwd minus fwd (medians), reported for convenience
Implementations: "cpp" (posenc_fast, compiled extension), "torch" (posenc_fast's pure
PyTorch backend), "torchdiffeq" (odeint, method "rk4", grid_constructor = our grid;
gradients by autograd through its steps). Correctness first: every implementation is
compared with the float64 reference loop before timing. Reported: median seconds with
20th / 80th percentiles of --repeats runs (wall clock, perf_counter), speed-ups of cpp
over each baseline, threads, and the machine's load average before and after (this
kind of machine is shared: a high load makes every figure slower and noisier). JSON
goes to benchmarks/results/floater_cpu.json with versions and the git SHA.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
S_STATES = 12
DELTA_T = 0.01
SUBSTEPS = 5
METHOD = "rk38"
ACTIVATION = "relu"


def inputs(S, d, L, dtype, seed):
    g = torch.Generator().manual_seed(seed)

    def rn(*shape, scale):
        return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    p0 = rn(S, d, scale=1.0)
    # weights of the default initialisation's scale: states stay O(1) over the range
    w1 = rn(d + 1, d, scale=0.5 / math.sqrt(d + 1))
    b1 = rn(d, scale=0.1)
    w2 = rn(d + 1, d, scale=0.3 / math.sqrt(d + 1))
    b2 = rn(d, scale=0.1)
    times = (torch.arange(L, dtype=torch.float64) * DELTA_T).to(dtype)
    return p0, w1, b1, w2, b2, times


def step_grid(times, K):
    """The step grid: from times[0], K equal steps per interval, sample times on it."""
    prev = times[:-1]
    h = (times[1:] - prev) / K
    inner = prev[:, None] + torch.arange(1, K, dtype=times.dtype) * h[:, None]
    return torch.cat([times[:1], torch.cat([inner, times[1:, None]], 1).reshape(-1)])


class Dynamics(torch.nn.Module):
    def __init__(self, w1, b1, w2, b2):
        super().__init__()
        self.w = (w1, b1, w2, b2)

    def forward(self, t, p):
        w1, b1, w2, b2 = self.w
        d, H = p.shape[1], w1.shape[1]
        return torch.relu(torch.addmm(b1 + t * w1[d], p, w1[:d])) @ w2[:H] + (t * w2[H] + b2)


def implementations(leaves, times):
    from posenc_fast.floater_encoding import floater

    impls = {}
    for name in ("cpp", "torch"):
        impls[name] = lambda name=name: floater(
            *leaves, times, SUBSTEPS, METHOD, ACTIVATION, backend=name
        )
    try:
        from torchdiffeq import odeint
    except ImportError:
        return impls
    func = Dynamics(*leaves[1:])
    grid = step_grid(times, SUBSTEPS)
    opts = {"grid_constructor": lambda f, y0, t: grid}
    # times[0] = 0: the state at the first sample time is p0, as in our contract
    impls["torchdiffeq"] = lambda: odeint(
        func, leaves[0], times, method="rk4", options=opts
    ).transpose(0, 1)
    return impls


def reference(leaves, times):
    from posenc_fast.reference import floater as ref

    with torch.no_grad():
        return ref.floater(
            *[t.detach().double() for t in leaves], times.double(), SUBSTEPS, METHOD, ACTIVATION
        )


def timed(fn, repeats, warmup=1):
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    q = statistics.quantiles(ts, n=5) if len(ts) >= 2 else [ts[0]] * 4
    return {"median": statistics.median(ts), "p20": q[0], "p80": q[3], "runs": ts}


def git_sha():
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip()
    except Exception:
        return None


def environment():
    from posenc_fast import __version__, _extension

    info = _extension.extension_info()
    return {
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_model": next(
            (
                ln.split(":", 1)[1].strip()
                for ln in open("/proc/cpuinfo")
                if ln.startswith("model name")
            ),
            None,
        )
        if os.path.exists("/proc/cpuinfo")
        else None,
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "posenc_fast": __version__,
        "git_sha": git_sha(),
        "extension": info.get("build_info"),
        "cpu_isa": info.get("cpu_isa"),
    }


def run_case(d, L, repeats, dtype=torch.float32):
    S = S_STATES
    p0, w1, b1, w2, b2, times = inputs(S, d, L, dtype, seed=d + L)
    leaves = [t.clone().requires_grad_(True) for t in (p0, w1, b1, w2, b2)]
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
