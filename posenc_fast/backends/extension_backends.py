"""The "cpp" and "cuda" backends: the compiled extension (csrc/), which implements
- the FLOATER integrator (forward and discrete-adjoint backward) as the low-level ops
  ``posenc_fast::floater_integrate`` / ``floater_integrate_backward``: defined with their
  CPU kernels by posenc_fast._C ("cpp" needs only that module), with CUDA kernels
  registered by posenc_fast._C_cuda ("cuda" needs both);
- learnable Fourier features and the sinusoidal / DFT encodings (with the fused add), CPU
  kernels in posenc_fast._C (csrc/fourier/): ``lff_kernel`` / ``lff_kernel_backward``,
  ``encoding_kernel``, ``encoding_add_kernel``, ``encoding_kernel_backward``;
- the rotary table and its fused application to q and k (LightGlue's layout),
  ``lff_rotary_kernel`` / ``apply_lff_rotary_kernel`` and their ``_backward`` ops. Same phase
  math as the Triton kernels (float32 with the error-free reduction of
  triton_kernels/_phase.py), float32 arithmetic for bfloat16 / float16 inputs and outputs,
  one parallel region per call, bitwise-deterministic for any thread count; float64 stays
  on the torch backend.
The autograd-carrying ops (ops/floater.py, ops/fourier_features.py, ops/encodings.py) call
them here.

Both backends are optional: when a module is missing, failed to build, was built for
another torch, or (cuda) there is no device, ``environment_reasons`` says why, "auto" falls
back to the torch backend and warns once, and ``python -m posenc_fast info`` shows it.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from .. import _extension
from ..reference.floater import ACTIVATIONS, METHODS
from . import _base
from ._base import Backend, OpSupport

# The CUDA kernels compile in CI (tools/check_cuda_compile.sh) but have not yet run the
# test matrix on a GPU. Until they have, they are used only when asked for explicitly:
# POSENC_FAST_CUDA_UNVALIDATED=1 (e.g. the H200 validation run) lifts the gate.
CUDA_VALIDATED = False
CUDA_GATE_ENV = "POSENC_FAST_CUDA_UNVALIDATED"
# The CUDA kernels hold the dynamics in shared memory split across thread blocks (and
# stream them from L2 beyond that); d and H up to this limit.
CUDA_MAX_DIM = 4096

_HALF_AND_SINGLE = (torch.float32, torch.bfloat16, torch.float16)
_INTEGERS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_ROTARY = OpSupport(
    devices=("cpu",),
    dtypes=_HALF_AND_SINGLE,
    input_dtypes={"x": _HALF_AND_SINGLE, "wr": _HALF_AND_SINGLE},
)


def _call_args(p0, w1, b1, w2, b2, times, substeps, method, activation):
    return (p0, w1, b1, w2, b2, times, int(substeps), str(method), str(activation))


class _ExtensionBackend(Backend):
    warn_when_unavailable = True
    parts: tuple[str, ...] = ("cpu",)  # the extension's modules this backend needs

    def _ops(self):
        for part in self.parts:
            if _extension.load(part) is None:
                why = "; ".join(self.environment_reasons())
                raise RuntimeError(f"posenc_fast: backend {self.name!r} is unavailable: {why}")
        return torch.ops.posenc_fast

    def floater_forward(
        self, p0, w1, b1, w2, b2, times, substeps: int, method: str, activation: str
    ):
        """out [S, L, d] = p at times; see posenc_fast/reference/floater.py for the semantics."""
        return self._ops().floater_integrate(
            *_call_args(p0, w1, b1, w2, b2, times, substeps, method, activation)
        )

    def floater_backward(
        self,
        grad,
        out,
        p0,
        w1,
        b1,
        w2,
        b2,
        times,
        substeps: int,
        method: str,
        activation: str,
        needs,
    ) -> list[Optional[torch.Tensor]]:
        """[dp0, dw1, db1, dw2, db2, dtimes] (None where not needed): the discrete adjoint."""
        needs = [bool(n) for n in needs]
        grads = self._ops().floater_integrate_backward(
            grad, out, *_call_args(p0, w1, b1, w2, b2, times, substeps, method, activation), needs
        )
        return [g if n else None for g, n in zip(grads, needs)]


class CppBackend(_ExtensionBackend):
    name = "cpp"
    summary = "C++ CPU kernels of the extension (FLOATER integrator, LFF, encodings, rotary)"
    SUPPORT = {
        "floater": OpSupport(
            devices=("cpu",),
            dtypes=(torch.float32, torch.float64),
            options={"method": METHODS, "activation": ACTIVATIONS},
        ),
        # float32 arithmetic throughout: float64 weights or positions go to the torch backend.
        "lff": OpSupport(
            devices=("cpu",),
            dtypes=_HALF_AND_SINGLE,
            options={"activation": ("gelu", "gelu_tanh", "relu")},
            input_dtypes={"x": _HALF_AND_SINGLE},
        ),
        "encoding": OpSupport(
            devices=("cpu",),
            dtypes=_HALF_AND_SINGLE,
            options={"kind": ("sinusoidal", "dft")},
            input_dtypes={"positions": _HALF_AND_SINGLE + _INTEGERS},
        ),
        # float64 positions or frequencies would lose their precision in the float32
        # phases: the torch backend takes those (as for the Triton kernels).
        "lff_rotary": _ROTARY,
        "apply_lff_rotary": _ROTARY,
    }

    def environment_reasons(self) -> list[str]:
        return _extension.reasons()

    # ------------------------------------------------------------------ lff
    def lff_forward(self, x, wr, w1, b1, w2, b2, activation: str, out_dtype: torch.dtype):
        """x [..., G, M] -> [..., G * Dg] (features [..., G * F] without w1..b2)."""
        return self._ops().lff_kernel(x, wr, w1, b1, w2, b2, str(activation), out_dtype)

    def lff_backward(
        self, grad, x, wr, w1, b1, w2, b2, activation: str, needs
    ) -> list[Optional[torch.Tensor]]:
        """(dx, dwr, dw1, db1, dw2, db2); None where not needed (or the weight is absent)."""
        needs = [bool(n) for n in needs]
        grads = self._ops().lff_kernel_backward(grad, x, wr, w1, b1, w2, b2, str(activation), needs)
        refs = (x, wr, w1, b1, w2, b2)
        return [g if n and r is not None else None for g, n, r in zip(grads, needs, refs)]

    # ------------------------------------------------------------------ encodings
    def encoding_forward(self, positions, dim, kind, base, block, out_dtype):
        block = None if block is None else float(block)
        return self._ops().encoding_kernel(
            positions, int(dim), str(kind), float(base), block, out_dtype
        )

    def encoding_add(self, x, positions, kind, base, block):
        block = None if block is None else float(block)
        return self._ops().encoding_add_kernel(x, positions, str(kind), float(base), block)

    def encoding_backward(self, grad, positions, dim, kind, base):
        return self._ops().encoding_kernel_backward(
            grad, positions, int(dim), str(kind), float(base)
        )

    # ------------------------------------------------------------------ rotary
    def lff_rotary_forward(self, x, wr, out_dtype):
        """x [..., M] -> [2, ..., F]: cos, then sin, each on two neighbouring channels."""
        return self._ops().lff_rotary_kernel(x, wr, out_dtype)

    def lff_rotary_backward(self, grad, x, wr, need_x: bool, need_wr: bool):
        dx, dwr = self._ops().lff_rotary_kernel_backward(grad, x, wr, bool(need_x), bool(need_wr))
        return (dx if need_x else None), (dwr if need_wr else None)

    def apply_lff_rotary_forward(self, q, k, x, wr, layout: str):
        """(q', k') in q's dtype, contiguous in the layout of q and k."""
        oq, ok = self._ops().apply_lff_rotary_kernel(q, k, x, wr, str(layout))
        return oq, ok

    def apply_lff_rotary_backward(self, gq, gk, q, k, x, wr, layout: str, needs):
        """[dq, dk, dx, dwr]; None where not needed."""
        needs = [bool(n) for n in needs]
        grads = self._ops().apply_lff_rotary_kernel_backward(
            gq, gk, q, k, x, wr, str(layout), needs
        )
        return [g if n else None for g, n in zip(grads, needs)]


class CudaBackend(_ExtensionBackend):
    name = "cuda"
    parts = ("cpu", "cuda")
    summary = "CUDA kernels of the compiled extension (FLOATER integrator, one persistent launch)"
    SUPPORT = {
        "floater": OpSupport(
            devices=("cuda",),
            dtypes=(torch.float32, torch.float64),
            max_sizes={"dim": CUDA_MAX_DIM, "hidden_dim": CUDA_MAX_DIM},
            options={"method": METHODS, "activation": ACTIVATIONS},
        ),
    }

    def environment_reasons(self) -> list[str]:
        for part in self.parts:  # the CPU module defines the ops, the CUDA one implements them
            reasons = _extension.reasons(part)
            if reasons:
                return reasons
        if not torch.cuda.is_available():
            return ["no CUDA device available"]
        too_old = _base.capability_reasons((7, 0))
        if too_old:  # an environment reason: "auto" warns and info shows it
            return too_old
        if not CUDA_VALIDATED and os.environ.get(CUDA_GATE_ENV, "") in ("", "0"):
            return [
                "the CUDA kernels have not passed the test matrix on a GPU yet; "
                f"set {CUDA_GATE_ENV}=1 to use them"
            ]
        return []
