"""A frozen Floater's stored states (Floater.freeze): what ``forward(length=l)`` returns
from them, without integrating."""

# The buffer "frozen_states" [S, L, d] (only while frozen), sliced by forward(length <= L):
# a constant table when exported (Sec. 4.4). A longer length raises, never integrates.

from __future__ import annotations

import torch
from torch import Tensor

from .cache import FloaterCache

BUFFER = "frozen_states"  # the buffer's name, in the module and its state_dict

TIMES_REFUSED = (
    "this Floater is frozen: it serves forward(length=...) from stored states "
    "and cannot integrate at other times; call unfreeze() first"
)


def positions(states: Tensor, length, cache: FloaterCache) -> Tensor:
    """The first ``length`` positions of the stored ``states`` [S, stored, d] (``length``
    already checked, here only against the stored length)."""
    if isinstance(length, Tensor) and torch.jit.is_tracing():
        # The TorchScript-based ONNX exporter traces sizes as tensors: a gather keeps
        # the length dynamic in the graph (a slice would bake in the traced value).
        return states.index_select(1, torch.arange(length, device=states.device))
    stored = states.shape[1]
    symbolic = isinstance(length, torch.SymInt)
    message = (
        f"length {length} exceeds the {stored} positions this Floater was frozen "
        f"for: call freeze({length}) (or unfreeze() to integrate)"
    )
    if symbolic:  # export / compile: a runtime assertion
        torch._check(length <= stored, lambda: message)
    elif length > stored:
        raise ValueError(message)
    if not torch.compiler.is_compiling():
        cache.hits += 1
    if symbolic:
        # A gather: a slice's strides depend on whether length == stored, which
        # torch.export would turn into a guard that excludes the frozen length.
        return states.index_select(1, torch.arange(length, device=states.device))
    return states[:, :length]
