"""A timm training step with and without ``use_fast_rope`` (posenc_fast.integrations.timm).

    python benchmarks/timm_rope_step.py --json benchmarks/results/timm_rope_step_cpu.json
    python benchmarks/timm_rope_step.py --quick          # tiny models: a smoke test (~10 s)

For each case, two copies of one timm model (the same initial weights) train side by side
in one process, their steps interleaved (the order swapped every step, so machine load
drifts and cache effects hit both alike), each with AdamW on a fixed batch of random
images and labels (10-class head, cross-entropy): "timm" as timm builds it, "fast" after
``use_fast_rope(model)``. The ratio is timm's median step time over fast's: above 1, the
fused rotary op makes the step faster.

Cases (timm 1.0.31's models, pretrained=False, num_classes=10):

    vit_small_patch16_rope_224         224 px, batch 8   axial (RotaryEmbeddingCat)
    vit_base_patch16_rope_224          224 px, batch 4   axial
    vit_small_patch16_rope_mixed_224   224 px, batch 2   Mixed (learnable freqs per block)
    vit_small_patch16_rope_mixed_224   448 px, batch 2   Mixed, 785 tokens
    vit_small_patch16_dinov3           224 px, batch 4   DINOv3 (4 registers; rescaled
                                                         coordinates in training, x2)

The goals (the brief of use_fast_rope): never slower; Mixed at 448 px at least 1.04x.
Run it on a quiet machine (the load average is recorded with every row; the script warns
above 0.5 per thread). Timings are reported, never asserted.
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


def step(model, opt, x, y) -> float:
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    return time.perf_counter() - t0


def run_case(name: str, args) -> dict:
    timm_model, fast, x, y, size, batch = make_case(name, args.quick)
    with torch.no_grad():  # the two compute the same function (eval: no augmentation)
        a, b = timm_model.eval()(x), fast.eval()(x)
    max_rel_diff = ((a - b).abs().max() / a.abs().max()).item()
    timm_model.train(), fast.train()
    models = {"timm": timm_model, "fast": fast}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    times = {k: [] for k in models}
    load_before = os.getloadavg()[0]
    for i in range(args.warmup + args.steps):
        order = list(models) if i % 2 == 0 else list(models)[::-1]
        for k in order:
            torch.manual_seed(i)  # the same augmentation draws for both
            s = step(models[k], opts[k], x, y)
            if i >= args.warmup:
                times[k].append(s)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "case": name,
        "model": CASES[name][0],
        "image_size": size,
        "batch": batch,
        "threads": torch.get_num_threads(),
        "load_average_1min_before": load_before,
        "load_average_1min_after": os.getloadavg()[0],
        "steps": times,
        "timm_s": med["timm"],
        "fast_s": med["fast"],
        "ratio": med["timm"] / med["fast"],
        "eval_logits_max_rel_diff": max_rel_diff,
    }


def render(rows: list[dict]) -> str:
    out = [
        "| case | image | batch | timm (s/step) | use_fast_rope (s/step) | ratio | load (1 min) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['model']} | {r['image_size']} px | {r['batch']} | {r['timm_s']:.3f} | "
            f"{r['fast_s']:.3f} | {r['ratio']:.3f}x | {r['load_average_1min_before']:.1f} |"
        )
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny models: a smoke test")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {list(CASES)}")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=10, help="measured steps per model")
    p.add_argument("--warmup", type=int, default=2)
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
            f"ratio {row['ratio']:.3f}x  (load {row['load_average_1min_before']:.1f})",
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
