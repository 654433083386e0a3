"""The machine's own ceilings, against which the benchmarks report "% of ceiling".

    python benchmarks/gpu_ceilings.py --out ceilings.json      # H200: ~15 s (estimate)
    python benchmarks/gpu_ceilings.py --dry-run --out /tmp/c.json

Measured with triton.testing.do_bench (median, device events, L2 flushed), on random data:
- copy_GBps: a 2 GiB bf16 device-to-device copy, bytes read + written (the same
  measurement lff_gpu.py makes for its own percentages: benchmarks/_gpu_common.ceilings);
- fill_GBps: a write-only fill of the same 2 GiB;
- bf16_mm_TFLOPs: an 8192 x 8192 x 8192 bf16 matmul;
- fp32_mm_TFLOPs: the same in float32 without TF32 (the FLOATER kernels' arithmetic is
  float32 FMA: its ceiling);
plus a read-only nvidia-smi query of the clocks, power and temperature before and after
(METHOD.md: the card's settings are measured as found, never changed).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _gpu_common  # noqa: E402
import torch  # noqa: E402

SMI_FIELDS = (
    "name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,power.draw,"
    "power.limit,temperature.gpu,utilization.gpu,memory.used,memory.total"
)


def smi() -> dict | str:
    """A read-only nvidia-smi query (never a setting)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unavailable: {type(exc).__name__}"
    if out.returncode != 0 or not out.stdout.strip():
        return f"unavailable: rc {out.returncode} {out.stderr.strip()[:200]}"
    values = [v.strip() for v in out.stdout.strip().splitlines()[0].split(",")]
    return dict(zip(SMI_FIELDS.split(","), values))


def fp32_matmul(device: str, bench_fn) -> float | None:
    if device != "cuda":
        return None
    k = 8192
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        mats = [torch.randn(k, k, device=device) for _ in range(2)]
        ms = bench_fn(lambda: mats[0] @ mats[1])[0]
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    return 2 * k**3 / (ms * 1e-3) / 1e12


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU: nothing measured, code paths run")
    p.add_argument("--rep-ms", type=int, default=200)
    p.add_argument("--out", required=True)
    _gpu_common.add_git_sha_argument(p)
    args = p.parse_args(argv)
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_ceilings: no CUDA device (use --dry-run on CPU)", file=sys.stderr)
        return 2
    report = {"benchmark": "benchmarks/gpu_ceilings.py", "dry_run": args.dry_run}
    report["environment"] = _gpu_common.environment(args.git_sha)
    report["nvidia_smi_before"] = smi() if device == "cuda" else None

    def bench_fn(fn):
        return _gpu_common.bench(fn, device, args.rep_ms)

    ceil = _gpu_common.ceilings(device, bench_fn, fill=True, dry_run=args.dry_run)
    ceil["fp32_mm_TFLOPs"] = fp32_matmul(device, bench_fn)
    report["ceilings"] = ceil
    report["nvidia_smi_after"] = smi() if device == "cuda" else None
    _gpu_common.write_json(report, args.out)
    shown = ", ".join(
        f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in ceil.items()
    )
    print(f"ceilings: {shown}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
