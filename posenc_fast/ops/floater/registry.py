"""Who implements FLOATER (backend name -> SUPPORT table + functions), and which
implementation runs a call: decided here only."""

# Every implementation has
#     forward(p0, w1, b1, w2, b2, times, options) -> out [S, L, d]
#     backward(grad, out, p0, w1, b1, w2, b2, times, options, needs, tape=None)
#         -> [dp0, dw1, db1, dw2, db2, dtimes], None where not needed: the discrete adjoint
# (the reference only ``forward``); ``options``: a FloaterOptions. "cpp" and "cuda" also
#     forward_taped(p0, w1, b1, w2, b2, times, options, intervals) -> (out, tape)
# keeping the first ``intervals`` intervals' stage values for backward(tape=) (tape.py).
#
# The extension's ops ``posenc_fast::floater_integrate[_backward][_taped]`` are defined with
# CPU kernels by posenc_fast._C; posenc_fast._C_cuda registers CUDA kernels ("cuda" needs
# both). The ``torch`` backend uses CUDA graphs on CUDA tensors (graphed.py).

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ... import _dispatch
from ..._dispatch import ANY, Implementation, OpSupport, Problem, extension_ops, register
from . import graphed, reference
from .reference import ACTIVATIONS, METHODS, FloaterOptions

_STATE_DTYPES = (torch.float32, torch.float64)
_ANY_DEVICE = OpSupport(devices=ANY, dtypes=_STATE_DTYPES)
# The CUDA kernels' limit on d and H (dynamics in a team's shared memory, the rest from L2).
CUDA_MAX_DIM = 4096


def _scalars(options: FloaterOptions) -> tuple:
    return int(options.substeps), str(options.method), str(options.activation)


@dataclass
class FloaterImplementation(Implementation):
    """A FLOATER implementation; ``forward_taped`` where it has a taped forward."""

    forward_taped: Optional[Callable] = None


def _extension(backend: str) -> FloaterImplementation:
    """The extension's integrator, run by ``backend``'s parts ("cpp" or "cuda")."""

    def forward(p0, w1, b1, w2, b2, times, options: FloaterOptions):
        return extension_ops(backend).floater_integrate(
            p0, w1, b1, w2, b2, times, *_scalars(options)
        )

    def backward(
        grad, out, p0, w1, b1, w2, b2, times, options: FloaterOptions, needs, tape=None
    ) -> list[Optional[torch.Tensor]]:
        needs = [bool(n) for n in needs]
        args = (grad, out, p0, w1, b1, w2, b2, times, *_scalars(options), needs)
        ops = extension_ops(backend)
        if tape is None:
            grads = ops.floater_integrate_backward(*args)
        else:
            grads = ops.floater_integrate_backward_taped(*args, tape)
        return [g if n else None for g, n in zip(grads, needs)]

    def forward_taped(p0, w1, b1, w2, b2, times, options: FloaterOptions, intervals: int):
        return extension_ops(backend).floater_integrate_taped(
            p0, w1, b1, w2, b2, times, *_scalars(options), intervals
        )

    support = OpSupport(devices=("cpu",), dtypes=_STATE_DTYPES, options=_OPTIONS)
    if backend == "cuda":
        support = OpSupport(
            devices=("cuda",),
            dtypes=_STATE_DTYPES,
            max_sizes={"dim": CUDA_MAX_DIM, "hidden_dim": CUDA_MAX_DIM},
            options=_OPTIONS,
        )
    return FloaterImplementation(backend, support, forward, backward, forward_taped)


_OPTIONS = {"method": METHODS, "activation": ACTIVATIONS}

FLOATER = register(
    "floater",
    FloaterImplementation("reference", _ANY_DEVICE, reference.forward),
    FloaterImplementation("torch", _ANY_DEVICE, graphed.forward, graphed.backward),
    _extension("cpp"),
    _extension("cuda"),
)


# -- which implementation runs a call: decided here, and only here ---------------------
# Eager: chosen once in the API, the op gets the name. Traced: dynamo cannot choose (the
# dispatcher may load the extension under a lock), so the op gets the request and
# :func:`in_op` resolves it when it runs; whether a compiled training call tapes is decided
# while tracing by :func:`traced_name` (a constant to dynamo) and :func:`within_limits`.


def problem_of(device: str, dtype: torch.dtype, sizes, options: FloaterOptions) -> Problem:
    """What the dispatcher decides a FLOATER call on: sizes = (S, d, H, L), or None when
    they are not known as numbers (no size limit is checked then)."""
    names = ("num_states", "dim", "hidden_dim", "length")
    known = {} if sizes is None else dict(zip(names, sizes), substeps=options.substeps)
    return Problem(
        op="floater",
        device=device,
        dtype=dtype,
        sizes=known,
        options={"method": options.method, "activation": options.activation},
    )


def choose(backend: str, device: str, dtype: torch.dtype, options: FloaterOptions, sizes=None):
    """The implementation that runs a FLOATER call with ``backend`` on device and dtype
    (BackendError explains a refusal)."""
    return _dispatch.choose(FLOATER, problem_of(device, dtype, sizes, options), backend)


def implementation(backend: str, p0, w1, times, options: FloaterOptions) -> Implementation:
    """:func:`choose` for a call on these tensors (their sizes' limits checked too)."""
    sizes = (p0.shape[0], p0.shape[1], w1.shape[1], times.shape[0])
    return choose(backend, p0.device.type, p0.dtype, options, sizes)


def in_op(backend: str, p0, w1, times, options: FloaterOptions) -> Implementation:
    """The implementation an op's body runs: the one ``backend`` names, or for "auto" (a
    traced call) the one :func:`implementation` chooses now."""
    if backend == "auto":
        return implementation(backend, p0, w1, times, options)
    return FLOATER[backend]


@torch._dynamo.assume_constant_result
def traced_name(backend, device, dtype, substeps, method, activation) -> str:
    """The name :func:`choose` gives a call torch.compile traces, without its sizes; ""
    when it refuses. :func:`within_limits` then checks the sizes."""
    try:
        return choose(backend, device, dtype, FloaterOptions(substeps, method, activation)).name
    except (_dispatch.BackendError, ValueError):
        return ""


def within_limits(impl: Implementation, p0, w1) -> bool:
    """Whether ``impl``'s dim / hidden_dim limits admit p0 [S, d], w1 [d+1, H] (a guard
    for symbolic sizes)."""
    limits, dim, hidden = impl.support.max_sizes, p0.shape[1], w1.shape[1]
    return dim <= limits.get("dim", dim) and hidden <= limits.get("hidden_dim", hidden)


def named(backend: str) -> Optional[Implementation]:
    """The implementation ``backend`` names (after POSENC_FAST_BACKEND), None for "auto":
    what is known before the inputs are."""
    return FLOATER.get(_dispatch.resolve_env(backend))
