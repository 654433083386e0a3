"""torch.library custom ops for FLOATER.

    posenc_fast::floater(p0, w1, b1, w2, b2, times, substeps, method, activation, backend)
        -> out [S, L, d]
    posenc_fast::floater_backward(grad, out, p0, w1, b1, w2, b2, times, substeps, method,
                                  activation, backend, needs)
        -> [dp0, dw1, db1, dw2, db2, dtimes]   (empty tensors where needs[i] is False)
    posenc_fast::floater_cached(p0, w1, b1, w2, b2, times, substeps, method, activation,
                                backend, cache_id, mode) -> out [S, L, d]
        floater(...) served from the cache of the Floater module with this id: what a
        compiled eval-mode Floater calls (posenc_fast/_floater_cache.py)

``backend`` names the implementation, chosen by the dispatcher before the call (or "auto"
in calls traced by torch.compile, resolved by the op when it runs). The
autograd registration saves the inputs and the output: the states at the sample times are
all the backward (the discrete adjoint) needs, since it recomputes each interval's
substeps from its starting state. When a double backward is requested (grad mode on
inside backward), the gradient is instead built by differentiating the reference
integrator run in the inputs' dtype, so gradgradcheck works.
"""

from __future__ import annotations

import contextlib
from typing import List  # noqa: UP035 (torch 2.5, see ops/__init__.py)

import torch
from torch import Tensor

from .. import _floater_cache, backends
from ..backends import Problem
from ..reference import floater as _reference
from ._autocast import autocast_disabled
from ._common import differentiable_grads


def problem(
    p0: Tensor, w1: Tensor, times: Tensor, substeps: int, method: str, activation: str
) -> Problem:
    """What the dispatcher decides a FLOATER call on."""
    return Problem(
        op="floater",
        device=p0.device.type,
        dtype=p0.dtype,
        sizes={
            "num_states": p0.shape[0],
            "dim": p0.shape[1],
            "hidden_dim": w1.shape[1],
            "length": times.shape[0],
            "substeps": substeps,
        },
        options={"method": method, "activation": activation},
    )


def _backend(name: str, p0, w1, times, substeps, method, activation):
    """The backend object; "auto" (passed by calls traced by torch.compile) is resolved
    here, where the tensors are real."""
    if name == "auto":
        name = backends.choose(problem(p0, w1, times, substeps, method, activation), "auto")
    return backends.get(name)


@torch.library.custom_op("posenc_fast::floater", mutates_args=())
def floater_op(
    p0: Tensor,
    w1: Tensor,
    b1: Tensor,
    w2: Tensor,
    b2: Tensor,
    times: Tensor,
    substeps: int,
    method: str,
    activation: str,
    backend: str,
) -> Tensor:
    with autocast_disabled(p0.device.type):
        impl = _backend(backend, p0, w1, times, substeps, method, activation)
        return impl.floater_forward(p0, w1, b1, w2, b2, times, substeps, method, activation)


def _states_like(p0: Tensor, times: Tensor) -> Tensor:
    """An empty [S, L, d] result: the fake (shape-only) kernel of the forward ops."""
    return p0.new_empty((p0.shape[0], times.shape[0], p0.shape[1]))


@floater_op.register_fake
def _(p0, w1, b1, w2, b2, times, substeps, method, activation, backend):
    return _states_like(p0, times)


@torch.library.custom_op("posenc_fast::floater_backward", mutates_args=())
def floater_backward_op(
    grad: Tensor,
    out: Tensor,
    p0: Tensor,
    w1: Tensor,
    b1: Tensor,
    w2: Tensor,
    b2: Tensor,
    times: Tensor,
    substeps: int,
    method: str,
    activation: str,
    backend: str,
    needs: List[bool],  # noqa: UP006
) -> List[Tensor]:  # noqa: UP006
    with autocast_disabled(p0.device.type):
        impl = _backend(backend, p0, w1, times, substeps, method, activation)
        grads = impl.floater_backward(
            grad, out, p0, w1, b1, w2, b2, times, substeps, method, activation, needs
        )
    return [g if g is not None else grad.new_empty(0) for g in grads]


@floater_backward_op.register_fake
def _(grad, out, p0, w1, b1, w2, b2, times, substeps, method, activation, backend, needs):
    refs = (p0, w1, b1, w2, b2, times)
    return [torch.empty_like(t) if need else grad.new_empty(0) for need, t in zip(needs, refs)]


def gradients(grad, out, inputs, substeps, method, activation, backend, needs) -> list:
    """(dp0, dw1, db1, dw2, db2, dtimes) of ``out`` = floater(*inputs, ...), None where
    ``needs`` is False. Used by the op's autograd registration and by the module's cache,
    which attaches this backward to stored states."""
    if not any(needs):
        return [None] * 6
    if torch.is_grad_enabled():
        # The reference integrated in the inputs' dtype: differentiable by autograd, and
        # its L = 0 result still has a graph to every input.
        return differentiable_grads(
            lambda: _reference.floater(
                *inputs, substeps, method, activation, None, inputs[0].dtype
            ),
            inputs,
            needs,
            grad,
            zero_fill=True,
        )
    grads = torch.ops.posenc_fast.floater_backward(
        grad, out, *inputs, substeps, method, activation, backend, needs
    )
    return [g if n else None for g, n in zip(grads, needs)]


def _setup_context(ctx, inputs, output):
    p0, w1, b1, w2, b2, times, substeps, method, activation, backend = inputs
    ctx.save_for_backward(p0, w1, b1, w2, b2, times, output)
    ctx.substeps, ctx.method, ctx.activation, ctx.backend = substeps, method, activation, backend


def _backward(ctx, grad):
    *inputs, out = ctx.saved_tensors
    needs = [bool(n) for n in ctx.needs_input_grad[:6]]
    grads = gradients(
        grad, out, inputs, ctx.substeps, ctx.method, ctx.activation, ctx.backend, needs
    )
    return (*grads, None, None, None, None)


floater_op.register_autograd(_backward, setup_context=_setup_context)


def _integrator(substeps: int, method: str, activation: str) -> _floater_cache.Integrate:
    def integrate(inputs, times, backend):
        impl = _backend(backend, inputs[0], inputs[1], times, substeps, method, activation)
        return impl.floater_forward(*inputs, times, substeps, method, activation), impl.name

    return integrate


# The op reads its cache's state on the host (value comparisons), which a captured CUDA
# graph would skip on replay: where torch has the tag, compiled code never graphs it.
_UNSAFE_IN_CUDA_GRAPHS = getattr(torch.Tag, "cudagraph_unsafe", None)
_TAGS = {"tags": (_UNSAFE_IN_CUDA_GRAPHS,)} if _UNSAFE_IN_CUDA_GRAPHS is not None else {}


@torch.library.custom_op("posenc_fast::floater_cached", mutates_args=(), **_TAGS)
def floater_cached_op(
    p0: Tensor,
    w1: Tensor,
    b1: Tensor,
    w2: Tensor,
    b2: Tensor,
    times: Tensor,
    substeps: int,
    method: str,
    activation: str,
    backend: str,
    cache_id: int,
    mode: str,
) -> Tensor:
    inputs = (p0, w1, b1, w2, b2)
    integrate = _integrator(substeps, method, activation)
    cache = _floater_cache.find(cache_id)
    with autocast_disabled(p0.device.type), _outside_inference_mode():
        if cache is None:  # the module is gone: nothing to keep the result for
            return integrate(inputs, times, backend)[0]
        config_key = _floater_cache.key(inputs, substeps, method, activation, backend)
        values, _ = _floater_cache.cached_states(cache, mode, inputs, times, config_key, integrate)
        # A copy: compiled code may write into an op's output buffer once it is dead, and
        # the stored states must stay as they are.
        return values.clone()


def _outside_inference_mode():
    # Tensors made in inference mode have no version counter, which the cache needs to
    # notice edits of what it handed out (the eager module does the same).
    if torch.is_inference_mode_enabled():
        return torch.inference_mode(False)
    return contextlib.nullcontext()


@floater_cached_op.register_fake
def _(p0, w1, b1, w2, b2, times, substeps, method, activation, backend, cache_id, mode):
    return _states_like(p0, times)


def _backward_cached(ctx, grad):
    return (*_backward(ctx, grad), None, None)


def _setup_cached(ctx, inputs, output):
    _setup_context(ctx, inputs[:10], output)


floater_cached_op.register_autograd(_backward_cached, setup_context=_setup_cached)
