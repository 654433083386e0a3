"""The "triton" backend: fused Triton kernels (triton_kernels/, shipped as
posenc_fast.triton_kernels). CUDA tensors; CPU tensors only under TRITON_INTERPRET=1,
which is how CI (no GPU) verifies the kernels -- "auto" never picks it for CPU tensors
(``auto_devices``), it must be named.

What it runs (all phases in float32 with the error-free reduction of
triton_kernels/_phase.py, within ~2e-7 of float64 math for |phase| <= 1e5):
- lff: features -> w1 -> act -> w2 in one pass; backward in one recomputing pass with
  deterministic (atomic-free, fixed-order) weight-gradient sums.
- encoding: sinusoidal / DFT tables, the fused x + pe (Sine-nD too), and the gradient
  to positions.
- lff_rotary / apply_lff_rotary: LightGlue's rotary cos / sin table, and q and k rotated
  in one pass (cos / sin once per position for every head); backward with deterministic
  weight-gradient sums.

Limits (the SUPPORT table below; larger sizes fall back to the torch backend, whose
reasons the dispatcher prints): pos_dim M <= 16 (unrolled), fourier_dim F <= 1024,
hidden_dim H <= 256 (the [rows, H] tiles live in registers), group_out_dim D/G <= 1024,
float32 / bfloat16 / float16 (float64 goes to the torch backend), positions not float64
(nor, for the rotary ops, wr: its float32 rounding would shift large phases). LayerNorm /
dropout are not fused: LearnableFourierFeatures runs them in PyTorch after the fused
features.

Verification without a GPU: the test matrix runs these kernels under the interpreter,
which needs Triton >= 3.9 (``INTERPRETER_MIN_TRITON``: older interpreters compute tl.fma
with two roundings, which the phase reduction cannot survive; with an older Triton the
backend is unavailable under TRITON_INTERPRET=1, and says why);
``python -m posenc_fast.triton_kernels.compile_report`` compiles them for sm_80 .. sm_120
with Triton's own compiler (registers, spills, shared memory, no approximate trig).
Which configurations a Triton version may compile for a GPU: triton_kernels/_configs.py.
GPU timings: benchmarks/lff_gpu.py, benchmarks/rotary.py --device cuda.
"""

from __future__ import annotations

import os
import re
from functools import lru_cache

import torch

from . import _base
from ._base import Backend, OpSupport

_HALF_AND_SINGLE = (torch.float32, torch.bfloat16, torch.float16)
_INTEGERS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def interpreter_enabled() -> bool:
    """Whether TRITON_INTERPRET asks for Triton's interpreter. The one place this is
    parsed (posenc_fast.triton_kernels uses it too); this module must not import triton."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def parse_version(text: str) -> tuple[int, int]:
    """(major, minor) of a version string such as "3.1.0" or "3.6.0+git1234"."""
    major, minor = (int(v) for v in re.findall(r"\d+", text)[:2])
    return major, minor


# The first Triton whose interpreter runs these kernels faithfully: before 3.9 it computes
# tl.fma(a, b, c) as a * b + c, rounded twice, which destroys the exact error terms of the
# phase reduction (_phase.py: errors up to ~0.7 instead of ~1e-7); before 3.7 it also
# raises "only 0-dimensional arrays can be converted to Python scalars" on loops over
# runtime sizes with numpy >= 2.4.
INTERPRETER_MIN_TRITON = (3, 9)


def interpreter_reason(triton_version: str, numpy_version: str) -> str:
    """Why Triton ``triton_version``'s interpreter cannot run these kernels ("" if it can)."""
    version = parse_version(triton_version)
    if version >= INTERPRETER_MIN_TRITON:
        return ""
    why = "rounds tl.fma twice (fixed in Triton 3.9), which breaks the phase reduction"
    if version < (3, 7) and parse_version(numpy_version) >= (2, 4):
        why += f", and fails on loops over runtime sizes with numpy {numpy_version} (fixed in 3.7)"
    return (
        f"TRITON_INTERPRET=1 needs triton>=3.9: Triton {triton_version}'s interpreter {why} "
        "(compiled kernels on a GPU are unaffected)"
    )


@lru_cache(maxsize=1)
def _interpreter_reason() -> str:
    import numpy
    import triton

    return interpreter_reason(triton.__version__, numpy.__version__)


def _devices() -> tuple[str, ...]:
    return ("cuda", "cpu") if interpreter_enabled() else ("cuda",)


@lru_cache(maxsize=1)
def _import_error() -> str:
    try:
        import triton  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install
        return f"triton is not importable ({type(exc).__name__}: {exc})"
    return ""


def _kernels():
    """The kernel modules, imported on first use (importing them compiles nothing)."""
    from ..triton_kernels import encodings, lff_backward, lff_forward

    return lff_forward, lff_backward, encodings


def _rotary_kernels():
    from ..triton_kernels import rotary

    return rotary


# Rotary embeddings: q / k / table in float32 or half precision, positions and frequencies
# converted to float32 on load (float64 ones would lose their precision: torch backend).
_ROTARY = OpSupport(
    devices=_devices(),
    dtypes=_HALF_AND_SINGLE,
    max_sizes={"pos_dim": 16},
    input_dtypes={"x": _HALF_AND_SINGLE, "wr": _HALF_AND_SINGLE},
)


def _encoding_support(positions: str) -> OpSupport:
    return OpSupport(
        devices=_devices(),
        dtypes=_HALF_AND_SINGLE,
        options={"kind": ("sinusoidal", "dft")},
        input_dtypes={positions: _HALF_AND_SINGLE + _INTEGERS},
    )


class TritonBackend(Backend):
    name = "triton"
    summary = "fused Triton kernels (CUDA; CPU tensors under TRITON_INTERPRET=1)"
    # Devices on which "auto" may pick this backend: the interpreter is for verification.
    auto_devices = ("cuda",)
    # On a CUDA machine, triton missing or a GPU too old means slow fallbacks: say so once.
    warn_when_unavailable = True
    SUPPORT: dict[str, OpSupport] = {
        "lff": OpSupport(
            devices=_devices(),
            dtypes=_HALF_AND_SINGLE,
            max_sizes={
                "pos_dim": 16,
                "fourier_dim": 1024,
                "hidden_dim": 256,
                "group_out_dim": 1024,
            },
            options={"activation": ("gelu", "gelu_tanh", "relu")},
            input_dtypes={"x": _HALF_AND_SINGLE},
        ),
        "encoding": _encoding_support("positions"),
        # The Sine-nD add: the 1-D kernel on x viewed as [..., M, dim / M]
        # (Backend.encoding_nd_add).
        "encoding_nd": _encoding_support("coords"),
        "lff_rotary": _ROTARY,
        "apply_lff_rotary": _ROTARY,
    }

    def environment_reasons(self) -> list[str]:
        err = _import_error()
        if err:
            return [err]
        if interpreter_enabled():
            reason = _interpreter_reason()
            return [reason] if reason else []
        if not torch.cuda.is_available():
            return ["no CUDA device and TRITON_INTERPRET is not set"]
        # An environment reason (not an input-dependent one), so that "auto" warns once
        # and `python -m posenc_fast info` shows it, instead of a silent fallback.
        reasons = _base.capability_reasons((8, 0), " (bf16 tensor cores)")
        if reasons:
            return reasons
        from ..triton_kernels import _configs  # imports triton, importable by now

        major, minor = _base.device_capability()
        reason = _configs.target_reason(10 * major + minor)
        return [reason] if reason else []

    # ------------------------------------------------------------------ lff
    def lff_forward(self, x, wr, w1, b1, w2, b2, activation, out_dtype):
        return _kernels()[0].lff_fwd(x, wr, w1, b1, w2, b2, activation, out_dtype)

    def lff_backward(self, grad, x, wr, w1, b1, w2, b2, activation, needs):
        return _kernels()[1].lff_bwd(grad, x, wr, w1, b1, w2, b2, activation, needs)

    # ------------------------------------------------------------------ encodings
    def encoding_forward(self, positions, dim, kind, base, block, out_dtype):
        return _kernels()[2].encoding_fwd(positions, dim, kind, base, block, out_dtype)

    def encoding_add(self, x, positions, kind, base, block):
        return _kernels()[2].encoding_add_fwd(x, positions, kind, base, block)

    def encoding_backward(self, grad, positions, dim, kind, base):
        return _kernels()[2].encoding_bwd(grad, positions, dim, kind, base)

    # ------------------------------------------------------------------ rotary
    def lff_rotary_forward(self, x, wr, out_dtype):
        return _rotary_kernels().rotary_table_fwd(x, wr, out_dtype)

    def lff_rotary_backward(self, grad, x, wr, need_x, need_wr):
        return _rotary_kernels().rotary_table_bwd(grad, x, wr, need_x, need_wr)

    def apply_lff_rotary_forward(self, q, k, x, wr, layout):
        return _rotary_kernels().rotary_apply_fwd(q, k, x, wr, layout)

    def apply_lff_rotary_backward(self, gq, gk, q, k, x, wr, layout, needs):
        return _rotary_kernels().rotary_apply_bwd(gq, gk, q, k, x, wr, layout, needs)
