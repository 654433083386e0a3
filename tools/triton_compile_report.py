"""Compile posenc_fast's Triton kernels for GPU targets without a GPU, and report their
resources."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from posenc_fast.triton_kernels._env import interpreter_enabled  # (does not import triton)

if interpreter_enabled():
    raise SystemExit("triton_compile_report: unset TRITON_INTERPRET (it replaces the compiler)")

import triton
import triton.language as tl
from posenc_fast.triton_kernels import _configs, _partial_sums
from posenc_fast.triton_kernels import encodings as enc
from posenc_fast.triton_kernels import lff_backward_fused as bwd
from posenc_fast.triton_kernels import lff_backward_split_k as split_k
from posenc_fast.triton_kernels import lff_forward as fwd
from posenc_fast.triton_kernels import lff_gemm as gemm
from posenc_fast.triton_kernels import lff_gemm_kernels as gemm_k
from posenc_fast.triton_kernels import rotary as rot
from posenc_fast.triton_kernels._launch import pow2
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

#     python tools/triton_compile_report.py [--arch 80,90] [--quick] [--filter REGEX]
#         [--json out.json] [--probe-refused]
#
# Runs Triton's real compiler (TTIR -> PTX -> cubin with the ptxas bundled in the triton
# wheel) for the configurations the launchers use on the GPU, for each architecture
# (default: sm_80, 86, 89, 90, 100, 120), and prints per kernel: registers, stack bytes
# (spills), shared memory, the matmul instruction family (wgmma / mma.sync / none) and
# whether the PTX contains approximate trig (it must not: the phases are reduced and
# evaluated by polynomials, see _phase.py). This catches what the interpreter cannot: code
# that only fails in compiled mode (e.g. non-constexpr globals, chained boolean operators)
# and configurations that spill.
#
# The configurations that _configs.py's rules refuse for an architecture (a Triton defect
# that aborts the compiler, or too much shared memory) are the ones the launchers never
# offer there: they are listed with the reason, not compiled (``--probe-refused`` compiles
# each of them in a child process, to show what the rule prevents). Every compiled one is
# checked against the target's shared memory limit and against _configs.shared_bound.
# Ends with one line per architecture, "sm_90: 58 compiled, 0 refused, 0 failed".
# Exit status 1 if anything fails to compile, exceeds a limit or contains approximate
# trig. Needs TRITON_INTERPRET unset.

_PTR = {tl.float32: "*fp32", tl.bfloat16: "*bf16", tl.float16: "*fp16"}
_FLOAT_ARGS = {"inv_sqrt_f"}


def _signature(fn, pointers: dict, constexprs: dict) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.isupper():
            sig[name] = pointers.get(name, "*fp32")
        elif name in _FLOAT_ARGS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def _cuobjdump() -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def _resources(cubin: bytes) -> str:
    tool = _cuobjdump()
    if not os.path.exists(tool):
        return "(cuobjdump not found)"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", out)
    return f"regs {m.group(1):>3} stack {m.group(2):>5} B shared {m.group(3):>5} B" if m else out


@dataclass
class Case:
    label: str
    name: str  # the kernel's name in _configs' rules
    kernel: object
    pointers: dict
    constexprs: dict
    options: dict  # num_warps, num_stages, enable_fp_fusion


def compile_one(case: Case, arch: int) -> tuple[str, str]:
    """("ok" | "bad" | "fail", the report line) of compiling one case for sm_{arch}."""
    kernel = case.kernel
    fn = kernel.fn if isinstance(kernel, triton.runtime.Autotuner) else kernel
    src = ASTSource(fn, _signature(fn, case.pointers, case.constexprs), case.constexprs)
    try:
        k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=case.options)
    except Exception as exc:  # report every failure, keep going
        return "fail", f"FAIL {case.label}: {type(exc).__name__}: {str(exc)[-600:]}"
    ptx = k.asm["ptx"]
    families = ("tcgen05", "wgmma", "mma.sync")  # Blackwell, Hopper, Ampere tensor cores
    mma = next((f for f in families if f in ptx), "no mma")
    approx = re.search(r"\b(sin|cos)\.approx", ptx) is not None
    shared = getattr(k.metadata, "shared", 0)
    warps, stages = case.options.get("num_warps", 4), case.options.get("num_stages", 3)
    bound = _configs.shared_bound(case.name, case.constexprs, warps, stages, arch)
    limit = _configs.shared_limit(arch)
    problems = []
    if approx:
        problems.append("APPROX TRIG")
    if shared > limit:
        problems.append(f"SHARED {shared} B > the sm_{arch} limit {limit} B")
    if shared > bound:
        problems.append(f"SHARED {shared} B > _configs.shared_bound {bound} B: fix the bound")
    line = (f"{'BAD ' if problems else 'ok  '}{case.label:<58} {_resources(k.asm['cubin'])} "
            f"(dyn shared {shared} B, bound {bound} B) {mma}"
            + "".join(f"  {p}" for p in problems))  # fmt: skip
    return ("bad" if problems else "ok"), line


def probe(case: Case, arch: int) -> str:
    """What compiling a refused case does, in a child process (it may abort)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--arch", str(arch), "--force", case.label]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode < 0:
        lines = [ln for ln in proc.stderr.splitlines() if "ssert" in ln or "rror" in ln]
        return f"killed by signal {-proc.returncode}: {(lines or ['?'])[-1][:300]}"
    out = [ln for ln in proc.stdout.splitlines() if ln.startswith(("ok ", "BAD ", "FAIL "))]
    return out[-1][:300] if out else f"exit {proc.returncode}: {proc.stderr[-300:]}"


# Constexprs every lff case starts from (bf16, gelu, M=2, no SPLIT), and the backward's
# flags for all six gradients.
_LFF = dict(M=2, MLP=True, ACT="gelu", COMPUTE=tl.bfloat16, PRECISION=None, INTERPRET=False,
            SPLIT=False)  # fmt: skip
_ALL_NEEDS = dict(NEED_X=True, NEED_WR=True, NEED_W1=True, NEED_B1=True, NEED_W2=True,
                  NEED_B2=True, STORE_H=False, STORE_GA=False, H_SPLIT=False)  # fmt: skip
_FEATURE_NEEDS = dict(_ALL_NEEDS, NEED_W1=False, NEED_B1=False, NEED_W2=False, NEED_B2=False)


def _fwd_config(key: tuple) -> tuple[dict, dict]:
    """(blocks, launch options) of a forward _CONFIGS entry."""
    br, bk, bd, w, st = key
    return dict(BLOCK_R=br, BLOCK_K=bk, BLOCK_D=bd), dict(num_warps=w, num_stages=st)


def _bwd_cases(label: str, constexprs: dict, pointer: str, arch: int):
    """The backward's configurations for sm_{arch}: its first choice and, where the rules
    refuse that, the next (what lff_bwd launches there)."""
    for blocks in bwd.gpu_candidates(constexprs):
        options = dict(bwd.OPTIONS)
        yield Case(
            f"{label} BR{blocks['BLOCK_R']}", "lff_bwd", bwd._lff_bwd_kernel,
            {"GRAD": pointer}, dict(constexprs, **blocks),
            dict(enable_fp_fusion=False, **options),
        )  # fmt: skip
        if _configs.refusal("lff_bwd", dict(constexprs, **blocks), **options, arch=arch) is None:
            return


def _split_k_cases(label: str, constexprs: dict, pointer: str, arch: int, quick: bool):
    """The large-weights path of the backward (lff_backward_split_k.py): its fused
    pass (no dw1 / dw2 partials, h and ga stored; block sizes chosen as _bwd_cases'; not
    with --quick: the same kernel as the fused backward) and the two weight-gradient
    kernels."""
    flags = dict(NEED_X=False, NEED_WR=False, NEED_W1=False, NEED_W2=False, STORE_H=True,
                 STORE_GA=True, H_SPLIT=True)  # fmt: skip
    for blocks, options in [] if quick else split_k.first_pass_candidates(constexprs):
        full = dict(constexprs, **flags, **blocks)
        yield Case(
            f"{label} split-K first pass BR{blocks['BLOCK_R']} BH{blocks['BLOCK_H']}", "lff_bwd",
            bwd._lff_bwd_kernel, {"GRAD": pointer, "HB": pointer, "GAB": pointer}, full,
            dict(enable_fp_fusion=False, **options),
        )  # fmt: skip
        if _configs.refusal("lff_bwd", full, **options, arch=arch) is None:
            break
    pb, po = split_k.phase_config(constexprs)
    yield Case(
        f"{label} split-K phase BR{pb['BLOCK_R']} BK{pb['BLOCK_K']} BH{pb['BLOCK_H']}",
        "lff_bwd_phase", split_k._lff_bwd_phase_kernel, {"GAB": pointer},
        dict(M=constexprs["M"], COMPUTE=constexprs["COMPUTE"], PRECISION=constexprs["PRECISION"],
             INTERPRET=False, NEED_X=True, NEED_WR=True, BLOCK_M=constexprs["BLOCK_M"], **pb),
        dict(enable_fp_fusion=False, **po),
    )  # fmt: skip
    for features, what in ((False, "dw2"), (True, "dw1")):
        wb, wo = split_k.wgrad_config(constexprs, features)
        yield Case(
            f"{label} split-K {what} BR{wb['BLOCK_R']} BI{wb['BLOCK_I']} BJ{wb['BLOCK_J']}",
            "lff_bwd_wgrad", split_k._lff_bwd_wgrad_kernel, {"A": pointer, "B": pointer},
            dict(FEATURES=features, M=constexprs["M"], COMPUTE=constexprs["COMPUTE"],
                 PRECISION=constexprs["PRECISION"], INTERPRET=False, **wb),
            dict(enable_fp_fusion=False, **wo),
        )  # fmt: skip


def _gemm_cases(quick: bool):
    """The gemm plan's Triton kernels (lff_gemm.py), labelled lff_gemm_*."""
    for dtype in (tl.bfloat16,) if quick else (tl.bfloat16, tl.float32):
        p, name = _PTR[dtype], "bf16" if dtype == tl.bfloat16 else "fp32"
        fb, fo = gemm.config("features", F2=384, H=256)
        for split in (False, True) if dtype == tl.bfloat16 and not quick else (False,):
            yield Case(
                f"lff_gemm_features {name}" + (" SPLIT" if split else ""), "lff_gemm_features",
                gemm_k._features_kernel, {"OUT": p},
                dict(M=2, SPLIT=split, INTERPRET=False, **fb),
                dict(enable_fp_fusion=False, **fo),
            )  # fmt: skip
        ab, ao = gemm.config("act_fwd", H=256)
        yield Case(
            f"lff_gemm_act_fwd {name}", "lff_gemm_act", gemm_k._act_fwd_kernel, {"A": p},
            dict(ACT="gelu", INTERPRET=False, **ab), dict(enable_fp_fusion=False, **ao),
        )  # fmt: skip
        bb, bo = gemm.config("act_bwd", H=256)
        yield Case(
            f"lff_gemm_act_bwd {name}", "lff_gemm_act", gemm_k._act_bwd_kernel,
            {"A": p, "GH": p, "HOUT": p, "GA": p},
            dict(ACT="gelu", STORE_H=True, NEED_B1=True, INTERPRET=False, **bb),
            dict(enable_fp_fusion=False, **bo),
        )  # fmt: skip
        pb, po = gemm.config("phase", F2=384)
        yield Case(
            f"lff_gemm_phase {name}", "lff_gemm_phase", gemm_k._phase_grad_kernel,
            {"GR": p, "RF": p},
            dict(M=2, NEED_X=True, NEED_WR=True, BLOCK_M=2, INTERPRET=False, **pb),
            dict(enable_fp_fusion=False, **po),
        )  # fmt: skip


def _rotary_cases(quick: bool):
    """(label, kernel, pointer dtypes, constexprs, launch options): the rotary
    launchers' GPU configurations at head_dim 64 (and 128), M = 2, interleaved pairs
    (LightGlue, timm) and halves (rotate-half: DINOv3, timm half=True)."""
    for F2 in (32,) if quick else (32, 64):
        for half in (False, True):
            bl, opts = rot.blocks(1 << 16, F2, half)
            tail = f"F{2 * F2} BN{bl['BLOCK_N']} BK{bl['BLOCK_K']}"
            fwd_opts = dict(enable_fp_fusion=False, **opts)
            pairs = "half" if half else "interleaved"
            base = dict(M=2, HALF=half, INTERPRET=False, **bl)
            for dt in ("bf16",) if quick else ("bf16", "fp32"):
                qk = {name: f"*{dt}" for name in ("Q", "K", "OQ", "OK")}
                yield (f"rotary_fwd {pairs} {dt} {tail}", rot._rotary_fwd_kernel, qk,
                       dict(base, TABLE=False), fwd_opts)  # fmt: skip
                grads = {name: f"*{dt}" for name in ("Q", "K", "GQ", "GK", "DQ", "DK")}
                needs = dict(NEED_Q=True, NEED_K=True, NEED_X=True, NEED_W=True)
                yield (f"rotary_bwd {pairs} {dt} {tail}", rot._rotary_bwd_kernel, grads,
                       dict(base, TABLE=False, BLOCK_M=2, **needs), fwd_opts)  # fmt: skip
            if not quick:
                only_qk = dict(NEED_Q=True, NEED_K=True, NEED_X=False, NEED_W=False)
                yield (f"rotary_bwd {pairs} bf16 q,k only {tail}", rot._rotary_bwd_kernel,
                       grads, dict(base, TABLE=False, BLOCK_M=2, **only_qk),
                       fwd_opts)  # fmt: skip
            table = {"OQ": "*bf16", "OK": "*bf16"}
            yield (f"rotary_table_fwd {pairs} bf16 {tail}", rot._rotary_fwd_kernel, table,
                   dict(base, TABLE=True), fwd_opts)  # fmt: skip
            yield (f"rotary_table_bwd {pairs} bf16 {tail}", rot._rotary_bwd_kernel,
                   {"GQ": "*bf16", "GK": "*bf16"},
                   dict(base, TABLE=True, BLOCK_M=2, NEED_Q=False, NEED_K=False, NEED_X=True,
                        NEED_W=True), fwd_opts)  # fmt: skip


def _cases(quick: bool, arch: int):
    """The Cases to compile for sm_{arch}."""
    bf16 = tl.bfloat16
    # (M, H): what the constexprs depend on (F and Dg are runtime sizes)
    shapes = {"canonical": (2, 32), "hidden128": (2, 128), "compute": (2, 256), "boxes": (4, 32)}
    for shape_name, (M, H) in shapes.items():
        block_h = pow2(H)
        # float32 in IEEE (FMA) and TF32 (tensor cores) matmuls, canonical shape only
        for dtype, precision in ((bf16, None), (tl.float32, "ieee"), (tl.float32, "tf32")):
            if dtype == tl.float32 and (quick or shape_name != "canonical"):
                continue
            kind = f"{dtype}" + (f" {precision}" if precision == "tf32" else "")
            constexprs = dict(_LFF, M=M, COMPUTE=dtype, PRECISION=precision, BLOCK_H=block_h)
            configs = fwd.offered(constexprs)
            for key in configs[:1] if quick else configs:
                blocks, opts = _fwd_config(key)
                br, bk, bd, w, st = key
                yield Case(
                    f"lff_fwd {shape_name} {kind} BR{br} BK{bk} BD{bd} w{w} s{st}",
                    "lff_fwd", fwd._lff_fwd_kernel, {"OUT": _PTR[dtype]},
                    dict(constexprs, **blocks), dict(enable_fp_fusion=False, **opts),
                )  # fmt: skip
            bwd_constexprs = dict(constexprs, **_ALL_NEEDS, BLOCK_M=triton.next_power_of_2(M))
            label = f"lff_bwd {shape_name} {kind}"
            yield from _bwd_cases(label, bwd_constexprs, _PTR[dtype], arch)
            # The compute shape's weights take the split-K path (CI's cost: the other
            # shapes and TF32 compiled the same way, see lff_backward._WGRAD_CONFIGS).
            if shape_name == "compute":
                yield from _split_k_cases(label, bwd_constexprs, _PTR[dtype], arch, quick)
    # The split-K path in float32 (IEEE FMA matmuls), compute shape (H=256).
    if not quick:
        constexprs = dict(_LFF, COMPUTE=tl.float32, PRECISION="ieee", BLOCK_H=256,
                          BLOCK_M=2, **_ALL_NEEDS)  # fmt: skip
        yield from _split_k_cases("lff_bwd compute fp32", constexprs, "*fp32", arch, quick)
    # The gemm plan's elementwise kernels (lff_gemm.py's GPU configurations), bf16 and
    # float32, at the compute shape (their block sizes do not depend on F or Dg).
    yield from _gemm_cases(quick)
    # relu with a bf16 MLP: the SPLIT path (features' rounding error as a second term),
    # canonical shape (H=32): the forward's first configuration, the backward's rule.
    fwd_blocks, fwd_opts = _fwd_config(fwd.offered(dict(_LFF, SPLIT=True, BLOCK_H=32))[0])
    yield Case(
        "lff_fwd canonical bf16 relu SPLIT", "lff_fwd", fwd._lff_fwd_kernel, {"OUT": "*bf16"},
        dict(_LFF, ACT="relu", SPLIT=True, BLOCK_H=32, **fwd_blocks),
        dict(enable_fp_fusion=False, **fwd_opts),
    )  # fmt: skip
    yield from _bwd_cases(
        "lff_bwd canonical bf16 relu SPLIT",
        dict(_LFF, **_ALL_NEEDS, ACT="relu", SPLIT=True, BLOCK_H=32, BLOCK_M=2),
        "*bf16",
        arch,
    )
    yield Case(
        "lff_fwd features-only bf16", "lff_fwd", fwd._lff_fwd_kernel, {"OUT": "*bf16"},
        dict(_LFF, MLP=False, BLOCK_R=64, BLOCK_K=32, BLOCK_H=16, BLOCK_D=64),
        dict(num_warps=4, num_stages=2, enable_fp_fusion=False),
    )  # fmt: skip
    yield from _bwd_cases(
        "lff_bwd features-only bf16",
        dict(_LFF, **_FEATURE_NEEDS, MLP=False, BLOCK_H=16, BLOCK_M=2),
        "*bf16",
        arch,
    )
    yield Case(
        "lff_sum_partials", "sum_partials", _partial_sums.sum_partials_kernel, {"OUT": "*bf16"},
        dict(BLOCK=1024, INTERPRET=False), dict(num_warps=4),
    )  # fmt: skip
    # (name, ADD, HAS_BIAS, INTERLEAVED, POS_INT, WRAP)
    variants = [
        ("sinusoidal", False, False, True, False, False),
        ("sinusoidal add int-positions wrap", True, False, True, True, True),
        ("dft add", True, False, False, False, False),
        ("sinusoidal block", False, True, True, False, False),
    ]
    for name, add, bias, interleaved, pos_int, wrap in variants[:2] if quick else variants:
        flags = dict(ADD=add, HAS_BIAS=bias, INTERLEAVED=interleaved, POS_INT=pos_int, WRAP=wrap)
        for br, bk, w in enc._FWD_CONFIGS[:1] if quick else enc._FWD_CONFIGS:
            pointers = {"X": "*bf16", "OUT": "*bf16", "COLS": "*i32"}
            pointers["P"] = "*i64" if flags["POS_INT"] else "*fp32"
            yield Case(
                f"encoding_fwd {name} BR{br} BK{bk} w{w}", "encoding_fwd",
                enc._encoding_fwd_kernel, pointers,
                dict(INTERPRET=False, BLOCK_R=br, BLOCK_K=bk, **flags),
                dict(num_warps=w, num_stages=2, enable_fp_fusion=False),
            )  # fmt: skip
    blocks, opts = enc._bwd_blocks(1 << 20, 384)
    for interleaved in (True, False):
        yield Case(
            f"encoding_bwd interleaved={interleaved}", "encoding_bwd", enc._encoding_bwd_kernel,
            {"GRAD": "*bf16", "COLS": "*i32"},
            dict(POS_INT=False, INTERLEAVED=interleaved, INTERPRET=False, **blocks),
            dict(enable_fp_fusion=False, **opts),
        )  # fmt: skip
    for label, kernel, pointers, constexprs, options in _rotary_cases(quick):
        yield Case(label, label.split()[0], kernel, pointers, constexprs, options)


def report(arch: int, quick: bool, probe_refused: bool, pattern: str = "") -> dict:
    """Compile every case for sm_{arch} (whose label matches ``pattern``), printing one line
    each; the result as a dict."""
    result = {"compiled": [], "refused": {}, "failed": {}}
    print(f"\n== sm_{arch} (shared memory limit {_configs.shared_limit(arch)} B per block)")
    for case in _cases(quick, arch):
        if not re.search(pattern, case.label):
            continue
        options = case.options
        reason = _configs.refusal(
            case.name, case.constexprs, options.get("num_warps", 4), options.get("num_stages", 3),
            arch,
        )  # fmt: skip
        if reason is not None:
            result["refused"][case.label] = reason
            print(f"skip {case.label}: refused, {reason}")
            if probe_refused:
                print(f"     probe: {probe(case, arch)}")
            continue
        status, line = compile_one(case, arch)
        print(line, flush=True)
        if status == "ok":
            result["compiled"].append(case.label)
        else:
            result["failed"][case.label] = line
    return result


def _summary(arch: int, r: dict) -> str:
    return (
        f"sm_{arch}: {len(r['compiled'])} compiled, {len(r['refused'])} refused, "
        f"{len(r['failed'])} failed"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--arch",
        default=",".join(map(str, _configs.REPORT_ARCHS)),
        help="compute capabilities x10, comma-separated (default: %(default)s)",
    )
    parser.add_argument("--quick", action="store_true", help="one configuration per kernel")
    parser.add_argument(
        "--filter", default="", help="only the cases whose label matches this regex"
    )
    parser.add_argument("--json", help="write the results per architecture to this file")
    parser.add_argument(
        "--probe-refused",
        action="store_true",
        help="compile each refused configuration in a child process and say what happens",
    )
    parser.add_argument(
        "--force", metavar="LABEL", help="compile this one case, even if refused (for probes)"
    )
    args = parser.parse_args(argv)
    archs = [int(a) for a in args.arch.split(",") if a.strip()]
    print(f"triton {triton.__version__}, targets {', '.join(f'sm_{a}' for a in archs)}")
    if args.force:
        cases = [c for c in _cases(False, archs[0]) if c.label == args.force]
        if not cases:
            raise SystemExit(f"no case labelled {args.force!r}")
        status, line = compile_one(cases[0], archs[0])
        print(line)
        return 0 if status == "ok" else 1
    results = {arch: report(arch, args.quick, args.probe_refused, args.filter) for arch in archs}
    print()
    for arch, r in results.items():
        print(_summary(arch, r))
    if args.json:
        record = {"triton": triton.__version__, "quick": args.quick}
        record["archs"] = {f"sm_{a}": r for a, r in results.items()}
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 1 if any(r["failed"] for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
