"""The FLOATER GPU benchmark: the CUDA FLOATER integrator against torchdiffeq (odeint and
odeint_adjoint), the package's torch backend and a CUDA-graphed PyTorch loop of the same
steps, with the goals each case is judged against.

    python benchmarks/floater_gpu.py --out floater_gpu.json    # the grid (H200: ~8 min, estimated)
    python benchmarks/floater_gpu.py --lengths 1024 --states 12 --dims 512 --out one.json
    python benchmarks/floater_gpu.py --dry-run --out /tmp/dry.json   # CPU, tiny sizes, seconds

The grid, implementations, checks, timing, guard and goals: benchmarks/README.md ("The
FLOATER GPU benchmark").
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import _gpu_common  # noqa: E402  (benchmarks/, beside this script)
import torch  # noqa: E402

from posenc_fast.cli._cases import FLOATER_DELTA_T as DELTA_T  # noqa: E402
from posenc_fast.cli._cases import FLOATER_SUBSTEPS as SUBSTEPS  # noqa: E402

ACTIVATION = "relu"
BASELINE_METHOD = "rk38"  # = torchdiffeq's fixed-grid "rk4"
BASELINES = ("torch", "torch-eager", "graph", "torchdiffeq", "adjoint")
# Measured in this order: first (pass 1, every case) those the goals need, forwards first,
# then (pass 2, every case, with the time left) the others.
GOAL_BASELINES = (("graph", "fwd"), ("torchdiffeq", "fwd"), ("graph", "bwd"), ("adjoint", "bwd"))
INFO_BASELINES = (
    ("torch", "fwd"),
    ("torch", "bwd"),
    ("torch-eager", "fwd"),
    ("torchdiffeq", "bwd"),
    ("adjoint", "fwd"),
)
MEASUREMENTS = GOAL_BASELINES + INFO_BASELINES
MODES = ("fwd", "bwd")
CHECK_LENGTH = 17  # sample times checked against the float64 reference
GOALS = {  # name: (comparison, threshold, what)
    "fwd_vs_torchdiffeq": (">=", 40.0, "torchdiffeq fwd / subject fwd"),
    "bwd_vs_adjoint": (">=", 50.0, "adjoint bwd / subject bwd"),
    "fwd_vs_graph": (">=", 6.0, "graphed loop fwd / subject fwd"),
    "bwd_vs_graph": (">=", 6.0, "graphed loop bwd / subject bwd"),
    "bwd_over_fwd": ("<=", 1.5, "subject bwd / subject fwd"),
}
INFO_RATIOS = {  # reported beside the goals
    "fwd_vs_torch": ("torch", "fwd"),
    "fwd_vs_torch_eager": ("torch-eager", "fwd"),
    "bwd_vs_torch": ("torch", "bwd"),
    "bwd_vs_torchdiffeq": ("torchdiffeq", "bwd"),
    "fwd_vs_adjoint": ("adjoint", "fwd"),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny grid, cpp as the subject")
    p.add_argument("--lengths", default=None, help="L values (default 256,1024,4096)")
    p.add_argument("--states", default=None, help="S values (default 12,36)")
    p.add_argument("--dims", default=None, help="d = H values (default 64,512,1024)")
    p.add_argument("--methods", default="rk38,rk4", help="the subject's methods")
    p.add_argument(
        "--impls",
        default=None,
        help="subset of cuda (the subject), " + ", ".join(BASELINES) + " (default: all; "
        "--dry-run: all but torch-eager, which is torch itself off CUDA)",
    )
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument(
        "--max-seconds-per-impl",
        type=float,
        default=20.0,
        help="skip a baseline measurement whose setup + one run is estimated above this",
    )
    p.add_argument(
        "--time-budget",
        type=float,
        default=450.0,
        help="seconds for the whole run; baselines that would end later are skipped (0: none)",
    )
    p.add_argument(
        "--subject-reserve",
        type=float,
        default=5.0,
        help="seconds kept per remaining case for the subject within --time-budget",
    )
    p.add_argument("--rep-ms", type=int, default=100, help="do_bench measuring time per point")
    p.add_argument("--fast-ms", type=float, default=30.0, help="calls below: do_bench")
    p.add_argument(
        "--slow-repeats", type=int, default=3, help="timed runs of slower calls, at most"
    )
    p.add_argument(
        "--target-seconds",
        type=float,
        default=4.0,
        help="time spent on the runs of one slower measurement (fewer repeats beyond)",
    )
    p.add_argument(
        "--cuda-layouts",
        default="",
        help="extra subject rows with the CUDA layout forced (set_development_options' "
        "floater_layout), ';'-separated (e.g. 'solo,1,12;cluster,4,12'), for tuning",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/...)")
    _gpu_common.add_git_sha_argument(p)
    args = p.parse_args(argv)
    dry = args.dry_run
    args.lengths = _ints(args.lengths or ("5,9" if dry else "256,1024,4096"))
    args.states = _ints(args.states or ("2" if dry else "12,36"))
    args.dims = _ints(args.dims or ("8" if dry else "64,512,1024"))
    args.methods = _names(args.methods)
    default_impls = [i for i in ("cuda", *BASELINES) if not (dry and i == "torch-eager")]
    args.impls = _names(args.impls) if args.impls else default_impls
    args.modes = _names(args.modes)
    args.cuda_layouts = [s.strip() for s in args.cuda_layouts.split(";") if s.strip()]
    bad = [m for m in args.modes if m not in MODES]
    bad += [i for i in args.impls if i not in ("cuda", *BASELINES)]
    bad += [m for m in args.methods if m not in ("rk4", "rk38", "midpoint", "euler")]
    if bad:
        p.error(f"unknown values {bad}")
    if min(args.lengths) < 2:
        p.error("lengths must be >= 2")
    return args


def _ints(text: str) -> list[int]:
    return sorted({int(v) for v in str(text).split(",") if v.strip()})


def _names(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


# ---------------------------------------------------------------- the graphed loop


def stage_schedule(times_host: list[float], K: int, tab) -> tuple[list[float], list[float]]:
    """(time of every stage of every step, size of every step) for intervals 1..L-1 (times
    start at 0: interval 0 has length zero and out[:, 0] = p0)."""
    stage_t, steps = [], []
    for j in range(1, len(times_host)):
        t0 = times_host[j - 1]
        h = (times_host[j] - t0) / K
        for k in range(K):
            steps.append(h)
            stage_t.extend(t0 + k * h + c * h for c in tab.c)
    return stage_t, steps


def plain_loop(p0, w1, b1, w2, b2, stage_t, steps, K: int, tab):
    """The integration as plain PyTorch, one op per layer (what CUDA graphs can replay):
    h(t, p) = relu(p w1[:d] + t w1[d] + b1) w2[:H] + t w2[H] + b2, the biases of every
    stage time computed up front (one op each, unbound into views), each stage
    addmm -> relu -> addmm, each stage input and the step as adds with alpha. Returns the
    states at the sample times [S, L, d]; differentiable."""
    d, H = p0.shape[1], w1.shape[1]
    W1, W2 = w1[:d], w2[:H]
    bias1 = torch.addr(b1, stage_t, w1[d]).unbind(0)
    bias2 = torch.addr(b2, stage_t, w2[H]).unbind(0)
    y, states, i = p0, [p0], 0
    for n, h in enumerate(steps):
        ks = []
        for row in tab.a:
            z = y
            for m, a in enumerate(row):
                if a:
                    z = torch.add(z, ks[m], alpha=h * a)
            ks.append(torch.addmm(bias2[i], torch.relu(torch.addmm(bias1[i], z, W1)), W2))
            i += 1
        for st, b in enumerate(tab.b):
            if b:
                y = torch.add(y, ks[st], alpha=h * b)
        if (n + 1) % K == 0:
            states.append(y)
    return torch.stack(states, dim=1)


# ---------------------------------------------------------------- a case


@dataclass
class Prepared:
    """An implementation ready to be timed: ``run()`` does one call (fwd: the forward;
    bwd: the backward alone); ``result()`` gives the output (fwd) or the gradients (bwd)
    of the last call; setup_s: host seconds spent preparing (the forward with a graph, a
    capture)."""

    run: Callable
    result: Callable
    setup_s: float
    held_bytes: Optional[int]
    note: str = ""


class Case:
    def __init__(self, ctx, L: int, S: int, d: int):
        from posenc_fast.cli import _cases, _inputs

        self.ctx, self.L, self.S, self.d = ctx, L, S, d
        dev = ctx.device
        *weights, self.times = _cases.floater_inputs(
            S, d, L, torch.float32, dev, ctx.seed + L + d + S
        )
        self.leaves = [t.requires_grad_(True) for t in weights]
        self.times_host = self.times.cpu().double().tolist()
        self.grad_out = _inputs.randn(
            (S, L, d), _inputs.generator(ctx.seed + 7 * L + d), torch.float32, dev
        )
        self.name = f"L={L} S={S} d=H={d}"

    # -- implementations -------------------------------------------------------------------

    def prepare(self, impl: str, mode: str, n: int, method: str = BASELINE_METHOD) -> Prepared:
        """``impl`` on the first ``n`` sample times, in ``mode``."""
        ctx = self.ctx
        before = torch.cuda.memory_allocated() if ctx.cuda else None
        t0 = time.perf_counter()
        times, g = self.times[:n], self.grad_out[:, :n]
        state: dict = {}
        if impl == "graph":
            prep = self._prepare_graph(mode, n, g)
        elif impl == "torch-eager":
            with _eager_torch():
                prep = self.prepare("torch", mode, n, method)
            run = prep.run

            def run_eager():
                with _eager_torch():
                    run()

            prep.run = run_eager
        elif mode == "fwd":
            call = self._call(impl, method, times)

            def run():
                with torch.no_grad():
                    state["result"] = call()

            prep = Prepared(run, lambda: state["result"], 0.0, None)
        else:
            out = self._call(impl, method, times)()  # the forward with its graph: setup

            def run():
                state["result"] = torch.autograd.grad(out, self.leaves, g, retain_graph=True)

            prep = Prepared(run, lambda: state["result"], 0.0, None)
        if (
            impl == "torch"
            and ctx.cuda
            and os.environ.get("POSENC_FAST_FLOATER_CUDA_GRAPHS") != "0"
        ):
            prep.run()  # the capture is setup, not a timed call
        _gpu_common.sync(ctx.device)
        prep.setup_s = time.perf_counter() - t0
        if ctx.cuda:
            prep.held_bytes = int(torch.cuda.memory_allocated() - before)
        return prep

    def _call(self, impl: str, method: str, times) -> Callable:
        from posenc_fast.cli import _baselines
        from posenc_fast.ops.floater import floater

        if impl in ("torchdiffeq", "adjoint"):
            baselines = _baselines.torchdiffeq_baselines(*self.leaves, times, SUBSTEPS)
            if not baselines:
                raise RuntimeError("torchdiffeq is not installed")
            fn = baselines["torchdiffeq" if impl == "torchdiffeq" else "torchdiffeq-adjoint"]
            return lambda: fn().transpose(0, 1)  # [L, S, d] -> [S, L, d]
        backend = self.ctx.subject if impl == "subject" else impl
        return lambda: floater(*self.leaves, times, SUBSTEPS, method, ACTIVATION, backend=backend)

    def _prepare_graph(self, mode: str, n: int, g) -> Prepared:
        from posenc_fast.ops.floater.torch_impl import TABLEAUX

        ctx, tab = self.ctx, TABLEAUX[BASELINE_METHOD]
        stage_t, steps = stage_schedule(self.times_host[:n], SUBSTEPS, tab)
        tvec = torch.tensor(stage_t, dtype=torch.float32, device=ctx.device)
        leaves = self.leaves

        def loop():
            return plain_loop(*leaves, tvec, steps, SUBSTEPS, tab)

        if not ctx.cuda:  # dry run: the same loop, eagerly
            note = "dry run: the loop run eagerly, not captured"
            if mode == "fwd":
                state: dict = {}

                def run():
                    with torch.no_grad():
                        state["out"] = loop()

                return Prepared(run, lambda: state["out"], 0.0, None, note)
            out = loop()
            grads: dict = {}

            def run_b():
                grads["g"] = torch.autograd.grad(out, leaves, g, retain_graph=True)

            return Prepared(run_b, lambda: grads["g"], 0.0, None, note)

        # Warm-up on a side stream before capturing (cuBLAS handles, the allocator), on two
        # intervals: as torch.cuda.make_graphed_callables does, without its full-size runs.
        w_t, w_steps = stage_schedule(self.times_host[:2], SUBSTEPS, tab)
        w_tvec = torch.tensor(w_t, dtype=torch.float32, device=ctx.device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            o = plain_loop(*leaves, w_tvec, w_steps, SUBSTEPS, tab)
            if mode == "bwd":
                torch.autograd.grad(o, leaves, torch.ones_like(o))
            del o
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        if mode == "fwd":
            graph = torch.cuda.CUDAGraph()
            with torch.no_grad(), torch.cuda.graph(graph):
                out = loop()
            graph.replay()
            return Prepared(graph.replay, lambda: out, 0.0, None, "CUDA graph replay")
        pool = torch.cuda.graph_pool_handle()
        g_fwd, g_bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(g_fwd, pool=pool):
            out = loop()
        with torch.cuda.graph(g_bwd, pool=pool):
            # retain_graph: the saved activations stay allocated, so the backward graph
            # can be replayed again and again after one forward replay
            grads_t = torch.autograd.grad(out, leaves, g, retain_graph=True)
        g_fwd.replay()
        g_bwd.replay()
        keep = (g_fwd, out)  # the forward graph owns the activations the backward reads

        def run_g():
            g_bwd.replay()

        run_g.keep = keep  # type: ignore[attr-defined]
        return Prepared(run_g, lambda: grads_t, 0.0, None, "CUDA graph replay (backward graph)")


@contextlib.contextmanager
def _eager_torch():
    """The torch backend launched op by op (no CUDA graphs) inside."""
    old = os.environ.get("POSENC_FAST_FLOATER_CUDA_GRAPHS")
    os.environ["POSENC_FAST_FLOATER_CUDA_GRAPHS"] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("POSENC_FAST_FLOATER_CUDA_GRAPHS", None)
        else:
            os.environ["POSENC_FAST_FLOATER_CUDA_GRAPHS"] = old


# ---------------------------------------------------------------- measuring


class Context:
    def __init__(self, args):
        self.args = args
        self.dry = args.dry_run
        self.device = "cpu" if self.dry else "cuda"
        self.cuda = self.device == "cuda"
        self.seed = args.seed
        self.t_start = time.perf_counter()
        self.history: dict = {}  # (S, d, impl, mode) -> (L, setup_s, run_s) measured
        self.subject = ""
        self.probe_min = 3 if self.dry else 17  # sample times of a probe run, at least

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_start


def release():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure(ctx: Context, prep: Prepared, est_run: Optional[float], warmups: int, repeats: int):
    """Time prep.run. est_run (s) None: time one call first to decide the method."""
    if est_run is None:
        first = _gpu_common.timed_calls(prep.run, ctx.device, 0, 1)
        est_run = first["ms"] / 1e3
        warmups = 0  # that call was the warm-up
    if est_run * 1e3 <= ctx.args.fast_ms:
        med, p20, p80 = _gpu_common.bench(prep.run, ctx.device, ctx.args.rep_ms)
        timing = "do_bench" if ctx.cuda else "wall-clock (1 warm-up, 3 runs)"
        res = {"ms": med, "ms_p20": p20, "ms_p80": p80, "timing": timing}
        res["peak_bytes"] = _gpu_common.peak_bytes(prep.run, ctx.device)
        return res
    t = _gpu_common.timed_calls(prep.run, ctx.device, warmups, repeats)
    t.pop("result")
    t["timing"] = "cuda-events" if ctx.cuda else "wall-clock"
    t["warmup_runs"] = warmups
    return t


def agreement(got, want) -> dict:
    """Largest |got - want| relative to the largest |want| (over all tensors given)."""
    if isinstance(got, torch.Tensor):
        got, want = [got], [want]
    worst, out = 0.0, {}
    for i, (a, b) in enumerate(zip(got, want)):
        a, b = a.detach().double(), b.detach().double()
        scale = float(b.abs().max()) or 1.0
        rel = float((a - b).abs().max()) / scale
        out[str(i)] = rel
        worst = max(worst, rel if rel == rel else math.inf)
    return {"max_rel_diff": worst, "per_tensor": out if len(out) > 1 else None}


def check_prefix(case: Case, method: str) -> dict:
    """The subject's forward and gradients on the first sample times against autograd
    through the float64 reference loop (the exact discrete adjoint)."""
    from posenc_fast.cli.verify import Result
    from posenc_fast.ops.floater import floater
    from posenc_fast.ops.floater import reference as ref

    n = min(case.L, CHECK_LENGTH)
    leaves = [t.detach().clone().requires_grad_(True) for t in case.leaves]
    times = case.times[:n]
    out = floater(*leaves, times, SUBSTEPS, method, ACTIVATION, backend=case.ctx.subject)
    g = case.grad_out[:, :n].contiguous()
    out.backward(g)
    leaves64 = [t.detach().double().requires_grad_(True) for t in case.leaves]
    expected = ref.floater(*leaves64, times.double(), SUBSTEPS, method, ACTIVATION)
    expected.backward(g.double())
    res = Result()
    res.add(out, expected, torch.float32, "floater", "forward")
    for name, a, b in zip(("p0", "w1", "b1", "w2", "b2"), leaves, leaves64):
        res.add_grad(a.grad, b.grad, torch.float32, f"d{name}")
    return {
        "sample_times": n,
        "max_fwd_err": res.fwd_err,
        "max_grad_rel_err": res.grad_err,
        "check": "ok" if not res.failures else "; ".join(res.failures)[:2000],
    }


def estimate(ctx: Context, case: Case, impl: str, mode: str) -> dict:
    """(setup_s, run_s) of impl at case.L: scaled from a shorter length of the same S, d
    measured before, else from a probe on the first ~L/32 sample times."""
    scale_to = case.L - 1  # intervals: the work is proportional to them
    prev = ctx.history.get((case.S, case.d, impl, mode))
    if prev is not None:
        L0, setup0, run0 = prev
        f = scale_to / (L0 - 1)
        return {"from": f"measured at L={L0}", "setup_s": setup0 * f, "run_s": run0 * f}
    n = min(case.L, max(ctx.probe_min, (case.L - 1) // 32 + 1))
    prep = case.prepare(impl, mode, n)
    try:
        t = _gpu_common.timed_calls(prep.run, ctx.device, 0, 1)
    finally:
        setup = prep.setup_s
        del prep
        release()
    f = scale_to / (n - 1)
    return {
        "from": f"probe on {n} sample times: setup {setup:.3g} s, one run {t['ms']:.4g} ms",
        "setup_s": setup * f,
        "run_s": t["ms"] / 1e3 * f,
    }


def plan_runs(ctx: Context, est: dict) -> tuple[int, int]:
    """(warm-ups, timed runs) of a slow call: as many as fit --target-seconds, at most
    --slow-repeats, at least one; a full-size warm-up only when it fits too (the probe or
    the shorter length measured before already ran the same code). (0, 0): do_bench."""
    a = ctx.args
    run = max(est["run_s"], 1e-9)
    if run * 1e3 <= a.fast_ms:
        return 0, 0
    reps = max(1, min(a.slow_repeats, int(a.target_seconds / run)))
    warm = 1 if (reps + 1) * run <= a.target_seconds else 0
    return warm, reps


def row_base(case: Case, impl: str, mode: str, method: str) -> dict:
    return {"case": case.name, "impl": impl, "mode": mode, "method": method}


def run_subject(
    ctx: Context, case: Case, method: str, mode: str, layout: str = "", tape_mb: str = ""
) -> tuple:
    """One subject row; layout: the CUDA layout forced for it (_gpu_common.forced_floater_layout),
    tape_mb: the tape's budget (POSENC_FAST_FLOATER_TAPE_MB) for it."""
    name = (
        ctx.subject
        + (f"[layout={layout}]" if layout else "")
        + (f"[tape={tape_mb}]" if tape_mb else "")
    )
    row = row_base(case, name, mode, method)
    old_tape = os.environ.get("POSENC_FAST_FLOATER_TAPE_MB")
    if tape_mb:
        os.environ["POSENC_FAST_FLOATER_TAPE_MB"] = tape_mb
    try:
        with _gpu_common.forced_floater_layout(layout):
            prep = case.prepare("subject", mode, case.L, method)
            row.update(measure(ctx, prep, None, 0, ctx.args.slow_repeats))
            row.update(setup_s=prep.setup_s, held_bytes=prep.held_bytes)
            result = prep.result()
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
        result = None
    finally:
        if tape_mb:
            if old_tape is None:
                os.environ.pop("POSENC_FAST_FLOATER_TAPE_MB", None)
            else:
                os.environ["POSENC_FAST_FLOATER_TAPE_MB"] = old_tape
        release()
    return row, result


def run_baseline(ctx: Context, case: Case, impl: str, mode: str, want, reserve: float) -> dict:
    row = row_base(case, impl, mode, BASELINE_METHOD)
    a = ctx.args
    prep = None
    if a.time_budget and ctx.elapsed() + reserve >= a.time_budget:
        row["skipped"] = (
            f"time budget: {ctx.elapsed():.0f} s of --time-budget {a.time_budget:g} s used"
        )
        return row
    try:
        est = estimate(ctx, case, impl, mode)
        row["estimate"] = est
        one = est["setup_s"] + est["run_s"]
        if one > a.max_seconds_per_impl:
            row["skipped"] = (
                f"estimated {one:.1f} s for the setup and one run > --max-seconds-per-impl "
                f"{a.max_seconds_per_impl:g} ({est['from']})"
            )
            return row
        warm, reps = plan_runs(ctx, est)
        total = est["setup_s"] + (
            (warm + reps) * est["run_s"] if reps else 2 * a.rep_ms / 1e3 + 10 * est["run_s"]
        )
        est["total_s"] = total
        if a.time_budget and ctx.elapsed() + total + reserve > a.time_budget:
            row["skipped"] = (
                f"time budget: estimated {total:.1f} s, {a.time_budget - ctx.elapsed():.0f} s "
                f"left of --time-budget {a.time_budget:g} s ({reserve:.0f} s kept for the subject)"
            )
            return row
        prep = case.prepare(impl, mode, case.L)
        row.update(measure(ctx, prep, est["run_s"], warm, reps))
        row.update(setup_s=prep.setup_s, held_bytes=prep.held_bytes)
        if prep.note:
            row["note"] = prep.note
        ctx.history[(case.S, case.d, impl, mode)] = (case.L, prep.setup_s, row["ms"] / 1e3)
        if want is not None:
            row["vs_subject"] = agreement(prep.result(), want)
    except Exception as exc:  # a failing baseline (out of memory, say) is a result too
        row["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
    finally:
        prep = None  # its graphs, pools and retained autograd graph go before the next
        release()
    return row


def subject_rows(ctx: Context, case: Case, entry: dict) -> dict:
    """Checks and timed rows of the subject (every method, every mode, forced layouts);
    returns its rk38 results per mode (what the baselines are compared with)."""
    want = {}
    for method in ctx.args.methods:
        try:
            entry["checks"][method] = check_prefix(case, method)
        except Exception as exc:
            entry["checks"][method] = {"check": f"failed: {type(exc).__name__}: {exc}"}
        release()
        for mode in ctx.args.modes:
            row, result = run_subject(ctx, case, method, mode)
            entry["rows"].append(row)
            print(line(row), flush=True)
            if method == BASELINE_METHOD and result is not None:
                want[mode] = result
    extra = [(layout, "", mode) for layout in ctx.args.cuda_layouts for mode in ctx.args.modes]
    if "bwd" in ctx.args.modes and BASELINE_METHOD in ctx.args.methods:
        extra.insert(0, ("", "0", "bwd"))  # the backward without a tape: every chunk re-taped
    for layout, tape_mb, mode in extra:
        row, result = run_subject(ctx, case, BASELINE_METHOD, mode, layout, tape_mb)
        if result is not None and mode in want:
            row["vs_subject"] = agreement(result, want[mode])
        entry["rows"].append(row)
        print(line(row), flush=True)
    entry["layouts"] = cuda_layouts()
    return want


def cuda_layouts() -> list[str]:
    """The CUDA integrator's layouts chosen so far in this process (Layout::why)."""
    from posenc_fast import _extension

    module = _extension.loaded_module("cuda")
    return list(module.floater_layouts()) if hasattr(module, "floater_layouts") else []


def subject_results(ctx: Context, case: Case) -> dict:
    """The subject's rk38 output and gradients again (untimed), for pass 2's comparisons."""
    want = {}
    for mode in ctx.args.modes:
        try:
            prep = case.prepare("subject", mode, case.L)
            prep.run()
            want[mode] = prep.result()
            del prep
        except Exception:  # its rows already say why
            pass
    release()
    return want


def goals(rows: list[dict], subject: str) -> dict:
    def find(impl, mode):
        for r in rows:
            if r["impl"] == impl and r["mode"] == mode and r["method"] == BASELINE_METHOD:
                return r
        return None

    def ratio(num, den):
        if num is None or den is None or "ms" not in num or "ms" not in den:
            missing = [r for r in (num, den) if r is None or "ms" not in r]
            why = "; ".join(
                f"{r['impl']} {r['mode']}: {r.get('skipped') or r.get('error') or 'no time'}"
                for r in missing
                if r is not None
            )
            return None, why or "not measured"
        return num["ms"] / den["ms"], ""

    sub = {m: find(subject, m) for m in MODES}
    out = {}
    pairs = {
        "fwd_vs_torchdiffeq": (find("torchdiffeq", "fwd"), sub["fwd"]),
        "bwd_vs_adjoint": (find("adjoint", "bwd"), sub["bwd"]),
        "fwd_vs_graph": (find("graph", "fwd"), sub["fwd"]),
        "bwd_vs_graph": (find("graph", "bwd"), sub["bwd"]),
        "bwd_over_fwd": (sub["bwd"], sub["fwd"]),
    }
    for name, (num, den) in pairs.items():
        op, threshold, what = GOALS[name]
        v, why = ratio(num, den)
        entry = {"value": v, "goal": f"{op} {threshold:g}", "what": what}
        if v is None:
            entry["pending"] = why
        else:
            entry["met"] = v >= threshold if op == ">=" else v <= threshold
        out[name] = entry
    measured = {r["impl"] for r in rows}
    for name, (impl, mode) in INFO_RATIOS.items():
        if impl not in measured:  # not asked for (--impls): no entry
            continue
        v, why = ratio(find(impl, mode), sub[mode])
        out[name] = {"value": v, "goal": None} if v is not None else {"value": None, "pending": why}
    return out


# ---------------------------------------------------------------- output


def line(row: dict) -> str:
    head = f"{row['case']:<20} {row['impl']:<12} {row['method']:<5} {row['mode']:<4}"
    if "ms" not in row:
        return f"{head} {'skipped: ' + row['skipped'] if 'skipped' in row else row.get('error')}"
    peak = row.get("peak_bytes")
    extra = f" peak {peak / 2**20:.0f} MiB" if peak is not None else ""
    if row.get("held_bytes"):
        extra += f" held {row['held_bytes'] / 2**20:.0f} MiB"
    if "vs_subject" in row:
        extra += f" diff vs subject {row['vs_subject']['max_rel_diff']:.1e}"
    if row.get("setup_s", 0) > 0.5:
        extra += f" setup {row['setup_s']:.1f} s"
    n = len(row["runs"]) if "runs" in row else "do_bench"
    return f"{head} {row['ms']:11.3f} ms [{row['ms_p20']:.3f}, {row['ms_p80']:.3f}] (n={n}){extra}"


def goals_line(case_name: str, g: dict) -> str:
    parts = []
    for name in GOALS:
        e = g[name]
        if e["value"] is None:
            parts.append(f"{name} pending")
        else:
            parts.append(f"{name} {e['value']:.2f} ({'met' if e['met'] else 'MISSED'})")
    return f"{case_name:<20} goals: " + ", ".join(parts)


def environment(ctx: Context) -> dict:
    from posenc_fast import _dispatch as ext
    from posenc_fast import _extension

    env = _gpu_common.environment(ctx.args.git_sha)
    env["extension"] = {part: _extension.extension_build_metadata(part) for part in ("cpu", "cuda")}
    env["cuda_gate"] = f"{ext.CUDA_GATE_ENV}={os.environ.get(ext.CUDA_GATE_ENV, '')}"
    env["allow_tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
    if ctx.cuda:
        props = torch.cuda.get_device_properties(0)
        env["sm_count"] = props.multi_processor_count
        env["l2_bytes"] = getattr(props, "L2_cache_size", None)
    return env


def pick_subject(ctx: Context) -> tuple[str, list[str]]:
    from posenc_fast._dispatch import BACKENDS

    if ctx.cuda:
        return "cuda", BACKENDS["cuda"].environment_reasons()
    # dry run: the C++ backend, or (pure-Python install) the float64-exact reference loop
    return ("cpp" if not BACKENDS["cpp"].environment_reasons() else "reference"), []


def main(argv=None) -> int:
    args = parse_args(argv)
    ctx = Context(args)
    if ctx.cuda and not torch.cuda.is_available():
        print(
            "floater_gpu: no CUDA device (use --dry-run to check the script on CPU)",
            file=sys.stderr,
        )
        return 2
    from posenc_fast import _dispatch as ext

    os.environ.setdefault(ext.CUDA_GATE_ENV, "1")  # this run is part of the validation
    ctx.subject, why = pick_subject(ctx)
    if why:
        print(
            f"floater_gpu: backend {ctx.subject!r} is unavailable: {'; '.join(why)}",
            file=sys.stderr,
        )
        return 2
    env = environment(ctx)
    out_path = args.out or _gpu_common.default_out("floater_gpu", env)
    report = {
        "benchmark": "benchmarks/floater_gpu.py",
        "dry_run": ctx.dry,
        "device": ctx.device,
        "subject": ctx.subject,
        "environment": env,
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "problem": {
            "substeps": SUBSTEPS,
            "delta_t": DELTA_T,
            "activation": ACTIVATION,
            "dtype": "float32",
            "baseline_method": BASELINE_METHOD + " (torchdiffeq 'rk4' on our grid)",
        },
        "goals": {k: f"{v[2]} {v[0]} {v[1]:g}" for k, v in GOALS.items()},
        "cases": [],
        "complete": False,
    }
    grid = [(L, S, d) for L in args.lengths for S in args.states for d in args.dims]
    wanted = [(i, m) for i, m in MEASUREMENTS if i in args.impls and m in args.modes]
    print(
        f"FLOATER GPU benchmark on {env.get('gpu', ctx.device)}: subject {ctx.subject!r}, "
        f"{len(grid)} cases, baselines {wanted}, time budget {args.time_budget:g} s, "
        f"max {args.max_seconds_per_impl:g} s per measurement",
        flush=True,
    )
    # Pass 1: every case with the subject and the baselines of the goals; pass 2: the
    # other baselines with the time left (so a tight budget loses those first).
    for pass_no, group in ((1, GOAL_BASELINES), (2, INFO_BASELINES)):
        todo = [m for m in wanted if m in group]
        if pass_no == 2 and not todo:
            break
        for index, (L, S, d) in enumerate(grid):
            case = Case(ctx, L, S, d)
            if pass_no == 1:
                entry = {"case": case.name, "L": L, "S": S, "d": d, "H": d, "substeps": SUBSTEPS}
                entry.update(steps=(L - 1) * SUBSTEPS, rows=[], checks={})
                report["cases"].append(entry)
                want = subject_rows(ctx, case, entry) if "cuda" in args.impls else {}
            else:
                entry = report["cases"][index]
                want = subject_results(ctx, case) if "cuda" in args.impls else {}
            left = len(grid) - index - 1
            reserve = args.subject_reserve * left if pass_no == 1 else 0.0
            for impl, mode in todo:
                row = run_baseline(ctx, case, impl, mode, want.get(mode), reserve)
                entry["rows"].append(row)
                print(line(row), flush=True)
            entry["goals"] = goals(entry["rows"], ctx.subject)
            print(goals_line(case.name, entry["goals"]), flush=True)
            report["elapsed_s"] = ctx.elapsed()
            report["goals_summary"] = summarize_goals(report["cases"])
            _gpu_common.write_json(report, out_path)
            del case, want
            release()
    report["complete"] = True
    report["elapsed_s"] = ctx.elapsed()
    report["goals_summary"] = summarize_goals(report["cases"])
    _gpu_common.write_json(report, out_path)
    print(f"goals: {report['goals_summary']}")
    print(f"wrote {out_path} after {ctx.elapsed():.0f} s")
    return 0


def summarize_goals(cases: list[dict]) -> dict:
    out = {}
    for name in GOALS:
        entries = [c["goals"][name] for c in cases if name in c.get("goals", {})]
        out[name] = {
            "met": sum(1 for e in entries if e.get("met") is True),
            "missed": sum(1 for e in entries if e.get("met") is False),
            "pending": sum(1 for e in entries if e["value"] is None),
        }
    return out


if __name__ == "__main__":
    sys.exit(main())
