"""The fixed cost of one small call: a posenc_fast module on one position against the
same-size module written in eager PyTorch, forward, with and without autograd, one thread,
in one process, the candidates alternating.

    python benchmarks/call_overhead.py [--backend cpp] [--repeats 7] [--json PATH]

Cases: LearnableFourierFeatures(2, 256, 32, 768) on x [1, 1, 2] against nn.Linear(256, 32)
-> nn.GELU -> nn.Linear(32, 768) on a [1, 256] row (the MLP alone: less work than LFF,
which also makes the features), and the eager LFF module as the public implementations
write it (nn.Linear for the frequencies, torch.cat of cos and sin, the MLP). Microseconds
per call, the median of ``--repeats`` timed loops of ``--calls`` calls each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

import posenc_fast as pf

M, F, H, D = 2, 256, 32, 768


class EagerLff(nn.Module):
    """LFF as the public implementations write it."""

    def __init__(self):
        super().__init__()
        self.wr = nn.Linear(M, F // 2, bias=False)
        self.mlp = nn.Sequential(nn.Linear(F, H), nn.GELU(), nn.Linear(H, D))

    def forward(self, x):
        p = self.wr(x)
        return self.mlp(torch.cat([torch.cos(p), torch.sin(p)], -1) / F**0.5).flatten(-2)


def _per_call_us(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def measure(backend: str, repeats: int, calls: int) -> list[dict]:
    torch.manual_seed(0)
    cases = {
        "posenc_fast": (
            pf.LearnableFourierFeatures(M, F, H, D, backend=backend),
            torch.randn(1, 1, M),
        ),
        "eager MLP (Linear-GELU-Linear)": (
            nn.Sequential(nn.Linear(F, H), nn.GELU(), nn.Linear(H, D)),
            torch.randn(1, F),
        ),
        "eager LFF": (EagerLff(), torch.randn(1, 1, M)),
    }
    rows = []
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            runs = {name: [] for name in cases}
            for module, x in cases.values():
                for _ in range(calls // 10):
                    module(x)  # warm-up: first-use work, allocator, caches
            for _ in range(repeats):
                for name, (module, x) in cases.items():
                    runs[name].append(_per_call_us(lambda m=module, x=x: m(x), calls))
            for name, times in runs.items():
                rows.append({"case": name, "autograd": grad, "us": statistics.median(times)})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="auto")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = measure(args.backend, args.repeats, args.calls)
    for grad in (False, True):
        base = next(r["us"] for r in rows if r["autograd"] == grad and "MLP" in r["case"])
        print(f"{'with' if grad else 'without'} autograd ({args.threads} thread):")
        for r in rows:
            if r["autograd"] == grad:
                print(f"  {r['case']:<32} {r['us']:7.1f} us   {r['us'] / base:5.2f}x the eager MLP")
    if args.json:
        env = {"torch": torch.__version__, "threads": args.threads, "backend": args.backend}
        with open(args.json, "w") as f:
            json.dump({"environment": env, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
