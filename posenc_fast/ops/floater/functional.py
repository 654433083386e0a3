"""FLOATER's functional API (``floater``, ``integrate``), its checks, and :func:`solve`,
the one path from checked arguments to the custom ops (implementation, tape, tracing)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ... import _checks, _dispatch
from .._custom_ops import autocast_disabled, fast_apply, onnx_exporting, plain_eager_grad
from . import registry, tape
from .op import FLOATER_OP, FLOATER_TAPED, FloaterFunction, FloaterTapedFunction
from .reference import ACTIVATIONS, METHODS, FloaterOptions


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the ODE is integrated in: float32 / float64 as given, float32 for half
    precision (a half-precision state would accumulate rounding over hundreds of steps)."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def is_exporting() -> bool:
    """Whether (non-strict) torch.export traces this call; not torch.compiler.is_exporting(),
    which older dynamo folds to True in every compile (docs/compatibility.md)."""
    return bool(getattr(torch.compiler, "_is_exporting_flag", False))


# -- checks ----------------------------------------------------------------------------


def check_times(times, dtype: torch.dtype, module_p0: Optional[Tensor] = None) -> Tensor:
    """``times`` checked and converted to ``dtype``; on ``module_p0``'s device when given
    (checked before the values are read)."""
    _checks.real_positions("times", times)
    if module_p0 is not None:
        _checks.same_device("the module (p0)", module_p0, times=times)
    if times.dim() != 1:
        raise ValueError(f"times must be a 1-D tensor [L], got shape {list(times.shape)}")
    times = times.to(dtype)
    # One read-back per call (none under torch.compile or on meta); a bad tensor is read
    # again to name the problem.
    if times.numel() and not torch.compiler.is_compiling() and times.device.type != "meta":
        bad = (~torch.isfinite(times)).any() | (times < 0).any() | (times[1:] < times[:-1]).any()
        if bool(bad):
            if not bool(torch.isfinite(times).all()):
                raise ValueError("times must be finite")
            if bool((times < 0).any()):
                raise ValueError(f"times must be >= 0, got a minimum of {float(times.min()):g}")
            if times.numel() > 1 and bool((times[1:] < times[:-1]).any()):
                j = int(torch.nonzero(times[1:] < times[:-1])[0, 0])
                raise ValueError(
                    f"times must be non-decreasing, but times[{j + 1}] = "
                    f"{float(times[j + 1]):g} < times[{j}] = {float(times[j]):g}"
                )
    return times


def _check_p0_rank(p0: Tensor) -> None:
    if p0.dim() != 2:
        raise ValueError(f"p0 must have shape [S, d] (num_states, dim), got {list(p0.shape)}")


def _check_shapes(p0: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> None:
    """The dynamics' shapes for p0 [S, d] (its rank checked): w1 [d+1, H], b1 [H],
    w2 [H+1, d], b2 [d]."""
    d = p0.shape[1]
    _checks.shape("w1", w1, (d + 1, None), "[d+1, H] with d = p0.shape[1]")
    H = w1.shape[1]
    _checks.shape("b1", b1, (H,), "[H] with H = w1.shape[1]")
    _checks.shape("w2", w2, (H + 1, d), "[H+1, d] with H = w1.shape[1], d = p0.shape[1]")
    _checks.shape("b2", b2, (d,), "[d] with d = p0.shape[1]")


def _check_options(options: FloaterOptions) -> None:
    _checks.positive_int("substeps", options.substeps)
    _checks.choice("method", options.method, METHODS)
    _checks.choice("activation", options.activation, ACTIVATIONS)


def check_dynamics(p0, w1, b1, w2, b2, options: FloaterOptions) -> None:
    """A module's parameters' shapes and device, and the options (dtypes: the module casts)."""
    _check_p0_rank(p0)
    _check_shapes(p0, w1, b1, w2, b2)
    _checks.same_device("p0", p0, w1=w1, b1=b1, w2=w2, b2=b2)
    _check_options(options)


def _check_args(p0, w1, b1, w2, b2, times, options: FloaterOptions) -> Tensor:
    _checks.float_tensor("p0", p0)
    _check_p0_rank(p0)
    for name, t in (("w1", w1), ("b1", b1), ("w2", w2), ("b2", b2)):
        _checks.float_tensor(name, t)
    _check_shapes(p0, w1, b1, w2, b2)
    _checks.tensor("times", times)
    _checks.same_device("p0", p0, w1=w1, b1=b1, w2=w2, b2=b2, times=times)
    _checks.same_dtype("p0", p0, w1=w1, b1=b1, w2=w2, b2=b2)
    _check_options(options)
    return check_times(times, state_dtype(p0.dtype))


# -- the functional API ----------------------------------------------------------------


def floater(
    p0: Tensor,
    w1: Tensor,
    b1: Tensor,
    w2: Tensor,
    b2: Tensor,
    times: Tensor,
    substeps: int = 5,
    method: str = "rk4",
    activation: str = "relu",
    backend: str = "auto",
) -> Tensor:
    """Integrate dp/dt = h(t, p) from p(0) = p0 and return p at ``times``.

    h(t, p) = act(p w1[:d] + t w1[d] + b1) w2[:H] + t w2[H] + b2 (the official code's: t
    joins each layer's input), shared by all states.

    Args:
        p0: initial values [S, d] (one state per block / projection). float32 and float64
            are integrated in their own dtype, float16 and bfloat16 in float32.
        w1 [d+1, H], b1 [H], w2 [H+1, d], b2 [d]: the dynamics, in p0's dtype.
        times: [L] sample times, non-decreasing, >= 0 (any real dtype; converted to the
            dtype of the integration).
        substeps: equal solver steps per interval between consecutive sample times (and
            from 0 to times[0]).
        method: "rk4" (classic Runge-Kutta), "rk38" (3/8 rule; torchdiffeq's "rk4"),
            "midpoint" or "euler".
        activation: "relu", "tanh", "gelu" (erf form) or "identity".
        backend: "auto", "reference", "torch", "cpp" or "cuda".

    Returns:
        [S, L, d] in p0's dtype: out[:, j] = p(times[j]). Gradients (to p0, the weights and
        times) are exact for the discretised solution, memory O(S*L*d); the cpp and cuda
        backends also keep the stage values of a training call (up to
        POSENC_FAST_FLOATER_TAPE_MB, default 1024 MiB; tape.py) for a cheaper backward.
        Autocast does not apply (here and in the modules): the dtype follows p0.
    """
    options = FloaterOptions(substeps, method, activation)
    return integrate(p0, w1, b1, w2, b2, times, options, backend)[0].to(p0.dtype)


def integrate(
    p0, w1, b1, w2, b2, times, options: FloaterOptions, backend: str
) -> tuple[Tensor, str]:
    """(out in :func:`state_dtype` of p0's dtype, name of the implementation that ran
    it): what :func:`floater` computes, its arguments checked."""
    times = _check_args(p0, w1, b1, w2, b2, times, options)
    return solve(p0, w1, b1, w2, b2, times, options, backend)


# -- the one solve path ----------------------------------------------------------------


def solve(p0, w1, b1, w2, b2, times, options: FloaterOptions, backend: str) -> tuple[Tensor, str]:
    """(states at ``times`` [S, L, d], the implementation's name) of checked arguments:
    every integration that may need a graph. Chooses the implementation once; a training
    call on one with a taped forward keeps a tape."""
    # Half-precision weights: integrate in float32 (differentiable casts).
    p0, w1, b1, w2, b2 = (t.to(times.dtype) for t in (p0, w1, b1, w2, b2))
    if torch.compiler.is_compiling():
        return _traced(p0, w1, b1, w2, b2, times, options, backend)
    impl = registry.implementation(backend, p0, w1, times, options)
    if impl.backward is None:  # the reference: autograd differentiates its loop
        return impl.forward(p0, w1, b1, w2, b2, times, options), impl.name
    args = (p0, w1, b1, w2, b2, times, *options, impl.name)
    grad = plain_eager_grad(args)
    if grad is False:  # no graph wanted: the implementation itself
        with autocast_disabled(p0.device.type):
            return impl.forward(p0, w1, b1, w2, b2, times, options), impl.name
    intervals = 0
    if tape.wanted(impl, p0, w1, b1, w2, b2, times) and not torch.jit.is_tracing():
        intervals = tape.intervals(p0, w1, times, options)
    if grad:  # plain tensors in plain eager mode: the Functions, without the ops' dispatch
        if intervals:
            return fast_apply(FloaterTapedFunction)(*args, intervals)[0], impl.name
        return fast_apply(FloaterFunction)(*args), impl.name
    # Tracers, modes, subclasses, a profiler: the ops (ONNX: the plain-ATen composition).
    if onnx_exporting():
        return FloaterFunction.onnx(*args[:-1]), impl.name
    if intervals:
        return FLOATER_TAPED(*args, intervals)[0], impl.name
    return FLOATER_OP(*args), impl.name


def _traced(p0, w1, b1, w2, b2, times, options: FloaterOptions, backend: str):
    """:func:`solve` while compile / export traces: the reference runs itself; the op gets
    the caller's request (chosen when it runs, registry.in_op), except a taping training
    call, chosen while dynamo traces (registry.traced_name). Export keeps the plain op."""
    named = registry.named(backend)
    if named is not None and named.backward is None:
        return named.forward(p0, w1, b1, w2, b2, times, options), named.name
    _dispatch.validate_name(backend)
    args = (p0, w1, b1, w2, b2, times, *options)
    if onnx_exporting():
        return FloaterFunction.onnx(*args), backend
    if not is_exporting():
        name = registry.traced_name(backend, p0.device.type, p0.dtype, *options)
        impl = registry.FLOATER.get(name)
        if (
            impl is not None
            and tape.wanted(impl, p0, w1, b1, w2, b2, times)
            and registry.within_limits(impl, p0, w1)
        ):
            intervals = tape.intervals(p0, w1, times, options)
            if intervals:
                return FLOATER_TAPED(*args, name, intervals)[0], name
    return FLOATER_OP(*args, backend), backend


def without_op(backend: str) -> bool:
    """Whether ``backend`` names the reference (runs without the ops; nothing to cache)."""
    impl = registry.named(backend)
    return impl is not None and impl.backward is None
