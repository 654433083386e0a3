"""Issue 12's CPU benchmark of the C++ LFF and encoding kernels ("cpp") against the code users
write: an eager module as the public LFF modules write it (nn.Linear for the frequencies,
cos / sin, torch.cat, nn.Linear + nn.GELU + nn.Linear) and torch.compile of it; for the
tables the literal formula in float32 and its torch.compile; for the fused add ``x + table``
with the table precomputed (a buffer, as most implementations keep it) and computed per call.

    python benchmarks/fourier_cpu.py                      # goals' cases, 1 and 2 threads
    python benchmarks/fourier_cpu.py --threads 2 --cases lff --sizes 196 --repeats 5

Each thread count runs in its own process (torch.compile fixes the thread count of the code
it generates). Implementations are timed interleaved (one call of each in turn, --repeats
rounds), wall clock, median with 20th / 80th percentiles. Correctness first: every
implementation is compared with the float64 reference. Floors measured in the same process:
write bandwidth (fill of a 256 MiB tensor), copy bandwidth, and torch.mm's rate at the MLP's
shapes; each cpp case reports % of its floor (the larger of bytes / write bandwidth and
GEMM FLOPs / that rate). Peak memory of fwd+bwd: the profiler's allocation records
(posenc_fast.cli._timing.peak_bytes_cpu). JSON: benchmarks/results/fourier_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from posenc_fast.cli._baselines import EagerLFF

ROOT = Path(__file__).resolve().parent.parent
M, F, H, D = 2, 256, 32, 768  # the goals' LFF shape


def median_p(runs):
    s = sorted(runs)
    q = statistics.quantiles(s, n=10, method="inclusive") if len(s) > 1 else [s[0]] * 9
    return {"ms": statistics.median(s) * 1e3, "p20": q[1] * 1e3, "p80": q[7] * 1e3}


def interleaved(impls: dict, repeats: int, warmup: int = 2) -> dict:
    """One call of each implementation in turn, `repeats` rounds (machine noise hits every
    implementation alike); median and percentiles per implementation."""
    for _ in range(warmup):
        for fn in impls.values():
            fn()
    runs = {name: [] for name in impls}
    for _ in range(repeats):
        for name, fn in impls.items():
            t0 = time.perf_counter()
            fn()
            runs[name].append(time.perf_counter() - t0)
    return {name: median_p(r) for name, r in runs.items()}


def bandwidth(repeats: int) -> dict:
    """Write (fill) and copy (read + write) bandwidth on 256 MiB tensors, GB/s."""
    n = 64 * 2**20
    a, b = torch.empty(n), torch.empty(n)
    b.fill_(1.0)
    t = interleaved({"fill": lambda: a.fill_(2.0), "copy": lambda: a.copy_(b)}, repeats)
    return {"write_GBps": 4 * n / t["fill"]["ms"] / 1e6, "copy_GBps": 8 * n / t["copy"]["ms"] / 1e6}


def floors(repeats: int) -> dict:
    """Bandwidths and torch.mm GFLOP/s at the MLP's shapes (whole and per tile)."""
    out = bandwidth(max(3, repeats // 3))
    mm = {}
    for m, k, nn_ in (
        (16384, F, H),
        (16384, H, D),
        (48, F, H),
        (48, H, D),
        (48, D, H),
        (F, 48, H),
        (H, 48, D),
    ):
        x, y, z = torch.randn(m, k), torch.randn(k, nn_), torch.empty(m, nn_)
        reps = 5 if m > 1000 else 200
        r = interleaved(
            {"mm": lambda x=x, y=y, z=z, reps=reps: [torch.mm(x, y, out=z) for _ in range(reps)]}, 5
        )
        mm[f"{m}x{k}x{nn_}"] = 2 * m * k * nn_ * reps / r["mm"]["ms"] / 1e6
    out["mm_GFLOPs"] = mm
    return out


def lff_case(N: int, repeats: int, compile_: bool):
    import posenc_fast as pf
    from posenc_fast import _testing
    from posenc_fast.cli._timing import peak_bytes_cpu
    from posenc_fast.ops.lff import reference as ref

    case = _testing.LffCase((N,), 1, M, F, H, D)
    x, wr, w1, b1, w2, b2 = _testing.lff_inputs(case, torch.float32, "cpu", seed=N)
    x = _testing.rand((N, 1, M), _testing.generator(N), 0.0, 64.0)  # e.g. pixel coordinates
    eager = EagerLFF.from_weights(wr, w1, b1, w2, b2)  # the bench's own eager baseline
    weights = [t.requires_grad_(True) for t in (wr, w1, b1, w2, b2)]
    fns = {
        "eager": lambda: eager(x),
        "cpp": lambda: pf.lff(x, *weights, backend="cpp"),
        "torch": lambda: pf.lff(x, *weights, backend="torch"),
    }
    if compile_:
        compiled = torch.compile(eager)
        fns["compile"] = lambda: compiled(x)
    with torch.no_grad():
        want = ref.lff(x, *[w.detach() for w in weights])
        err = {k: float((f().double() - want).abs().max()) for k, f in fns.items()}
    grad = torch.randn(N, D)
    params = [*weights, *eager.parameters()]

    def fwd_bwd(fn):
        def run():
            fn().backward(grad)
            for p in params:
                p.grad = None

        return run

    def no_grad(fn):
        def run():
            with torch.no_grad():
                fn()

        return run

    res = {
        "N": N,
        "max_abs_err_vs_float64": err,
        "fwd": interleaved({k: no_grad(f) for k, f in fns.items()}, repeats),
        "fwd+bwd": interleaved({k: fwd_bwd(f) for k, f in fns.items()}, max(3, repeats // 2)),
    }
    res["peak_MiB_fwd+bwd"] = {k: peak_bytes_cpu(fwd_bwd(f)) / 2**20 for k, f in fns.items()}
    res["out_MB"] = N * D * 4 / 1e6
    return res


def table_case(kind: str, N: int, dim: int, repeats: int, compile_: bool):
    import posenc_fast as pf
    from posenc_fast import _testing
    from posenc_fast.ops.encodings import reference as ref

    p = _testing.rand((N,), _testing.generator(N + dim), 0.0, float(N))
    formula = (
        (lambda p: ref.dft(p, dim, compute_dtype=torch.float32))
        if kind == "dft"
        else (lambda p: ref.sinusoidal(p, dim, compute_dtype=torch.float32))
    )
    api = pf.dft if kind == "dft" else pf.sinusoidal
    fns = {
        "eager": lambda: formula(p),
        "cpp": lambda: api(p, dim, backend="cpp"),
        "torch": lambda: api(p, dim, backend="torch"),
    }
    if compile_:
        compiled = torch.compile(formula)
        fns["compile"] = lambda: compiled(p)
    want = formula(p.double()) if kind == "sinusoidal" else ref.dft(p, dim)
    err = {k: float((f().double() - want).abs().max()) for k, f in fns.items()}
    return {
        "kind": kind,
        "N": N,
        "dim": dim,
        "max_abs_err_vs_float64": err,
        "fwd": interleaved(fns, repeats),
        "out_MB": N * dim * 4 / 1e6,
    }


def add_case(kind: str, B: int, L: int, dim: int, repeats: int, compile_: bool):
    import posenc_fast as pf
    from posenc_fast.ops.encodings import reference as ref

    x = torch.randn(B, L, dim)
    pos = torch.arange(L)
    formula = ref.dft if kind == "dft" else ref.sinusoidal
    table = formula(pos, dim, compute_dtype=torch.float32)
    module = (pf.DFTPE if kind == "dft" else pf.SinusoidalPE)(dim, backend="cpp")
    torch_module = type(module)(dim, backend="torch")

    def per_call(x):
        return x + formula(pos, dim, compute_dtype=torch.float32)

    def with_table(x):
        return x + table

    fns = {
        "eager": lambda: with_table(x),
        "eager-table-per-call": lambda: per_call(x),
        "cpp": lambda: module(x),
        "torch": lambda: torch_module(x),
    }
    if compile_:
        c1, c2 = torch.compile(with_table), torch.compile(per_call)
        fns["compile"] = lambda: c1(x)
        fns["compile-table-per-call"] = lambda: c2(x)
    want = x.double() + formula(pos, dim)
    err = {k: float((f().double() - want).abs().max()) for k, f in fns.items()}
    return {
        "kind": kind,
        "B": B,
        "L": L,
        "dim": dim,
        "max_abs_err_vs_float64": err,
        "fwd": interleaved(fns, repeats),
        "bytes_MB": 2 * B * L * dim * 4 / 1e6,
    }


def run_one(args) -> dict:
    torch.set_num_threads(args.threads)
    out = {"threads": args.threads, "load_before": os.getloadavg(), "floors": floors(args.repeats)}
    cases = args.cases.split(",")
    out["lff"] = (
        [lff_case(n, args.repeats, not args.no_compile) for n in map(int, args.sizes.split(","))]
        if "lff" in cases
        else []
    )
    out["tables"] = (
        [
            table_case(k, 16384, 768, args.repeats, not args.no_compile)
            for k in ("sinusoidal", "dft")
        ]
        if "tables" in cases
        else []
    )
    out["adds"] = (
        [
            add_case(k, 8, 1024, 768, args.repeats, not args.no_compile)
            for k in ("sinusoidal", "dft")
        ]
        if "add" in cases
        else []
    )
    out["load_after"] = os.getloadavg()
    return out


def _row(what: str, t: dict, floor_ms: float) -> str:
    """cpp's median [p20, p80], each other implementation's time / cpp's, % of the floor."""
    c = t["cpp"]
    ratios = "  ".join(f"{k} {v['ms'] / c['ms']:.2f}x" for k, v in t.items() if k != "cpp")
    pct = 100 * floor_ms / c["ms"]
    return (
        f"  {what:30s} cpp {c['ms']:8.2f} ms [{c['p20']:.2f}, {c['p80']:.2f}]  {ratios}"
        f"  floor {floor_ms:.2f} ms ({pct:.0f}%)"
    )


def summarize(r: dict) -> list[str]:
    fl = r["floors"]
    mm = ", ".join(f"{k}: {v:.0f}" for k, v in fl["mm_GFLOPs"].items())
    lines = [
        f"threads={r['threads']} write {fl['write_GBps']:.1f} GB/s copy {fl['copy_GBps']:.1f}"
        f" GB/s; mm GFLOP/s {mm}; load {r['load_before']}"
    ]
    r1, r2 = fl["mm_GFLOPs"][f"16384x{F}x{H}"], fl["mm_GFLOPs"][f"16384x{H}x{D}"]
    for c in r["lff"]:
        for mode in ("fwd", "fwd+bwd"):
            # GEMM time at torch.mm's rates: the [N, F] x [F, H] and [N, H] x [H, D] products
            # (the backward does each three times: recompute / data gradient / weight gradient)
            k = 1 if mode == "fwd" else 3
            gemm_ms = k * 2 * c["N"] * (F * H / r1 + H * D / r2) / 1e6
            floor_ms = max(c["out_MB"] / fl["write_GBps"], gemm_ms)
            lines.append(_row(f"lff N={c['N']} {mode}", c[mode], floor_ms))
        peak = " ".join(f"{k} {v:.1f}" for k, v in c["peak_MiB_fwd+bwd"].items())
        lines.append(f"  lff N={c['N']} peak MiB fwd+bwd: {peak}")
    for c in r["tables"]:
        lines.append(
            _row(f"table {c['kind']} N={c['N']}", c["fwd"], c["out_MB"] / fl["write_GBps"])
        )
    for c in r["adds"]:
        what = f"add {c['kind']} {c['B']}x{c['L']}x{c['dim']}"
        lines.append(_row(what, c["fwd"], c["bytes_MB"] / fl["copy_GBps"]))
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--cases", default="lff,tables,add")
    ap.add_argument("--sizes", default="196,4096,16384")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fourier_cpu.json"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        args.threads = int(args.threads)
        print(json.dumps(run_one(args)))
        return 0
    from posenc_fast.cli._environment import describe

    report = {"benchmark": "fourier_cpu", "environment": describe(), "runs": []}
    for t in args.threads.split(","):
        cmd = [
            sys.executable,
            __file__,
            "--child",
            "--threads",
            t,
            "--cases",
            args.cases,
            "--sizes",
            args.sizes,
            "--repeats",
            str(args.repeats),
        ] + (["--no-compile"] if args.no_compile else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        report["runs"].append(r)
        print("\n".join(summarize(r)), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
