"""Rotary learnable Fourier features (LightGlue): ``pf.apply_lff_rotary`` against the code
LightGlue users run, on the CPU or a GPU.

    python benchmarks/rotary.py                      # CPU, float32, ~1-2 min on 2 cores
    python benchmarks/rotary.py --device cuda --dtypes float32,bfloat16   # GPU (pending)

Cases: LightGlue's self-attention (B = 1, 4 heads of 64 channels, M = 2, N = 512 and
2048 keypoints; positions [B, N, 2] in (-1, 1), q and k sliced from a fused qkv
projection as LightGlue does, channel stride 3) and a ViT-like one (B = 8, N = 1024,
12 heads of 64). Modes: fwd (no autograd) and fwd+bwd (gradients to q, k and wr, as in
training; positions need none). Implementations, on the same inputs:
    eager          LightGlue's formulas restated (tests/rotary/test_rotary.py names the commit):
                   nn.Linear phases -> cos, sin -> stack -> repeat_interleave -> the
                   table, then t * cos + rotate_half(t) * sin for q and for k
    eager-rotate   the rotation alone with the table already computed (LightGlue builds
                   the table once per image and reuses it in each of its 9 layers: this is
                   its per-layer cost); fwd only
    compile        torch.compile (default mode) of ``eager``
    torch, triton, cpp   posenc_fast.apply_lff_rotary with that backend (the table is
                   never built; cos / sin are recomputed from x, also in the backward);
                   triton on a GPU only, cpp (the C++ kernels) on the CPU only
Correctness first: each implementation's q' and k' against the float64 reference.
Reported: median ms with 20th / 80th percentiles (CPU: wall clock and process CPU time,
the implementations interleaved, see ``timed``), speed-ups of posenc_fast over each
baseline (CPU: by CPU time), peak memory of fwd+bwd (CPU: profiler allocations, CUDA:
max allocated), threads and load average. JSON to benchmarks/results/rotary_<device>.json with
versions and the git SHA.
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
from torch import nn  # noqa: E402

import posenc_fast as pf  # noqa: E402
from posenc_fast.ops.rotary import reference as ref  # noqa: E402

# (name, B, N, heads, head_dim)
CASES = {
    "lightglue-512": (1, 512, 4, 64),
    "lightglue-2048": (1, 2048, 4, 64),
    "vit-1024": (8, 1024, 12, 64),
}
DRY_CASE = ("dry-run", (1, 64, 2, 16))  # --dry-run: a tiny case, no torch.compile
M = 2


def rotate_half(t):
    pairs = t.unflatten(-1, (-1, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


def eager_table(proj: nn.Linear, x):
    phases = proj(x)
    return torch.stack((phases.cos(), phases.sin())).unsqueeze(-3).repeat_interleave(2, dim=-1)


def eager_rotate(table, q, k):
    return q * table[0] + rotate_half(q) * table[1], k * table[0] + rotate_half(k) * table[1]


def inputs(case, dtype, device, seed=0):
    B, N, H, D = CASES[case]
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, N, H, D, 3, generator=g).to(device=device, dtype=dtype).transpose(1, 2)
    q, k = qkv[..., 0], qkv[..., 1]  # [B, H, N, D], channel stride 3 (LightGlue's SelfBlock)
    x = (torch.rand(B, N, M, generator=g) * 2 - 1).to(device)
    proj = nn.Linear(M, D // 2, bias=False)
    with torch.no_grad():
        proj.weight.copy_(torch.randn(proj.weight.shape, generator=g))  # LightGlue: gamma 1
    return q, k, x, proj.to(device)


def implementations(device, q, k, x, proj, compile_=True):
    def eager():
        return eager_rotate(eager_table(proj, x), q, k)

    table = eager_table(proj, x).detach()
    impls = {
        "eager": eager,
        "eager-rotate": lambda: eager_rotate(table, q, k),
    }
    if compile_:
        impls["compile"] = torch.compile(eager)
    runs_on = {"torch": device, "triton": "cuda", "cpp": "cpu"}
    for name in ("torch", "triton", "cpp"):
        if name in pf.available_backends() and runs_on[name] == device:
            impls[name] = lambda name=name: pf.apply_lff_rotary(q, k, x, proj.weight, backend=name)
    return impls


def timed(calls: dict, device: str, repeats: int) -> dict:
    """{key: timing} for every callable of ``calls``. CUDA: do_bench each (device events).
    CPU: after two warm-up calls each, ``repeats`` rounds that call every implementation
    once in turn (interleaved, so that a busy neighbour slows them all alike), timing
    both the wall clock and this process's CPU time (process_time: with one thread, the
    work done, hardly affected by other processes; with more, summed over threads)."""
    if device == "cuda":
        out = {}
        for key, fn in calls.items():
            ms, p20, p80 = _gpu_common.bench(fn, device, rep_ms=200)
            out[key] = {"ms": ms, "ms_p20": p20, "ms_p80": p80}
        return out
    for fn in calls.values():
        fn(), fn()
    wall: dict = {key: [] for key in calls}
    cpu: dict = {key: [] for key in calls}
    for _ in range(repeats):
        for key, fn in calls.items():
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            cpu[key].append((time.process_time() - c0) * 1e3)
            wall[key].append((time.perf_counter() - w0) * 1e3)
    out = {}
    for key in calls:
        c = _gpu_common.quantiles(cpu[key])
        out[key] = {**_gpu_common.quantiles(wall[key]), "cpu_ms": c["ms"],
                    "cpu_ms_p20": c["ms_p20"], "cpu_ms_p80": c["ms_p80"]}  # fmt: skip
    return out


def peak(fn, device):
    if device == "cuda":
        return _gpu_common.peak_bytes(fn, device)
    from posenc_fast.cli._timing import peak_bytes_cpu

    return peak_bytes_cpu(fn)


def run_case(case, dtype, device, repeats, compile_=True):
    q, k, x, proj = inputs(case, dtype, device)
    with torch.no_grad():
        want = ref.apply_rotary(q, k, x, proj.weight, out_dtype=torch.float64)
    scale = float(max(w.abs().max() for w in want))
    # q, k are views of a qkv tensor: leaves of their own here, for their gradients
    q.requires_grad_(True), k.requires_grad_(True)
    leaves = [q, k, proj.weight]
    rows, calls = {}, {}
    for name, fn in implementations(device, q, k, x, proj, compile_).items():
        with torch.no_grad():
            got = fn()
        err = max(float((g.double() - w).abs().max()) for g, w in zip(got, want))
        rows[name] = {"max_abs_err_vs_float64": err, "max_abs_ref": scale}

        def fwd(fn=fn):
            with torch.no_grad():
                return fn()

        calls[name, "fwd"] = fwd
        if name != "eager-rotate":
            grads = [torch.randn_like(t) for t in got]

            def fwd_bwd(fn=fn, grads=grads):
                for t in leaves:
                    t.grad = None
                torch.autograd.backward(fn(), grads)

            calls[name, "fwd+bwd"] = fwd_bwd
    for (name, mode), t in timed(calls, device, repeats).items():
        rows[name][mode] = t
    for (name, mode), fn in calls.items():
        if mode == "fwd+bwd":
            rows[name]["peak_MB_fwd+bwd"] = (peak(fn, device) or 0) / 2**20
    clock = "cpu_ms" if device == "cpu" else "ms"
    for name, entry in rows.items():
        print(
            f"  {case:15s} {str(dtype)[6:]:8s} {name:13s} "
            + "  ".join(
                f"{m} {entry[m]['ms']:8.2f} ms"
                + (f" (cpu {entry[m]['cpu_ms']:7.2f})" if device == "cpu" else "")
                for m in ("fwd", "fwd+bwd")
                if m in entry
            )
            + f"  (max err {entry['max_abs_err_vs_float64']:.1e} of {scale:.2g})",
            flush=True,
        )
    ours = [n for n in ("triton", "cpp", "torch") if n in rows]
    speedups = {}
    for mine in ours:
        speedups[mine] = {
            f"vs {name} {m}": rows[name][m][clock] / rows[mine][m][clock]
            for name in rows
            if name not in ours
            for m in ("fwd", "fwd+bwd")
            if m in rows[name]
        }
    return {"case": case, "shape": CASES[case], "dtype": str(dtype)[6:], "impls": rows,
            "speedups": speedups, "speedups_by": clock}  # fmt: skip


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--dtypes", default="float32")
    ap.add_argument("--repeats", type=int, default=7, help="CPU: timed calls per mode")
    ap.add_argument("--threads", default="", help="CPU: torch.set_num_threads values")
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="one tiny case, no torch.compile, 2 repeats: checks this script anywhere",
    )
    args = ap.parse_args(argv)
    if args.dry_run:
        CASES.setdefault(*DRY_CASE)
        args.cases, args.repeats = DRY_CASE[0], 2
    env = _gpu_common.environment()
    report = {"benchmark": "rotary", "environment": env, "dry_run": args.dry_run, "results": []}
    if args.device == "cpu":
        report["load_before"] = os.getloadavg()
    threads = [int(t) for t in args.threads.split(",") if t] or [torch.get_num_threads()]
    for n_threads in threads:
        torch.set_num_threads(n_threads)
        print(f"threads {n_threads}", flush=True)
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            for case in args.cases.split(","):
                res = run_case(case, dtype, args.device, args.repeats, not args.dry_run)
                res["threads"] = n_threads
                report["results"].append(res)
                for mine, s in res["speedups"].items():
                    print("    " + mine + ": " + ", ".join(f"{k} {v:.2f}x" for k, v in s.items()))
    if args.device == "cpu":
        report["load_after"] = os.getloadavg()
    out = args.out or os.path.join(_gpu_common.RESULTS, f"rotary_{args.device}.json")
    _gpu_common.write_json(report, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
