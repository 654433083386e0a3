"""The "cpp" and "cuda" backends: the compiled extension (csrc/), which implements the
FLOATER integrator (forward and discrete-adjoint backward) as the low-level ops
``posenc_fast::floater_integrate`` / ``floater_integrate_backward``: defined with their CPU
kernels by posenc_fast._C ("cpp" needs only that module), with CUDA kernels registered by
posenc_fast._C_cuda ("cuda" needs both). The autograd-carrying op posenc_fast::floater
(ops/floater.py) calls them here.

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
    summary = "C++ CPU kernels of the compiled extension (FLOATER integrator)"
    SUPPORT = {
        "floater": OpSupport(
            devices=("cpu",),
            dtypes=(torch.float32, torch.float64),
            options={"method": METHODS, "activation": ACTIVATIONS},
        ),
    }

    def environment_reasons(self) -> list[str]:
        return _extension.reasons()


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
