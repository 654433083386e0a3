"""``python -m posenc_fast bench``: every implementation side by side on the same inputs.

For each op and size: the reference (eager, working dtype), torch.compile(reference) and
every usable posenc_fast backend; forward ("fwd", under no_grad) and forward+backward
("fwd+bwd"). Prints a table of median times (20th-80th percentiles), speed-ups against
the reference and against torch.compile, achieved GB/s of the counted floor bytes, and
peak memory; --json saves it with the machine, versions and git SHA; --plot draws time
against size. Timings are reported, never asserted.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from . import _cases, _timing
from ._environment import describe

MODES = ("fwd", "fwd+bwd")


def _runner(case, fn, mode):
    """A closure running one implementation once in ``mode``."""
    if mode == "fwd":

        def run():
            with torch.no_grad(), case.context():
                return fn()

        return run
    grad = {}

    def run():
        with case.context():
            out = fn()
        g = grad.get("g")
        if g is None:
            g = grad["g"] = torch.randn_like(out)
        out.backward(g)
        for t in case.leaves:
            t.grad = None

    return run


def _impls(case, compile_baseline: bool, max_autotune: bool) -> dict:
    impls = {"reference": lambda: case.reference(*case.args)}
    if compile_baseline:
        compiled = torch.compile(case.reference)
        impls["compile"] = lambda: compiled(*case.args)
        if max_autotune:
            compiled_max = torch.compile(case.reference, mode="max-autotune")
            impls["compile-max"] = lambda: compiled_max(*case.args)
    impls.update(case.backends)
    return impls


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def measure(
    cases, modes, device, min_time, compile_baseline=True, max_autotune=False
) -> list[dict]:
    timer = _timing.time_cuda if device == "cuda" else _timing.time_cpu
    peak = _timing.peak_bytes_cuda if device == "cuda" else _timing.peak_bytes_cpu
    results = []
    total = sum(
        len(_impls(c, False, False)) + compile_baseline + max_autotune for c in cases
    ) * len(modes)
    done = 0
    for case in cases:
        impls = _impls(case, compile_baseline, max_autotune)
        for mode in modes:
            for name, fn in impls.items():
                done += 1
                run = _runner(case, fn, mode)
                t0 = time.perf_counter()
                try:
                    med, p20, p80 = timer(run, min_time)
                    mem = peak(run)
                    error = ""
                except Exception as exc:  # one failing baseline must not stop the table
                    med = p20 = p80 = float("nan")
                    mem = -1
                    error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                _progress(
                    f"[{done}/{total}] {case.op} {case.label} {mode:<7} {name:<12} "
                    + (f"{med:9.3f} ms" if not error else f"failed: {error}")
                    + f"  ({time.perf_counter() - t0:.1f} s)"
                )
                results.append(
                    {
                        "op": case.op,
                        "case": case.label,
                        "size": case.size,
                        "sizes": case.sizes,
                        "mode": mode,
                        "impl": name,
                        "ms": med,
                        "ms_p20": p20,
                        "ms_p80": p80,
                        "peak_bytes": mem,
                        "floor_bytes": case.floor_bytes,
                        "error": error,
                    }
                )
    _add_ratios(results)
    return results


def _add_ratios(results: list[dict]) -> None:
    by_key: dict = {}
    for r in results:
        by_key.setdefault((r["op"], r["case"], r["mode"]), {})[r["impl"]] = r
    for group in by_key.values():
        ref = group.get("reference", {}).get("ms")
        comp = group.get("compile", {}).get("ms")
        for r in group.values():
            ok = r["ms"] == r["ms"] and r["ms"] > 0
            r["speedup_vs_reference"] = ref / r["ms"] if ok and ref else None
            r["speedup_vs_compile"] = comp / r["ms"] if ok and comp else None
            # GB/s of the counted floor bytes (forward only: the backward moves more)
            r["gbps"] = (
                r["floor_bytes"] / r["ms"] / 1e6
                if ok and r["mode"] == "fwd" and r["floor_bytes"]
                else None
            )


def _fmt_ratio(v) -> str:
    return f"{v:.2f}x" if v else "-"


def table(results: list[dict]) -> str:
    lines = []
    header = (
        f"{'impl':<12} {'median ms':>10} {'p20-p80 ms':>17} {'vs ref':>7} "
        f"{'vs compile':>10} {'GB/s':>7} {'peak MB':>9}"
    )
    current = None
    for r in results:
        key = (r["op"], r["case"], r["mode"])
        if key != current:
            current = key
            lines.append("")
            lines.append(f"{r['op']}  {r['case']}  [{r['mode']}]")
            lines.append(header)
        if r["error"]:
            lines.append(f"{r['impl']:<12} failed: {r['error']}")
            continue
        gbps = f"{r['gbps']:.1f}" if r["gbps"] else "-"
        peak = f"{r['peak_bytes'] / 2**20:.1f}" if r["peak_bytes"] >= 0 else "-"
        lines.append(
            f"{r['impl']:<12} {r['ms']:>10.3f} {r['ms_p20']:>8.3f}-{r['ms_p80']:<8.3f} "
            f"{_fmt_ratio(r['speedup_vs_reference']):>7} {_fmt_ratio(r['speedup_vs_compile']):>10} "
            f"{gbps:>7} {peak:>9}"
        )
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib: pip install 'posenc-fast[plot]'", file=sys.stderr)
        return
    panels = sorted({(r["op"], r["mode"]) for r in results})
    cols = 2
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4 * rows), squeeze=False)
    for ax, (op, mode) in zip(axes.flat, panels):
        sel = [r for r in results if r["op"] == op and r["mode"] == mode and not r["error"]]
        for impl in dict.fromkeys(r["impl"] for r in sel):
            pts = sorted((r["size"], r["ms"]) for r in sel if r["impl"] == impl)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{op} [{mode}]")
        ax.set_xlabel("positions")
        ax.set_ylabel("ms (median)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}", file=sys.stderr)


def _floater_cases(quick: bool, device: str) -> list:
    try:
        from .floater_suite import bench_cases
    except ImportError:
        return []
    return bench_cases(quick, device)


def run(args) -> int:
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("bench --device cuda: no CUDA device is visible to torch", file=sys.stderr)
        return 2
    known = ["lff", "sinusoidal", "dft", "floater"]
    ops = known if args.ops == "all" else [o.strip() for o in args.ops.split(",")]
    bad = [o for o in ops if o not in known]
    modes = [m.strip() for m in args.modes.split(",")]
    if bad or any(m not in MODES for m in modes):
        print(f"choose --ops from {known} and --modes from {list(MODES)}", file=sys.stderr)
        return 2
    min_time = args.min_time if args.min_time is not None else (0.1 if args.quick else 0.5)
    cases = _cases.cases(args.quick, device, ops)
    if "floater" in ops:
        cases += _floater_cases(args.quick, device)
    env = describe()
    _progress(
        f"posenc_fast bench: {len(cases)} cases on {device}, modes {modes}, git {env['git_sha']}"
    )
    t0 = time.perf_counter()
    results = measure(cases, modes, device, min_time, not args.no_compile, args.max_autotune)
    print(table(results))
    print(
        f"\n{len(results)} measurements in {time.perf_counter() - t0:.0f} s on {env['processor']} "
        f"({env['threads']} threads), torch {env['torch']}, git {env['git_sha']}"
    )
    if args.json:
        payload = {"environment": env, "device": device, "quick": args.quick, "results": results}
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
        print(f"results written to {args.json}", file=sys.stderr)
    if args.plot:
        plot(results, args.plot)
    return 0
