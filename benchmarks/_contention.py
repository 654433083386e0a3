"""Contention mode of benchmarks/cpu_lab.py: a busy process pinned to one CPU while the
timings run.

Two cores are often shared (docs/performance.md): a kernel that runs one parallel region per
call degrades gracefully when another process holds a core, dozens of small parallel ATen
ops each wait for it. :func:`busy_cpu` starts that other process itself, so the condition
is reproducible, and always stops it:

- the block's ``finally`` terminates it (normal exit, exceptions, Ctrl-C);
- the child asks the kernel for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``), so
  even a SIGKILLed benchmark leaves nothing spinning; it also exits on its own when it
  finds itself re-parented.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

# argv: cpu, parent pid. Pin, arm the parent-death signal, report, then spin.
_BUSY_LOOP = """
import ctypes, os, signal, sys
cpu, parent = int(sys.argv[1]), int(sys.argv[2])
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
except (AttributeError, OSError):
    pass
os.sched_setaffinity(0, {cpu})
print("spinning", flush=True)
while os.getppid() == parent:
    for _ in range(1_000_000):
        pass
"""


def cpus() -> list[int]:
    """The CPUs this process may run on (all of them where the OS has no affinity call)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


@contextlib.contextmanager
def busy_cpu(cpu: int | None = None):
    """Run a busy-looping process pinned to ``cpu`` (default: the last CPU this process
    may use) for the duration of the block; yields its ``Popen``."""
    allowed = cpus()
    if len(allowed) < 2:
        raise RuntimeError(
            f"contention mode needs at least 2 CPUs, this process may use {len(allowed)}"
        )
    cpu = allowed[-1] if cpu is None else cpu
    proc = subprocess.Popen(
        [sys.executable, "-c", _BUSY_LOOP, str(cpu), str(os.getpid())],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        if proc.stdout.readline().strip() != "spinning":  # pinned and running
            raise RuntimeError(f"the busy process did not start (exit code {proc.poll()})")
        yield proc
    finally:
        _stop(proc)
