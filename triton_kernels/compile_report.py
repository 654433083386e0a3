"""Compile every kernel for a GPU target without a GPU, and report its resources.

    python -m posenc_fast.triton_kernels.compile_report [--arch 90] [--quick]

Runs Triton's real compiler (TTIR -> PTX -> cubin with the ptxas bundled in the triton
wheel) for the configurations the launchers use on the GPU, and prints per kernel:
registers, stack bytes (spills), shared memory, the matmul instruction family (wgmma /
mma.sync / none) and whether the PTX contains approximate trig (it must not: the phases
are reduced and evaluated by polynomials, see _phase.py). This catches what the
interpreter cannot: code that only fails in compiled mode (e.g. non-constexpr globals,
chained boolean operators) and configurations that spill. Needs TRITON_INTERPRET unset.
Exit status 1 if any kernel fails to compile or contains approximate trig.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

from ..backends.triton_backend import interpreter_enabled  # (does not import triton)

if interpreter_enabled():
    raise SystemExit("compile_report: unset TRITON_INTERPRET (it replaces the compiler)")

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import encodings as enc
from . import lff_backward as bwd
from . import lff_forward as fwd
from . import rotary as rot
from ._launch import pow2

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


def compile_one(label, kernel, pointers, constexprs, options, arch) -> bool:
    fn = kernel.fn if isinstance(kernel, triton.runtime.Autotuner) else kernel
    src = ASTSource(fn, _signature(fn, pointers, constexprs), constexprs)
    try:
        k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    except Exception as exc:  # report every failure, keep going
        print(f"FAIL {label}: {type(exc).__name__}: {str(exc)[-600:]}")
        return False
    ptx = k.asm["ptx"]
    mma = "wgmma" if "wgmma" in ptx else ("mma.sync" if "mma.sync" in ptx else "no mma")
    approx = re.search(r"\b(sin|cos)\.approx", ptx) is not None
    shared = getattr(k.metadata, "shared", "?")
    print(f"{'BAD ' if approx else 'ok  '}{label:<58} {_resources(k.asm['cubin'])} "
          f"(dyn shared {shared} B) {mma}{'  APPROX TRIG' if approx else ''}")  # fmt: skip
    return not approx


# Constexprs every lff case starts from (bf16, gelu, M=2, no SPLIT), and the backward's
# flags for all six gradients.
_LFF = dict(M=2, MLP=True, ACT="gelu", COMPUTE=tl.bfloat16, PRECISION=None, INTERPRET=False,
            SPLIT=False)  # fmt: skip
_ALL_NEEDS = dict(NEED_X=True, NEED_WR=True, NEED_W1=True, NEED_B1=True, NEED_W2=True,
                  NEED_B2=True)  # fmt: skip
_FEATURE_NEEDS = dict(_ALL_NEEDS, NEED_W1=False, NEED_B1=False, NEED_W2=False, NEED_B2=False)


def _fwd_config(key: tuple) -> tuple[dict, dict]:
    """(blocks, launch options) of a forward _CONFIGS entry."""
    br, bk, bd, w, st = key
    return dict(BLOCK_R=br, BLOCK_K=bk, BLOCK_D=bd), dict(num_warps=w, num_stages=st)


def _cases(quick: bool):
    """(label, kernel, pointer dtypes, constexprs, launch options) to compile."""
    bf16 = tl.bfloat16
    shapes = {
        "canonical": (2, 128, 32, 768),
        "compute": (2, 384, 256, 1024),
        "boxes": (4, 128, 32, 192),
    }
    for shape_name, (M, F2, H, DG) in shapes.items():
        block_h = pow2(H)
        for dtype in (bf16, tl.float32):
            if dtype == tl.float32 and (quick or shape_name != "canonical"):
                continue
            precision = "ieee" if dtype == tl.float32 else None
            configs = fwd.configs_for(block_h)
            for key in configs[:1] if quick else configs:
                blocks, opts = _fwd_config(key)
                br, bk, bd, w, st = key
                yield (
                    f"lff_fwd {shape_name} {dtype} BR{br} BK{bk} BD{bd} w{w} s{st}",
                    fwd._lff_fwd_kernel,
                    {"OUT": _PTR[dtype]},
                    dict(_LFF, M=M, COMPUTE=dtype, PRECISION=precision, BLOCK_H=block_h,
                         **blocks),
                    dict(enable_fp_fusion=False, **opts),
                )  # fmt: skip
            torch_dtype = {bf16: torch.bfloat16, tl.float32: torch.float32}[dtype]
            blocks, opts = bwd._blocks(1 << 20, F2, H, DG, torch_dtype)
            yield (
                f"lff_bwd {shape_name} {dtype} BR{blocks['BLOCK_R']}",
                bwd._lff_bwd_kernel,
                {"GRAD": _PTR[dtype]},
                dict(_LFF, **_ALL_NEEDS, M=M, COMPUTE=dtype, PRECISION=precision,
                     BLOCK_H=block_h, BLOCK_M=triton.next_power_of_2(M), **blocks),
                dict(enable_fp_fusion=False, **opts),
            )  # fmt: skip
    # relu with a bf16 MLP: the SPLIT path (features' rounding error as a second term),
    # canonical shape (H=32): the forward's first configuration, the backward's rule.
    fwd_blocks, fwd_opts = _fwd_config(fwd.configs_for(32)[0])
    blocks, opts = bwd._blocks(1 << 20, 128, 32, 768, torch.bfloat16)
    yield (
        "lff_fwd canonical bf16 relu SPLIT",
        fwd._lff_fwd_kernel,
        {"OUT": "*bf16"},
        dict(_LFF, ACT="relu", SPLIT=True, BLOCK_H=32, **fwd_blocks),
        dict(enable_fp_fusion=False, **fwd_opts),
    )
    yield (
        f"lff_bwd canonical bf16 relu SPLIT BR{blocks['BLOCK_R']}",
        bwd._lff_bwd_kernel,
        {"GRAD": "*bf16"},
        dict(_LFF, **_ALL_NEEDS, ACT="relu", SPLIT=True, BLOCK_H=32, BLOCK_M=2, **blocks),
        dict(enable_fp_fusion=False, **opts),
    )
    yield (
        "lff_fwd features-only bf16",
        fwd._lff_fwd_kernel,
        {"OUT": "*bf16"},
        dict(_LFF, MLP=False, BLOCK_R=64, BLOCK_K=32, BLOCK_H=16, BLOCK_D=64),
        dict(num_warps=4, num_stages=2, enable_fp_fusion=False),
    )
    yield (
        "lff_bwd features-only bf16",
        bwd._lff_bwd_kernel,
        {"GRAD": "*bf16"},
        dict(_LFF, **_FEATURE_NEEDS, MLP=False, BLOCK_H=16, BLOCK_M=2, **blocks),
        dict(enable_fp_fusion=False, **opts),
    )
    yield (
        "lff_sum_partials",
        bwd._sum_partials_kernel,
        {"OUT": "*bf16"},
        dict(BLOCK=1024, INTERPRET=False),
        dict(num_warps=4),
    )
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
            yield (
                f"encoding_fwd {name} BR{br} BK{bk} w{w}",
                enc._encoding_fwd_kernel,
                pointers,
                dict(INTERPRET=False, BLOCK_R=br, BLOCK_K=bk, **flags),
                dict(num_warps=w, num_stages=2, enable_fp_fusion=False),
            )
    blocks, opts = enc._bwd_blocks(1 << 20, 384)
    for interleaved in (True, False):
        yield (
            f"encoding_bwd interleaved={interleaved}",
            enc._encoding_bwd_kernel,
            {"GRAD": "*bf16", "COLS": "*i32"},
            dict(POS_INT=False, INTERLEAVED=interleaved, INTERPRET=False, **blocks),
            dict(enable_fp_fusion=False, **opts),
        )
    yield from rot.compile_cases(quick)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--arch", type=int, default=90, help="compute capability x10 (90 = H100/H200)"
    )
    parser.add_argument("--quick", action="store_true", help="one configuration per kernel")
    args = parser.parse_args(argv)
    print(f"triton {triton.__version__}, target sm_{args.arch}")
    ok = True
    for label, kernel, pointers, constexprs, options in _cases(args.quick):
        ok &= compile_one(label, kernel, pointers, constexprs, options, args.arch)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
