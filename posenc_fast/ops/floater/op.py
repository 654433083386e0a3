"""The torch.library custom ops of FLOATER (floater, floater_taped, floater_backward,
floater_cached) and their autograd: what the public API and the module call, so that
torch.compile, export and ONNX see one op per integration. Every op's schema starts with
the same ten arguments (:func:`_schema`); the Python side passes one FloaterOptions.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from ..._dispatch import Implementation
from .._common import CustomOp, autocast_disabled, differentiable_grads
from . import cache as _cache
from . import reference
from . import tape as _tape
from .reference import FloaterOptions
from .registry import FLOATER, implementation

# The schema types of FloaterOptions' fields (infer_schema's spelling: int is SymInt).
_SCHEMA_TYPES = {int: "SymInt", str: "str"}


def _schema(returns: str, before: str = "", after: str = "") -> str:
    """An op's schema: ``before``, the ten arguments every FLOATER op takes (the tensors
    reference.TENSORS, the fields of FloaterOptions, the backend's name), ``after``.
    Written out rather than inferred from annotations: one definition for every op (and
    torch 2.5's infer_schema read some annotation forms wrongly)."""
    call = [f"Tensor {name}" for name in reference.TENSORS]
    call += [f"{_SCHEMA_TYPES[type(v)]} {n}" for n, v in FloaterOptions._field_defaults.items()]
    call.append("str backend")
    args = ", ".join(part for part in (before, ", ".join(call), after) if part)
    return f"({args}) -> {returns}"


def _in_op(backend: str, p0, w1, times, options) -> Implementation:
    """Inside an op's body: the named implementation, or "auto" (passed by calls traced by
    torch.compile) resolved here, where the tensors are real (registry.implementation:
    the same decision as the API's)."""
    if backend == "auto":
        return implementation(backend, p0, w1, times, options)
    return FLOATER[backend]


def _floater(p0, w1, b1, w2, b2, times, substeps, method, activation, backend) -> Tensor:
    options = FloaterOptions(substeps, method, activation)
    with autocast_disabled(p0.device.type):
        impl = _in_op(backend, p0, w1, times, options)
        return impl.forward(p0, w1, b1, w2, b2, times, options)


def _states_like(p0: Tensor, times: Tensor) -> Tensor:
    """An empty [S, L, d] result: the fake (shape-only) kernel of the forward ops."""
    return p0.new_empty((p0.shape[0], times.shape[0], p0.shape[1]))


def _floater_fake(p0, w1, b1, w2, b2, times, substeps, method, activation, backend):
    return _states_like(p0, times)


def _backward_body(
    grad, out, p0, w1, b1, w2, b2, times, substeps, method, activation, backend, needs, tape
) -> list[Tensor]:
    options = FloaterOptions(substeps, method, activation)
    with autocast_disabled(p0.device.type):
        impl = _in_op(backend, p0, w1, times, options)
        grads = impl.backward(grad, out, p0, w1, b1, w2, b2, times, options, needs, tape)
    return [g if g is not None else grad.new_empty(0) for g in grads]


def _backward_fake(
    grad, out, p0, w1, b1, w2, b2, times, substeps, method, activation, backend, needs, tape
):
    refs = (p0, w1, b1, w2, b2, times)
    return [torch.empty_like(t) if need else grad.new_empty(0) for need, t in zip(needs, refs)]


FLOATER_BACKWARD = CustomOp(
    "posenc_fast::floater_backward",
    _backward_body,
    _backward_fake,
    schema=_schema(
        "Tensor[]", before="Tensor grad, Tensor out", after="bool[] needs, Tensor? tape"
    ),
)


def gradients(grad, out, inputs, options: FloaterOptions, backend: str, needs, tape=None) -> list:
    """(dp0, dw1, db1, dw2, db2, dtimes) of ``out`` = floater(*inputs, options), None where
    ``needs`` is False (``tape``: what floater_taped kept). Used by the ops' autograd
    registrations and by the module's cache, which attaches this backward to stored states."""
    if not any(needs):
        return [None] * 6
    if torch.is_grad_enabled():
        # The reference integrated in the inputs' dtype: differentiable by autograd, and
        # its L = 0 result still has a graph to every input.
        return differentiable_grads(
            lambda: reference.floater(*inputs, *options, None, inputs[0].dtype),
            inputs,
            needs,
            grad,
            zero_fill=True,
        )
    grads = FLOATER_BACKWARD(grad, out, *inputs, *options, backend, needs, tape)
    return [g if n else None for g, n in zip(grads, needs)]


def _setup_context(ctx, inputs, output):
    p0, w1, b1, w2, b2, times, substeps, method, activation, backend = inputs
    ctx.save_for_backward(p0, w1, b1, w2, b2, times, output)
    ctx.options, ctx.backend = FloaterOptions(substeps, method, activation), backend


def _backward(ctx, grad):
    *inputs, out = ctx.saved_tensors
    needs = [bool(n) for n in ctx.needs_input_grad[:6]]
    tape = getattr(ctx, "tape", None)  # floater_taped's context holds its tape (_setup_taped)
    grads = gradients(grad, out, inputs, ctx.options, ctx.backend, needs, tape)
    return (*grads, None, None, None, None)


FLOATER_OP = CustomOp(
    "posenc_fast::floater",
    _floater,
    _floater_fake,
    schema=_schema("Tensor"),
    backward=_backward,
    setup_context=_setup_context,
    op_function="forward",
    impl_args=lambda p0, w1, b1, w2, b2, times, *options: (
        (p0, w1, b1, w2, b2, times, FloaterOptions(*options))
    ),
    # ONNX has no ODE solver: the export unrolls the solver steps (the reference's loop,
    # in the state dtype), so the sequence length is static in the graph and the graph
    # grows with L * substeps. Deployed models freeze() the states instead (api.py).
    onnx=lambda p0, w1, b1, w2, b2, times, substeps, method, activation, backend: reference.floater(
        p0, w1, b1, w2, b2, times, substeps, method, activation, None, p0.dtype
    ),
)


def _floater_taped(
    p0, w1, b1, w2, b2, times, substeps, method, activation, backend, intervals
) -> tuple[Tensor, Tensor]:
    options = FloaterOptions(substeps, method, activation)
    with autocast_disabled(p0.device.type):
        # the dispatcher checks the sizes (a compiled call names its backend while tracing)
        impl = implementation(backend, p0, w1, times, options)
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
    _setup_context(ctx, inputs[:10], out)
    ctx.tape = tape  # made by the op, read once by its backward


def _backward_taped(ctx, grad, _grad_tape):
    return (*_backward(ctx, grad), None)  # and none for intervals


FLOATER_TAPED = CustomOp(
    "posenc_fast::floater_taped",
    _floater_taped,
    _floater_taped_fake,
    schema=_schema("(Tensor, Tensor)", after="SymInt intervals"),
    backward=_backward_taped,
    setup_context=_setup_taped,
)


def integrator(options: FloaterOptions) -> _cache.Integrate:
    """``integrate(inputs, times, backend) -> (states, name of the implementation)``, what
    the cache calls: the implementation's forward itself (no graph: the cache attaches
    the backward)."""

    def integrate(inputs, times, backend):
        impl = _in_op(backend, inputs[0], inputs[1], times, options)
        return impl.forward(*inputs, times, options), impl.name

    return integrate


def _floater_cached(
    p0, w1, b1, w2, b2, times, substeps, method, activation, backend, cache_id, mode
) -> Tensor:
    inputs = (p0, w1, b1, w2, b2)
    options = FloaterOptions(substeps, method, activation)
    integrate = integrator(options)
    cache = _cache.find(cache_id)
    with autocast_disabled(p0.device.type), _outside_inference_mode():
        if cache is None:  # the module is gone: nothing to keep the result for
            return integrate(inputs, times, backend)[0]
        config_key = _cache.key(inputs, options, backend)
        values, _ = _cache.cached_states(cache, mode, inputs, times, config_key, integrate)
        # A copy: compiled code may write into an op's output buffer once it is dead, and
        # the stored states must stay as they are.
        return values.clone()


def _outside_inference_mode():
    # Tensors made in inference mode have no version counter, which the cache needs to
    # notice edits of what it handed out (the eager module does the same).
    if torch.is_inference_mode_enabled():
        return torch.inference_mode(False)
    return contextlib.nullcontext()


def _floater_cached_fake(
    p0, w1, b1, w2, b2, times, substeps, method, activation, backend, cache_id, mode
):
    return _states_like(p0, times)


def _backward_cached(ctx, grad):
    return (*_backward(ctx, grad), None, None)


def _setup_cached(ctx, inputs, output):
    _setup_context(ctx, inputs[:10], output)


# The op reads its cache's state on the host (value comparisons), which a captured CUDA
# graph would skip on replay: where torch has the tag, compiled code never graphs it.
_UNSAFE_IN_CUDA_GRAPHS = getattr(torch.Tag, "cudagraph_unsafe", None)

FLOATER_CACHED = CustomOp(
    "posenc_fast::floater_cached",
    _floater_cached,
    _floater_cached_fake,
    schema=_schema("Tensor", after="SymInt cache_id, str mode"),
    backward=_backward_cached,
    setup_context=_setup_cached,
    tags=(_UNSAFE_IN_CUDA_GRAPHS,) if _UNSAFE_IN_CUDA_GRAPHS is not None else (),
)
