"""compute-sanitizer over the GPU kernels, on small shapes (the `sanitize` stage of
benchmarks/gpu_validate.sh):

    python benchmarks/gpu_sanitize.py --out sanitize.json     # H200: ~30-40 s (estimate)
    python benchmarks/gpu_sanitize.py --dry-run --out x.json  # the workloads on the CPU

Runs, each a child process of this script under compute-sanitizer:
- memcheck over every kernel (workload "kernels"): the Triton kernels of LFF (forward,
  backward, features only), the encodings (tables, fused adds, backward) and rotary (table,
  fused apply, both backwards), and the CUDA FLOATER integrator (forward, backward, the
  cross-team reduction) in its automatic layout; shapes with tails everywhere (odd sizes,
  fewer rows than a block). The CUDA caching allocator is off
  (PYTORCH_NO_CUDA_MEMORY_CACHING=1): every tensor is its own allocation, so a read past
  its end is outside any allocation and memcheck sees it.
- racecheck and synccheck over the CUDA FLOATER integrator (workload "floater"): forward
  and backward in every layout, forced one after the other (the CUDA module's
  set_development_options(floater_layout=...)): one
  block (shared-memory exchange), a cluster of 2 (sm_90), a cooperative grid team of 3,
  weights from L2 with vectors read from L2. racecheck finds shared-memory hazards
  between a block's threads (missing __syncthreads), synccheck barriers not reached by
  every thread of a block or warp.

Every child also checks its results against the float64 reference, so a sanitized run
that computed nonsense fails too. The report (--out) lists each run: tool, workload, exit
status, the sanitizer's error count, seconds, and the first lines of its report; the exit
status is 0 only when every run is clean. Where compute-sanitizer is missing, or refuses
the device (seen on the gVisor runtime: "Device not supported"), the run is recorded as
"unavailable" with the reason, and the exit status is 3.

--dry-run (the CPU machine, tests/common/test_gpu_scripts.py): no sanitizer; each workload
runs directly on the CPU (Triton under TRITON_INTERPRET=1, FLOATER on the cpp backend) and
the report is written the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# (tool, workload): what each sanitizer run covers
RUNS = (("memcheck", "kernels"), ("racecheck", "floater"), ("synccheck", "floater"))
# The FLOATER layouts the "floater" workload forces, as the CUDA module's floater_layout
# "mode,C,Sg[,resident[,staged]]", for its shape (S=5, d=9, H=7): one block; a cluster of
# 2 blocks (sm_90); a grid team of 3 blocks; weights from L2, vectors read from L2.
FLOATER_LAYOUTS = ("solo,1,5", "cluster,2,3", "grid,3,2", "grid,2,3,0,0")
SANITIZER_ENV = "COMPUTE_SANITIZER"
STATUS_UNAVAILABLE = 3


def find_sanitizer() -> tuple[str | None, str]:
    """(path of compute-sanitizer, how it was found) or (None, why not): $COMPUTE_SANITIZER,
    then PATH, then the CUDA toolkit's bin/ and compute-sanitizer/ folders."""
    named = os.environ.get(SANITIZER_ENV)
    if named:
        ok = os.path.isfile(named) and os.access(named, os.X_OK)
        return (
            (named, f"{SANITIZER_ENV}={named}")
            if ok
            else (None, f"{SANITIZER_ENV}={named} is not executable")
        )
    found = shutil.which("compute-sanitizer")
    if found:
        return found, "on PATH"
    root = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    for sub in ("bin", "compute-sanitizer"):
        path = os.path.join(root, sub, "compute-sanitizer")
        if os.path.isfile(path):
            return path, f"in the CUDA toolkit ({path})"
    return None, "compute-sanitizer not found (PATH, the CUDA toolkit; set COMPUTE_SANITIZER)"


# ------------------------------------------------------------------ reading its output

_SUMMARY = re.compile(r"=+ ERROR SUMMARY: (\d+) errors?")
_RACE = re.compile(
    r"=+ RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)"
)
_UNSUPPORTED = re.compile(
    r"Device not supported|not supported on this|unable to .*device|Error: Target application", re.I
)


def parse_output(text: str) -> dict:
    """compute-sanitizer's verdict in ``text`` (its output interleaved with the child's):
    {"errors": the ERROR SUMMARY count (None if it printed none), "hazards": racecheck's
    displayed hazards (None without), "unsupported": its refusal of the device, or None,
    "report": the first 40 lines it printed about errors}."""
    errors = [int(m.group(1)) for m in _SUMMARY.finditer(text)]
    races = [tuple(int(g) for g in m.groups()) for m in _RACE.finditer(text)]
    lines = [ln for ln in text.splitlines() if ln.startswith("=========")]
    unsupported = next((ln for ln in lines if _UNSUPPORTED.search(ln)), None)
    report = [ln for ln in lines if "SUMMARY" not in ln and ln.strip("= ")][:40]
    return {
        "errors": sum(errors) if errors else None,
        "hazards": sum(r[0] for r in races) if races else None,
        "unsupported": unsupported.strip("= ") if unsupported else None,
        "report": report,
    }


def verdict(rc: int, parsed: dict) -> str:
    """clean, errors (the sanitizer found something, or the workload failed under it), or
    unavailable (it refused the device)."""
    if parsed["unsupported"] and not parsed["errors"]:
        return "unavailable"
    if rc == 0 and parsed["errors"] == 0 and not parsed["hazards"]:
        return "clean"
    return "errors"


# ------------------------------------------------------------------ the workloads (child)


def _check(got, want, dtype, kind, what):
    from posenc_fast.tolerances import assert_close

    assert_close(got, want, dtype, kind, what=what)


def workload_kernels(device: str) -> list[str]:
    """Every Triton kernel (LFF, encodings, rotary: forward and backward) and the CUDA
    FLOATER integrator on small shapes with tails; each result checked against the
    reference. On the CPU (dry run): Triton's interpreter, FLOATER on the cpp backend."""
    import torch

    import posenc_fast as pf
    from posenc_fast.cli import _inputs
    from posenc_fast.ops.encodings import reference as ref_enc
    from posenc_fast.ops.lff import reference as ref_lff
    from posenc_fast.ops.rotary import reference as ref_rot

    ran = []
    f32 = torch.float32
    for case in (
        _inputs.LffCase((37,), 2, 3, 18, 9, 13, "gelu_tanh"),
        _inputs.LffCase((5,), 1, 2, 10, 0, 0),
    ):
        inputs = _inputs.lff_inputs(case, f32, device, seed=1)
        leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in inputs]
        y = pf.lff(*leaves, activation=case.activation, backend="triton")
        y.backward(torch.ones_like(y))
        want = ref_lff.lff(*inputs, case.activation)
        _check(y, want, f32, "lff" if case.hidden_dim else "encoding", f"lff {case.id}")
        ran.append(f"triton lff {case.id} forward+backward")
    g = _inputs.generator(2)
    p = _inputs.rand((3, 19), g, -50.0, 50.0, f32, device).requires_grad_()
    x = _inputs.randn((3, 19, 14), g, f32, device).requires_grad_()
    for kind, fn, module in (
        ("sinusoidal", pf.sinusoidal, pf.SinusoidalPE),
        ("dft", pf.dft, pf.DFTPE),
    ):
        table = fn(p, 14, backend="triton")
        y = module(14, backend="triton")(x, p)
        (table.sum() + y.sum()).backward()
        want = ref_enc.dft(p.detach(), 14) if kind == "dft" else ref_enc.sinusoidal(p.detach(), 14)
        _check(table, want, f32, "encoding", kind)
        ran.append(f"triton {kind} table, fused add, backward (positions [3, 19], dim 14)")
    case = _inputs.RotaryCase(2, 3, 1, 37, 20, 18, 2, "bnhd")
    q, k, xr, wr = (t.requires_grad_() for t in _inputs.rotary_inputs(case, f32, device, seed=3))
    oq, ok = pf.apply_lff_rotary(q, k, xr, wr, case.layout, backend="triton")
    table = pf.lff_rotary(xr, wr, backend="triton")
    (oq.sum() + ok.sum() + table.sum()).backward()
    wq, _ = ref_rot.apply_lff_rotary(q.detach(), k.detach(), xr.detach(), wr.detach(), case.layout)
    _check(oq, wq, f32, "rotary", "rotary q")
    ran.append(f"triton rotary apply + table, forward+backward ({case.id})")
    ran += workload_floater(device, layouts=(None,))
    return ran


def workload_floater(device: str, layouts=FLOATER_LAYOUTS) -> list[str]:
    """The CUDA FLOATER integrator (forward, backward with every gradient) in each layout of
    ``layouts`` (None: the automatic one), against the reference. On the CPU (dry run): the
    cpp backend, once."""
    import torch

    import posenc_fast as pf
    from posenc_fast.cli._inputs import FloaterCase, floater_inputs
    from posenc_fast.ops.floater import reference as ref

    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import _gpu_common

    backend = "cuda" if device == "cuda" else "cpp"
    if device != "cuda":
        layouts = (None,)
    ran = []
    case = FloaterCase(5, 9, 7, 4, 2, "rk4", "tanh", repeat_time=True)
    for dtype in (torch.float32, torch.float64):
        args = floater_inputs(case, dtype, device, seed=5)
        want = ref.floater(*[a.double() for a in args], case.substeps, case.method, case.activation)
        for layout in layouts:
            leaves = [a.detach().clone().requires_grad_() for a in args]
            with _gpu_common.forced_floater_layout(layout):
                out = pf.floater(
                    *leaves, case.substeps, case.method, case.activation, backend=backend
                )
                out.backward(torch.ones_like(out))
            _check(out, want, dtype, "floater", f"floater {layout or 'auto'} {dtype}")
            what = f"{backend} floater {case.id} {str(dtype)[6:]} {layout or 'auto'}"
            ran.append(f"{what}: forward+backward")
    return ran


WORKLOADS = {"kernels": workload_kernels, "floater": workload_floater}


def child(workload: str, device: str) -> int:
    if device == "cuda":
        import torch

        torch.cuda.init()
    t0 = time.perf_counter()
    for line in WORKLOADS[workload](device):
        print(f"   ran: {line}", flush=True)
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
    print(f"   workload {workload} done in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


# ------------------------------------------------------------------ the runs (parent)


def run_one(sanitizer: str | None, tool: str, workload: str, dry: bool, timeout: float) -> dict:
    env = dict(os.environ, POSENC_FAST_CUDA_UNVALIDATED="1", PYTHONUNBUFFERED="1")
    # no autotuning (one compile per kernel), every tensor its own allocation
    env.update(POSENC_FAST_TRITON_AUTOTUNE="0", PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    device = "cpu" if dry else "cuda"
    cmd = [sys.executable, os.path.abspath(__file__), "--child", workload, "--device", device]
    if dry:
        env["TRITON_INTERPRET"] = "1"
    else:
        # --error-exitcode: a finding fails the child even where it exits 0 itself
        opts = ["--tool", tool, "--error-exitcode", "86", "--print-limit", "50"]
        if tool == "memcheck":
            opts += ["--leak-check", "no"]  # torch keeps its allocations to the end
        cmd = [sanitizer, *opts, *cmd]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT
        )
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc = 124
        text = (
            (exc.stdout or b"").decode(errors="replace")
            if isinstance(exc.stdout, bytes)
            else (exc.stdout or "")
        )
    seconds = time.perf_counter() - t0
    parsed = parse_output(text)
    if dry:  # no sanitizer: the workload's own verdict
        parsed["errors"] = 0 if rc == 0 else None
    status = "timeout" if rc == 124 else verdict(rc, parsed)
    ran = [ln.strip()[5:] for ln in text.splitlines() if ln.strip().startswith("ran: ")]
    tail = [] if status == "clean" else text.splitlines()[-15:]
    return {"tool": tool, "workload": workload, "status": status, "rc": rc,
            "errors": parsed["errors"], "hazards": parsed["hazards"],
            "unsupported": parsed["unsupported"], "seconds": round(seconds, 1),
            "ran": ran, "report": parsed["report"], "tail": tail}  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="sanitize.json", help="the report (JSON)")
    ap.add_argument("--dry-run", action="store_true", help="the workloads on the CPU, no sanitizer")
    ap.add_argument("--runs", default=",".join(f"{t}:{w}" for t, w in RUNS),
                    help="tool:workload pairs (default: %(default)s)")  # fmt: skip
    ap.add_argument("--budget", type=float, default=120.0,
                    help="seconds for all runs: each run is stopped at what is left")  # fmt: skip
    ap.add_argument("--child", choices=sorted(WORKLOADS), help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    ap.add_argument("--git-sha", default="", help="the tree's commit (gpu_validate.sh passes it)")
    args = ap.parse_args(argv)
    if args.child:
        return child(args.child, args.device)

    runs = [tuple(r.split(":")) for r in args.runs.split(",") if r]
    sanitizer, how = (None, "dry run: no sanitizer") if args.dry_run else find_sanitizer()
    report = {"benchmark": "sanitize", "dry_run": args.dry_run, "sanitizer": sanitizer, "how": how,
              "git_sha": args.git_sha, "runs": []}  # fmt: skip
    if sanitizer:
        ver = subprocess.run([sanitizer, "--version"], capture_output=True, text=True)
        report["version"] = (ver.stdout.strip().splitlines() or [""])[-1]
    print(f"== compute-sanitizer: {sanitizer or '-'} ({how})", flush=True)
    deadline = time.monotonic() + args.budget
    done: dict[str, dict] = {}  # dry run: each workload once (no tool to tell the runs apart)
    for tool, workload in runs:
        left = deadline - time.monotonic()
        if args.dry_run and workload in done:
            res = dict(done[workload], tool=tool, seconds=0.0)
        elif left < 5:
            res = {"tool": tool, "workload": workload, "status": "timeout", "rc": None,
                   "errors": None, "unsupported": None, "seconds": 0.0, "ran": [],
                   "report": [f"not run: {args.budget:.0f} s budget spent"]}  # fmt: skip
        elif sanitizer is None and not args.dry_run:
            res = {"tool": tool, "workload": workload, "status": "unavailable", "rc": None,
                   "errors": None, "unsupported": how, "seconds": 0.0, "ran": [],
                   "report": []}  # fmt: skip
        else:
            res = run_one(sanitizer, tool, workload, args.dry_run, left)
            done[workload] = res
        report["runs"].append(res)
        found = f"{res['errors']} errors" + (
            f", {res['hazards']} hazards" if res.get("hazards") else ""
        )
        print(f"== {tool} {workload}: {res['status']} ({found}, {len(res['ran'])} kernel calls, "
              f"{res['seconds']} s)", flush=True)  # fmt: skip
        for line in (
            res["report"][:20] + res.get("tail", [])[-10:] if res["status"] != "clean" else []
        ):
            print(f"   {line}")
        if res.get("unsupported"):
            print(f"   unavailable: {res['unsupported']}")
        _write(args.out, report)  # after every run: a run cut at the stage's limit keeps the rest
    statuses = {r["status"] for r in report["runs"]}
    report["clean"] = statuses == {"clean"}
    _write(args.out, report)
    if report["clean"]:
        return 0
    return STATUS_UNAVAILABLE if statuses == {"unavailable"} else 1


def _write(path: str, report: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


if __name__ == "__main__":
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    sys.exit(main())
