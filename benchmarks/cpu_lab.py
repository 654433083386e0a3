"""The CPU benchmark lab: ``python -m posenc_fast bench``'s cases and machinery, plus what
the project's own measurements need (benchmarks/RESULTS.md, the README's table):

    python benchmarks/cpu_lab.py --quick --threads 1,2 --contention --max-autotune \\
        --json benchmarks/results/cpu_quick.json

Every option of ``bench`` (``--help``), and:

- ``--contention``: each thread count >= 2 (or the largest) again with a busy process
  pinned to one CPU (_contention.py: always stopped, even when this process is killed);
- reliability probes (_reliability.py): the load average at the start and the end, and the
  floors this run measured against this machine's usual ones (a history file,
  ``--history PATH`` or ``off``); a warning line under the tables and ``"reliability"`` in
  the JSON when the figures should not be trusted.

The JSON has bench's layout (rows carry their setting's threads and contention), which
benchmarks/render_cpu_table.py turns into the tables.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _contention, _reliability

import _contention
import _reliability

from posenc_fast.cli import bench, bench_arguments
from posenc_fast.cli._environment import describe


@contextlib.contextmanager
def busy_process():
    """A process spinning on the last CPU for the block: what a contention setting
    records (its pid and CPU)."""
    with _contention.busy_cpu() as proc:
        yield {"busy_pid": proc.pid, "busy_cpu": _contention.cpus()[-1]}


def settings_from(threads: str | None, contention: bool) -> list[bench.Setting]:
    """``--threads 1,2 --contention`` -> 1 and 2 threads, then every count >= 2 (or the
    largest, if none is) again with a busy process."""
    out = bench.settings_from(threads)
    if contention:
        counts = [s.threads for s in out]
        busy = [t for t in counts if t >= 2] or [max(counts)]
        out += [bench.Setting(t, True, busy_process) for t in busy]
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python benchmarks/cpu_lab.py", description=__doc__.split("\n\n")[0]
    )
    bench_arguments(p)
    p.add_argument(
        "--contention",
        action="store_true",
        help="also run with a busy process pinned to one CPU (at each --threads count >= 2)",
    )
    p.add_argument(
        "--history",
        default=None,
        metavar="PATH|off",
        help="the floors' history the reliability probe compares with (default: "
        "$XDG_CACHE_HOME/posenc_fast/bench_floors.json, else ~/.cache/...); off: none",
    )
    return p


def run(args) -> int:
    if args.contention and (args.device != "cpu" or len(_contention.cpus()) < 2):
        print("--contention needs --device cpu and at least 2 CPUs", file=sys.stderr)
        return 2
    try:
        sel = bench.select(args)
        sel.settings = settings_from(args.threads, args.contention)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    env = describe()
    t0 = time.perf_counter()
    load_start = _reliability.load_average()  # before the benchmark adds its own threads
    result = bench.measure_selection(sel, args, env)
    reliability = _reliability.assess(
        result["settings"], env, sel.device, load_start, _reliability.load_average(),
        _reliability.history_path(args.history),
    )  # fmt: skip
    bench.report(
        args, sel, env, result, time.perf_counter() - t0,
        extra={"reliability": reliability}, notes=_reliability.summary(reliability),
    )  # fmt: skip
    return 0


def main(argv=None) -> int:
    return run(parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
