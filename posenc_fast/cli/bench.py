"""``python -m posenc_fast bench``: every implementation of each case (_cases) side by side;
timings are reported, never asserted. Columns: docs/performance.md."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import threading
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .._dispatch import AUTO_ORDER
from . import _cases, _floors, _timing
from ._cases import Impl
from ._environment import describe

MODES = ("fwd", "fwd+bwd")
KNOWN_OPS = ("lff", "sinusoidal", "dft", "floater", "rotary")
# "--ops all": rotary runs only when named (its torch.compile baselines are slow)
DEFAULT_OPS = ("lff", "sinusoidal", "dft", "floater")
COMPILE_MODES = {"compile": None, "compile-max": "max-autotune"}
DEFAULT_COMPILE_TIMEOUT = 300.0


@dataclass(frozen=True)
class Setting:
    """Threads (None: as is); ``context()``, a busy process beside the timings (cpu_lab.py)."""

    threads: int | None = None
    contention: bool = False
    context: Optional[Callable[[], AbstractContextManager]] = field(
        default=None, compare=False, repr=False
    )


class CompileTimeout(BaseException):
    """A BaseException: torch's ``except Exception`` must not swallow it."""


@contextlib.contextmanager
def time_box(seconds: float | None):
    """Raise CompileTimeout in the block after ``seconds`` (main thread only: signals)."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise CompileTimeout(f"did not finish within {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def applied(setting: Setting):
    """Set the thread count and enter the setting's context for the block."""
    before = torch.get_num_threads()
    if setting.threads:
        torch.set_num_threads(setting.threads)
    try:
        if setting.context is not None:
            with setting.context() as started:
                yield dict(started or {})
        else:
            yield {}
    finally:
        torch.set_num_threads(before)


def _runner(case, impl: Impl, mode: str):
    """A closure running one implementation once in ``mode``."""
    if mode == "fwd":

        def run():
            with torch.no_grad(), case.context():
                return impl.fn()

        return run
    grad = {}

    def run():
        with case.context():
            out = impl.fn()
        g = grad.get("g")
        if g is None:  # one incoming gradient per output (rotary's: q' and k')
            g = grad["g"] = (
                tuple(torch.randn_like(o) for o in out)
                if isinstance(out, tuple)
                else torch.randn_like(out)
            )
        # autograd.grad, not backward: nothing accumulates into .grad between runs
        return torch.autograd.grad(out, impl.leaves, g)

    return run


def _impls(case, compile_modes=("compile",)) -> dict[str, Impl]:
    impls = {"eager": Impl(lambda: case.eager(*case.args), case.leaves)}
    impls.update(case.baselines)
    for name in compile_modes:
        compiled = torch.compile(case.eager, mode=COMPILE_MODES[name])
        impls[name] = Impl(lambda c=compiled: c(*case.args), case.leaves)
    impls.update(case.backends)
    return impls


def _joined(out) -> torch.Tensor:
    """An output as one float64 tensor: a tuple's members (rotary's q', k') stacked."""
    if isinstance(out, tuple):
        return torch.stack([o.detach().to(torch.float64) for o in out])
    return out.detach().to(torch.float64)


def _forward(case, impl: Impl) -> torch.Tensor:
    with torch.no_grad(), case.context():
        out = impl.fn()
    return _joined(impl.layout(out) if impl.layout else out)


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


class _Accuracy:
    """Each forward's largest error vs the float64 spec and difference from auto's backend."""

    def __init__(self, case):
        self.case = case
        self.spec = _joined(case.spec())
        ranked = [n for n in AUTO_ORDER if n in case.backends]
        self.name = ranked[0] if ranked else None
        self.ours = _forward(case, case.backends[self.name]) if self.name else None

    def of(self, impl: Impl) -> dict:
        out = _forward(self.case, impl)
        if out.shape != self.spec.shape:
            return {"max_err_vs_spec": None, "max_diff_vs_ours": None}
        return {
            "max_err_vs_spec": _max_abs(out.cpu(), self.spec.cpu()),
            "max_diff_vs_ours": _max_abs(out, self.ours) if self.ours is not None else None,
            "ours": self.name,
        }


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _measure_one(case, name, impl, mode, timer, peak, min_time, compile_timeout, with_peak):
    """One row: time (and, if ``with_peak``, peak memory) of one implementation."""
    run = _runner(case, impl, mode)
    row = {"ms": float("nan"), "ms_p20": float("nan"), "ms_p80": float("nan"), "error": ""}
    try:
        with time_box(compile_timeout if name in COMPILE_MODES else None):
            run()  # warm-up: compilation and lazy initialisation stay out of the timings
        row["ms"], row["ms_p20"], row["ms_p80"] = timer(run, min_time)
        if with_peak:
            row["peak_bytes"] = peak(run)
    except CompileTimeout as exc:
        row["error"] = f"torch.compile {name}: {exc} (not timed)"
        torch._dynamo.reset()  # drop the half-built compilation
    except Exception as exc:  # one failing implementation must not stop the table
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return row


class _Run:
    """One ``measure`` call; errors in the first setting, peak memory once per thread count."""

    def __init__(self, cases, modes, device, min_time, compile_modes, compile_timeout, total):
        self.cases, self.modes, self.min_time = cases, modes, min_time
        self.compile_modes, self.compile_timeout = compile_modes, compile_timeout
        self.timer = _timing.time_cuda if device == "cuda" else _timing.time_cpu
        self.peak = _timing.peak_bytes_cuda if device == "cuda" else _timing.peak_bytes_cpu
        self.done, self.total = 0, total
        self.results: list[dict] = []
        self.errors: dict = {}  # (op, case, mode, impl) -> error columns
        self.peaks: dict = {}  # (threads, op, case, mode, impl) -> peak bytes

    def case(self, case, setting: Setting, threads: int, machine: dict, first: bool) -> None:
        # compile each case afresh: a shared eager form would hit dynamo's recompile limit
        torch._dynamo.reset()
        impls = _impls(case, self.compile_modes)
        accuracy = _Accuracy(case) if first else None
        for mode in self.modes:
            work = case.work.get(mode)
            for name, impl in impls.items():
                self.done += 1
                t0 = time.perf_counter()
                key = (case.op, case.label, mode, name)
                row = _measure_one(
                    case, name, impl, mode, self.timer, self.peak, self.min_time,
                    self.compile_timeout, (threads, *key) not in self.peaks,
                )  # fmt: skip
                if "peak_bytes" in row:
                    self.peaks[(threads, *key)] = row["peak_bytes"]
                if first and not row["error"]:
                    self.errors[key] = accuracy.of(impl)
                row.update(self.errors.get(key, {}))
                row["peak_bytes"] = self.peaks.get((threads, *key), -1)
                _progress(
                    f"[{self.done}/{self.total}] {case.op} {case.label} {mode:<7} {name:<19} "
                    + (f"{row['ms']:9.3f} ms" if not row["error"] else row["error"])
                    + f"  ({time.perf_counter() - t0:.1f} s)"
                )
                self.results.append(
                    {
                        "op": case.op,
                        "case": case.label,
                        "size": case.size,
                        "sizes": case.sizes,
                        "mode": mode,
                        "impl": name,
                        "threads": threads,
                        "contention": setting.contention,
                        **row,
                        "floor_ms": _floors.floor_ms(work, machine),
                        "floor_bytes": work.bytes if work else 0,
                        "floor_gflop": work.flops / 1e9 if work else 0.0,
                    }
                )


def measure(
    cases,
    modes,
    device,
    min_time,
    compile_modes=("compile",),
    settings=(Setting(),),
    compile_timeout=DEFAULT_COMPILE_TIMEOUT,
) -> dict:
    """Every case x mode x implementation in every setting: {"settings", "results"}."""
    per_setting = sum(len(_impls(c, ())) + len(compile_modes) for c in cases) * len(modes)
    state = _Run(
        cases, modes, device, min_time, compile_modes, compile_timeout,
        per_setting * len(settings),
    )  # fmt: skip
    gemm_shapes = set().union(*(w.shapes() for c in cases for w in c.work.values()))
    described = []
    for index, setting in enumerate(settings):
        with applied(setting) as started:
            torch._dynamo.reset()  # compiled kernels are specialised to the thread count
            machine = _floors.measure(device, gemm_shapes, state.timer, min(min_time, 0.2))
            threads = torch.get_num_threads()
            described.append(
                {
                    "threads": threads,
                    "contention": setting.contention,
                    **started,
                    "machine": machine,
                }
            )
            where = "".join(f", {k} {v}" for k, v in started.items())
            _progress(
                f"-- {threads} thread(s){where}: bandwidth {machine['bandwidth_gbps']:.1f} GB/s, "
                + ", ".join(f"GEMM {k} {v:.1f} GFLOP/s" for k, v in machine["gemm_gflops"].items())
            )
            for case in cases:
                state.case(case, setting, threads, machine, first=index == 0)
    _add_ratios(state.results)
    return {"settings": described, "results": state.results}


def _add_ratios(results: list[dict]) -> None:
    groups: dict = {}
    for r in results:
        key = (r["threads"], r["contention"], r["op"], r["case"], r["mode"])
        groups.setdefault(key, {})[r["impl"]] = r
    for group in groups.values():
        eager = group.get("eager", {}).get("ms")
        comp = group.get("compile", {}).get("ms")
        for r in group.values():
            ok = r["ms"] == r["ms"] and r["ms"] > 0
            r["speedup_vs_eager"] = eager / r["ms"] if ok and eager == eager and eager else None
            r["speedup_vs_compile"] = comp / r["ms"] if ok and comp == comp and comp else None
            r["pct_of_floor"] = 100.0 * r["floor_ms"] / r["ms"] if ok and r["floor_ms"] else None
            r["gbps"] = r["floor_bytes"] / r["ms"] / 1e6 if ok and r["floor_bytes"] else None


def _fmt(v, spec: str, suffix: str = "") -> str:
    return f"{v:{spec}}{suffix}" if v is not None else "-"


def table(report: dict) -> str:
    lines = []
    header = (
        f"{'impl':<19} {'median ms':>10} {'p20-p80 ms':>17} {'vs eager':>8} {'vs compile':>10} "
        f"{'% floor':>8} {'err f64':>8} {'diff ours':>9} {'peak MB':>8}"
    )
    current = None
    for r in report["results"]:
        setting = (r["threads"], r["contention"])
        key = (*setting, r["op"], r["case"], r["mode"])
        if key != current:
            if current is None or current[:2] != setting:
                lines += ["", f"=== {r['threads']} thread(s)" + (", contention" * r["contention"])]
            current = key
            floor = _fmt(r["floor_ms"], ".3f", " ms")
            lines += ["", f"{r['op']}  {r['case']}  [{r['mode']}]  floor {floor}", header]
        if r["error"]:
            lines.append(f"{r['impl']:<19} failed: {r['error']}")
            continue
        peak = r["peak_bytes"] / 2**20 if r["peak_bytes"] >= 0 else None
        lines.append(
            f"{r['impl']:<19} {r['ms']:>10.3f} {r['ms_p20']:>8.3f}-{r['ms_p80']:<8.3f} "
            f"{_fmt(r['speedup_vs_eager'], '.2f', 'x'):>8} "
            f"{_fmt(r['speedup_vs_compile'], '.2f', 'x'):>10} "
            f"{_fmt(r['pct_of_floor'], '.0f', '%'):>8} {_fmt(r.get('max_err_vs_spec'), '.1e'):>8} "
            f"{_fmt(r.get('max_diff_vs_ours'), '.1e'):>9} {_fmt(peak, '.1f'):>8}"
        )
    return "\n".join(lines)


def _panel(r: dict) -> tuple:
    """A plot panel: op (with the rotary family), dtype, mode, threads, contention."""
    sizes = r.get("sizes") or {}
    op = f"{r['op']} {sizes['family']}" if sizes.get("family") else r["op"]
    return (op, sizes.get("dtype", ""), r["mode"], r["threads"], r["contention"])


def plot(results: list[dict], path: str) -> None:
    """Median time against size, a panel per op (rotary: per family), dtype, mode, setting."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib: pip install 'posenc-fast[plot]'", file=sys.stderr)
        return
    panels = sorted({_panel(r) for r in results})
    cols = 2
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        op, dtype, mode, threads, busy = panel
        sel = [r for r in results if _panel(r) == panel and not r["error"]]
        for impl in dict.fromkeys(r["impl"] for r in sel):
            pts = sorted((r["size"], r["ms"]) for r in sel if r["impl"] == impl)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
        family = " " in op
        ax.set_xscale("log")
        ax.set_yscale("log")
        if family:  # ticks: the grids; each labelled with its batch (the cases' differ)
            grids = {r["size"]: r for r in sel if r["impl"] == "eager"}
            for r in grids.values():
                ax.annotate(f"B={r['sizes']['B']}", (r["size"], r["ms"]), fontsize=7)
            ax.minorticks_off()
            ax.set_xticks(sorted(grids))
            ax.set_xticklabels(
                ["x".join(map(str, grids[n]["sizes"]["grid"])) for n in sorted(grids)]
            )
        ax.set_title(
            f"{op} {dtype} [{mode}], {threads} thread(s)" + (", contention" if busy else "")
        )
        ax.set_xlabel("grid cells" if family else "positions")
        ax.set_ylabel("ms (median)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}", file=sys.stderr)


def bench_cases(quick: bool, device: str, ops, floater_sizes=None) -> list:
    """Every case ``bench`` (and benchmarks/test_bench.py) runs for ``ops`` on ``device``."""
    cases = _cases.cases(quick, device, list(ops))
    if "floater" in ops:
        cases += _cases.floater_cases(quick, device, floater_sizes)
    return cases


def floater_sizes_from(text: str | None) -> list[tuple[int, int]] | None:
    """``--floater-sizes 512x64,512x512`` -> [(512, 64), (512, 512)]; None without it."""
    if not text:
        return None
    out = []
    for item in text.split(","):
        L, sep, d = item.strip().partition("x")
        if not (sep and L.isdigit() and d.isdigit() and int(L) > 0 and int(d) > 0):
            raise ValueError(f"--floater-sizes takes LxD pairs such as 512x64, got {item!r}")
        out.append((int(L), int(d)))
    return out


def settings_from(threads: str | None) -> list[Setting]:
    """``--threads 1,2`` -> 1 and 2 threads (default: torch's count)."""
    counts = [int(t) for t in threads.split(",")] if threads else [torch.get_num_threads()]
    if any(t < 1 for t in counts):
        raise ValueError(f"--threads takes positive counts, got {threads!r}")
    return [Setting(t) for t in counts]


@dataclass
class Selection:
    """What one run measures, as its command line asks (:func:`select`)."""

    device: str
    ops: list
    modes: list
    settings: list
    cases: list
    min_time: float
    compile_modes: tuple


def select(args) -> Selection:
    """The run ``args`` asks for; ValueError with the message to print."""
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("bench --device cuda: no CUDA device is visible to torch")
    ops = list(DEFAULT_OPS) if args.ops == "all" else [o.strip() for o in args.ops.split(",")]
    bad = [o for o in ops if o not in KNOWN_OPS]
    modes = [m.strip() for m in args.modes.split(",")]
    if bad or any(m not in MODES for m in modes):
        raise ValueError(f"choose --ops from {list(KNOWN_OPS)} and --modes from {list(MODES)}")
    settings = settings_from(args.threads)
    floater_sizes = floater_sizes_from(args.floater_sizes)
    if floater_sizes and "floater" not in ops:
        raise ValueError("--floater-sizes needs floater among --ops")
    min_time = args.min_time if args.min_time is not None else (0.1 if args.quick else 0.5)
    compile_modes = () if args.no_compile else ("compile",)
    if args.max_autotune and not args.no_compile:
        compile_modes += ("compile-max",)
    cases = bench_cases(args.quick, device, ops, floater_sizes)
    families = getattr(args, "families", None)
    if families:
        chosen = {f.strip() for f in families.split(",")}
        known = {"lightglue", *_cases.ROTARY_FAMILIES}
        if "rotary" not in ops or not chosen <= known:
            raise ValueError(f"--families needs rotary among --ops and names from {sorted(known)}")
        cases = [c for c in cases if c.op != "rotary" or c.sizes["family"] in chosen]
    return Selection(device, ops, modes, settings, cases, min_time, compile_modes)


def measure_selection(sel: Selection, args, env: dict) -> dict:
    """:func:`measure` of what ``sel`` selects, with a progress line first."""
    _progress(
        f"posenc_fast bench: {len(sel.cases)} cases on {sel.device}, modes {sel.modes}, "
        f"{len(sel.settings)} setting(s), git {env['git_sha']}"
    )
    return measure(
        sel.cases, sel.modes, sel.device, sel.min_time, sel.compile_modes, sel.settings,
        args.compile_timeout,
    )  # fmt: skip


def report(args, sel: Selection, env: dict, result: dict, seconds: float, extra=None, notes=()):
    """Print the tables and ``notes``; save the JSON (with ``extra``) and plot as asked."""
    print(table(result))
    print(
        f"\n{len(result['results'])} measurements in {seconds:.0f} s on "
        f"{env['processor']} ({env['cpu_count']} CPUs), torch {env['torch']}, git {env['git_sha']}"
    )
    for line in notes:
        print(line)
    if args.json:
        payload = {
            "environment": env,
            "device": sel.device,
            "quick": args.quick,
            "min_time": sel.min_time,
            "compile_timeout_s": args.compile_timeout,
            **(extra or {}),
            **result,
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
        print(f"results written to {args.json}", file=sys.stderr)
    if args.plot:
        plot(result["results"], args.plot)


def run(args) -> int:
    try:
        sel = select(args)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    env = describe()
    t0 = time.perf_counter()
    result = measure_selection(sel, args, env)
    report(args, sel, env, result, time.perf_counter() - t0)
    return 0
