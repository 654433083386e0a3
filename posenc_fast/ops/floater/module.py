"""The Floater module: FLOATER's states for positions 0..L-1 or given times, with the
result cache of eval calls (cache.py), refresh_every, freeze (frozen.py) and the refusal
of an ONNX export of an unfrozen module."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

from ... import _checks, _dispatch
from .._custom_ops import onnx_export_running
from . import cache
from . import frozen as _frozen
from .functional import check_dynamics, check_times, is_exporting, solve, state_dtype, without_op
from .op import FLOATER_CACHED, StoredStates, states_without_graph
from .reference import ACTIVATIONS, METHODS, FloaterOptions
from .registry import FLOATER

# w2's default initialisation scale: h starts near zero (the paper's warm start, Sec. 3.3).
INIT_OUTPUT_SCALE = 1e-2


def _check_init_scale(init_scale) -> float:
    """The scale of w2's initialisation: a finite float >= 0 (0: w2 starts at zero)."""
    if isinstance(init_scale, bool) or not isinstance(init_scale, (int, float)):
        raise TypeError(f"init_scale must be a float >= 0, got {type(init_scale).__name__}")
    if not math.isfinite(init_scale) or init_scale < 0:
        raise ValueError(f"init_scale must be a finite float >= 0, got {init_scale}")
    return float(init_scale)


# An ONNX export of an unfrozen module refuses, naming the fix (docs/deploying.md).
_UNFROZEN_EXPORT = (
    "an ONNX export of an unfrozen Floater would unroll its ODE solver into the graph "
    "(minutes of tracing, a graph growing with length x substeps): call freeze(L) on it "
    "first (e.g. model.floater_bias.freeze(197) for a ViT-B/16 at 224 px), with L the "
    "longest length the exported model must serve"
)


class Floater(nn.Module):
    r"""FLOATER position encoding: ``forward(length=L)`` or ``forward(times=t)`` -> [S, L, d].

    S = num_states initial values ``p0`` [S, d] (e.g. one per Transformer block and Q/K/V
    projection) share the dynamics ``h(t, p) = [act([p, t] w1 + b1), t] w2 + b2`` with
    ``w1`` [d+1, H], ``b1`` [H], ``w2`` [H+1, d], ``b2`` [d] (H = hidden_dim, default d).

    - ``fl(length=L)``: p(t_i) at t_i = i * delta_t, i = 0..L-1, so out[:, 0] equals p0.
    - ``fl(times=t)``: t a 1-D non-decreasing tensor of times >= 0 -> [S, len(t), d].
    - Each interval between sample times (and from 0 to the first): ``substeps`` equal
      steps of ``method``. Defaults (the official code's): delta_t 0.01, 5 RK4 steps, ReLU.
    - Gradients are exact for the discretised solution, memory O(S*L*d).
    - Cache: in eval mode or under no_grad the result is kept; a repeated call costs
      nothing, a longer one extends the cached states, and gradients still flow when
      enabled. Any change of a parameter's values invalidates it (values are compared, so
      ``.data`` writes and fused optimizers are caught, FSDP2's re-gathered unchanged
      values are not a change). :meth:`clear_cache` drops it; copies and pickles start
      without it. Compiled eval calls share it (op posenc_fast::floater_cached);
      torch.export does not cache.
    - ``refresh_every=k`` (training mode): one call in k computes a differentiable result,
      the k - 1 calls after it return its values detached (the official code's trick); the
      dynamics then get gradients only on refresh calls (DDP needs
      find_unused_parameters=True). Default 1: every call recomputes. Ignored under
      torch.compile.
    - ONNX export: :meth:`freeze` first; exporting an unfrozen module raises with that fix
      (docs/deploying.md). The functional :func:`floater` exports its solver unrolled.
    - Half-precision parameters (``model.to(torch.bfloat16)``): the ODE is integrated in
      float32 and the result returned in their dtype; gradients reach them.
    - Initialisation: p0 = 0, w1 and b1 as nn.Linear(d+1, H), w2 U(+-init_scale /
      sqrt(H+1)) (``init_scale`` default 0.01), b2 = 0: the output starts near zero, as if
      there were no FLOATER term (Sec. 3.3, 4.4). ``init_scale=0``: w2 = 0, output exactly
      zero (w1 and b1 get gradients once w2 moves).

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
        self._cache = cache.FloaterCache()
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
        """t_i = i * delta_t, i < length, in the integration's dtype, rounded once from
        float64 (a prefix of a longer sequence is bitwise the shorter one)."""
        t = torch.arange(length, dtype=torch.float64, device=self.p0.device) * self.delta_t
        return t.to(self._state_dtype())

    @property
    def options(self) -> FloaterOptions:
        """(substeps, method, activation): how the ODE is integrated."""
        return FloaterOptions(self.substeps, self.method, self.activation)

    def _check_dynamics(self) -> None:
        """What the module integrates (attributes a caller may have replaced since
        construction): functional.check_dynamics."""
        check_dynamics(self.p0, self.w1, self.b1, self.w2, self.b2, self.options)

    def _check_call(self, length, times) -> tuple:
        """(length, times) checked before anything runs, ``times`` in the integration's
        dtype; a frozen module refuses ``times``, an ONNX export an unfrozen module."""
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
            times = check_times(times, self._state_dtype(), module_p0=self.p0)
        self._check_dynamics()
        return length, times

    def integrate_states(self, length: int, states: Optional[slice] = None) -> Tensor:
        """The states (``states`` only, when given) at positions 0..length-1 [S, L, dim],
        integrated now as a training call does (no cache); ``length`` already checked."""
        self._check_dynamics()
        p0 = self.p0 if states is None else self.p0[states]
        t = self.length_times(length)
        out, _ = solve(p0, self.w1, self.b1, self.w2, self.b2, t, self.options, self.backend)
        return out.to(self.p0.dtype)

    def forward(self, length: Optional[int] = None, times: Optional[Tensor] = None) -> Tensor:
        """length: int >= 0 (times i * delta_t; may be symbolic under export / compile), or
        times: [L] -> [num_states, L, dim] in the parameters' dtype."""
        length, times = self._check_call(length, times)
        if self.frozen:  # freeze(): the stored states, no integration
            return _frozen.positions(self._buffers[_frozen.BUFFER], length, self._cache)
        mode = "times"
        if times is None:
            mode, times = "length", self.length_times(length)
        if torch.compiler.is_compiling():
            out = self._compiled(mode, times)
        elif self.training and torch.is_grad_enabled():
            out = cache.reuse(self._cache, mode, times, self.refresh_every)
            if out is None:
                inputs = self._inputs()
                out, name = solve(*inputs, times, self.options, self.backend)
                if self.refresh_every != 1:
                    options, backend = self.options, self.backend
                    cache.refreshed(self._cache, mode, out, inputs, times, options, backend, name)
        else:
            with cache.outside_inference_mode():
                out = self._cached(mode, times)
        return out.to(self.p0.dtype)

    def _cached(self, mode: str, times: Tensor) -> Tensor:
        """An eval or no_grad call: the result cache's states, with the integration's
        backward attached when gradients are wanted."""
        inputs = self._inputs()
        values, name = cache.cached_states(
            self._cache, mode, inputs, times, self.options, self.backend, states_without_graph
        )
        wants_grad = torch.is_grad_enabled() and (
            any(p.requires_grad for p in inputs) or times.requires_grad
        )
        if not wants_grad:
            return values
        if FLOATER[name].backward is None:  # the reference: recompute, autograd differentiates
            return solve(*inputs, times, self.options, self.backend)[0]
        return StoredStates.apply(values, *inputs, times, self.options, name)

    def _compiled(self, mode: str, times: Tensor) -> Tensor:
        """Under torch.compile: the cache's bookkeeping inside the opaque op floater_cached.
        Not cached: training steps (refresh_every would vary the graph), torch.export (a
        pure function of its inputs) and the reference backend (no op)."""
        inputs = self._inputs()
        training_step = self.training and torch.is_grad_enabled()
        if training_step or is_exporting() or without_op(self.backend):
            return solve(*inputs, times, self.options, self.backend)[0]
        return FLOATER_CACHED(*inputs, times, *self.options, self.backend, self._cache.id, mode)

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
        """Integrate once for positions 0..length-1 and serve ``forward(length=l <=
        length)`` from the buffer ``frozen_states`` [num_states, length, dim] from now on
        (also in training: no gradient then). Saved in state_dict (loading it freezes a
        fresh module). Call again after changing the parameters; :meth:`unfreeze` undoes
        it. Returns the module."""
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

    def cache_info(self) -> cache.FloaterCacheInfo:
        """(hits, misses, lengths, frozen), like functools.lru_cache's cache_info(): calls
        served without integrating, calls that integrated, positions cached per call form,
        the frozen length. Counted where the cache applies (eval / no_grad) and for eager
        frozen calls; not for training steps. :meth:`clear_cache` resets the counts."""
        results = self._cache
        lengths = {mode: int(e.out.shape[1]) for mode, e in results.entries.items()}
        return cache.FloaterCacheInfo(results.hits, results.misses, lengths, self.frozen_length)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # A frozen module's state_dict freezes this one: create the buffer the copy fills.
        stored = state_dict.get(prefix + _frozen.BUFFER)
        if isinstance(stored, Tensor):
            mine = self._buffers.get(_frozen.BUFFER)
            if mine is None or mine.shape != stored.shape:
                empty = torch.empty(stored.shape, dtype=self.p0.dtype, device=self.p0.device)
                self.register_buffer(_frozen.BUFFER, empty)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
