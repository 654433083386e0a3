"""FLOATER in training: train-step overhead of FLOATER Q/K/V biases.

    python benchmarks/floater_train.py --json benchmarks/results/floater_train_cpu.json
    python benchmarks/floater_train.py --quick          # tiny sizes: a smoke test (~20 s)

For each model x batch x thread count, three copies of one model (same initial weights)
train side by side, their steps interleaved (so machine load drifts hit all three alike),
each with AdamW on random inputs:

- "without": the model as is;
- "exact": ``add_floater_biases(model)``, biases integrated on every step (one
  integration of all blocks' states per step, and one adjoint pass);
- "reuse k", for each k of ``--reuse`` (default 10,400; 400 is the paper's official
  setting, ``update_flow_every = 400``): ``add_floater_biases(model, refresh_every=k)``: one
  step in k integrates, the others reuse the biases as constants. Its amortised step time
  is (t_exact + (k - 1) t_reuse) / k, with t_reuse measured on reuse steps (the warm-up
  step is its refresh).

``--backend`` names the FLOATER backend of the "exact" and "reuse" variants (default
"auto": on CUDA the CUDA integrator where POSENC_FAST_CUDA_UNVALIDATED=1 lifts its gate,
else the torch backend captured in CUDA graphs).

``--compile``: every variant runs as ``torch.compile(model)`` (inductor, the default; the
first warm-up step compiles, ~1 min for ViT-S here), and "reuse k" (ignored under
torch.compile) gives way to "per block": ``add_floater_biases(model,
share_integration=False)``, each block integrating its own three states (what compiled
training ran before the shared integration was traced).

Models: timm ``vit_small_patch16_224`` (224 px, L = 197, d = 384, 12 blocks: S = 36 states;
cross-entropy loss) at each ``--vit-batches``, and a BERT-base-like
``nn.TransformerEncoder`` (12 layers, d = 768, 12 heads, FFN 3072, GELU, L = 512, S = 36;
mean-square loss of its output) at ``--bert-batches``. ``--quick`` shrinks both (a 2-block
ViT at 32 px and a 2-layer encoder at d = 64, L = 64).

Where the extra time goes: on the last exact step, torch.profiler's totals of the custom
ops ``posenc_fast::floater`` (integration forward) and ``posenc_fast::floater_backward``
(its discrete adjoint); the rest of the overhead is the adds, the Python of the wrapped
attention and whatever the profiler cannot attribute. ``--contention`` repeats every
setting with a busy process pinned to one core (benchmarks/_contention.py).

Timings are reported, never asserted. The median of ``--steps`` measured steps after
``--warmup`` steps (batch 32 ViT-S is ~8 s a step on 2 cores: keep both small).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _contention, beside it
from _contention import busy_cpu

from posenc_fast.cli._environment import describe
from posenc_fast.integrations.attention import add_floater_biases

ROOT = Path(__file__).resolve().parent.parent
# the integration's forward (taped in eager training on the cpp backend) and its backward
OPS = {
    "fwd": ("posenc_fast::floater", "posenc_fast::floater_taped"),
    "bwd": ("posenc_fast::floater_backward",),
}


def import_timm():
    """timm without torchvision (tests/_timm.py stands in for the names it imports)."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from _timm import import_timm as imp
    finally:
        sys.path.pop(0)
    return imp()


# -- models ---------------------------------------------------------------------------------


def vit_small(quick: bool) -> tuple[nn.Module, int]:
    vt = import_timm().models.vision_transformer
    if quick:
        return vt.VisionTransformer(
            img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2, num_classes=10
        ), 32
    # timm's vit_small_patch16_224 (the registry's create_model would import more of timm)
    return vt.VisionTransformer(
        img_size=224, patch_size=16, embed_dim=384, depth=12, num_heads=6, num_classes=1000
    ), 224


def bert_like(quick: bool) -> tuple[nn.Module, int, int]:
    d, heads, ffn, layers, L = (64, 2, 128, 2, 64) if quick else (768, 12, 3072, 12, 512)
    layer = nn.TransformerEncoderLayer(
        d, heads, ffn, dropout=0.1, activation="gelu", batch_first=True, norm_first=False
    )
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False), d, L


def make_case(model_name: str, batch: int, quick: bool, device: str = "cpu"):
    """(model, inputs, loss_fn) with fixed seeds (drawn on the CPU, then moved: the same
    numbers on every device)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if model_name == "vit_s16":
        model, px = vit_small(quick)
        x = torch.randn(batch, 3, px, px, generator=g).to(device)
        y = torch.randint(0, model.num_classes, (batch,), generator=g).to(device)
        return model.to(device), x, lambda out: nn.functional.cross_entropy(out, y)
    model, d, L = bert_like(quick)
    x = torch.randn(batch, L, d, generator=g).to(device)
    return model.to(device), x, lambda out: out.square().mean()


def sync(x: torch.Tensor) -> None:
    """Wait for the device's queued work (CUDA steps are timed to their end)."""
    if x.is_cuda:
        torch.cuda.synchronize(x.device)


# -- timing ---------------------------------------------------------------------------------


def step(model, opt, x, loss_fn, profile=False) -> tuple[float, dict]:
    """One training step (forward, backward, AdamW); (seconds, profiled op totals: on
    CUDA the time of the kernels each op launched, on the CPU the op's own time)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if x.is_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    prof = torch.profiler.profile(activities=activities) if profile else contextlib.nullcontext()
    with prof:
        sync(x)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x)).backward()
        opt.step()
        sync(x)
        seconds = time.perf_counter() - t0
    ops = {}
    if profile:
        for ev in prof.key_averages():
            for key, names in OPS.items():
                if ev.key in names:
                    total = ev.cpu_time_total
                    if x.is_cuda:  # the kernels' time (named cuda_time_total before 2.4)
                        total = getattr(ev, "device_time_total", None)
                        total = getattr(ev, "cuda_time_total", 0) if total is None else total
                    ops[key] = ops.get(key, 0.0) + total / 1e6
    return seconds, ops


def run_setting(model_name, batch, threads, args) -> dict:
    torch.set_num_threads(threads)
    if args.compile:  # compile afresh: dynamo's recompile limit counts every earlier model
        torch._dynamo.reset()
    base, x, loss_fn = make_case(model_name, batch, args.quick, args.device)
    base.train()
    variants = {"without": base}
    exact = copy.deepcopy(base)
    add_floater_biases(exact, backend=args.backend)
    variants["exact"] = exact
    if args.compile:
        third = copy.deepcopy(base)
        add_floater_biases(third, share_integration=False, backend=args.backend)
        variants["per_block"] = third
    else:
        for k in args.reuse:
            third = copy.deepcopy(base)
            add_floater_biases(third, refresh_every=k, backend=args.backend)
            variants[f"reuse{k}"] = third
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in variants.items()}
    run = {k: torch.compile(m) if args.compile else m for k, m in variants.items()}
    times = {k: [] for k in variants}
    ops = {}
    total = args.warmup + args.steps
    for i in range(total):
        for k in variants:
            last_exact = k == "exact" and i == total - 1 and not args.no_profile
            s, o = step(run[k], opts[k], x, loss_fn, profile=last_exact)
            if i >= args.warmup:
                times[k].append(s)
            if o:
                ops = o
    med = {k: statistics.median(v) for k, v in times.items()}
    t_without, t_exact = med["without"], med["exact"]
    row = {
        "model": model_name,
        "batch": batch,
        "device": args.device,
        "threads": threads,
        "contention": args.busy,
        "compiled": args.compile,
        "load_average_1min": os.getloadavg()[0],
        "steps": {k2: v for k2, v in times.items()},
        "without_s": t_without,
        "exact_s": t_exact,
        "exact_overhead_pct": 100 * (t_exact / t_without - 1),
        "integration_fwd_s": ops.get("fwd"),
        "integration_bwd_s": ops.get("bwd"),
    }
    if args.compile:
        row["per_block_s"] = med["per_block"]
        row["per_block_overhead_pct"] = 100 * (med["per_block"] / t_without - 1)
    else:
        row["reuse"] = {}
        for k in args.reuse:
            t_reuse = med[f"reuse{k}"]
            amortised = (t_exact + (k - 1) * t_reuse) / k
            row["reuse"][str(k)] = {
                "step_s": t_reuse,
                "amortised_s": amortised,
                "overhead_pct": 100 * (amortised / t_without - 1),
            }
        first = row["reuse"][str(args.reuse[0])]  # the table's column (and older readers)
        row["reuse_k"] = args.reuse[0]
        row["reuse_step_s"] = first["step_s"]
        row["reuse_amortised_s"] = first["amortised_s"]
        row["reuse_overhead_pct"] = first["overhead_pct"]
    extra = t_exact - t_without
    if ops:
        row["rest_of_overhead_s"] = extra - ops.get("fwd", 0.0) - ops.get("bwd", 0.0)
    row["backend"] = args.backend
    del variants, run, opts, base, exact
    return row


def integrator_rows(args) -> list[dict]:
    """The integrator alone at the models' shapes (S = 36, H = d, times i * 0.01, five RK4
    steps per interval, ReLU, float32, cpp or auto backend): forward and backward (the
    discrete adjoint, every gradient) seconds, per thread count, on a quiet machine and
    with a busy process on one core; and, as the eager-PyTorch yardstick of contention,
    the ViT-S (or quick ViT) training step without FLOATER under the same conditions."""
    from posenc_fast.ops.floater import floater

    shapes = (
        [(64, 17)]
        if args.quick
        else [tuple(map(int, x.split("x"))) for x in args.shapes.split(",")]
    )
    rows = []
    for busy in (False, True):
        for t in [int(x) for x in args.threads.split(",")]:
            torch.set_num_threads(t)
            with busy_cpu() if busy else contextlib.nullcontext():
                for d, L in shapes:
                    g = torch.Generator().manual_seed(0)
                    p0 = (0.3 * torch.randn(36, d, generator=g)).requires_grad_()
                    w1 = (torch.randn(d + 1, d, generator=g) / d**0.5).requires_grad_()
                    b1 = (0.1 * torch.randn(d, generator=g)).requires_grad_()
                    w2 = (torch.randn(d + 1, d, generator=g) * 0.3 / d**0.5).requires_grad_()
                    b2 = (0.1 * torch.randn(d, generator=g)).requires_grad_()
                    times = (torch.arange(L, dtype=torch.float64) * 0.01).float()
                    fwd, bwd = [], []
                    for _ in range(args.warmup + args.steps):
                        t0 = time.perf_counter()
                        out = floater(p0, w1, b1, w2, b2, times, substeps=5, method="rk4")
                        t1 = time.perf_counter()
                        out.backward(torch.ones_like(out))
                        fwd.append(t1 - t0)
                        bwd.append(time.perf_counter() - t1)
                    f = statistics.median(fwd[args.warmup :])
                    b = statistics.median(bwd[args.warmup :])
                    rows.append(
                        {"what": f"integrator S=36 d={d} L={L}", "threads": t, "busy": busy,
                         "fwd_s": f, "bwd_s": b, "bwd_over_fwd": b / f,
                         "load_average_1min": os.getloadavg()[0]}
                    )  # fmt: skip
                    print(
                        f"integrator d={d:4d} L={L:4d} t{t} {'busy' if busy else 'quiet'}: "
                        f"fwd {f:7.3f} s  bwd {b:7.3f} s  bwd/fwd {b / f:5.2f}",
                        flush=True,
                    )
                model, x, loss_fn = make_case("vit_s16", 2 if args.quick else 8, args.quick)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
                ts = [step(model, opt, x, loss_fn)[0] for _ in range(args.warmup + args.steps)]
                s_ = statistics.median(ts[args.warmup :])
                rows.append(
                    {"what": "eager vit_s16 step without FLOATER", "threads": t, "busy": busy,
                     "step_s": s_, "load_average_1min": os.getloadavg()[0]}
                )  # fmt: skip
                print(f"eager ViT step t{t} {'busy' if busy else 'quiet'}: {s_:7.3f} s", flush=True)
    return rows


def fmt(row) -> str:
    f = row["integration_fwd_s"]
    b = row["integration_bwd_s"]
    prof = f"  fwd {f:6.2f}  bwd {b:6.2f}" if f is not None and b is not None else ""
    busy = "  busy" if row["contention"] else ""
    third, pct = _third(row)
    more = "".join(
        f"  reuse{k} {v['overhead_pct']:+.1f}%" for k, v in list(row.get("reuse", {}).items())[1:]
    )
    return (
        f"{row['model']:8s} b{row['batch']:<3d} t{row['threads']}{busy:6s} "
        f"{row['without_s']:8.2f} {row['exact_s']:8.2f} {third:8.2f} "
        f"{row['exact_overhead_pct']:+8.1f}% {pct:+8.1f}%{prof}{more}"
    )


def _third(row) -> tuple[float, float]:
    """(s/step, overhead %) of the third variant: reuse k amortised, or per block under
    --compile."""
    if row.get("compiled"):
        return row["per_block_s"], row["per_block_overhead_pct"]
    return row["reuse_amortised_s"], row["reuse_overhead_pct"]


def render(paths: list[Path]) -> str:
    """The overhead table (markdown) of the training rows of one or more --json files."""
    rows = [r for path in paths for r in json.loads(path.read_text())["rows"] if "model" in r]
    compiled = any(r.get("compiled") for r in rows)
    third = "per block" if compiled else f"reuse {rows[0].get('reuse_k', 10) if rows else 10}"
    unit = "s/step" if compiled else "amortised s/step"
    more = any(len(r.get("reuse", {})) > 1 for r in rows)  # further refresh_every values
    out = [
        f"| model | batch | threads | load (1 min) | without (s/step) | exact (s/step) | {third} "
        f"({unit}) | exact overhead | {third} overhead | integration fwd / bwd (s) |"
        + (" other reuse overheads |" if more else ""),
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if more else ""),
    ]
    for r in rows:
        f, b = r.get("integration_fwd_s"), r.get("integration_bwd_s")
        prof = f"{f:.2f} / {b:.2f}" if f is not None and b is not None else "-"
        busy = " + busy core" if r["contention"] else ""
        if r.get("device", "cpu") != "cpu":
            busy += f" ({r['device']})"
        if r.get("compiled"):
            busy += " (compiled)"
        name = "ViT-S/16" if r["model"] == "vit_s16" else "BERT-base-like"
        t3, pct3 = _third(r)
        out.append(
            f"| {name} | {r['batch']} | {r['threads']}{busy} | {r['load_average_1min']:.1f} | "
            f"{r['without_s']:.2f} | {r['exact_s']:.2f} | {t3:.2f} | "
            f"{r['exact_overhead_pct']:+.0f}% | {pct3:+.0f}% | {prof} |"
            + (
                " "
                + ", ".join(
                    f"k={k}: {v['overhead_pct']:+.1f}%"
                    for k, v in list(r.get("reuse", {}).items())[1:]
                )
                + " |"
                if more
                else ""
            )
        )
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny models: a smoke test")
    p.add_argument("--models", default="vit_s16,bert", help="vit_s16,bert")
    p.add_argument("--vit-batches", default="8,32")
    p.add_argument("--bert-batches", default="8")
    p.add_argument("--threads", default="1,2", help="thread counts, e.g. 2,1")
    p.add_argument("--steps", type=int, default=2, help="measured steps per variant")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument(
        "--reuse", default="10,400", help="refresh_every of the reuse variants (comma-separated)"
    )
    p.add_argument("--backend", default="auto", help="the FLOATER backend (auto, cuda, torch, cpp)")
    p.add_argument("--contention", action="store_true", help="also with a busy core")
    p.add_argument("--no-profile", action="store_true", help="skip torch.profiler")
    p.add_argument(
        "--integrator",
        action="store_true",
        help="instead: the integrator alone (fwd, bwd) and an eager ViT step, quiet and busy",
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu or cuda (the models and inputs on it; steps timed to the device's end)",
    )
    p.add_argument("--compile", action="store_true", help="torch.compile every variant")
    p.add_argument("--shapes", default="384x197", help="--integrator: d x L, e.g. 384x197,768x512")
    p.add_argument("--json", type=Path, help="write the rows and the environment here")
    p.add_argument("--render", type=Path, nargs="+", help="only print the table of --json files")
    args = p.parse_args(argv)
    if args.render:
        print(render(args.render))
        return 0
    try:
        args.reuse = [int(k) for k in str(args.reuse).split(",") if k.strip()]
    except ValueError:
        p.error(f"--reuse must be comma-separated integers, got {args.reuse!r}")
    if args.steps < 1 or args.warmup < 1 or not args.reuse or min(args.reuse) < 2:
        p.error("--steps and --warmup must be >= 1, --reuse >= 2 (its warm-up is the refresh)")
    if args.warmup + args.steps > min(args.reuse) and not args.compile:
        p.error("--warmup + --steps must be <= --reuse (measured steps must be reuse steps)")
    threads = [int(t) for t in args.threads.split(",")]
    if args.device != "cpu":
        if args.integrator or args.contention:
            p.error("--integrator and --contention measure the CPU runtime: --device cpu")
        if not torch.cuda.is_available() and args.device.startswith("cuda"):
            p.error(f"--device {args.device}: torch sees no CUDA device")
        threads = threads[:1]  # the host threads barely matter to a GPU step
    cases = []
    for m in args.models.split(","):
        if m not in ("vit_s16", "bert"):
            p.error(f"unknown model {m!r} (vit_s16, bert)")
        batches = args.vit_batches if m == "vit_s16" else args.bert_batches
        cases += [(m, int(b)) for b in batches.split(",")]
    if args.quick:  # one batch of 2 per model
        cases = [(m, 2) for m in dict.fromkeys(m for m, _ in cases)]
    print(f"load average before: {os.getloadavg()}", flush=True)
    third = "perblock" if args.compile else f"reuse{args.reuse[0]}"
    print(
        f"{'model':8s} {'batch':4s} {'thr':8s} {'without':>8s} {'exact':>8s} "
        f"{third:>8s} {'exact %':>9s} {third[:5] + ' %':>9s}  (s/step; "
        "integration fwd/bwd s from torch.profiler)",
        flush=True,
    )
    rows = []
    environment = describe() if args.json else None

    def save() -> None:  # after every row: a run stopped at a time limit keeps what it measured
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            result = {
                "environment": environment,
                "load_average_end": os.getloadavg(),
                "argv": sys.argv[1:] if argv is None else list(argv),
                "rows": rows,
            }
            args.json.write_text(json.dumps(result, indent=1))

    if args.integrator:
        rows = integrator_rows(args)
    for busy in ((False, True) if args.contention else (False,)) if not args.integrator else ():
        for model_name, batch in cases:
            for t in threads:
                args.busy = busy
                with busy_cpu() if busy else contextlib.nullcontext():
                    row = run_setting(model_name, batch, t, args)
                rows.append(row)
                print(fmt(row), flush=True)
                save()
    print(f"load average after: {os.getloadavg()}", flush=True)
    save()
    if args.json:
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
