"""Rotary embeddings on a GPU: LightGlue's (``pf.apply_lff_rotary``) and the grid
families' (``pf.rotary``: axial / EVA-02, RoPE-Mixed, DINOv3, FLUX's N-D) against the code
their users run (the GPU pipeline's rotary stage).

    python benchmarks/rotary.py --device cuda --dtypes float32,bfloat16
    python benchmarks/rotary.py --device cuda --cases nd-video,mixed-vit224 --time-budget 40
    python benchmarks/rotary.py --dry-run --out X.json    # a tiny CPU check of this script

The CPU cases run with ``python -m posenc_fast bench --ops rotary``; this script's cases,
inputs and baselines are that command's (``posenc_fast/cli/_cases.py`` ``rotary_case``,
``rotary_family_case``; ``_baselines``):
- LightGlue's self-attention (B = 1, 4 heads of 64 channels, M = 2, N = 512 and 2048
  keypoints; positions [B, N, 2] in (-1, 1), q and k sliced from a fused qkv projection as
  LightGlue does, channel stride 3) and a ViT-like one (B = 8, N = 1024, 12 heads of 64);
  gradients to q, k and wr.
- the families ("<family>-<grid>", FAMILY_CASES): ViT-B/16 (12 heads of 64) at 224 px
  (B = 8, 14 x 14) and 448 px (B = 2, 28 x 28), and the video grid 8 x 32 x 32 (B = 1, N-D
  only); prefix tokens as the models have them; gradients to q, k (and Mixed's freqs).
Modes: fwd (no autograd) and fwd+bwd. Implementations, on the same inputs:
    eager          LightGlue's formulas restated (tests/rotary/test_rotary.py names the
                   commit): nn.Linear phases -> cos, sin -> table, then t * cos +
                   rotate_half(t) * sin for q and k; for the families timm 1.0.31's Eva
                   attention (apply_rot_embed_cat, torch.cat of the prefix; Mixed's table
                   built in the call, axial's cached, DINOv3's once per model forward) and
                   FLUX's apply_rope (tests/rotary/test_rotary_baselines.py checks them)
    eager-rotate   LightGlue: the rotation alone with the table already computed (its
                   per-layer cost); fwd only here
    compile        torch.compile (default mode) of ``eager``
    torch, triton  posenc_fast with that backend (no table: cos / sin from x in the
                   kernel, also in the backward)
Correctness first: each implementation's q' and k' against the float64 reference.
Reported: median ms with 20th / 80th percentiles (do_bench), speed-ups of posenc_fast over
each baseline, peak memory of fwd+bwd (max allocated). JSON (written after every case) to
benchmarks/results/rotary_<device>.json with versions and the git SHA
(benchmarks/summarize_gpu.py's ``rotary()`` reads it); ``--time-budget`` begins no case that
would end after that many seconds (judged by the longest case so far; the proof's stage
limit) and records the rest as not run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _gpu_common  # noqa: E402  (benchmarks/, beside this script)
import torch  # noqa: E402

from posenc_fast.cli import _cases, _timing, bench  # noqa: E402

CASES = dict(_cases.ROTARY_SIZES)  # name -> (B, N, heads, head_dim)
# the families: "axial-vit224" etc. -> (family, grid name) of _cases.ROTARY_FAMILIES
FAMILY_CASES = {
    f"{family}-{grid}": (family, grid)
    for family, grids in _cases.ROTARY_FAMILIES.items()
    for grid in grids
    if grid != "grid8192"  # the CPU plot's third 2-D size; the GPU's large case is the video
}
CASES.update({name: _cases.ROTARY_GRIDS[grid] for name, (_, grid) in FAMILY_CASES.items()})
DRY_CASE = ("dry-run", (1, 64, 2, 16))  # --dry-run: a tiny case on the CPU, no torch.compile
DRY_FAMILY = ("dry-run-mixed", ("mixed", "dry"), (1, (4, 4)))  # and a tiny family case
OURS = ("triton", "cpp", "torch")


def timed(fn, device: str) -> dict:
    """Median and 20th / 80th percentile ms: do_bench (device events) on CUDA; on the CPU
    (--dry-run only: it checks this script, its timings mean nothing) bench's timer."""
    if device == "cuda":
        ms, p20, p80 = _gpu_common.bench(fn, device, rep_ms=200)
    else:
        ms, p20, p80 = _timing.time_cpu(fn, 0.0)
    return {"ms": ms, "ms_p20": p20, "ms_p80": p80}


def peak(fn, device: str) -> int:
    if device == "cuda":
        return _gpu_common.peak_bytes(fn, device)
    return _timing.peak_bytes_cpu(fn)


def make_case(name, dtype, device):
    """bench's case ``name``: a LightGlue size (rotary_case) or a family's (rotary_family_case)."""
    if name in FAMILY_CASES:
        family, grid = FAMILY_CASES[name]
        return _cases.rotary_family_case(family, grid, device, dtype, sizes=CASES[name])
    return _cases.rotary_case(name, device, dtype, sizes=CASES[name])


def run_case(name, dtype, device, compile_=True):
    torch._dynamo.reset()  # compiled afresh per case (bench's _Run.case says why)
    case = make_case(name, dtype, device)
    want = bench._joined(case.spec())
    scale = float(want.abs().max())
    rows = {}
    for impl_name, impl in bench._impls(case, ("compile",) if compile_ else ()).items():
        # q' and k' stacked, against the reference's
        err = float((bench._forward(case, impl) - want).abs().max())
        rows[impl_name] = {"max_abs_err_vs_float64": err, "max_abs_ref": scale}
        # eager-rotate: the forward only, as this stage has always timed it (bench --ops
        # rotary also times its backward, to q, k and the table)
        for mode in ("fwd",) if impl_name == "eager-rotate" else bench.MODES:
            rows[impl_name][mode] = timed(bench._runner(case, impl, mode), device)
        if "fwd+bwd" in rows[impl_name]:
            run = bench._runner(case, impl, "fwd+bwd")
            rows[impl_name]["peak_MB_fwd+bwd"] = (peak(run, device) or 0) / 2**20
    for impl_name, entry in rows.items():
        print(
            f"  {name:15s} {str(dtype)[6:]:8s} {impl_name:13s} "
            + "  ".join(f"{m} {entry[m]['ms']:8.2f} ms" for m in bench.MODES if m in entry)
            + f"  (max err {entry['max_abs_err_vs_float64']:.1e} of {scale:.2g})",
            flush=True,
        )
    ours = [n for n in OURS if n in rows]
    speedups = {}
    for mine in ours:
        speedups[mine] = {
            f"vs {other} {m}": rows[other][m]["ms"] / rows[mine][m]["ms"]
            for other in rows
            if other not in ours
            for m in bench.MODES
            if m in rows[other]
        }
    return {"case": name, "shape": CASES[name], "sizes": case.sizes, "dtype": str(dtype)[6:],
            "impls": rows, "speedups": speedups, "speedups_by": "ms"}  # fmt: skip


def triton_calls(device: str):
    """(name, call) for each Triton path this script times, every case and dtype, with the
    inputs on ``device``: what tools/prepare_gpu_build.sh compiles ahead for the GPU (on
    `meta` tensors, tools/triton_ahead.py), so that the GPU run compiles none of it."""
    for name in CASES:
        for dtype in (torch.float32, torch.bfloat16):
            for mode in bench.MODES:

                def call(name=name, dtype=dtype, mode=mode):
                    case = make_case(name, dtype, device)
                    bench._runner(case, bench._impls(case, ())["triton"], mode)()

                yield f"{name} {str(dtype)[6:]} {mode}", call


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (the CPU: bench --ops rotary)")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds: begin no case that would end after this, judged by the longest case "
        "so far (the rest recorded as not run)",
    )
    ap.add_argument("--dtypes", default="float32")
    ap.add_argument("--out", default=None)
    _gpu_common.add_git_sha_argument(ap)
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="one tiny case on the CPU, no torch.compile: checks this script anywhere",
    )
    args = ap.parse_args(argv)
    if args.dry_run:
        CASES.setdefault(*DRY_CASE)
        FAMILY_CASES.setdefault(*DRY_FAMILY[:2])
        CASES.setdefault(DRY_FAMILY[0], DRY_FAMILY[2])
        args.cases, args.device = f"{DRY_CASE[0]},{DRY_FAMILY[0]}", "cpu"
    elif args.device != "cuda":
        print(
            "rotary.py times the GPU; the CPU cases: python -m posenc_fast bench --ops rotary",
            file=sys.stderr,
        )
        return 2
    env = _gpu_common.environment(args.git_sha)
    report = {"benchmark": "rotary", "environment": env, "dry_run": args.dry_run, "results": []}
    out = args.out or os.path.join(_gpu_common.RESULTS, f"rotary_{args.device}.json")
    start = time.perf_counter()
    longest = 0.0  # the longest case so far: one that would end past the budget is not begun
    report["not_run"] = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for name in args.cases.split(","):
            begun = time.perf_counter()
            if args.time_budget is not None and begun - start + longest > args.time_budget:
                report["not_run"].append(f"{name} {dtype_name}")
                continue
            res = run_case(name, dtype, args.device, not args.dry_run)
            longest = max(longest, time.perf_counter() - begun)
            res["threads"] = torch.get_num_threads()
            report["results"].append(res)
            for mine, s in res["speedups"].items():
                print("    " + mine + ": " + ", ".join(f"{k} {v:.2f}x" for k, v in s.items()))
            _gpu_common.write_json(report, out)  # after every case: a stage cut keeps them
    if report["not_run"]:
        print(f"time budget spent: not run {', '.join(report['not_run'])}")
    _gpu_common.write_json(report, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
