"""benchmarks/RESULTS.md's CPU tables from one ``python -m posenc_fast bench --json`` run
(or ``benchmarks/cpu_lab.py``'s, the same with its busy-process settings).

    python benchmarks/cpu_lab.py --quick --threads 1,2 --contention --max-autotune \
        --json benchmarks/results/cpu_quick.json
    python benchmarks/render_cpu_table.py benchmarks/results/cpu_quick.json > cpu_tables.md

Prints markdown: one table per setting (threads, with or without the busy process) with
every implementation's median ms, its speed-up against eager and against torch.compile and
its % of the floor measured in that setting; the largest error of each implementation
against the float64 spec; the CPU goals, each met or missed with the figure that
decides it; and, when the run has FLOATER or rotary rows, their median ms with cpp's
speed-up over every other implementation (RESULTS.md's FLOATER cases, L = 512, d = H in
{64, 512}, and its rotary cases, LightGlue's and a ViT's sizes in float32 and bfloat16:

    python -m posenc_fast bench --ops floater --floater-sizes 512x64,512x512 \
        --threads 2,1 --json floater_cpu.json
    python -m posenc_fast bench --ops rotary --threads 1 --json rotary_cpu.json

then this script). Every number comes from the JSON: nothing is estimated.
"""

from __future__ import annotations

import argparse
import json
import sys

BASELINES = (
    "eager",
    "eager-cached",
    "eager-rotate",
    "compile",
    "compile-max",
    "torchdiffeq",
    "torchdiffeq-adjoint",
)
OURS = ("torch", "cpp", "triton", "cuda")
OP_NAMES = {
    "lff": "LFF",
    "sinusoidal": "sinusoidal table",
    "dft": "DFT table",
    "sinusoidal_add": "SinusoidalPE add",
    "dft_add": "DFTPE add",
    "floater": "FLOATER",
    "rotary": "rotary",
}
# ops with a table of their own (speed-up of cpp over every other implementation), and
# outside the CPU goals, which are the LFF and table ops'
OWN_TABLES = {"floater": "FLOATER", "rotary": "Rotary LFF (LightGlue)"}


def _setting_name(threads: int, contention: bool) -> str:
    return f"{threads} thread{'s' * (threads != 1)}" + (", busy process on one core" * contention)


def _groups(results: list[dict]) -> dict:
    """(threads, contention) -> (op, case, mode) -> impl -> row, in the run's order."""
    out: dict = {}
    for r in results:
        setting = out.setdefault((r["threads"], r["contention"]), {})
        setting.setdefault((r["op"], r["case"], r["mode"]), {})[r["impl"]] = r
    return out


def _x(v) -> str:
    return f"{v:.2f}x" if v is not None else "-"


def _cell(r: dict | None, ratios: bool) -> str:
    if r is None:
        return ""
    if r.get("error"):
        return "failed" if "compile" not in r["error"] else "unfinished"
    ms = r["ms"]
    text = f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"
    parts = []
    if ratios:
        parts.append(f"{_x(r.get('speedup_vs_eager'))} / {_x(r.get('speedup_vs_compile'))}")
    if r.get("pct_of_floor") is not None:
        parts.append(f"{r['pct_of_floor']:.0f}%")
    return f"{text} ({'; '.join(parts)})" if parts else text


def _label(op: str, case: str) -> str:
    return f"{OP_NAMES.get(op, op)} {case.replace(' float32', '')}"


def setting_tables(report: dict) -> str:
    groups = _groups(report["results"])
    impls = list(dict.fromkeys(r["impl"] for r in report["results"]))
    columns = [i for i in BASELINES if i in impls] + [i for i in OURS if i in impls]
    machines = {(s["threads"], s["contention"]): s["machine"] for s in report["settings"]}
    lines = []
    for (threads, contention), rows in groups.items():
        m = machines.get((threads, contention), {})
        gemm = ", ".join(f"{k}: {v:.0f}" for k, v in m.get("gemm_gflops", {}).items())
        lines += [
            f"#### {_setting_name(threads, contention)}",
            "",
            f"Floors measured in this setting: bandwidth {m.get('bandwidth_gbps', 0):.1f} GB/s "
            f"(fill {m.get('fill_gbps', 0):.1f}, copy {m.get('copy_gbps', 0):.1f}); GEMM "
            f"GFLOP/s at [{m.get('gemm_rows', '?')}, k] x [k, n], k x n = {gemm}.",
            "",
            "| op, size | mode | floor ms | " + " | ".join(columns) + " |",
            "|---|---|---|" + "---|" * len(columns),
        ]
        for (op, case, mode), by_impl in rows.items():
            floor = next(iter(by_impl.values())).get("floor_ms")
            cells = [_cell(by_impl.get(i), i not in ("eager", "compile")) for i in columns]
            lines.append(
                f"| {_label(op, case)} | {mode} | {f'{floor:.3g}' if floor else '-'} | "
                + " | ".join(cells)
                + " |"
            )
        lines.append("")
    return "\n".join(lines)


def accuracy_table(report: dict) -> str:
    """Largest |forward - float64 spec| per implementation (first setting, fwd rows)."""
    first = report["settings"][0]
    rows: dict = {}
    for r in report["results"]:
        same = (r["threads"], r["contention"]) == (first["threads"], first["contention"])
        if same and r["mode"] == "fwd" and r.get("max_err_vs_spec") is not None:
            rows.setdefault((r["op"], r["case"]), {})[r["impl"]] = r["max_err_vs_spec"]
    seen = {i for v in rows.values() for i in v}
    impls = [i for i in (*BASELINES, *OURS) if i in seen]
    lines = ["| op, size | " + " | ".join(impls) + " |", "|---|" + "---|" * len(impls)]
    for (op, case), errs in rows.items():
        cells = [f"{errs[i]:.1e}" if i in errs else "" for i in impls]
        lines.append(f"| {_label(op, case)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def op_table(report: dict, op: str) -> str:
    """One op per setting, case and mode: every implementation's median ms and cpp's
    speed-up over each of the others (RESULTS.md's FLOATER table, e.g. from ``bench --ops
    floater --floater-sizes 512x64,512x512 --threads 2,1``, and its rotary table, from
    ``bench --ops rotary --threads 1``); '' without rows of ``op``."""
    rows = [r for r in report["results"] if r["op"] == op]
    if not rows:
        return ""
    seen = dict.fromkeys(r["impl"] for r in rows)
    impls = [i for i in (*BASELINES, *OURS) if i in seen]
    others = [i for i in impls if i != "cpp"] if "cpp" in seen else []
    head = ["threads", "case", "mode", *impls, *(f"cpp vs {i}" for i in others)]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for (threads, contention), groups in _groups(rows).items():
        for (_, case, mode), by_impl in groups.items():
            ok = {i: r["ms"] for i, r in by_impl.items() if not r.get("error") and r["ms"] > 0}
            cells = [f"{ok[i]:.3g}" if i in ok else "-" for i in impls]
            cpp = ok.get("cpp")
            cells += [_x(ok[i] / cpp) if cpp and i in ok else "-" for i in others]
            where = f"{threads}" + (", busy" if contention else "")
            lines.append(f"| {where} | {case} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _goal(rows, what, impl, key, target, pick=min):
    """(what, verdict text) for the rows that have ``impl``; pick: the deciding figure."""
    vals = [(r[key], r) for r in rows if r["impl"] == impl and r.get(key) is not None]
    if not vals:
        return what, "pending (not measured in this run)"
    v, r = pick(vals, key=lambda t: t[0])
    ok = v >= target if pick is min else v <= target
    where = (
        f"{_label(r['op'], r['case'])} {r['mode']}, {_setting_name(r['threads'], r['contention'])}"
    )
    return (
        what,
        f"{'met' if ok else 'MISSED'}: {'worst' if pick is min else 'largest'} {v:.2f} ({where})",
    )


def goals(report: dict) -> str:
    res = [r for r in report["results"] if not r.get("error")]
    quiet = [r for r in res if not r["contention"]]
    lff = [r for r in quiet if r["op"] == "lff" and r["sizes"].get("N") in (196, 4096, 16384)]
    tables = [r for r in quiet if r["op"] in ("sinusoidal", "dft")]
    adds = [r for r in quiet if r["op"].endswith("_add")]
    busy = [r for r in res if r["contention"] and r["threads"] == 2 and r["op"] not in OWN_TABLES]
    ours_all = [r for r in quiet if r["op"] not in OWN_TABLES]
    eager_peak = {
        (r["case"], r["mode"], r["threads"]): r["peak_bytes"] for r in lff if r["impl"] == "eager"
    }
    memory = [
        {**r, "peak_ratio": r["peak_bytes"] / eager_peak[(r["case"], r["mode"], r["threads"])]}
        for r in lff
        if r["mode"] == "fwd+bwd"
        and r["sizes"]["N"] == 16384
        and r["peak_bytes"] >= 0
        and eager_peak.get((r["case"], r["mode"], r["threads"]), -1) > 0
    ]
    items = [
        _goal(
            lff,
            "LFF: cpp >= 2x eager (fwd, fwd+bwd, 1 and 2 threads)",
            "cpp",
            "speedup_vs_eager",
            2.0,
        ),
        _goal(lff, "LFF: cpp >= 1.5x torch.compile", "cpp", "speedup_vs_compile", 1.5),
        _goal(
            memory,
            "LFF N=16384 fwd+bwd: cpp peak memory <= eager's / 2",
            "cpp",
            "peak_ratio",
            0.5,
            max,
        ),
        _goal(tables, "tables: cpp >= 1.5x torch.compile", "cpp", "speedup_vs_compile", 1.5),
        _goal(adds, "adds: cpp >= 1.0x torch.compile", "cpp", "speedup_vs_compile", 1.0),
        _goal(adds, "adds: cpp >= 1.3x eager", "cpp", "speedup_vs_eager", 1.3),
        _goal(busy, "contention, 2 threads: cpp >= 1.0x eager", "cpp", "speedup_vs_eager", 1.0),
        _goal(
            ours_all,
            "torch backend >= 1.0x eager (every size, fwd and fwd+bwd)",
            "torch",
            "speedup_vs_eager",
            1.0,
        ),
        _goal(ours_all, "cpp >= 50% of the measured floor", "cpp", "pct_of_floor", 50.0),
    ]
    lines = ["| CPU goal | this run |", "|---|---|"]
    lines += [f"| {what} | {verdict} |" for what, verdict in items]
    return "\n".join(lines)


# the rotary families' goals (fwd+bwd, every family and size): ours >= 3x timm's eager,
# >= 1.5x its torch.compile, peak memory <= 1/2 of compile's
ROTARY_GOALS = {"vs eager": 3.0, "vs compile": 1.5, "peak vs compile": 0.5}


def rotary_family_table(report: dict, mode: str = "fwd+bwd") -> str:
    """The rotary families' rows (``bench --ops rotary --families ...``) in ``mode``: per
    setting and case, the median ms of eager, compile and ours (the fastest backend), and
    ours against each goal (met / MISSED); '' without family rows."""
    rows = [
        r for r in report["results"]
        if r["op"] == "rotary" and r["sizes"].get("family", "lightglue") != "lightglue"
        and r["mode"] == mode
    ]  # fmt: skip
    if not rows:
        return ""
    head = ["threads", "family", "case", "eager ms", "compile ms", "ours ms (backend)",
            "vs eager (>= 3x)", "vs compile (>= 1.5x)",
            "peak MB ours / compile (<= 0.5)"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]

    def verdict(v, goal, at_most=False):
        if v is None:
            return "-"
        ok = v <= goal if at_most else v >= goal
        return f"{v:.2f}{'' if at_most else 'x'} {'met' if ok else 'MISSED'}"

    for (threads, contention), groups in _groups(rows).items():
        for (_, case, _), by_impl in groups.items():
            ok = {i: r for i, r in by_impl.items() if not r.get("error") and r["ms"] > 0}
            ours = [ok[i] for i in OURS if i in ok]
            if not ours:
                continue
            best = min(ours, key=lambda r: r["ms"])
            eager, comp = ok.get("eager"), ok.get("compile")
            peak = None
            if comp and comp["peak_bytes"] > 0 and best["peak_bytes"] >= 0:
                peak = best["peak_bytes"] / comp["peak_bytes"]
            mb = [f"{r['peak_bytes'] / 2**20:.1f}" if r else "-" for r in (best, comp)]
            cells = [
                f"{threads}" + (", busy" if contention else ""),
                best["sizes"]["family"],
                case.split(" ", 1)[1],
                f"{eager['ms']:.3g}" if eager else "-",
                f"{comp['ms']:.3g}" if comp else "-",
                f"{best['ms']:.3g} ({best['impl']})",
                verdict(eager["ms"] / best["ms"] if eager else None, ROTARY_GOALS["vs eager"]),
                verdict(comp["ms"] / best["ms"] if comp else None, ROTARY_GOALS["vs compile"]),
                f"{mb[0]} / {mb[1]}: "
                + verdict(peak, ROTARY_GOALS["peak vs compile"], at_most=True),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render(report: dict) -> str:
    env = report.get("environment", {})
    head = (
        f"Measured with `python -m posenc_fast bench` on {env.get('cpu_model', '?')} "
        f"({env.get('cpu_count', '?')} CPUs), torch {env.get('torch', '?')}, "
        f"git {env.get('git_sha', '?')[:12]}; median ms (speed-up vs eager / vs torch.compile; "
        "% of the measured floor)."
    )
    parts = [
        head,
        setting_tables(report),
        "Largest |error| of the forward output against the float64 spec:\n\n"
        + accuracy_table(report),
        goals(report),
    ]
    families = rotary_family_table(report)
    if families:
        parts.append(f"Rotary families against their goals (fwd+bwd):\n\n{families}")
    for op, title in OWN_TABLES.items():
        table = op_table(report, op)
        if table:
            parts.append(
                f"{title}, median ms, and cpp's speed-up over each implementation:\n\n{table}"
            )
    return "\n\n".join(parts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", help="the file written by `python -m posenc_fast bench --json`")
    args = p.parse_args(argv)
    with open(args.json) as f:
        print(render(json.load(f)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
