"""The LFF GPU benchmark: fused Triton LFF kernels against eager and torch.compile.

    python benchmarks/lff_gpu.py                       # every case, on the GPU (~10-20 min)
    python benchmarks/lff_gpu.py --cases canonical,small --impls eager,triton
    python benchmarks/lff_gpu.py --dry-run             # CPU, tiny sizes, Triton interpreter

Per case and mode (fwd, bwd through a retained graph, fwd+bwd), side by side on the same
inputs: the eager baseline (posenc_fast/cli/_baselines.py, phases in float32), its
torch.compile, the torch backend and the Triton backend (auto and each plan forced), each
checked against the float64 reference first; median ms, GB/s and TFLOP/s against ceilings
measured in the same run, % of the floor, speed-ups and peak memory go to JSON after every
case. Bytes, FLOPs and predicted floors: benchmarks/NOTES.md ("The LFF GPU benchmark").
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

# The LFF cases, CASES, are posenc_fast/cli/_cases.py's LFF_GPU_SHAPES (imported below,
# after --dry-run has chosen the Triton interpreter).
# --dry-run: the same cases shrunk so the interpreter gets through them in seconds.
DRY_CASES = {
    "canonical": (96, 2, 1, 32, 16, 48, "bfloat16"),
    "small": (32, 2, 1, 16, 16, 24, "bfloat16"),
    "compute": (64, 2, 1, 48, 32, 64, "bfloat16"),
    "compute-fp32": (64, 2, 1, 48, 32, 64, "float32"),
    "canonical-fp32": (96, 2, 1, 32, 16, 48, "float32"),
    "boxes-G2": (64, 4, 2, 16, 16, 32, "bfloat16"),
}
# Sinusoidal / DFT tables and fused adds (forward only): (kind, rows, L, dim, add)
ENC_CASES = {
    "sinusoidal-table": ("sinusoidal", 2**20, 2**20, 768, False),  # int positions: fp32 out
    "sinusoidal-add": ("sinusoidal", 2**20, 16384, 768, True),  # x bf16 [64, 16384, 768]
    "dft-add": ("dft", 2**20, 16384, 768, True),
}
DRY_ENC_CASES = {
    "sinusoidal-add": ("sinusoidal", 256, 64, 24, True),
    "dft-add": ("dft", 128, 64, 16, True),
}
MODES = ("fwd", "bwd", "fwd+bwd")
IMPLS = ("eager", "compile", "compile-max", "torch", "auto", "fused", "gemm")
PLAN_OF = {"auto": None, "fused": "fused", "gemm": "gemm"}  # the Triton backend's rows


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, Triton interpreter")
    p.add_argument(
        "--cases",
        default=None,
        help="comma-separated, run in the order given: LFF cases (LFF_GPU_SHAPES of "
        f"posenc_fast/cli/_cases.py) and "
        f"table / fused-add cases ({', '.join(ENC_CASES)}); default: every LFF case, then "
        "every table case. An LFF case may name its own modes: small:fwd, compute:fwd+bwd",
    )
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument(
        "--impls", default="eager,compile,torch,auto,fused,gemm", help=f"subset of {IMPLS}"
    )
    p.add_argument("--max-autotune", action="store_true", help="also compile-max")
    p.add_argument("--rep-ms", type=int, default=200, help="do_bench measuring time per point")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/...)")
    p.add_argument("--no-encodings", action="store_true", help="skip the table / fused-add cases")
    p.add_argument("--git-sha", default="", help="the tree's commit (gpu_validate.sh passes it)")
    return p.parse_args(argv)


ARGS = _args() if __name__ == "__main__" else _args([])
if ARGS.dry_run:
    # Before anything imports the kernels: the interpreter replaces the compiler.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import _gpu_common  # noqa: E402  (benchmarks/, beside this script)
import torch  # noqa: E402

import posenc_fast as pf  # noqa: E402
from posenc_fast.cli import (  # noqa: E402
    _baselines,
    _cases,
    _inputs,
)
from posenc_fast.ops.lff import plan as lff_plan  # noqa: E402
from posenc_fast.ops.lff import reference as lff_ref  # noqa: E402
from posenc_fast.tolerances import mismatch  # noqa: E402

CASES = _cases.LFF_GPU_SHAPES  # name: (N, M_total, G, F, H, D, dtype name)
DEVICE = "cpu" if ARGS.dry_run else "cuda"
COPY_TBPS_DATASHEET, MMA_TFLOPS_DATASHEET = 4.3, 790.0  # docs/performance.md, for predictions
FP32_TFLOPS_DATASHEET = 67.0  # H200 datasheet, plain fp32: only when not measured


# ---------------------------------------------------------------- measuring
# (shared with floater_gpu.py: benchmarks/_gpu_common.py)


def bench(fn) -> tuple[float, float, float]:
    """(median, p20, p80) milliseconds."""
    return _gpu_common.bench(fn, DEVICE, ARGS.rep_ms)


def peak_bytes(fn) -> int | None:
    """Most bytes allocated at once during fn(), above what was allocated before."""
    return _gpu_common.peak_bytes(fn, DEVICE)


def ceilings() -> dict:
    """Device-to-device copy bandwidth (bytes read + written), bf16 and fp32 matmul rates."""
    return _gpu_common.ceilings(DEVICE, bench, fp32=True)


# ---------------------------------------------------------------- cases


def counts(N, M, G, F, H, D, itemsize=2) -> dict:
    """Bytes and FLOPs per mode; ``itemsize`` of the output (and of dY)."""
    R, Dg = N * G, D // G
    fwd_bytes = R * (M // G) * 4 + N * D * itemsize
    bwd_bytes = R * (M // G) * 4 + N * D * itemsize
    fwd_flops = 2 * R * (F * H + H * Dg)
    bwd_flops = 2 * R * (F * H + 2 * H * Dg + 2 * F * H)
    return {
        "fwd": (fwd_bytes, fwd_flops),
        "bwd": (bwd_bytes, bwd_flops),
        "fwd+bwd": (fwd_bytes + bwd_bytes, fwd_flops + bwd_flops),
    }


def make_case(name, spec):
    N, M, G, F, H, D, dtype_name = spec
    dtype = getattr(torch, dtype_name)
    case = _inputs.LffCase((N,), G, M // G, F, H, D // G, "gelu")
    x, wr, w1, b1, w2, b2 = _inputs.lff_inputs(case, dtype, DEVICE, seed=N + F + G)
    weights = [t.requires_grad_(True) for t in (wr, w1, b1, w2, b2)]
    # The eager baseline as a user writes it (nn.Linear, torch.cat, nn.GELU) with copies of
    # the weights: float32 phases, the MLP in the weights' dtype, every intermediate
    # ([R, F/2] phases, cos, sin, [R, F], [R, H]) in memory.
    eager = _baselines.EagerLFF.from_weights(
        *(t.detach() for t in weights), phase_dtype=torch.float32
    )
    return {"name": name, "spec": spec, "dtype": dtype, "x": x, "weights": weights,
            "eager": eager}  # fmt: skip


def leaves(case, impl) -> list:
    """What a backward row differentiates: the eager module's own parameters for the
    baselines built from it, else the case's weights."""
    if impl in ("eager", "compile", "compile-max"):
        return list(case["eager"].parameters())
    return case["weights"]


def wanted_impls() -> set:
    wanted = set(ARGS.impls.replace("triton", "auto").split(","))
    unknown = wanted - set(IMPLS)
    if unknown:
        raise SystemExit(f"unknown --impls {sorted(unknown)}; choose from {IMPLS}")
    return wanted


@contextlib.contextmanager
def plan_env(plan):
    """POSENC_FAST_LFF_PLAN set to ``plan`` (None: auto) while a row is checked, built and
    timed (the backward of a "bwd" row runs after its forward: both inside)."""
    old = os.environ.get(lff_plan.ENV_PLAN)
    os.environ[lff_plan.ENV_PLAN] = plan or "auto"
    try:
        yield
    finally:
        if old is None:
            del os.environ[lff_plan.ENV_PLAN]
        else:
            os.environ[lff_plan.ENV_PLAN] = old


def auto_plan(case, mode) -> dict:
    """The plan auto takes for this case and mode, and why (the backend's own decision)."""
    from posenc_fast.triton_kernels import _launch

    x, (wr, w1, _, w2, _) = case["x"], case["weights"]
    w = lff_plan._work("bwd" if mode == "bwd" else "fwd", x, wr, w1, w2, case["dtype"], "gelu")
    with plan_env(None):
        d = lff_plan.decide(w, _launch.device_name(x.device), None)
    out = {"plan": d.plan, "plan_how": d.how, "plan_why": d.why}
    out["predicted_ms"] = {p: e.ms for p, e in d.estimates.items()}
    return out


def implementations(case) -> dict:
    x, weights, eager = case["x"], case["weights"], case["eager"]
    impls = {}
    wanted = wanted_impls()
    if ARGS.max_autotune:
        wanted.add("compile-max")
    if "eager" in wanted:
        impls["eager"] = lambda: eager(x)
    if "compile" in wanted and not ARGS.dry_run:
        f = torch.compile(eager)
        impls["compile"] = lambda: f(x)
    if "compile-max" in wanted and not ARGS.dry_run:
        f_max = torch.compile(eager, mode="max-autotune")
        impls["compile-max"] = lambda: f_max(x)
    if "torch" in wanted:
        impls["torch"] = lambda: pf.lff(x, *weights, backend="torch")
    for name in ("auto", "fused", "gemm"):
        if name in wanted:
            impls[name] = lambda: pf.lff(x, *weights, backend="triton")
    return impls


def check(case, fn, rows=4096) -> dict:
    """fn's first rows against the float64 reference, before any timing: max abs error
    and the verdict of posenc_fast.tolerances ("ok" or the mismatch report)."""
    with torch.no_grad():
        y = fn()
    n = min(rows, y.shape[0])
    w = [t.detach() for t in case["weights"]]
    expected = lff_ref.lff(case["x"][:n], *w, "gelu")
    verdict = mismatch(y[:n], expected, case["dtype"], "lff") or "ok"
    return {"max_abs_err": float((y[:n].double() - expected).abs().max()), "check": verdict}


def runner(fn, mode, weights, grad):
    if mode == "fwd":

        def run():
            with torch.no_grad():
                return fn()

        return run
    if mode == "bwd":
        y = fn()

        def run():
            return torch.autograd.grad(y, weights, grad, retain_graph=True)

        return run

    def run():
        return torch.autograd.grad(fn(), weights, grad)

    return run


# ---------------------------------------------------------------- main


def _launch_tf32() -> bool:
    """torch's TF32 setting for float32 matmuls, as the kernels read it."""
    from posenc_fast.triton_kernels import _launch

    return _launch.tf32_allowed()


def forward_config() -> dict | None:
    """The configuration the forward autotuner picked (last key), for the record."""
    try:
        from posenc_fast.triton_kernels import lff_forward

        cache = lff_forward._lff_fwd_tuned.tuner.cache
        return {str(k): str(v) for k, v in cache.items()} or None
    except Exception:  # interpreter (no autotuner use) or API drift
        return None


def encoding_case(spec) -> tuple[dict, int]:
    """({"eager": fn, "triton": fn}, bytes moved) of a table / fused-add case; eager: the
    table as a user writes it in float32 (_baselines), then x + table."""
    kind, rows, L, dim, add = spec
    fns = {}
    table = _baselines.table_module(kind, dim, DEVICE)
    if add:
        x = _inputs.randn((rows // L, L, dim), _inputs.generator(2), torch.bfloat16, DEVICE)
        module = (pf.DFTPE if kind == "dft" else pf.SinusoidalPE)(dim, backend="triton")
        eager = _baselines.EagerAdd(table)
        fns["eager"] = lambda: eager(x)
        fns["triton"] = lambda: module(x)
        return fns, 2 * x.numel() * x.element_size()
    pos = torch.arange(rows, device=DEVICE)
    encode = pf.dft if kind == "dft" else pf.sinusoidal
    fns["eager"] = lambda: table(pos)
    # (not named fn: encoding_rows' loop rebinds fn, which this closure would then call;
    # the first GPU run failed so, 2026-11-27)
    fns["triton"] = lambda: encode(pos, dim, backend="triton")
    return fns, rows * dim * 4 + rows * 8


def triton_calls(device: str):
    """(name, call) for each Triton path this script times (every LFF case with each plan,
    forward and backward to the weights as ``runner`` takes it; every table / fused-add
    case), with the
    inputs on ``device``: what tools/prepare_gpu_build.sh compiles ahead for the GPU (on
    `meta` tensors, tools/triton_ahead.py), so that the GPU run compiles none of it."""
    global DEVICE
    DEVICE = device
    for name, spec in CASES.items():
        for plan in ("fused", "gemm"):  # auto takes one of them

            def lff_fwd_bwd(spec=spec, name=name, plan=plan):
                case = make_case(name, spec)
                N, _, _, _, _, D, _ = spec
                with plan_env(plan):
                    y = pf.lff(case["x"], *case["weights"], backend="triton")
                    grad = _inputs.randn((N, D), _inputs.generator(1), case["dtype"], DEVICE)
                    torch.autograd.grad(y, case["weights"], grad)

            yield f"{name} {plan}", lff_fwd_bwd
    for name, spec in ENC_CASES.items():
        yield name, lambda spec=spec: encoding_case(spec)[0]["triton"]()


def encoding_rows(name, spec, copy_gbps) -> list[dict]:
    fns, nbytes = encoding_case(spec)
    if "compile" in ARGS.impls.split(",") and not ARGS.dry_run:
        fns["compile"] = torch.compile(fns["eager"])
    expected = fns["triton"]().double()
    out = []
    for impl, fn in fns.items():
        row = {"case": name, "mode": "fwd", "impl": impl, "bytes": nbytes}
        try:
            got = fn().double()
            row["max_abs_err_vs_triton"] = float((got - expected).abs().max())
            med, p20, p80 = bench(fn)
            row.update(ms=med, ms_p20=p20, ms_p80=p80, GBps=nbytes / (med * 1e-3) / 1e9)
            row["pct_copy_ceiling"] = 100 * row["GBps"] / copy_gbps
            row["floor_ms"] = nbytes / (copy_gbps * 1e9) * 1e3
            row["pct_of_floor"] = 100 * row["floor_ms"] / med
            row["peak_bytes"] = peak_bytes(fn)
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"
        out.append(row)
    for row in out:
        for base in ("eager", "compile"):
            base_row = next((r for r in out if r["impl"] == base), {})
            if "ms" in row and "ms" in base_row:
                row[f"speedup_vs_{base}"] = base_row["ms"] / row["ms"]
        print(_line(row))
    return out


def main() -> int:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run to check the script on CPU", file=sys.stderr)
        return 2
    cases = DRY_CASES if ARGS.dry_run else CASES
    enc_cases = DRY_ENC_CASES if ARGS.dry_run else ENC_CASES
    if ARGS.cases:
        names = ARGS.cases.split(",")
    else:
        names = list(cases) + ([] if ARGS.no_encodings else list(enc_cases))
    # "name:fwd+bwd" runs that case in those modes only ("+"-separated), else --modes
    case_modes = {n.split(":")[0]: n.split(":")[1].split("+") for n in names if ":" in n}
    names = [n.split(":")[0] for n in names]
    unknown = [n for n in names if n not in cases and n not in enc_cases]
    if unknown:
        print(f"unknown cases {unknown}; choose from {list(cases) + list(enc_cases)}",
              file=sys.stderr)  # fmt: skip
        return 2
    env = _gpu_common.environment(ARGS.git_sha)
    env["triton_autotune"] = os.environ.get("POSENC_FAST_TRITON_AUTOTUNE", "1") != "0"
    out_path = ARGS.out or _gpu_common.default_out("lff_gpu", env)
    ceil = ceilings()
    report = {
        "benchmark": "benchmarks/lff_gpu.py",
        "dry_run": ARGS.dry_run,
        "environment": env,
        "ceilings": ceil,
        "results": [],
    }
    copy_gbps = ceil["copy_GBps"] or COPY_TBPS_DATASHEET * 1e3
    mma_tflops = ceil["bf16_mm_TFLOPs"] or MMA_TFLOPS_DATASHEET
    print(f"ceilings: {ceil}")
    for name in names:
        if name in enc_cases:  # a table / fused-add case (forward only)
            report["results"] += encoding_rows(name, enc_cases[name], copy_gbps)
            _write(report, out_path)
            continue
        case = make_case(name, cases[name])
        N, M, G, F, H, D, _ = case["spec"]
        cnt = counts(N, M, G, F, H, D, case["dtype"].itemsize)
        # float32 products run on the fp32 units (TF32 off, torch's default): their ceiling
        fp32 = case["dtype"] == torch.float32 and not _launch_tf32()
        mma_case = (ceil.get("fp32_mm_TFLOPs") or FP32_TFLOPS_DATASHEET) if fp32 else mma_tflops
        impls = implementations(case)
        grad = _inputs.randn((N, D), _inputs.generator(1), case["dtype"], DEVICE)
        errors = {}
        for impl, fn in impls.items():
            try:
                with plan_env(PLAN_OF.get(impl)):
                    errors[impl] = check(case, fn)
            except Exception as exc:  # record and skip: a broken baseline is a result too
                errors[impl] = f"failed: {type(exc).__name__}: {exc}"
        for mode in case_modes.get(name, ARGS.modes.split(",")):
            nbytes, flops = cnt[mode]
            floor_ms = max(nbytes / (copy_gbps * 1e9), flops / (mma_case * 1e12)) * 1e3
            row_base = {"case": name, "mode": mode, "N": N, "M": M, "G": G, "F": F, "H": H}
            row_base.update({"D": D, "dtype": str(case["dtype"]), "bytes": nbytes, "flops": flops})
            rows = {}
            chosen = auto_plan(case, mode) if set(impls) & set(PLAN_OF) else {}
            for impl, fn in impls.items():
                row = dict(row_base, impl=impl, correctness=errors[impl])
                if impl == "auto":
                    row.update(chosen)
                if isinstance(errors[impl], str):
                    rows[impl] = row
                    continue
                if PLAN_OF.get(impl) and PLAN_OF[impl] == chosen.get("plan") and "auto" in rows:
                    # the same function as auto's row: its figures, not timed twice
                    same = {k: v for k, v in rows["auto"].items() if k not in row_base}
                    same.pop("impl", None)
                    row.update({k: v for k, v in same.items() if not k.startswith("plan")})
                    row["same_as"] = "auto"
                    rows[impl] = row
                    continue
                try:
                    with plan_env(PLAN_OF.get(impl)):
                        run = runner(fn, mode, leaves(case, impl), grad)
                        med, p20, p80 = bench(run)
                    row.update(ms=med, ms_p20=p20, ms_p80=p80)
                    row["GBps"] = nbytes / (med * 1e-3) / 1e9
                    row["pct_copy_ceiling"] = 100 * row["GBps"] / copy_gbps
                    row["TFLOPs"] = flops / (med * 1e-3) / 1e12
                    row["pct_mma_ceiling"] = 100 * row["TFLOPs"] / mma_case
                    row["mma_ceiling"] = "fp32" if fp32 else "bf16"
                    row["floor_ms"] = floor_ms
                    row["pct_of_floor"] = 100 * floor_ms / med
                    with plan_env(PLAN_OF.get(impl)):
                        row["peak_bytes"] = peak_bytes(run)
                    del run
                except Exception as exc:
                    row["error"] = f"{type(exc).__name__}: {exc}"
                rows[impl] = row
            for row in rows.values():
                for base in ("eager", "compile", "compile-max"):
                    if "ms" in row and "ms" in rows.get(base, {}):
                        row[f"speedup_vs_{base}"] = rows[base]["ms"] / row["ms"]
                report["results"].append(row)
                print(_line(row))
        if name in ("small", "seq1d") and "auto" in impls and DEVICE == "cuda":
            report["results"].append(_graph_replay(case, impls["auto"], cnt["fwd"][0]))
        del case, impls, grad
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        report["triton_forward_config"] = forward_config()
        _write(report, out_path)
    print(f"wrote {out_path}")
    return 0


def _write(report, path) -> None:
    _gpu_common.write_json(report, path)


def _graph_replay(case, fn, nbytes) -> dict:
    """Small inputs: the forward replayed from a CUDA graph (launch overhead removed; the
    capture itself shows that the path never synchronises)."""
    row = {"case": case["name"], "mode": "fwd (CUDA graph replay)", "impl": "auto"}
    try:
        with torch.no_grad():
            fn()  # autotune and compile outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
        med, p20, p80 = bench(graph.replay)
        row.update(ms=med, ms_p20=p20, ms_p80=p80, GBps=nbytes / (med * 1e-3) / 1e9)
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"
    print(_line(row))
    return row


def _line(row) -> str:
    if "ms" not in row:
        why = row.get("error") or row.get("correctness")
        return f"{row['case']:<16} {row['mode']:<8} {row['impl']:<12} {why}"
    extra = "".join(
        f" x{row[k]:.2f} vs {k[11:]}"
        for k in ("speedup_vs_eager", "speedup_vs_compile")
        if k in row
    )
    mem = f" peak {row['peak_bytes'] / 2**20:.0f} MiB" if row.get("peak_bytes") is not None else ""
    return (
        f"{row['case']:<16} {row['mode']:<8} {row['impl']:<12} {row['ms']:9.4f} ms "
        f"[{row['ms_p20']:.4f}, {row['ms_p80']:.4f}] {row['GBps']:8.1f} GB/s "
        f"({row.get('pct_copy_ceiling', float('nan')):5.1f}% copy, "
        f"{row.get('pct_of_floor', float('nan')):5.1f}% of floor){extra}{mem}"
    )


if __name__ == "__main__":
    sys.exit(main())
