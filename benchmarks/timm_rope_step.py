"""A timm training step with and without ``use_fast_rope`` (posenc_fast.integrations.timm).

    python benchmarks/timm_rope_step.py --json benchmarks/results/timm_rope_step_cpu.json
    python benchmarks/timm_rope_step.py --quick          # tiny models: a smoke test (~10 s)

For each case, two copies of one timm model (the same initial weights) train side by side
in one process, their steps interleaved (the order swapped every step, so machine load
drifts and cache effects hit both alike), each with AdamW on a fixed batch of random
images and labels (10-class head, cross-entropy): "timm" as timm builds it, "fast" after
``use_fast_rope(model)``. The ratio is timm's median step time over fast's: above 1, the
fused rotary op makes the step faster. The ratio of the median CPU times of the process
(all threads) is recorded beside it: on a busy machine it drifts less than wall time.

Cases (timm 1.0.31's models, pretrained=False, num_classes=10):

    vit_small_patch16_rope_224         224 px, batch 8   axial (RotaryEmbeddingCat)
    vit_base_patch16_rope_224          224 px, batch 4   axial
    vit_small_patch16_rope_mixed_224   224 px, batch 2   Mixed (learnable freqs per block)
    vit_small_patch16_rope_mixed_224   448 px, batch 2   Mixed, 785 tokens
    vit_small_patch16_dinov3           224 px, batch 4   DINOv3 (4 registers; rescaled
                                                         coordinates in training, x2)

The goals (the brief of use_fast_rope): never slower; Mixed at 448 px at least 1.04x.
Run it on a quiet machine. On a shared one, a pair of steps (one of each model) is kept
only if no other task was runnable just before and just after it (/proc/loadavg; else it
is measured again, after waiting for quiet: ``--max-running``, ``--patience``); the load
average and the pairs measured again are recorded with every row. Timings are reported,
never asserted.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from posenc_fast.cli._environment import describe
from posenc_fast.integrations.timm import use_fast_rope

ROOT = Path(__file__).resolve().parent.parent

# name -> (timm model, image size, batch, extra arguments)
CASES = {
    "vit_s_rope_224_b8": ("vit_small_patch16_rope_224", 224, 8, {}),
    "vit_b_rope_224_b4": ("vit_base_patch16_rope_224", 224, 4, {}),
    "vit_s_mixed_224_b2": ("vit_small_patch16_rope_mixed_224", 224, 2, {}),
    "vit_s_mixed_448_b2": ("vit_small_patch16_rope_mixed_224", 448, 2, {}),
    "vit_s_dinov3_224_b4": ("vit_small_patch16_dinov3", 224, 4, {"rope_rescale_coords": 2.0}),
}
# --quick: the same families, tiny (2 blocks, dim 64, 32 px)
QUICK = dict(patch_size=8, embed_dim=64, depth=2, num_heads=2)


def import_timm():
    """timm without torchvision (tests/_timm.py stands in for the names it imports)."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from _timm import import_timm as imp
    finally:
        sys.path.pop(0)
    return imp()


def make_case(name: str, quick: bool):
    """(timm model, converted copy, images, labels) with fixed seeds."""
    arch, size, batch, extra = CASES[name]
    kwargs = dict(pretrained=False, num_classes=10, **extra)
    if quick:
        size, batch = 32, 2
        kwargs.update(QUICK)
    torch.manual_seed(0)
    model = import_timm().create_model(arch, img_size=size, **kwargs).train()
    fast = use_fast_rope(copy.deepcopy(model))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 3, size, size, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    return model, fast, x, y, size, batch


def step(model, opt, x, y) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the process: all threads) of one training step."""
    t0, c0 = time.perf_counter(), time.process_time()
    opt.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    return time.perf_counter() - t0, time.process_time() - c0


def run_case(name: str, args) -> dict:
    timm_model, fast, x, y, size, batch = make_case(name, args.quick)
    with torch.no_grad():  # the two compute the same function (eval: no augmentation)
        a, b = timm_model.eval()(x), fast.eval()(x)
    max_rel_diff = ((a - b).abs().max() / a.abs().max()).item()
    timm_model.train(), fast.train()
    models = {"timm": timm_model, "fast": fast}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    times = {k: [] for k in models}
    cpu = {k: [] for k in models}
    load_before = os.getloadavg()[0]
    discarded = 0
    i = 0
    while len(times["timm"]) < args.steps:
        # one pair: both models' steps, in alternating order; kept when no other process
        # ran beside it (else measured again, after a wait: at most --patience seconds)
        order = list(models) if i % 2 == 0 else list(models)[::-1]
        if i >= args.warmup and args.max_running:
            wait_quiet(args.max_running, args.patience)
        quiet = running() <= args.max_running if args.max_running else True
        pair = {}
        for k in order:
            torch.manual_seed(i)  # the same augmentation draws for both
            pair[k] = step(models[k], opts[k], x, y)
        quiet = quiet and (running() <= args.max_running if args.max_running else True)
        if i >= args.warmup:
            if quiet or discarded >= args.max_discarded:
                for k, (s, c) in pair.items():
                    times[k].append(s)
                    cpu[k].append(c)
            else:
                discarded += 1
        i += 1
    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    pairwise = statistics.median(a / b for a, b in zip(times["timm"], times["fast"]))
    return {
        "case": name,
        "model": CASES[name][0],
        "image_size": size,
        "batch": batch,
        "threads": torch.get_num_threads(),
        "load_average_1min_before": load_before,
        "load_average_1min_after": os.getloadavg()[0],
        "pairs_discarded": discarded,
        "steps": times,
        "timm_s": med["timm"],
        "fast_s": med["fast"],
        "ratio": med["timm"] / med["fast"],
        "ratio_pairwise_median": pairwise,
        "cpu_steps": cpu,
        "timm_cpu_s": med_cpu["timm"],
        "fast_cpu_s": med_cpu["fast"],
        "cpu_ratio": med_cpu["timm"] / med_cpu["fast"],
        "eval_logits_max_rel_diff": max_rel_diff,
    }


def running() -> int:
    """Runnable tasks on the machine now (/proc/loadavg's 4th field), this process's
    included; 0 where unknown."""
    try:
        with open("/proc/loadavg") as f:
            return int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return 0


def wait_quiet(limit: int, patience: float) -> None:
    """Wait (at most ``patience`` seconds) until at most ``limit`` tasks are runnable over
    three samples 0.2 s apart."""
    end = time.monotonic() + patience
    while time.monotonic() < end:
        samples = []
        for _ in range(3):
            samples.append(running())
            time.sleep(0.2)
        if max(samples) <= limit:
            return
        time.sleep(2.0)


def render(rows: list[dict]) -> str:
    out = [
        "| model | image | batch | timm (s/step) | use_fast_rope (s/step) | ratio | "
        "ratio of CPU time | load (1 min) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['model']} | {r['image_size']} px | {r['batch']} | {r['timm_s']:.3f} | "
            f"{r['fast_s']:.3f} | {r['ratio']:.3f}x | {r['cpu_ratio']:.3f}x | "
            f"{r['load_average_1min_before']:.1f} |"
        )
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny models: a smoke test")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {list(CASES)}")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=10, help="measured steps per model")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--max-running",
        type=int,
        default=-1,
        help="keep a pair of steps only if at most this many tasks were runnable before and "
        "after it (/proc/loadavg), else measure it again: default threads + 1 (our own), "
        "0 with --quick; 0 keeps every pair",
    )
    p.add_argument("--patience", type=float, default=300.0, help="seconds to wait for quiet")
    p.add_argument("--max-discarded", type=int, default=50, help="then keep pairs regardless")
    p.add_argument("--json", type=Path, help="write the rows and the environment here")
    p.add_argument("--render", type=Path, help="only print the table of a --json file")
    args = p.parse_args(argv)
    if args.render:
        print(render(json.loads(args.render.read_text())["rows"]))
        return 0
    names = [c for c in args.cases.split(",") if c]
    unknown = [c for c in names if c not in CASES]
    if unknown or args.steps < 1 or args.warmup < 0:
        p.error(f"unknown cases {unknown} (of {list(CASES)}), or --steps < 1 / --warmup < 0")
    torch.set_num_threads(args.threads)
    if args.max_running < 0:  # a smoke test keeps every pair: it measures nothing
        args.max_running = 0 if args.quick else args.threads + 1
    load = os.getloadavg()[0]
    print(f"load average before: {os.getloadavg()}", flush=True)
    if load > 0.5 * args.threads:
        print(f"warning: the machine is busy (load {load:.1f}): ratios are unreliable", flush=True)
    rows = []
    for name in names:
        row = run_case(name, args)
        rows.append(row)
        print(
            f"{name:22s} timm {row['timm_s']:7.3f} s  fast {row['fast_s']:7.3f} s  "
            f"ratio {row['ratio']:.3f}x (pairwise {row['ratio_pairwise_median']:.3f}x)  "
            f"CPU-time ratio {row['cpu_ratio']:.3f}x  (load {row['load_average_1min_before']:.1f}, "
            f"{row['pairs_discarded']} pairs measured again)",
            flush=True,
        )
    print(render(rows))
    if args.json:
        timm = import_timm()
        environment = {**describe(), "timm": timm.__version__, "threads": args.threads}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"environment": environment, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
