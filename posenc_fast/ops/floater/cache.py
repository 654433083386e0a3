"""The result cache of a Floater module, one entry per call form ("length" / "times"): a
repeated eval call costs nothing, a longer one integrates only the new positions, a change
of parameter values or configuration recomputes. refresh_every keeps its refresh here too.

Under torch.compile the bookkeeping cannot be traced: the op ``posenc_fast::floater_cached``
(op.py) consults the same cache when it runs, found by an integer id (all a graph carries).
Inputs are ``(p0, w1, b1, w2, b2)`` in the integration's dtype and ``times``.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

from ..._dispatch import Implementation
from .reference import FloaterOptions
from .registry import FLOATER, implementation

Integrate = Callable[[Implementation, Sequence[Tensor], Tensor, FloaterOptions], Tensor]

_ids = itertools.count()
# id -> cache of a live module; a module's cache leaves the registry with the module.
_registry: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


@dataclass
class Entry:
    """A stored result ``out`` [S, Lc, d] (detached) and what it is valid for."""

    out: Tensor
    out_version: int  # out._version when stored: an in-place edit of a returned view shows
    key: tuple  # dtype, device, substeps, method, activation, backend
    inputs: tuple  # detached copies of (p0, w1, b1, w2, b2) when computed
    times: Tensor  # the sample times (detached copy)
    backend: str  # the backend that computed it (extensions use the same one)

    def intact(self) -> bool:
        """False when a returned view of ``out`` was edited in place."""
        return self.out._version == self.out_version


class FloaterCacheInfo(NamedTuple):
    """What :meth:`Floater.cache_info` returns: hits (calls answered from the cache or
    frozen states), misses (calls that integrated), lengths (positions held per call form,
    e.g. {"length": 196}), frozen (the length freeze() stored, 0 if none)."""

    hits: int
    misses: int
    lengths: dict
    frozen: int


class FloaterCache:
    """One module's stored results, one :class:`Entry` per call form."""

    def __init__(self):
        self.id = next(_ids)
        self.entries: dict[str, Entry] = {}
        self.reused = 0  # refresh_every: calls served since the last refresh
        self.hits = 0  # Floater.cache_info's counts
        self.misses = 0
        _registry[self.id] = self

    def __reduce__(self):
        # Copies and pickles start empty: a shared id would serve another module's results.
        return (FloaterCache, ())

    def clear(self) -> None:
        self.entries = {}
        self.reused = 0
        self.hits = self.misses = 0


def find(cache_id: int) -> Optional[FloaterCache]:
    """The cache with this id, or None when its module no longer exists."""
    return _registry.get(cache_id)


def key(inputs: Sequence[Tensor], options: FloaterOptions, backend: str):
    """The configuration a result depends on besides the values of inputs and times."""
    return (inputs[0].dtype, inputs[0].device, *options, backend)


def valid(entry: Optional[Entry], inputs: Sequence[Tensor], config_key: tuple) -> bool:
    """Whether ``entry`` still describes these inputs and this configuration."""
    if entry is None or not entry.intact() or entry.key != config_key:
        return False
    # The values decide: fused optimizers and .data writes skip _version, and FSDP2 gathers
    # unchanged values into fresh storage, so neither pointers nor versions can.
    return all(torch.equal(a, b) for a, b in zip(entry.inputs, inputs))


def serve(entry: Entry, mode: str, times: Tensor) -> Optional[Tensor]:
    """The stored values answering a call at ``times`` when ``entry`` covers it, or None:
    the same times ("times" form), or a prefix of the stored ones ("length" form)."""
    L, Lc = times.shape[0], entry.out.shape[1]
    if mode == "times":
        same = entry.times.shape == times.shape and torch.equal(entry.times, times)
        return entry.out if same else None
    if Lc >= L and torch.equal(entry.times[:L], times):
        return entry.out[:, :L]
    return None


def store(
    cache: FloaterCache,
    mode: str,
    out: Tensor,
    inputs: Sequence[Tensor],
    times: Tensor,
    config_key: tuple,
    backend: str,
) -> Entry:
    out = out.detach()
    copies = tuple(t.detach().clone() for t in inputs)
    entry = Entry(out, out._version, config_key, copies, times.detach().clone(), backend)
    cache.entries[mode] = entry
    return entry


def _onwards(entry: Entry, inputs: Sequence[Tensor], times: Tensor):
    """(inputs, times) integrating the positions beyond ``entry``'s from its last state.
    The ops start at time 0, so time is shifted by t0 = times[Lc-1] through the biases:
    b1 + t0 w1[d], b2 + t0 w2[H]."""
    p0, w1, b1, w2, b2 = inputs
    Lc = entry.out.shape[1]
    d, H = p0.shape[1], w1.shape[1]
    t0 = times[Lc - 1]
    return (entry.out[:, -1], w1, b1 + t0 * w1[d], w2, b2 + t0 * w2[H]), times[Lc:] - t0


def _extends(entry: Entry, mode: str, times: Tensor) -> bool:
    Lc = entry.out.shape[1]
    return (
        mode == "length" and 0 < Lc < times.shape[0] and torch.equal(times[:Lc], entry.times[:Lc])
    )


def cached_states(
    cache: FloaterCache,
    mode: str,
    inputs: Sequence[Tensor],
    times: Tensor,
    options: FloaterOptions,
    backend: str,
    integrate: Integrate,
) -> tuple[Tensor, str]:
    """(states at ``times`` detached, the implementation's name): from the cache, by
    extending it, or integrated afresh (then stored)."""
    config_key = key(inputs, options, backend)
    entry = cache.entries.get(mode)
    onwards = None
    if valid(entry, inputs, config_key):
        values = serve(entry, mode, times)
        if values is not None:
            cache.hits += 1
            return values, entry.backend
        if _extends(entry, mode, times):
            onwards = entry
    cache.misses += 1
    with torch.no_grad():
        if onwards is None:
            impl = implementation(backend, inputs[0], inputs[1], times, options)
            out = integrate(impl, inputs, times, options)
        else:  # the stored states, then the new positions by the same implementation
            impl = FLOATER[onwards.backend]
            new = integrate(impl, *_onwards(onwards, inputs, times), options)
            out = torch.cat([onwards.out, new], dim=1)
    return store(cache, mode, out, inputs, times, config_key, impl.name).out, impl.name


# -- refresh_every: a training call integrates one call in k -------------------------------


def reuse(cache: FloaterCache, mode: str, times: Tensor, every: int) -> Optional[Tensor]:
    """The last refresh's values (detached) when they may serve this training call: fewer
    than ``every`` - 1 calls served since, and the same times; else None."""
    if every == 1:
        return None
    entry = cache.entries.get(mode)
    if entry is None or cache.reused >= every - 1 or not entry.intact():
        return None
    values = serve(entry, mode, times)
    if values is not None:
        cache.reused += 1
    return values


def refreshed(cache, mode, out, inputs, times, options: FloaterOptions, backend, name) -> None:
    """Keep a refresh's result ``out`` (made by implementation ``name`` for a call with
    ``backend``) for the calls :func:`reuse` serves."""
    store(cache, mode, out, inputs, times, key(inputs, options, backend), name)
    cache.reused = 0


@contextlib.contextmanager
def _outside_inference():
    with torch.inference_mode(False), torch.no_grad():
        yield


def outside_inference_mode():
    """Leave inference mode for the cache's work: its tensors need version counters."""
    if torch.is_inference_mode_enabled():
        return _outside_inference()
    return contextlib.nullcontext()
