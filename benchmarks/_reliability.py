"""Whether a benchmarks/cpu_lab.py run's figures can be trusted: a run on a loaded machine
says so.

Two signs, each turned into one warning line (printed under the tables and saved in the
JSON under "reliability"):

- **Load**: the 1-minute load average (``os.getloadavg``) above the number of CPUs, read
  when the run starts (before the benchmark itself adds to it: what other processes
  ran in the last minute) and when it ends, less the threads the benchmark ran itself
  (its largest thread count, plus its busy process in the ``--contention`` setting).
- **Floors far below the machine's usual ones**: the bandwidth and GEMM rates that the run
  measures for its floors (_floors), compared per setting (device, CPU model and count,
  threads, contention) with the median of the earlier runs on this machine, kept in a
  small history file in the user's cache (``$XDG_CACHE_HOME/posenc_fast/bench_floors.json``,
  else ``~/.cache/...``; the lab's ``--history`` names another file, ``off`` disables
  it). Below FAR_BELOW of the usual: another process took the memory bus or the cores. The
  first run on a machine has nothing to compare with and says so.

Neither sign changes a timing; they only say how far to believe it.
"""

from __future__ import annotations

import json
import os
import statistics

# A floor below this fraction of the machine's usual one is "far below".
FAR_BELOW = 0.5
# Runs kept per setting in the history (the usual floor is their median).
HISTORY_RUNS = 20


def load_average() -> float | None:
    """The 1-minute load average, or None where the platform has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def history_path(chosen: str | None = None) -> str | None:
    """The floors' history file: ``chosen`` (--history), None when that is "off", else the
    user cache's."""
    if chosen:
        return None if chosen.lower() == "off" else chosen
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "posenc_fast", "bench_floors.json")


def _read(path: str | None) -> dict:
    if path is None:
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):  # missing or damaged: start afresh
        return {}


def _write(path: str | None, data: dict) -> str | None:
    """Saves the history; returns why it could not (None: saved or disabled)."""
    if path is None:
        return None
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)  # whole file or nothing, if two runs end together
    except OSError as exc:
        return f"floor history not saved ({exc.strerror or exc})"
    return None


def setting_key(env: dict, device: str, setting: dict) -> str:
    """The machine and setting whose floors are comparable across runs."""
    where = "with a busy process" if setting.get("contention") else "quiet"
    return (
        f"{device} | {env.get('cpu_model', '?')} | {env.get('cpu_count', '?')} CPUs | "
        f"{setting['threads']} thread(s), {where}"
    )


def _rates(machine: dict) -> dict[str, float]:
    """The floor's measured rates by name: bandwidth and each GEMM shape."""
    rates = {"bandwidth GB/s": machine["bandwidth_gbps"]}
    rates.update({f"GEMM {k} GFLOP/s": v for k, v in machine["gemm_gflops"].items()})
    return rates


def floors_far_below(machine: dict, earlier: list[dict]) -> list[str]:
    """The rates of ``machine`` below FAR_BELOW of their median over ``earlier`` runs'
    rates (dicts as _rates returns), as "name measured (usual U)"."""
    low = []
    for name, value in _rates(machine).items():
        seen = [r[name] for r in earlier if isinstance(r.get(name), (int, float))]
        if seen:
            usual = statistics.median(seen)
            if value < FAR_BELOW * usual:
                low.append(f"{name} {value:.3g} (usual {usual:.3g})")
    return low


def assess(
    settings: list[dict],
    env: dict,
    device: str,
    load_start: float | None,
    load_end: float | None,
    path: str | None = None,
) -> dict:
    """The run's reliability: {"reliable", "warnings", "load_start", "load_end",
    "cpu_count", "history", "compared_runs"}; adds this run's floors to the history at
    ``path`` (None: none kept)."""
    cpus = env.get("cpu_count") or os.cpu_count() or 1
    warnings = []
    if load_start is not None and load_start > cpus:
        warnings.append(
            f"the load average was {load_start:.1f} when the run started, above the "
            f"{cpus} CPUs: other processes were running"
        )
    own = max((s["threads"] for s in settings), default=1)
    own += any(s.get("contention") for s in settings)
    if load_end is not None and load_end - own > cpus:
        warnings.append(
            f"the load average was {load_end:.1f} when the run ended, {load_end - own:.1f} "
            f"beyond the benchmark's own {own} thread(s), above the {cpus} CPUs"
        )
    history = _read(path)
    compared = {}
    for s in settings:
        key = setting_key(env, device, s)
        earlier = history.get(key, [])
        compared[key] = len(earlier)
        low = floors_far_below(s["machine"], earlier)
        if low:
            warnings.append(
                f"floors measured far below this machine's usual ones ({s['threads']} "
                f"thread(s){', busy process' if s.get('contention') else ''}): " + ", ".join(low)
            )
        history[key] = [*earlier, _rates(s["machine"])][-HISTORY_RUNS:]
    note = _write(path, history)
    return {
        "reliable": not warnings,
        "warnings": warnings,
        "load_start": load_start,
        "load_end": load_end,
        "cpu_count": cpus,
        "history": path,
        "compared_runs": compared,
        **({"note": note} if note else {}),
    }


def summary(reliability: dict) -> list[str]:
    """Lines for the end of the bench output."""
    if reliability["warnings"]:
        return [
            "WARNING: these figures are unreliable: " + "; ".join(reliability["warnings"]) + "."
        ]
    if not any(reliability["compared_runs"].values()):
        load = reliability["load_start"]
        return [
            f"load average {load:.1f} at the start ({reliability['cpu_count']} CPUs); no earlier "
            "run on this machine to compare the floors with"
            if load is not None
            else "no earlier run on this machine to compare the floors with"
        ]
    return []
