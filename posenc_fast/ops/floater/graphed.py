"""The ``torch`` backend on CUDA, captured in CUDA graphs: one launch per call instead of
thousands of small kernels; the same code runs eagerly elsewhere."""

# torch_impl.py's loop is thousands of tiny ops, each a kernel launch on a GPU; a graph
# replays the whole call in one. The fallback where the CUDA integrator cannot run.
# Per problem (device, dtype, sizes, options; for the backward which gradients) a
# :class:`Graphed` entry holds static input buffers, the graph and its outputs: a call
# copies inputs in (no host sync), replays, returns clones. Captured on a problem's first
# call after a warm-up over two intervals on a side stream; entries in a small LRU
# (:data:`MAX_ENTRIES`). Results equal the eager loop's bitwise (same kernels, same order).
# Not captured: CPU tensors, a stream already capturing (reduce-overhead, a user's graph),
# ``POSENC_FAST_FLOATER_CUDA_GRAPHS=0``.

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Callable, Optional

import torch
from torch import Tensor

from . import torch_impl
from .reference import FloaterOptions

GRAPHS_ENV = "POSENC_FAST_FLOATER_CUDA_GRAPHS"
MAX_ENTRIES = 8  # captured problems kept (a training run has one forward and one backward)
WARMUP_INTERVALS = 2


class Graphed:
    """``fn(*inputs) -> [tensor or None]`` on static copies of its first inputs, captured in a
    CUDA graph when ``capture`` (after a run on ``warmup(*inputs)``), else run eagerly."""

    def __init__(self, fn: Callable, inputs, capture: bool, warmup: Optional[Callable] = None):
        self.fn = fn
        self.inputs = [t.detach().clone() for t in inputs]  # static buffers
        self.graph = None
        self.outputs = None
        if capture:
            self._capture(warmup)

    def _capture(self, warmup: Optional[Callable]) -> None:
        device = self.inputs[0].device
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side), torch.no_grad():
            self.fn(*(warmup(*self.inputs) if warmup else self.inputs))
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph):
            self.outputs = self.fn(*self.inputs)
        self.graph = graph

    def __call__(self, *inputs) -> list:
        for buf, t in zip(self.inputs, inputs):
            buf.copy_(t)
        if self.graph is not None:
            self.graph.replay()
            outs = self.outputs
        else:
            with torch.no_grad():
                outs = self.fn(*self.inputs)
        return [None if o is None else o.clone() for o in outs]


_ENTRIES: OrderedDict = OrderedDict()
_LOCK = threading.Lock()


def clear() -> None:
    """Drop every captured graph and its buffers."""
    with _LOCK:
        _ENTRIES.clear()


def entries() -> int:
    """Captured problems held now."""
    return len(_ENTRIES)


def capturable(t: Tensor) -> bool:
    """Whether a call on ``t`` is captured: a CUDA tensor, graphs allowed
    (POSENC_FAST_FLOATER_CUDA_GRAPHS), and no capture under way on the current stream."""
    if t.device.type != "cuda":
        return False
    if os.environ.get(GRAPHS_ENV, "").strip().lower() in ("0", "false", "no", "off"):
        return False
    return not torch.cuda.is_current_stream_capturing()


def _entry(key, make: Callable[[], Graphed]) -> Graphed:
    with _LOCK:
        entry = _ENTRIES.get(key)
        if entry is not None:
            _ENTRIES.move_to_end(key)
            return entry
    entry = make()  # outside the lock: a capture takes a while
    with _LOCK:
        _ENTRIES[key] = entry
        while len(_ENTRIES) > MAX_ENTRIES:
            _ENTRIES.popitem(last=False)
    return entry


def _key(kind: str, p0: Tensor, w1: Tensor, times: Tensor, options: FloaterOptions, *extra):
    return (kind, p0.device, p0.dtype, *p0.shape, w1.shape[1], times.shape[0], *options, *extra)


def _head(t: Tensor, n: int, dim: int = 0) -> Tensor:
    return t.narrow(dim, 0, min(n, t.shape[dim]))


def forward(p0, w1, b1, w2, b2, times, options: FloaterOptions, capture=None) -> Tensor:
    """torch_impl.floater_forward, captured where :func:`capturable` (``capture`` None);
    ``capture`` False: the static-buffer path run eagerly (tests), True: captured."""
    if capture is None:
        if not capturable(p0):
            return torch_impl.floater_forward(p0, w1, b1, w2, b2, times, options)
        capture = True

    def fn(p0, w1, b1, w2, b2, times):
        return [torch_impl.floater_forward(p0, w1, b1, w2, b2, times, options)]

    def warmup(p0, w1, b1, w2, b2, times):
        return p0, w1, b1, w2, b2, _head(times, WARMUP_INTERVALS)

    inputs = (p0, w1, b1, w2, b2, times)
    key = _key("fwd", p0, w1, times, options, capture)
    return _entry(key, lambda: Graphed(fn, inputs, capture, warmup))(*inputs)[0]


def backward(
    grad, out, p0, w1, b1, w2, b2, times, options: FloaterOptions, needs, tape=None, capture=None
) -> list[Optional[Tensor]]:
    """torch_impl.floater_backward, captured as :func:`forward` is (``tape``: the
    registry's signature, never given to this backend)."""
    needs = tuple(bool(n) for n in needs)
    if capture is None:
        if not capturable(p0) or not any(needs):
            return torch_impl.floater_backward(grad, out, p0, w1, b1, w2, b2, times, options, needs)
        capture = True

    def fn(grad, out, p0, w1, b1, w2, b2, times):
        return torch_impl.floater_backward(grad, out, p0, w1, b1, w2, b2, times, options, needs)

    def warmup(grad, out, p0, w1, b1, w2, b2, times):
        n = WARMUP_INTERVALS
        return _head(grad, n, 1), _head(out, n, 1), p0, w1, b1, w2, b2, _head(times, n)

    inputs = (grad, out, p0, w1, b1, w2, b2, times)
    key = _key("bwd", p0, w1, times, options, needs, capture)
    return _entry(key, lambda: Graphed(fn, inputs, capture, warmup))(*inputs)
