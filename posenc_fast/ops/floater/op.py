"""FLOATER's custom ops and the autograd.Functions of their eager path

    posenc_fast::floater(p0, w1, b1, w2, b2, times, substeps, method, activation, backend)
        -> out [S, L, d]
    posenc_fast::floater_taped(..., backend, intervals) -> (out, tape)
    posenc_fast::floater_cached(..., backend, cache_id, mode) -> out   (torch.compile only)
    posenc_fast::floater_backward(grad, out, ..., backend, needs, tape?)
        -> [dp0, dw1, db1, dw2, db2, dtimes]   (empty tensors where needs[i] is False)

Schemas: reference.TENSORS and FloaterOptions' fields. ``backend``: the API's choice, or
the caller's request in a traced call (registry.in_op). The backward is the discrete
adjoint (reading the taped form's tape, tape.py); a double backward differentiates the
reference's loop.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..._dispatch import BackendError
from .._custom_ops import autocast_disabled, custom_op, differentiable_grads, direct_call_ok
from . import cache as _cache
from . import reference
from . import tape as _tape
from .reference import FloaterOptions
from .registry import FLOATER, in_op

# The schema types of FloaterOptions' fields (infer_schema's spelling: int is SymInt).
_SCHEMA_TYPES = {int: "SymInt", str: "str"}


def _schema(returns: str, before: str = "", after: str = "") -> str:
    """An op's schema: ``before``, the ten arguments every FLOATER op takes, ``after``."""
    call = [f"Tensor {name}" for name in reference.TENSORS]
    call += [f"{_SCHEMA_TYPES[type(v)]} {n}" for n, v in FloaterOptions._field_defaults.items()]
    call.append("str backend")
    args = ", ".join(part for part in (before, ", ".join(call), after) if part)
    return f"({args}) -> {returns}"


def _states_like(p0: Tensor, times: Tensor) -> Tensor:
    """An empty [S, L, d] result: the fake (shape-only) kernel of the forward ops."""
    return p0.new_empty((p0.shape[0], times.shape[0], p0.shape[1]))


# -- backward ------------------------------------------------------------------------------


def floater_backward(
    grad, out, p0, w1, b1, w2, b2, times, substeps, method, activation, backend, needs, tape
) -> list[Tensor]:
    options = FloaterOptions(substeps, method, activation)
    with autocast_disabled(p0.device.type):
        impl = in_op(backend, p0, w1, times, options)
        grads = impl.backward(grad, out, p0, w1, b1, w2, b2, times, options, needs, tape)
    return [g if g is not None else grad.new_empty(0) for g in grads]


def _backward_fake(
    grad, out, p0, w1, b1, w2, b2, times, substeps, method, activation, backend, needs, tape
):
    refs = (p0, w1, b1, w2, b2, times)
    return [torch.empty_like(t) if need else grad.new_empty(0) for need, t in zip(needs, refs)]


FLOATER_BACKWARD = custom_op(
    "floater_backward",
    floater_backward,
    _backward_fake,
    schema=_schema(
        "Tensor[]", before="Tensor grad, Tensor out", after="bool[] needs, Tensor? tape"
    ),
)


def gradients(grad, out, inputs, options: FloaterOptions, backend: str, needs, tape=None) -> list:
    """(dp0, dw1, db1, dw2, db2, dtimes) of ``out`` = floater(*inputs, options), None where
    not needed: the backward of every Function and op here."""
    if not any(needs):
        return [None] * 6
    if torch.is_grad_enabled():
        # A double backward: the reference integrated in the inputs' dtype, which autograd
        # differentiates (its L = 0 result still has a graph to every input).
        return differentiable_grads(
            lambda: reference.floater(*inputs, *options, compute_dtype=inputs[0].dtype),
            inputs,
            needs,
            grad,
            zero_fill=True,
        )
    args = (grad, out, *inputs, *options, backend, needs, tape)
    grads = floater_backward(*args) if direct_call_ok(*args) else FLOATER_BACKWARD(*args)
    return [g if n else None for g, n in zip(grads, needs)]


# -- posenc_fast::floater ------------------------------------------------------------------


def floater(p0, w1, b1, w2, b2, times, substeps, method, activation, backend) -> Tensor:
    options = FloaterOptions(substeps, method, activation)
    with autocast_disabled(p0.device.type):
        impl = in_op(backend, p0, w1, times, options)
        return impl.forward(p0, w1, b1, w2, b2, times, options)


def _floater_fake(p0, w1, b1, w2, b2, times, substeps, method, activation, backend):
    return _states_like(p0, times)


def _setup_context(ctx, inputs, output):
    p0, w1, b1, w2, b2, times, substeps, method, activation, backend = inputs[:10]
    ctx.save_for_backward(p0, w1, b1, w2, b2, times, output)
    ctx.options, ctx.backend = FloaterOptions(substeps, method, activation), backend


class FloaterFunction(torch.autograd.Function):
    """p0 [S, d], the dynamics, times [L] -> the states at the times [S, L, d]."""

    @staticmethod
    def forward(ctx, p0, w1, b1, w2, b2, times, substeps, method, activation, backend):
        options = FloaterOptions(substeps, method, activation)
        with autocast_disabled(p0.device.type):
            out = FLOATER[backend].forward(p0, w1, b1, w2, b2, times, options)
        ctx.save_for_backward(p0, w1, b1, w2, b2, times, out)
        ctx.options, ctx.backend = options, backend
        return out

    @staticmethod
    def backward(ctx, grad):
        *inputs, out = ctx.saved_tensors
        needs = [bool(n) for n in ctx.needs_input_grad[:6]]
        grads = gradients(grad, out, inputs, ctx.options, ctx.backend, needs)
        return (*grads, None, None, None, None)

    @staticmethod
    def onnx(p0, w1, b1, w2, b2, times, substeps, method, activation):
        """What an ONNX export traces: the reference's loop unrolled in the state dtype (a
        static length; deployed modules freeze() instead)."""
        args = (p0, w1, b1, w2, b2, times, substeps, method, activation)
        return reference.floater(*args, compute_dtype=p0.dtype)


FLOATER_OP = custom_op(
    "floater",
    floater,
    _floater_fake,
    schema=_schema("Tensor"),
    backward=FloaterFunction.backward,
    setup_context=_setup_context,
)


# -- posenc_fast::floater_taped: the forward that keeps the stage values (tape.py) ----------


def floater_taped(
    p0, w1, b1, w2, b2, times, substeps, method, activation, backend, intervals
) -> tuple[Tensor, Tensor]:
    options = FloaterOptions(substeps, method, activation)
    with autocast_disabled(p0.device.type):
        impl = in_op(backend, p0, w1, times, options)
        if impl.forward_taped is None:
            raise BackendError(f"posenc_fast: backend {impl.name!r} has no taped forward")
        return impl.forward_taped(p0, w1, b1, w2, b2, times, options, intervals)


def _floater_taped_fake(
    p0, w1, b1, w2, b2, times, substeps, method, activation, backend, intervals
):
    options = FloaterOptions(substeps, method, activation)
    n = _tape.numel(p0.shape[0], p0.shape[1], w1.shape[1], intervals, options)
    return _states_like(p0, times), p0.new_empty(n)


def _setup_taped(ctx, inputs, output):
    out, tape = output
    ctx.mark_non_differentiable(tape)
    _setup_context(ctx, inputs, out)
    ctx.tape = tape  # made by the op, read once by its backward


class FloaterTapedFunction(torch.autograd.Function):
    """:class:`FloaterFunction` that also returns the tape of its first ``intervals``
    intervals, which its backward reads instead of integrating them again."""

    @staticmethod
    def forward(ctx, p0, w1, b1, w2, b2, times, substeps, method, activation, backend, intervals):
        options = FloaterOptions(substeps, method, activation)
        with autocast_disabled(p0.device.type):
            out, tape = FLOATER[backend].forward_taped(
                p0, w1, b1, w2, b2, times, options, intervals
            )
        ctx.mark_non_differentiable(tape)
        ctx.save_for_backward(p0, w1, b1, w2, b2, times, out)
        ctx.options, ctx.backend, ctx.tape = options, backend, tape
        return out, tape

    @staticmethod
    def backward(ctx, grad, _grad_tape):
        *inputs, out = ctx.saved_tensors
        needs = [bool(n) for n in ctx.needs_input_grad[:6]]
        grads = gradients(grad, out, inputs, ctx.options, ctx.backend, needs, ctx.tape)
        return (*grads, None, None, None, None, None)


FLOATER_TAPED = custom_op(
    "floater_taped",
    floater_taped,
    _floater_taped_fake,
    schema=_schema("(Tensor, Tensor)", after="SymInt intervals"),
    backward=FloaterTapedFunction.backward,
    setup_context=_setup_taped,
)


# -- the module's cached states ------------------------------------------------------------


def states_without_graph(impl, inputs, times: Tensor, options: FloaterOptions) -> Tensor:
    """The states at ``times`` without a graph (the result cache's integration): the
    implementation itself in plain eager mode, else the op (for tracers, modes, profiler)."""
    if impl.backward is None:  # the reference: no op
        return impl.forward(*inputs, times, options)
    if direct_call_ok(*inputs, times):
        with autocast_disabled(times.device.type):
            return impl.forward(*inputs, times, options)
    return FLOATER_OP(*inputs, times, *options, impl.name)


class StoredStates(torch.autograd.Function):
    """Cached states ``out`` with the integration's backward attached (each returned tensor
    has a graph of its own)."""

    @staticmethod
    def forward(ctx, out, p0, w1, b1, w2, b2, times, options, backend):
        ctx.save_for_backward(p0, w1, b1, w2, b2, times, out)
        ctx.options, ctx.backend = options, backend
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        *inputs, out = ctx.saved_tensors
        needs = [bool(n) for n in ctx.needs_input_grad[1:7]]
        grads = gradients(grad, out, inputs, ctx.options, ctx.backend, needs)
        return (None, *grads, None, None)


def _states_in_op(impl, inputs, times: Tensor, options: FloaterOptions) -> Tensor:
    """The cached op's integration: inside its body, the implementation itself."""
    return impl.forward(*inputs, times, options)


def floater_cached(
    p0, w1, b1, w2, b2, times, substeps, method, activation, backend, cache_id, mode
) -> Tensor:
    """Under torch.compile: the module's result cache (cache.py), found by its id."""
    inputs = (p0, w1, b1, w2, b2)
    options = FloaterOptions(substeps, method, activation)
    cache = _cache.find(cache_id)
    with autocast_disabled(p0.device.type), _cache.outside_inference_mode():
        if cache is None:  # the module is gone: nothing to keep the result for
            return in_op(backend, p0, w1, times, options).forward(*inputs, times, options)
        values, _ = _cache.cached_states(
            cache, mode, inputs, times, options, backend, _states_in_op
        )
        # A copy: compiled code may reuse a dead output's buffer; the cache must not change.
        return values.clone()


def _floater_cached_fake(
    p0, w1, b1, w2, b2, times, substeps, method, activation, backend, cache_id, mode
):
    return _states_like(p0, times)


def _backward_cached(ctx, grad):
    return (*FloaterFunction.backward(ctx, grad), None, None)  # none for cache_id, mode


# Host reads of the cache's state, which a CUDA graph replay would skip: never graphed.
_UNSAFE_IN_CUDA_GRAPHS = getattr(torch.Tag, "cudagraph_unsafe", None)

FLOATER_CACHED = custom_op(
    "floater_cached",
    floater_cached,
    _floater_cached_fake,
    schema=_schema("Tensor", after="SymInt cache_id, str mode"),
    backward=_backward_cached,
    setup_context=_setup_context,
    tags=(_UNSAFE_IN_CUDA_GRAPHS,) if _UNSAFE_IN_CUDA_GRAPHS is not None else (),
)
