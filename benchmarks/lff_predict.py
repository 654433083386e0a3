"""Predicted times of the Triton LFF plans for the GPU goal rows, from counts.

    python benchmarks/lff_predict.py            # the table (no GPU needed)
    python benchmarks/lff_predict.py --terms    # with each plan's terms

The cost model of posenc_fast/ops/lff/plan.py (FLOPs, bytes, sincos instructions,
launches) on the ceilings the first GPU run measured on an H200
(benchmarks/results/gpu_2026-11-27/proof/ceilings.json), beside what that run measured
for eager PyTorch and torch.compile(default) on the same cases (proof/lff_gpu.json), and
each case's floor at those ceilings. Everything printed for the plans is PREDICTED.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from posenc_fast.ops.lff import plan

HERE = os.path.dirname(os.path.abspath(__file__))
FIRST_RUN = os.path.join(HERE, "results", "gpu_2026-11-27", "proof", "lff_gpu.json")

# goal rows: (case, dtype, mode) -> (rows, M, F2, H, Dg)
SHAPES = {
    "compute": (2**20, 2, 384, 256, 1024),
    "compute-fp32": (2**20, 2, 384, 256, 1024),
    "canonical": (2**20, 2, 128, 32, 768),
    "small": (4096, 2, 128, 32, 768),
    "seq1d": (65536, 1, 128, 32, 768),
}


def measured_baselines() -> dict:
    """(case, mode, impl) -> ms measured by the first GPU run."""
    try:
        with open(FIRST_RUN) as f:
            rows = json.load(f)["results"]
    except (OSError, ValueError, KeyError):
        return {}
    return {(r["case"], r["mode"], r["impl"]): r["ms"] for r in rows if "ms" in r and "N" in r}


def floor_ms(c: plan.Ceilings, case: str, mode: str, R, M, F2, H, Dg, e) -> float:
    """max(bytes at the copy rate, products at the matmul rate): the floors of
    docs/performance.md (the backward with the features recomputed)."""
    F = 2 * F2
    nbytes = R * (4 * M + Dg * e)
    flops = 2 * R * (F * H + H * Dg) if mode == "fwd" else 2 * R * (3 * F * H + 2 * H * Dg)
    kind = "mma16" if e == 2 else "ieee"
    return 1e3 * max(nbytes / (c.copy_GBps * 1e9), flops / (c.matmul_TFLOPs(kind) * 1e12))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--terms", action="store_true", help="print each plan's terms")
    args = p.parse_args(argv)
    c = plan.H200
    base = measured_baselines()
    print(f"ceilings: {c.source}")
    print(
        f"{'case':<13} {'mode':<4} {'floor':>8} {'fused':>9} {'gemm':>9} {'auto':>5} "
        f"{'eager*':>8} {'compile*':>9} {'auto/compile':>12}   (ms; * measured 2026-11-27)"
    )
    for case, (R, M, F2, H, Dg) in SHAPES.items():
        e = 4 if case.endswith("fp32") else 2
        kind = "ieee" if e == 4 else "mma16"
        for mode in ("fwd", "bwd"):
            w = plan.Work(mode, R, M, F2, H, Dg, kind, e)
            est = plan.predict(w, c)
            best = min(est, key=lambda k: est[k].ms)
            compile_ms = base.get((case, mode, "compile"))
            eager_ms = base.get((case, mode, "eager"))
            ratio = f"{compile_ms / est[best].ms:.2f}x" if compile_ms else "-"
            print(
                f"{case:<13} {mode:<4} {floor_ms(c, case, mode, R, M, F2, H, Dg, e):8.3f} "
                f"{est['fused'].ms:9.3f} {est['gemm'].ms:9.3f} {best:>5} "
                f"{eager_ms if eager_ms else float('nan'):8.3f} "
                f"{compile_ms if compile_ms else float('nan'):9.3f} {ratio:>12}"
            )
            if args.terms:
                for name, estimate in est.items():
                    terms = ", ".join(f"{k} {v:.3f}" for k, v in estimate.terms.items())
                    print(f"    {name}: {terms}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
