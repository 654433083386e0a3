"""Merge the outputs of benchmarks/gpu_validate.sh into one JSON summary and a short
Markdown table, each figure against the goals of docs/performance.md (the project's
performance brief, quoted in benchmarks/README.md).

    python benchmarks/summarize_gpu.py OUT_DIR [OUT_DIR ...] --json summary.json --md summary.md

Reads whatever it finds in the folders (or files) given, so the outputs of several device
calls can be merged afterwards on any machine (no GPU, no torch needed):
    stages.jsonl           one line per stage of gpu_validate.sh (status, seconds)
    *junit*.xml            pytest results (tests, tests-large)
    verify*.txt            python -m posenc_fast verify (PASS / FAIL lines)
    ceilings.json          benchmarks/gpu_ceilings.py
    floater_gpu*.json      benchmarks/floater_gpu.py (FLOATER goals per case)
    lff_gpu*.json          benchmarks/lff_gpu.py (LFF and table goals)
    bench_cli*.json        python -m posenc_fast bench --json
    compile_report*.txt    python tools/triton_compile_report.py
    triton_compiles*.jsonl every Triton compilation of the run, a hit or a miss of the cache
                           prepared ahead (tools/triton_ahead.py's compile log)
    triton_records*.jsonl  every Triton launcher call of the run (tools/triton_ahead.py's
                           recorder): kept whole in summary.json, what the next preparation
                           compiles
    triton_cache_check*.txt  whether the prepared cache matched this machine's Triton
    sanitize*.json         benchmarks/gpu_sanitize.py (compute-sanitizer per tool and workload)
A figure that is missing is reported as pending, never filled in.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import xml.etree.ElementTree as ET

# The LFF goals on the GPU (FLOATER's come with floater_gpu.json), per case and mode, for
# the row users get (impl "auto"; "triton" in files written before the plans): against
# torch.compile(default) measured in the same process, the memory floor for the
# memory-bound canonical case, peak memory against compile's.
LFF_VS_COMPILE = {
    ("compute", "fwd"): 1.5,
    ("compute", "bwd"): 1.2,
    ("compute-fp32", "fwd"): 0.9,
    ("compute-fp32", "bwd"): 0.9,
    ("small", "fwd"): 1.0,  # <= 64k positions: latency no worse than compile's
    ("seq1d", "fwd"): 1.0,
}
LFF_MEMORY_VS_COMPILE = {
    ("compute", "bwd"): 3.0,
    ("compute-fp32", "fwd"): 3.0,
    ("compute-fp32", "bwd"): 3.0,
}  # fmt: skip  (compile's peak / ours)
LFF_FLOOR_PCT = {"fwd": 85.0, "bwd": 65.0}  # memory-bound cases: % of the memory floor
LFF_MEMORY = 2.0  # fwd+bwd rows: eager's peak / ours
ENV_KEYS = ("gpu", "gpu_capability", "driver", "torch", "torch_cuda", "triton", "python")
ENV_KEYS += ("posenc_fast", "git_sha")
TABLE_PCT_COPY, TABLE_VS_EAGER, TABLE_VS_COMPILE, TABLE_MIN_BYTES = 90.0, 8.0, 1.2, 256e6


def _files(paths: list[str]) -> list[str]:
    out = []
    for p in paths:
        if os.path.isdir(p):
            out += sorted(glob.glob(os.path.join(p, "*")))
        elif os.path.exists(p):
            out.append(p)
    return [f for f in out if os.path.isfile(f)]


def _load_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except Exception as exc:  # a truncated file is reported, not fatal
        return {"unreadable": f"{type(exc).__name__}: {exc}"}


def junit(path: str) -> dict:
    try:
        root = ET.parse(path).getroot()
    except Exception as exc:
        return {"file": os.path.basename(path), "unreadable": f"{type(exc).__name__}: {exc}"}
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    res = {"file": os.path.basename(path), "tests": 0, "failures": 0, "errors": 0}
    res.update(skipped=0, time_s=0.0, failed=[], skip_reasons={})
    for s in suites:
        for key in ("tests", "failures", "errors", "skipped"):
            res[key] += int(s.get(key, 0) or 0)
        res["time_s"] += float(s.get("time", 0) or 0)
        for case in s.iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            for tag in ("failure", "error"):
                for el in case.findall(tag):
                    res["failed"].append(f"{name}: {(el.get('message') or '')[:200]}")
            for el in case.findall("skipped"):
                why = (el.get("message") or "")[:120]
                res["skip_reasons"][why] = res["skip_reasons"].get(why, 0) + 1
    res["passed"] = res["tests"] - res["failures"] - res["errors"] - res["skipped"]
    return res


def verify(path: str) -> dict:
    """``python -m posenc_fast verify`` output: PASS / FAIL / SKIP lines per op, backend and
    dtype (and the failures' detail lines under a FAIL)."""
    # gpu_validate.sh runs verify's op groups side by side and concatenates their outputs:
    # complete when every part (one header line each) reached its closing line
    rows, failures, skipped, seed, parts, closed = [], [], [], None, 0, 0
    with open(path, errors="replace") as f:
        for ln in f:
            words = ln.split()
            if not words:
                continue
            if words[0] in ("PASS", "FAIL") and len(words) >= 4:
                rows.append({"status": words[0], "op": words[1], "backend": words[2],
                             "dtype": words[3], "line": ln.strip()})  # fmt: skip
                if words[0] == "FAIL":
                    failures.append(ln.strip())
            elif words[0] == "SKIP":
                skipped.append(ln.strip())
            elif rows and rows[-1]["status"] == "FAIL" and ln.startswith("      "):
                failures.append(ln.strip())
            elif ln.startswith("posenc_fast verify:") and "seed" in words:
                seed = words[words.index("seed") + 1].rstrip(",")
                parts += 1
            elif ln.startswith(("all backends agree", "1 mismatching")) or "mismatching op" in ln:
                closed += 1
    complete = closed > 0 and closed >= parts
    return {"file": os.path.basename(path), "seed": seed, "complete": complete,
            "passed": sum(r["status"] == "PASS" for r in rows),
            "failed": sum(r["status"] == "FAIL" for r in rows),
            "rows": rows, "failures": failures, "skipped": skipped}  # fmt: skip


def compile_report(path: str) -> dict:
    with open(path, errors="replace") as f:
        lines = f.read().splitlines()
    return {
        "file": os.path.basename(path),
        "compiled_ok": sum(1 for ln in lines if ln.startswith("ok  ")),
        "approx_trig": [ln.strip() for ln in lines if ln.startswith("BAD ")],
        "failed": [ln.strip()[:300] for ln in lines if ln.startswith("FAIL")],
        "wgmma_kernels": sum(1 for ln in lines if ln.startswith("ok  ") and "wgmma" in ln),
    }


def sanitize(report: dict) -> dict:
    """compute-sanitizer's runs: tool, workload, status (clean / errors / unavailable /
    timeout), error count and seconds each, and whether all were clean."""
    runs = [
        {k: r.get(k) for k in ("tool", "workload", "status", "errors", "hazards", "seconds")}
        | {"report": (r.get("report") or [])[:10], "unsupported": r.get("unsupported")}
        for r in report.get("runs", [])
    ]
    clean = bool(runs) and all(r["status"] == "clean" for r in runs)
    return {"dry_run": report.get("dry_run"), "version": report.get("version"),
            "clean": clean, "runs": runs}  # fmt: skip


def floater(report: dict) -> dict:
    cases = []
    for c in report.get("cases", []):
        rows = {(r["impl"], r["mode"], r["method"]): r for r in c.get("rows", [])}
        sub = report.get("subject", "cuda")
        entry = {"case": c["case"], "L": c.get("L"), "S": c.get("S"), "d": c.get("d")}
        for mode in ("fwd", "bwd"):
            r = rows.get((sub, mode, "rk38"), {})
            entry[f"{sub}_{mode}_ms"] = r.get("ms")
            entry[f"{sub}_{mode}_rk4_ms"] = rows.get((sub, mode, "rk4"), {}).get("ms")
        entry[f"{sub}_bwd_untaped_ms"] = rows.get((f"{sub}[tape=0]", "bwd", "rk38"), {}).get("ms")
        entry["layouts"] = c.get("layouts", c.get("plans", []))  # "plans" before
        entry["checks"] = {m: v.get("check") for m, v in c.get("checks", {}).items()}
        entry["goals"] = c.get("goals", {})
        cases.append(entry)
    return {
        "subject": report.get("subject"),
        "complete": report.get("complete"),
        "elapsed_s": report.get("elapsed_s"),
        "goals_summary": report.get("goals_summary"),
        "cases": cases,
    }


def _verdict(value, threshold, op=">=") -> dict:
    if value is None:
        return {"value": None, "pending": "not measured"}
    met = value >= threshold if op == ">=" else value <= threshold
    return {"value": value, "goal": f"{op} {threshold:g}", "met": met}


def lff(report: dict) -> dict:
    rows = report.get("results", [])
    by = {}
    for r in rows:
        by.setdefault((r["case"], r["mode"]), {})[r["impl"]] = r
    out = []
    for (case, mode), impls in by.items():
        t = impls.get("auto") or impls.get("triton")
        if t is None:
            continue
        e = {"case": case, "mode": mode, "ms": t.get("ms"), "error": t.get("error")}
        e["plan"] = t.get("plan")
        e["pct_of_floor"] = t.get("pct_of_floor")
        e["pct_copy_ceiling"] = t.get("pct_copy_ceiling")
        e["speedup_vs_eager"] = t.get("speedup_vs_eager")
        e["speedup_vs_compile"] = t.get("speedup_vs_compile")
        e["plans"] = {p: impls[p].get("ms") for p in ("fused", "gemm") if p in impls}
        corr = t.get("correctness")
        e["check"] = corr.get("check") if isinstance(corr, dict) else corr
        goals = {}
        compile_row = impls.get("compile", {})
        if "N" not in t:  # tables and fused adds
            if (t.get("bytes") or 0) >= TABLE_MIN_BYTES:
                goals["pct_copy_ceiling"] = _verdict(t.get("pct_copy_ceiling"), TABLE_PCT_COPY)
            goals["vs_eager"] = _verdict(t.get("speedup_vs_eager"), TABLE_VS_EAGER)
            if "compile" in impls:
                goals["vs_compile"] = _verdict(t.get("speedup_vs_compile"), TABLE_VS_COMPILE)
        elif mode == "fwd+bwd":
            eager_peak = impls.get("eager", {}).get("peak_bytes")
            peak = t.get("peak_bytes")
            ratio = eager_peak / peak if eager_peak and peak else None
            e["memory_vs_eager"] = ratio
            goals["memory_vs_eager"] = _verdict(ratio, LFF_MEMORY)
        else:
            if (case, mode) in LFF_VS_COMPILE and "compile" in impls:
                goals["vs_compile"] = _verdict(
                    t.get("speedup_vs_compile"), LFF_VS_COMPILE[(case, mode)]
                )
            elif not case.startswith(("compute", "small", "seq1d")):  # memory-bound
                goals["pct_of_floor"] = _verdict(t.get("pct_of_floor"), LFF_FLOOR_PCT[mode])
            if (case, mode) in LFF_MEMORY_VS_COMPILE and compile_row:
                peak, theirs = t.get("peak_bytes"), compile_row.get("peak_bytes")
                ratio = theirs / peak if theirs and peak else None
                e["memory_vs_compile"] = ratio
                goals["memory_vs_compile"] = _verdict(ratio, LFF_MEMORY_VS_COMPILE[(case, mode)])
        e["goals"] = goals
        out.append(e)
    return {"ceilings": report.get("ceilings"), "rows": out}


def rotary(report: dict) -> dict:
    """benchmarks/rotary.py: per case and dtype, each implementation's median ms per mode
    and its error against the float64 reference, and posenc_fast's speed-ups."""
    rows = []
    for res in report.get("results", []):
        for name, entry in res.get("impls", {}).items():
            rows.append(
                {
                    "case": res.get("case"),
                    "dtype": res.get("dtype"),
                    "impl": name,
                    "fwd_ms": (entry.get("fwd") or {}).get("ms"),
                    "fwd_bwd_ms": (entry.get("fwd+bwd") or {}).get("ms"),
                    "max_abs_err": entry.get("max_abs_err_vs_float64"),
                    "speedups": res.get("speedups", {}).get(name),
                }
            )
    return {"dry_run": report.get("dry_run"), "rows": rows}


def bench_cli(report: dict) -> dict:
    """Per op, case and mode: the fastest posenc_fast backend against eager PyTorch."""
    groups = {}
    for r in report.get("results", []):
        groups.setdefault((r["op"], r["case"], r["mode"]), []).append(r)
    rows = []
    for (op, case, mode), rs in groups.items():
        ours = [r for r in rs if r["impl"] in ("torch", "triton", "cpp", "cuda")]
        ours = [r for r in ours if not r.get("error") and r.get("ms") == r.get("ms")]
        if not ours:
            continue
        best = min(ours, key=lambda r: r["ms"])
        rows.append(
            {
                "op": op,
                "case": case,
                "mode": mode,
                "best": best["impl"],
                "ms": best["ms"],
                "speedup_vs_eager": best.get("speedup_vs_eager"),
                "speedup_vs_compile": best.get("speedup_vs_compile"),
                "gbps": best.get("gbps"),
            }
        )
    errors = [
        f"{r['op']} {r['case']} {r['mode']} {r['impl']}: {r['error']}"
        for r in report.get("results", [])
        if r.get("error")
    ]
    return {"device": report.get("device"), "rows": rows, "errors": errors[:50]}


def _lines(path: str) -> list[str]:
    with open(path) as f:
        return [ln.strip() for ln in f if ln.strip()]


def triton_compiles(path: str, into: dict) -> None:
    """Add a compile log's hits and misses to ``into``: posenc_fast's kernels (by name, the
    misses with their compile seconds) and the others (torch.compile's, in this process)."""
    for line in _lines(path):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        side = "posenc_fast" if str(row.get("module") or "").startswith("posenc_fast") else "other"
        entry = into.setdefault(side, {"hits": 0, "misses": 0, "miss_s": 0.0, "missed": {}})
        if row.get("hit"):
            entry["hits"] += 1
            continue
        entry["misses"] += 1
        entry["miss_s"] = round(entry["miss_s"] + (row.get("us") or 0) / 1e6, 2)
        if side == "posenc_fast":
            entry["missed"][row.get("kernel", "?")] = entry["missed"].get(row.get("kernel"), 0) + 1


def summarize(paths: list[str]) -> dict:
    summary: dict = {"sources": [], "stages": [], "tests": [], "environment": None}
    for path in _files(paths):
        name = os.path.basename(path)
        src = os.path.relpath(path)
        if name.startswith("triton_compiles") and name.endswith(".jsonl"):
            triton_compiles(path, summary.setdefault("triton", {}).setdefault("compiles", {}))
        elif name.startswith("triton_records") and name.endswith(".jsonl"):
            summary.setdefault("triton", {})["records"] = _lines(path)
        elif name.startswith("triton_cache_check") and name.endswith(".txt"):
            summary.setdefault("triton", {})["cache_check"] = "; ".join(_lines(path))
        elif name.endswith(".jsonl") and name.startswith("stages"):
            with open(path) as f:
                for ln in f:
                    if ln.strip():
                        try:
                            rec = json.loads(ln)
                        except json.JSONDecodeError:
                            rec = {"stage": "?", "unreadable": ln.strip()[:200]}
                        rec["source"] = os.path.dirname(src)
                        summary["stages"].append(rec)
        elif name.endswith(".xml") and "junit" in name:
            summary["tests"].append(junit(path))
        elif name.startswith("verify") and name.endswith(".txt"):
            summary["verify"] = verify(path)
        elif name.startswith("compile_report") and name.endswith(".txt"):
            summary["compile_report"] = compile_report(path)
        elif name.endswith(".json") and name not in ("summary.json",):
            data = _load_json(path)
            if not isinstance(data, dict):
                continue
            kind = str(data.get("benchmark", ""))
            if "floater_gpu" in kind:
                summary["floater"] = floater(data)
            elif "lff_gpu" in kind:
                summary["lff"] = lff(data)
            elif kind == "rotary":
                summary["rotary"] = rotary(data)
            elif kind == "sanitize":
                summary["sanitize"] = sanitize(data)
            elif "gpu_ceilings" in kind:
                summary["ceilings"] = data.get("ceilings")
                summary["nvidia_smi"] = data.get("nvidia_smi_before")
            elif "results" in data and "quick" in data:
                summary["bench_cli"] = bench_cli(data)
            else:
                continue
            env = data.get("environment")
            if isinstance(env, dict) and (summary["environment"] is None or env.get("gpu")):
                known = (summary["environment"] or {}).get("git_sha")
                summary["environment"] = {k: env.get(k) for k in ENV_KEYS}
                if env.get("git_sha", "unknown") == "unknown" and known:
                    # (bench's JSON: the package's CLI knows no commit in a copied tree)
                    summary["environment"]["git_sha"] = known
        else:
            continue
        summary["sources"].append(src)
    return summary


# ---------------------------------------------------------------- markdown


def _x(v, fmt="{:.2f}x") -> str:
    return "-" if v is None else fmt.format(v)


def _goal(g: dict | None) -> str:
    if not g:
        return "-"
    if g.get("value") is None:
        return "pending"
    return f"{g['value']:.2f}{'' if g.get('met') else ' (missed)'}"


def _row(*cells) -> str:
    """One row of a Markdown table."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


# The FLOATER table's goal columns, in order.
_FLOATER_GOALS = (
    "bwd_over_fwd",
    "fwd_vs_torchdiffeq",
    "bwd_vs_adjoint",
    "fwd_vs_graph",
    "bwd_vs_graph",
)


def markdown(s: dict) -> str:
    out = ["# GPU validation summary", ""]
    env = {k: v for k, v in (s.get("environment") or {}).items() if v is not None}
    if env:
        out.append(
            f"{env.get('gpu', '?')}, driver {env.get('driver', '?')}, "
            f"torch {env.get('torch', '?')} (CUDA {env.get('torch_cuda', '?')}), "
            f"triton {env.get('triton', '?')}, "
            f"posenc_fast {env.get('posenc_fast', '?')} at {env.get('git_sha', '?')}"
        )
        out.append("")
    if s["stages"]:
        out += ["| stage | status | seconds | note |", "|---|---|---|---|"]
        for r in s["stages"]:
            secs = r.get("seconds")
            out.append(
                _row(
                    r.get("stage"),
                    r.get("status"),
                    "-" if secs is None else secs,
                    r.get("note", ""),
                )
            )
        out.append("")
    tr = s.get("triton")
    if tr:
        ours = tr.get("compiles", {}).get("posenc_fast", {})
        other = tr.get("compiles", {}).get("other", {})
        out.append(
            f"**Triton cache** ({tr.get('cache_check') or 'no prepared cache checked'}): "
            f"posenc_fast kernels {ours.get('hits', 0)} hits, {ours.get('misses', 0)} misses "
            f"({ours.get('miss_s', 0)} s compiling); other Triton kernels in these processes "
            f"{other.get('hits', 0)} hits, {other.get('misses', 0)} misses "
            f"({other.get('miss_s', 0)} s); {len(tr.get('records', []))} launcher calls "
            "recorded for the next preparation"
        )
        missed = ours.get("missed") or {}
        out += [f"- compiled here: {k} x{n}" for k, n in sorted(missed.items())[:20]]
        out.append("")
    v = s.get("verify")
    if v:
        backends = sorted({(r["op"], r["backend"]) for r in v["rows"]})
        out.append(
            f"**verify** (every op x dtype x backend against float64, seed {v['seed']}): "
            f"{v['passed']} passed, {v['failed']} failed"
            + ("" if v["complete"] else " (cut before the end)")
            + f"; op/backend pairs checked: {', '.join(f'{o}/{b}' for o, b in backends)}"
        )
        out += [f"- {f}" for f in v["failures"][:20]]
        out += [f"- {sk}" for sk in v["skipped"]]
        out.append("")
    for t in s["tests"]:
        if "unreadable" in t:
            out.append(f"**{t['file']}**: unreadable ({t['unreadable']})")
            continue
        out.append(
            f"**{t['file']}**: {t['passed']} passed, {t['failures']} failed, {t['errors']} "
            f"errors, {t['skipped']} skipped in {t['time_s']:.0f} s"
        )
        out += [f"- FAILED {f}" for f in t["failed"][:20]]
        out.append("")
    c = s.get("ceilings")
    if c:
        out.append(
            "Ceilings: copy "
            + _x(c.get("copy_GBps"), "{:.0f} GB/s")
            + ", fill "
            + _x(c.get("fill_GBps"), "{:.0f} GB/s")
            + ", bf16 matmul "
            + _x(c.get("bf16_mm_TFLOPs"), "{:.0f} TFLOP/s")
            + ", fp32 matmul "
            + _x(c.get("fp32_mm_TFLOPs"), "{:.1f} TFLOP/s")
        )
        out.append("")
    f = s.get("floater")
    if f:
        sub = f.get("subject") or "cuda"
        out += [
            f"FLOATER ({sub}, rk38; ratios = baseline time / {sub} time; goals: fwd vs "
            "torchdiffeq >= 40, bwd vs adjoint >= 50, vs graphed loop >= 6, bwd/fwd <= 1.5; bwd: "
            "over the forward's tape)",
            "",
            f"| case | {sub} fwd ms | {sub} bwd ms | bwd/fwd | vs torchdiffeq fwd | "
            "vs adjoint bwd | vs graph fwd | vs graph bwd | check |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for e in f["cases"]:
            g = e["goals"]
            checks = ", ".join(f"{m} {v}" for m, v in e["checks"].items()) or "-"
            out.append(
                _row(
                    e["case"],
                    _x(e.get(sub + "_fwd_ms"), "{:.3f}"),
                    _x(e.get(sub + "_bwd_ms"), "{:.3f}"),
                    *(_goal(g.get(k)) for k in _FLOATER_GOALS),
                    checks[:80],
                )
            )
        if not f.get("complete"):
            out.append("")
            out.append("(floater_gpu.py did not finish: the cases above are those it wrote)")
        out.append("")
    lf = s.get("lff")
    if lf and lf["rows"]:
        out += [
            "LFF and tables (auto: the plan users get; each plan's ms beside it; % of the "
            "floor at the measured ceilings; goals against compile in the same process)",
            "",
            "| case | mode | plan | ms | fused / gemm ms | % floor | vs eager | vs compile | "
            "goals | check |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for e in lf["rows"]:
            goals = e.get("goals", {})
            missed = [k for k, v in goals.items() if v.get("met") is False]
            pending = [k for k, v in goals.items() if v.get("value") is None]
            verdict = "met" if goals and not missed and not pending else ""
            if missed:
                verdict = "missed: " + ", ".join(missed)
            if pending:
                verdict += (" " if verdict else "") + "pending: " + ", ".join(pending)
            plans = " / ".join(_x(e.get("plans", {}).get(p), "{:.4f}") for p in ("fused", "gemm"))
            out.append(
                _row(
                    e["case"],
                    e["mode"],
                    e.get("plan") or "-",
                    _x(e.get("ms"), "{:.4f}"),
                    plans,
                    _x(e.get("pct_of_floor") or e.get("pct_copy_ceiling"), "{:.0f}%"),
                    _x(e.get("speedup_vs_eager")),
                    _x(e.get("speedup_vs_compile")),
                    verdict or "-",
                    str(e.get("check") or e.get("error") or "-")[:40],
                )
            )
        out.append("")
    ro = s.get("rotary")
    if ro and ro["rows"]:
        out += [
            "Rotary LFF and the grid families (`benchmarks/rotary.py`): q' and k' from positions",
            "",
            "| case | dtype | implementation | fwd ms | fwd+bwd ms | max err | speed-ups |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in ro["rows"]:
            ups = ", ".join(f"{k} {v:.2f}x" for k, v in (r["speedups"] or {}).items())
            out.append(
                _row(
                    r["case"],
                    r["dtype"],
                    r["impl"],
                    _x(r["fwd_ms"], "{:.4f}"),
                    _x(r["fwd_bwd_ms"], "{:.4f}"),
                    _x(r["max_abs_err"], "{:.1e}"),
                    ups or "-",
                )
            )
        out.append("")
    b = s.get("bench_cli")
    if b and b["rows"]:
        out += [
            f"`python -m posenc_fast bench --device {b.get('device')}`: fastest backend per case",
            "",
            "| op | case | mode | backend | ms | vs eager | vs compile |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in b["rows"]:
            out.append(
                _row(
                    r["op"],
                    r["case"],
                    r["mode"],
                    r["best"],
                    f"{r['ms']:.4f}",
                    _x(r["speedup_vs_eager"]),
                    _x(r["speedup_vs_compile"]),
                )
            )
        if b["errors"]:
            out.append("")
            out += [f"- failed: {e}" for e in b["errors"][:10]]
        out.append("")
    sz = s.get("sanitize")
    if sz:
        dry = " (dry run: no sanitizer)" if sz.get("dry_run") else ""
        out += [
            f"compute-sanitizer{dry}: {'clean' if sz['clean'] else 'NOT clean'}"
            + (f" ({sz['version']})" if sz.get("version") else ""),
            "",
            "| tool | workload | status | errors | seconds |",
            "|---|---|---|---|---|",
        ]
        for r in sz["runs"]:
            errors = "-" if r["errors"] is None else r["errors"]
            if r.get("hazards"):
                errors = f"{errors} ({r['hazards']} hazards)"
            out.append(_row(r["tool"], r["workload"], r["status"], errors, r["seconds"]))
        for r in sz["runs"]:
            out += [f"- {r['tool']}: {ln}" for ln in r["report"][:5]]
            if r.get("unsupported"):
                out.append(f"- {r['tool']}: {r['unsupported']}")
        out.append("")
    cr = s.get("compile_report")
    if cr:
        out.append(
            f"Triton compile report: {cr['compiled_ok']} kernels compiled ({cr['wgmma_kernels']} "
            f"with wgmma), {len(cr['failed'])} failed, {len(cr['approx_trig'])} with approximate "
            "trig (must be 0)"
        )
        out += [f"- {ln}" for ln in (cr["failed"] + cr["approx_trig"])[:10]]
        out.append("")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="+", help="folders (or files) written by gpu_validate.sh")
    p.add_argument("--json", default=None, help="write the merged summary here")
    p.add_argument("--md", default=None, help="write the Markdown table here")
    args = p.parse_args(argv)
    s = summarize(args.paths)
    if not s["sources"]:
        print(f"summarize_gpu: nothing to summarize in {args.paths}", file=sys.stderr)
        return 1
    md = markdown(s)
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(s, f, indent=1, default=str)
        os.replace(tmp, args.json)
    if args.md:
        with open(args.md, "w") as f:
            f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
