"""FLOATER's public function and modules: argument checks, the call path to the custom
ops, and the modules' cache, refresh and freeze logic."""

# Path of a call: ``floater`` (checks) -> the dispatcher picks an implementation from the
# registry (registry.py) -> the custom op ``posenc_fast::floater`` (op.py) -> the
# implementation's integrator (torch_impl.py, or the C++/CUDA extension: csrc/floater/) ->
# backward: ``posenc_fast::floater_backward``, the discrete adjoint, recomputing each
# interval from the states saved at the sample times (an eager training call on the cpp or
# cuda backend runs ``posenc_fast::floater_taped`` instead, whose backward reads most
# intervals from its tape: tape.py). The semantics are written out in
# reference.py; the module's result cache is cache.py, its frozen states frozen.py. A module
# checks a call once (Floater._check_call) and then integrates through _solve, unchecked.

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

from ... import _checks, _dispatch
from .._custom_ops import onnx_export_running, onnx_exporting
from . import cache as _floater_cache
from . import frozen as _frozen
from . import reference as _reference
from . import registry
from . import shared as _shared
from . import tape as _tape
from .op import FLOATER_CACHED, FLOATER_OP, FLOATER_TAPED, gradients
from .reference import FloaterOptions
from .registry import FLOATER

METHODS = _reference.METHODS
ACTIVATIONS = _reference.ACTIVATIONS

# Scale of the default initialisation of the output layer (w2): small, so h starts close
# to zero and a model starts as if it had no FLOATER term (the paper's warm start, Sec. 3.3
# and 4.4), while every weight still receives a gradient.
INIT_OUTPUT_SCALE = 1e-2


def _check_init_scale(init_scale) -> float:
    """The scale of w2's initialisation: a finite float >= 0 (0: w2 starts at zero)."""
    if isinstance(init_scale, bool) or not isinstance(init_scale, (int, float)):
        raise TypeError(f"init_scale must be a float >= 0, got {type(init_scale).__name__}")
    if not math.isfinite(init_scale) or init_scale < 0:
        raise ValueError(f"init_scale must be a finite float >= 0, got {init_scale}")
    return float(init_scale)


def _is_compiling() -> bool:
    return torch.compiler.is_compiling()


def _is_exporting() -> bool:
    """Whether torch.export traces this call. Not torch.compiler.is_exporting(): dynamo
    before torch 2.13 folds it to True in every torch.compile (seen on 2.7, 2.9 and
    2.11), which turned the compiled cache off. The flag it reads is set by non-strict
    export (the default from torch 2.9); torch 2.5 has none, and a strict export is
    traced like a compile: the exported program then keeps the cache op (which checks
    the parameters' values on every call: the results are those of a fresh integration)."""
    return bool(getattr(torch.compiler, "_is_exporting_flag", False))


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the ODE is integrated in for parameters of ``dtype``: theirs when float32
    or float64, float32 for float16/bfloat16 (a half-precision state would accumulate its
    rounding over hundreds of steps; autocast keeps float32 for such work too)."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _check_times(times, dtype: torch.dtype, module_p0: Optional[Tensor] = None) -> Tensor:
    """``times`` checked and converted to ``dtype``; ``module_p0``: a module's p0, whose
    device ``times`` must be on (checked before the values are read: a meta tensor would
    fail there with an error that names no argument)."""
    _checks.real_positions("times", times)
    if module_p0 is not None:
        _checks.same_device("the module (p0)", module_p0, times=times)
    if times.dim() != 1:
        raise ValueError(f"times must be a 1-D tensor [L], got shape {list(times.shape)}")
    times = times.to(dtype)
    # Value checks read the tensor back once per call. Under torch.compile they would break
    # the graph, so they are skipped there (the module's own times are valid by construction),
    # and on the meta device there are no values to read (shape inference only).
    if times.numel() and not _is_compiling() and times.device.type != "meta":
        # One read-back decides; only a bad tensor is read again, to name the problem.
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


def _check_floater_args(p0, w1, b1, w2, b2, times, options: FloaterOptions) -> Tensor:
    _checks.float_tensor("p0", p0)
    _check_p0_rank(p0)
    for name, t in (("w1", w1), ("b1", b1), ("w2", w2), ("b2", b2)):
        _checks.float_tensor(name, t)
    _check_shapes(p0, w1, b1, w2, b2)
    _checks.tensor("times", times)
    _checks.same_device("p0", p0, w1=w1, b1=b1, w2=w2, b2=b2, times=times)
    _checks.same_dtype("p0", p0, w1=w1, b1=b1, w2=w2, b2=b2)
    _check_options(options)
    return _check_times(times, state_dtype(p0.dtype))


def integrate(
    p0, w1, b1, w2, b2, times, options: FloaterOptions, backend: str
) -> tuple[Tensor, str]:
    """(out in :func:`state_dtype` of p0's dtype, name of the backend that ran it): what
    :func:`floater` computes, its arguments checked."""
    times = _check_floater_args(p0, w1, b1, w2, b2, times, options)
    return _solve(p0, w1, b1, w2, b2, times, options, backend)


def _solve(p0, w1, b1, w2, b2, times, options: FloaterOptions, backend: str) -> tuple[Tensor, str]:
    """:func:`integrate` of checked arguments (``times`` in the dtype of the integration):
    the modules' path, which checks once per call before it (Floater._check_call)."""
    # Half-precision weights: integrate in float32 (differentiable casts, so gradients
    # reach the half-precision tensors).
    p0, w1, b1, w2, b2 = (t.to(times.dtype) for t in (p0, w1, b1, w2, b2))
    if _is_compiling() and not _without_op(backend):
        # The dispatcher asks each backend whether it can run here, which may load the C++
        # extension under a lock: dynamo cannot trace that. The op resolves "auto" when it
        # runs instead (registry.implementation, as below: same answer).
        _dispatch.validate_name(backend)
        intervals, name = _compiled_tape(p0, w1, b1, w2, b2, times, options, backend)
        if intervals:
            out, _ = FLOATER_TAPED(p0, w1, b1, w2, b2, times, *options, name, intervals)
            return out, name
        return FLOATER_OP(p0, w1, b1, w2, b2, times, *options, backend), backend
    impl = registry.implementation(backend, p0, w1, times, options)
    if _tape.wanted(impl, p0, w1, b1, w2, b2, times) and not _traced():
        intervals = _tape.intervals(p0, w1, times, options)
        if intervals:
            out, _ = FLOATER_TAPED(p0, w1, b1, w2, b2, times, *options, impl.name, intervals)
            return out, impl.name
    return FLOATER_OP.run(impl, p0, w1, b1, w2, b2, times, *options), impl.name


def _compiled_tape(p0, w1, b1, w2, b2, times, options: FloaterOptions, backend: str):
    """Under torch.compile: (the intervals a training call keeps on the tape (tape.py), 0
    for none; the implementation that runs it), decided while dynamo traces: the backend
    comes from :func:`_taped_backend`, the intervals from the sizes (symbolic ones too)
    and the budget POSENC_FAST_FLOATER_TAPE_MB as it is then, which stays in the
    compiled code."""
    if _is_exporting():  # an exported program keeps the plain op (ONNX knows only that one)
        return 0, backend
    name = _taped_backend(backend, p0.device.type, p0.dtype, *options)
    impl = FLOATER.get(name)
    if impl is None or not _tape.wanted(impl, p0, w1, b1, w2, b2, times):
        return 0, backend
    return _tape.intervals(p0, w1, times, options), name


@torch._dynamo.assume_constant_result
def _taped_backend(backend, device, dtype, substeps, method, activation) -> str:
    """registry.choose's name for a compiled call, or "" when the dispatcher refuses.
    Dynamo runs it for real while tracing (the dispatcher may load the C++ extension,
    which it could not trace) and keeps the answer as a constant; the sizes' limits are
    checked when the op runs (registry.implementation), which raises the refusal."""
    try:
        return registry.choose(
            backend, device, dtype, FloaterOptions(substeps, method, activation)
        ).name
    except (_dispatch.BackendError, ValueError):
        return ""


def _traced() -> bool:
    """A jit trace or an ONNX export: they see the plain op (whose ONNX form is the solver
    unrolled), never the taped one."""
    return torch.jit.is_tracing() or onnx_exporting()


def _without_op(backend: str) -> bool:
    """Whether ``backend`` names an implementation that runs without the op (the
    reference: autograd differentiates it, nothing to cache or trace)."""
    impl = registry.named(backend)
    return impl is not None and impl.differentiable


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

    h(t, p) = act(p w1[:d] + t w1[d] + b1) w2[:H] + t w2[H] + b2: the time is concatenated
    to the input of each layer, as in the paper's official code; h is shared by all states.

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
        times) are exact for the discretised solution (backpropagation through the solver
        steps), with memory O(S*L*d); on the cpp and cuda backends a training call also
        keeps the solver's stage values (up to POSENC_FAST_FLOATER_TAPE_MB, default 1024
        MiB; see posenc_fast/ops/floater/tape.py), which makes its backward cheaper.
        Autocast does not apply: the dtype follows p0 under torch.autocast too, and the
        same holds for the modules.
    """
    options = FloaterOptions(substeps, method, activation)
    return integrate(p0, w1, b1, w2, b2, times, options, backend)[0].to(p0.dtype)


# An ONNX export of an unfrozen module refuses at once. The alternatives were to unroll the
# solver into the graph (what it did: every step of every interval traced op by op, more
# than 16 minutes for a timm ViT-Tiny with FLOATER biases, and a graph whose size grows
# with length x substeps) or to freeze automatically to the export's length in eval mode.
# A demanding user expects neither surprise: freezing would change the model they passed
# (a new buffer in its state_dict, and every later call served from it), and the length
# it would bake in is the example input's, while the deployed model's longest input (its
# dynamic axes' bound) is something only the user knows; and the exporter traces with
# fake parameters, so the states could not even be computed inside the trace. The error
# names the fix, a single call before exporting. The functional posenc_fast.floater is
# the way to export the solver itself (its length is then static).
_UNFROZEN_EXPORT = (
    "an ONNX export of an unfrozen Floater would unroll its ODE solver into the graph "
    "(minutes of tracing, a graph growing with length x substeps): call freeze(L) on it "
    "first (e.g. model.floater_bias.freeze(197) for a ViT-B/16 at 224 px), with L the "
    "longest length the exported model must serve"
)


class _StoredStates(torch.autograd.Function):
    """Returns states computed earlier (the cache) with the discrete-adjoint backward
    attached: a repeated call costs nothing, yet gradients still reach the parameters,
    and every returned tensor has a graph of its own (so each can be backpropagated)."""

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


class Floater(nn.Module):
    r"""FLOATER position encoding: ``forward(length=L)`` or ``forward(times=t)`` -> [S, L, d].

    S = num_states initial values ``p0`` [S, d] (e.g. one per Transformer block and Q/K/V
    projection) share the dynamics ``h(t, p) = [act([p, t] w1 + b1), t] w2 + b2`` with
    ``w1`` [d+1, H], ``b1`` [H], ``w2`` [H+1, d], ``b2`` [d] (H = hidden_dim, default d).

    - ``fl(length=L)``: p(t_i) at t_i = i * delta_t, i = 0..L-1, so out[:, 0] equals p0.
    - ``fl(times=t)``: t a 1-D non-decreasing tensor of times >= 0 -> [S, len(t), d].
    - Every interval between consecutive sample times (and from 0 to the first) is
      integrated with ``substeps`` equal steps of ``method``. Defaults follow the official
      code: delta_t 0.01, five RK4 steps per interval, ReLU.
    - Gradients are exact for the discretised solution (the discrete adjoint), memory
      O(S*L*d).
    - Cache: in eval mode or under no_grad the result is kept. A repeated call costs
      nothing (a longer one extends the cached states from the last one instead of
      starting over; there is no maximum length), and gradients still flow when enabled.
      Any change to a parameter's values invalidates it (an in-place update, a replaced
      tensor, ``.data`` writes, fused optimizers), caught by comparing against the values
      the cache was computed with; parameters re-materialised with unchanged values (FSDP2
      gathers them into fresh storage on every forward) keep it. :meth:`clear_cache` drops
      it; copies (``copy.deepcopy``, pickling, ``torch.save`` of the module) start without
      it. Under torch.compile the same cache serves compiled eval calls (through the op
      posenc_fast::floater_cached, which returns a copy); torch.export does not cache.
    - ``refresh_every=k`` (training mode): compute a differentiable result on one call in
      k and return that result's values, detached, on the k - 1 calls in between (the
      official code's trick to save time; the dynamics then receive gradients only on
      refresh calls, so DistributedDataParallel needs find_unused_parameters=True).
      Default 1: every training call recomputes, and every parameter receives a gradient
      on every call (DDP's default settings work). Ignored under torch.compile.
    - ONNX export: :meth:`freeze` first. Exporting an unfrozen module raises at once with
      that fix rather than unrolling the solver into the graph (minutes of tracing) or
      freezing on its own, which would change the model you passed and bake in the example
      input's length instead of the longest one you deploy (see _UNFROZEN_EXPORT). The
      functional :func:`floater` still exports its solver, unrolled, for a static length.
    - Half-precision parameters (``model.to(torch.bfloat16)``): the ODE is integrated in
      float32 and the result returned in their dtype; gradients reach them.
    - Initialisation: p0 = 0, w1 and b1 as nn.Linear(d+1, H), w2 small
      (U(+-init_scale / sqrt(H+1)), ``init_scale`` default 0.01), b2 = 0, so h is close to
      0 and the output near zero: a model starts as if it had no FLOATER term (Sec. 3.3;
      Sec. 4.4's "initialize the FLOATER with smaller weights"). ``init_scale=0`` starts
      with w2 = 0 and the output exactly zero (w1 and b1 still get gradients once w2 moves
      away from zero); with every parameter zero the output is exactly zero.

    Example::

        fl = posenc_fast.Floater(dim=512, num_states=6)  # one state per encoder block
        pe = fl(length=x.shape[1])                       # [6, L, 512]
        for n, block in enumerate(blocks):
            x = block(x + pe[n])
    """

    def __init__(
        self,
        dim: int,
        num_states: int,
        hidden_dim: Optional[int] = None,
        delta_t: float = 0.01,
        substeps: int = 5,
        method: str = "rk4",
        activation: str = "relu",
        backend: str = "auto",
        device=None,
        dtype=None,
        refresh_every: int = 1,
        init_scale: float = INIT_OUTPUT_SCALE,
    ):
        super().__init__()
        _checks.positive_int("dim", dim)
        _checks.positive_int("num_states", num_states)
        if hidden_dim is None:
            hidden_dim = dim
        _checks.positive_int("hidden_dim", hidden_dim)
        self.delta_t = _checks.positive_float("delta_t", delta_t)
        self.substeps = _checks.positive_int("substeps", substeps)
        self.method = _checks.choice("method", method, METHODS)
        self.activation = _checks.choice("activation", activation, ACTIVATIONS)
        self.backend = _dispatch.validate_name(backend)
        self.refresh_every = _checks.positive_int("refresh_every", refresh_every)
        self.init_scale = _check_init_scale(init_scale)
        self.dim, self.num_states, self.hidden_dim = dim, num_states, hidden_dim
        factory = {"device": device, "dtype": dtype}
        self.p0 = nn.Parameter(torch.empty(num_states, dim, **factory))
        self.w1 = nn.Parameter(torch.empty(dim + 1, hidden_dim, **factory))
        self.b1 = nn.Parameter(torch.empty(hidden_dim, **factory))
        self.w2 = nn.Parameter(torch.empty(hidden_dim + 1, dim, **factory))
        self.b2 = nn.Parameter(torch.empty(dim, **factory))
        self._cache = _floater_cache.FloaterCache()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.p0.zero_()
            bound = 1.0 / math.sqrt(self.dim + 1)
            self.w1.uniform_(-bound, bound)
            self.b1.uniform_(-bound, bound)
            out_bound = self.init_scale / math.sqrt(self.hidden_dim + 1)
            self.w2.uniform_(-out_bound, out_bound)
            self.b2.zero_()
        self.clear_cache()

    def clear_cache(self) -> None:
        self._cache.clear()

    # -- computation -------------------------------------------------------------------

    def _state_dtype(self) -> torch.dtype:
        return state_dtype(self.p0.dtype)

    def _inputs(self) -> tuple[Tensor, ...]:
        """The parameters in the dtype of the integration (differentiable casts; no-ops
        for float32/float64 parameters)."""
        dtype = self._state_dtype()
        return tuple(p.to(dtype) for p in (self.p0, self.w1, self.b1, self.w2, self.b2))

    def length_times(self, length: int) -> Tensor:
        """t_i = i * delta_t, i = 0..length-1, in the dtype of the integration (the
        parameters' dtype, float32 for half-precision ones), rounded once from float64, so
        a prefix of a longer sequence is bitwise the shorter one."""
        t = torch.arange(length, dtype=torch.float64, device=self.p0.device) * self.delta_t
        return t.to(self._state_dtype())

    @property
    def options(self) -> FloaterOptions:
        """(substeps, method, activation): how the ODE is integrated."""
        return FloaterOptions(self.substeps, self.method, self.activation)

    def _check_dynamics(self) -> None:
        """What the module integrates: its parameters' shapes and device, its options
        (attributes a caller may have replaced since construction). Their dtypes need no
        check: :meth:`_inputs` casts them all to the dtype of the integration."""
        _check_p0_rank(self.p0)
        _check_shapes(self.p0, self.w1, self.b1, self.w2, self.b2)
        _checks.same_device("p0", self.p0, w1=self.w1, b1=self.b1, w2=self.w2, b2=self.b2)
        _check_options(self.options)

    def _check_call(self, length, times) -> tuple:
        """forward's arguments, and the module when it integrates, checked once, before
        anything runs: (length, times), ``times`` converted to the dtype of the
        integration. Which error a bad call raises first is that of the call forms:
        a frozen module refuses ``times``, an ONNX export an unfrozen module."""
        if (length is None) == (times is None):
            raise ValueError("pass exactly one of length or times")
        if self.frozen:  # freeze(): the stored states serve it, no integration
            if times is not None:
                raise ValueError(_frozen.TIMES_REFUSED)
            if isinstance(length, Tensor) and torch.jit.is_tracing():
                return length, None  # the ONNX exporter's traced size (frozen.positions)
            return _checks.size("length", length, minimum=0), None
        if onnx_export_running():
            raise RuntimeError(_UNFROZEN_EXPORT)
        if length is not None:
            length = _checks.size("length", length, minimum=0)
        else:
            times = _check_times(times, self._state_dtype(), module_p0=self.p0)
        self._check_dynamics()
        return length, times

    def _integrate(self, inputs, times: Tensor, backend: str) -> tuple[Tensor, str]:
        """(states at ``times``, backend name); forward() has checked the call."""
        return _solve(*inputs, times, self.options, backend)

    def _compute(self, times: Tensor) -> Tensor:
        return self._integrate(self._inputs(), times, self.backend)[0]

    def integrate_states(self, length: int, states: Optional[slice] = None) -> Tensor:
        """The states (those of ``states`` only, when given) at positions 0..length-1 as a
        training call computes them, integrated now: no cache, no refresh bookkeeping.
        [S, L, dim] in the parameters' dtype; ``length`` is trusted (a size already
        checked), as the attention integrations pass it."""
        self._check_dynamics()
        t = self.length_times(length)
        if states is None:
            return self._compute(t).to(self.p0.dtype)
        inputs = (self.p0[states], self.w1, self.b1, self.w2, self.b2)
        out, _ = _solve(*inputs, t, self.options, self.backend)
        return out.to(self.p0.dtype)

    def _config_key(self, inputs) -> tuple:
        return _floater_cache.key(inputs, self.options, self.backend)

    def forward(self, length: Optional[int] = None, times: Optional[Tensor] = None) -> Tensor:
        """length: int >= 0 (times i * delta_t), or times: [L] -> [num_states, L, dim].

        ``length`` may be symbolic (a dynamic dimension under torch.export or
        torch.compile). The result has the parameters' dtype."""
        length, times = self._check_call(length, times)
        if self.frozen:  # freeze(): the stored states, no integration
            return _frozen.positions(self._buffers[_frozen.BUFFER], length, self._cache)
        if length is not None:
            return self._states("length", self.length_times(length)).to(self.p0.dtype)
        return self._states("times", times).to(self.p0.dtype)

    def _states(self, mode: str, t: Tensor) -> Tensor:
        training_step = self.training and torch.is_grad_enabled()
        if _is_compiling():
            return self._compiled_states(mode, t, training_step)
        if training_step:
            if self.refresh_every == 1:
                return self._compute(t)
            return self._refresh_step(mode, t)
        if torch.is_inference_mode_enabled():
            # Tensors made in inference mode have no version counter, which the cache needs
            # to notice edits of what it handed out: build and keep the cache outside it.
            with torch.inference_mode(False), torch.no_grad():
                return self._cached(mode, t)
        return self._cached(mode, t)

    def _compiled_states(self, mode: str, t: Tensor, training_step: bool) -> Tensor:
        """Under torch.compile the cache's bookkeeping runs inside the opaque op
        posenc_fast::floater_cached, so a compiled graph stays whole and its eval calls
        are served from the same cache as eager ones. Not cached there: training steps
        (refresh_every included: whether a call refreshes decides whether its result has a
        graph, which one compiled graph cannot vary), torch.export (an exported program
        must be a pure function of its inputs) and the reference backend (no op)."""
        if training_step or _is_exporting() or _without_op(self.backend):
            return self._compute(t)
        return FLOATER_CACHED(*self._inputs(), t, *self.options, self.backend, self._cache.id, mode)

    def _refresh_step(self, mode: str, t: Tensor) -> Tensor:
        cache = self._cache
        entry = cache.entries.get(mode)
        if entry is not None and cache.reused < self.refresh_every - 1 and entry.intact():
            values = _floater_cache.serve(entry, mode, t)
            if values is not None:
                cache.reused += 1
                return values
        inputs = self._inputs()
        out, backend = self._integrate(inputs, t, self.backend)
        _floater_cache.store(cache, mode, out, inputs, t, self._config_key(inputs), backend)
        cache.reused = 0
        return out

    def _cached(self, mode: str, t: Tensor) -> Tensor:
        inputs = self._inputs()
        values, backend = _floater_cache.cached_states(
            self._cache, mode, inputs, t, self._config_key(inputs), self._integrate
        )
        wants_grad = torch.is_grad_enabled() and (
            any(p.requires_grad for p in inputs) or t.requires_grad
        )
        if not wants_grad:
            return values
        if FLOATER[backend].differentiable:  # no hand-written backward to attach: recompute
            return self._compute(t)
        return _StoredStates.apply(values, *inputs, t, self.options, backend)

    def extra_repr(self) -> str:
        s = f"dim={self.dim}, num_states={self.num_states}, hidden_dim={self.hidden_dim}"
        s += f", delta_t={self.delta_t}"
        s += f", substeps={self.substeps}, method={self.method!r}, activation={self.activation!r}"
        if self.refresh_every != 1:
            s += f", refresh_every={self.refresh_every}"
        if self.init_scale != INIT_OUTPUT_SCALE:
            s += f", init_scale={self.init_scale:g}"
        if self.backend != "auto":
            s += f", backend={self.backend!r}"
        return s

    # -- inference: stored states (freeze, frozen.py) and cache statistics ----------------

    @property
    def frozen(self) -> bool:
        """Whether :meth:`freeze` stored the states (forward then integrates nothing)."""
        return self._buffers.get(_frozen.BUFFER) is not None

    @property
    def frozen_length(self) -> int:
        """The number of positions freeze() stored (0 when not frozen)."""
        states = self._buffers.get(_frozen.BUFFER)
        return 0 if states is None else int(states.shape[1])

    def freeze(self, length: int) -> Floater:
        """Integrate once for positions 0..length-1 (times i * delta_t) and serve
        ``forward(length=l)``, l <= length, from the stored states from now on (also in
        training mode: the dynamics then receive no gradient). The states are the buffer
        ``frozen_states`` [num_states, length, dim] in the parameters' dtype, saved in
        state_dict; loading such a state_dict freezes a fresh module. Call it again after
        changing the parameters; :meth:`unfreeze` integrates again. Returns the module."""
        length = _checks.size("length", length, minimum=1)
        if isinstance(length, torch.SymInt):
            raise TypeError("length must be a concrete int: freeze() runs eagerly, not traced")
        self.unfreeze()  # integrate, not serve the previous table
        with torch.no_grad():
            states = self.forward(length=length).detach().clone()
        self.register_buffer(_frozen.BUFFER, states)
        return self

    def unfreeze(self) -> Floater:
        """Drop the stored states: forward integrates (and caches) again. Returns the module."""
        self._buffers.pop(_frozen.BUFFER, None)
        return self

    def cache_info(self) -> _floater_cache.FloaterCacheInfo:
        """(hits, misses, lengths, frozen): how often forward was served without integrating
        (hits) or integrated (misses), the positions the result cache holds per call form
        and the frozen length; like functools.lru_cache's cache_info(). Counted in eval
        mode or under no_grad (where the cache applies) and for frozen calls, eagerly and
        under torch.compile (frozen calls there are traced: not counted); training steps
        integrate and are not counted. :meth:`clear_cache` resets the counts."""
        cache = self._cache
        lengths = {mode: int(e.out.shape[1]) for mode, e in cache.entries.items()}
        return _floater_cache.FloaterCacheInfo(
            cache.hits, cache.misses, lengths, self.frozen_length
        )

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # A state_dict saved from a frozen module freezes this one: the buffer is created
        # (shape from the checkpoint) so that the usual copy fills it.
        stored = state_dict.get(prefix + _frozen.BUFFER)
        if isinstance(stored, Tensor):
            mine = self._buffers.get(_frozen.BUFFER)
            if mine is None or mine.shape != stored.shape:
                empty = torch.empty(stored.shape, dtype=self.p0.dtype, device=self.p0.device)
                self.register_buffer(_frozen.BUFFER, empty)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class FloaterAttentionBias(nn.Module):
    r"""FLOATER's compatible form (Eq. 12-13): position-dependent biases for the Q/K/V
    projections of every attention block, all driven by one shared dynamics.

    ``forward(length)`` -> [num_layers, num_projections, L, dim]: bias[n, j] is added to
    projection j (0: Q, 1: K, 2: V by convention) of block n. One :class:`Floater` with
    num_states = num_layers * num_projections holds the initial values; ``floater_kwargs``
    (hidden_dim, delta_t, substeps, method, activation, backend, refresh_every, init_scale,
    device, dtype) go to it. The default initialisation (p0 = 0, h close to 0) starts the biases
    near zero, so a pretrained Transformer can be warm-started with FLOATER switched off.

    Example::

        class Block(nn.Module):
            def __init__(self, dim, heads):
                super().__init__()
                self.heads = heads
                self.qkv = nn.Linear(dim, 3 * dim)
                self.proj = nn.Linear(dim, dim)

            def forward(self, x, bias):  # x [B, L, dim], bias [3, L, dim]
                q, k, v = (self.qkv(x).unflatten(-1, (3, -1)) + bias.transpose(0, 1)).unbind(-2)
                q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in (q, k, v))
                y = F.scaled_dot_product_attention(q, k, v)
                return x + self.proj(y.transpose(1, 2).flatten(2))

        pos = posenc_fast.FloaterAttentionBias(dim=256, num_layers=4)
        blocks = nn.ModuleList(Block(256, heads=8) for _ in range(4))
        bias = pos(x.shape[1])  # [4, 3, L, 256]
        for n, block in enumerate(blocks):
            x = block(x, bias[n])
    """

    def __init__(self, dim: int, num_layers: int, num_projections: int = 3, **floater_kwargs):
        super().__init__()
        _checks.positive_int("num_layers", num_layers)
        _checks.positive_int("num_projections", num_projections)
        self.num_layers, self.num_projections = num_layers, num_projections
        self.floater = Floater(dim, num_layers * num_projections, **floater_kwargs)
        self._step = _shared.Slot()  # a training forward's one integration (shared.py)

    def reset_parameters(self) -> None:
        self.floater.reset_parameters()

    def forward(self, length: Optional[int] = None, times: Optional[Tensor] = None) -> Tensor:
        """length: int >= 0, or times [L] -> [num_layers, num_projections, L, dim]."""
        out = self.floater(length, times)
        return out.unflatten(0, (self.num_layers, self.num_projections))

    def block(self, layer: int, share: bool = True) -> _shared.BlockBiases:
        """What an attention block holds to get its biases: ``block(n)(length)`` is
        :meth:`block_biases` of block n."""
        return _shared.BlockBiases(self, layer, share)

    def block_biases(self, n: int, length: int, share: bool = True) -> Tensor:
        """Block ``n``'s biases for positions 0..length-1: [num_projections, L, dim], equal
        to ``self(length)[n]``. In a training step (train mode, gradients on) one
        integration of all blocks' states per forward serves every block and its backward
        (layer 0 makes it; ``share=False``: block n integrates its own states); otherwise
        the module's cache or frozen states serve it (docs/floater-training.md)."""
        fl = self.floater
        # Frozen: stored biases, never integrate. An ONNX export goes through forward too,
        # which refuses an unfrozen module.
        if fl.frozen or onnx_export_running() or not (fl.training and torch.is_grad_enabled()):
            return self(length)[n]
        return _shared.training_block(self, self._step, n, length, share)

    def extra_repr(self) -> str:
        return f"num_layers={self.num_layers}, num_projections={self.num_projections}"

    # -- inference: the Floater's, see Floater.freeze --------------------------------------

    @property
    def frozen(self) -> bool:
        return self.floater.frozen

    def freeze(self, length: int) -> FloaterAttentionBias:
        """Store the biases of positions 0..length-1 (Floater.freeze): a model given
        biases by add_floater_biases (``model.floater_bias.freeze(L)``) then runs and
        exports without integrating. Returns the module."""
        self.floater.freeze(length)
        return self

    def unfreeze(self) -> FloaterAttentionBias:
        self.floater.unfreeze()
        return self

    def cache_info(self) -> _floater_cache.FloaterCacheInfo:
        """Floater.cache_info of the shared Floater."""
        return self.floater.cache_info()
