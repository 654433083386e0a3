"""One integration per training forward, shared by the attention blocks that a
FloaterAttentionBias serves: the result, whether it still describes the module, and each
block's slice (:class:`BlockBiases`, what the integrations hold per block).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


@dataclass(eq=False)
class _Shared:
    """One training forward's biases of all blocks [N, P, L, dim] and what they describe
    (``key`` None: made under torch.compile, which cannot compute the eager key)."""

    biases: Tensor
    key: Optional[tuple]


class Slot:
    """A holder (``value``) that copies and pickles leave empty: what it holds is derived
    data (a tensor with an autograd graph, which could not be deep-copied). A plain
    attribute of a module, so torch.compile traces reads and writes of it. The bias module
    keeps its training forward's shared result in one (:class:`_Shared`)."""

    def __init__(self):
        self.value = None

    def __deepcopy__(self, memo) -> Slot:
        return type(self)()

    def __reduce__(self):
        return (type(self), ())


def _key(floater, length: int) -> tuple:
    """What a shared result describes: the length, the options and the parameter tensors
    at their version counters (an in-place optimizer step bumps them)."""
    params = (floater.p0, floater.w1, floater.b1, floater.w2, floater.b2)
    versions = tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in params)
    return (length, floater.options, floater.backend, floater.refresh_every, versions)


def _drop_when_consumed(step: Slot, entry: _Shared):
    """A hook on ``entry.biases``: its gradient arrives when the backward reaches the
    integration, whose graph is then freed: the entry must not serve another forward."""
    step_ref, entry_ref = weakref.ref(step), weakref.ref(entry)

    def hook(grad):
        current = step_ref()
        if current is not None and current.value is not None and current.value is entry_ref():
            current.value = None

    return hook


def _in_backward() -> bool:
    """Whether autograd's engine runs this code (activation checkpointing recomputes)."""
    return torch._C._current_graph_task_id() != -1


def _per_block(source, n: int, length: int) -> Tensor:
    """Block n's biases from an integration of its own states only."""
    P = source.num_projections
    return source.floater.integrate_states(length, slice(n * P, (n + 1) * P))


def _all_blocks(source, length: int) -> Tensor:
    """``source(length)`` of a training call, by the same operations, without the refresh
    bookkeeping of ``refresh_every`` (used only to recompute a forward)."""
    out = source.floater.integrate_states(length)
    return out.unflatten(0, (source.num_layers, source.num_projections))


def _compiled_block(source, step: Slot, n: int, length: int) -> Tensor:
    """A training forward traced by torch.compile: layer 0 integrates all blocks' states
    and leaves the result in ``step``, where the later layers of the same forward find it
    (within one graph, the traced tensor itself; across graph breaks, a graph input). The
    eager key (pointers, version counters) and the consumption hook cannot be traced:
    here a result serves the layers that follow layer 0 in its forward, and the blocks a
    non-reentrant checkpoint recomputes in its backward."""
    if n == 0:
        biases = source(length)
        step.value = _Shared(biases, None)
        return biases[0]
    entry = step.value  # (its key is never read here: a guard on it would recompile each step)
    if entry is None or entry.biases.shape[2] != length:
        return _per_block(source, n, length)
    return entry.biases[n]


def training_block(source, step: Slot, n: int, length: int, share: bool) -> Tensor:
    """Block n's biases [P, L, dim] in a training step: from the step's one integration
    of all blocks when it is still valid (layer 0 makes it), else integrated for the
    block alone (``share=False`` always)."""
    if torch.compiler.is_compiling():
        if not share:
            return _per_block(source, n, length)
        return _compiled_block(source, step, n, length)
    if not share:
        return _per_block(source, n, length)
    entry = step.value
    valid = entry is not None and entry.key == _key(source.floater, length)
    if _in_backward():  # activation checkpointing recomputes; nothing new is shared here
        if not valid:  # reentrant: the forward ran under no_grad
            return _per_block(source, n, length)
        if n == 0 and entry.biases.requires_grad:
            # Non-reentrant checkpointing wants the forward's operations again: layer 0
            # integrated all states (values only fill the forward's saved tensors).
            return _all_blocks(source, length)[n]
        return entry.biases[n]
    if valid and n != 0:
        return entry.biases[n]
    if n != 0 and source.floater.refresh_every == 1:  # layer 0 did not run first
        return _per_block(source, n, length)
    biases = source(length)  # all blocks: one integration (or the refresh bookkeeping)
    entry = _Shared(biases, _key(source.floater, length))
    step.value = entry
    if biases.requires_grad:
        biases.register_hook(_drop_when_consumed(step, entry))
    return biases[n]


class BlockBiases:
    """Block ``layer``'s biases from a FloaterAttentionBias: ``biases(length)`` ->
    [num_projections, L, dim], equal to ``module(length)[layer]``. Holds the module
    without registering it as a submodule of every projection (it is registered once, on
    the model: a state_dict lists it once). Made by :meth:`FloaterAttentionBias.block`."""

    def __init__(self, module, layer: int, share: bool = True):
        self.module, self.layer, self.share = module, layer, share

    def __call__(self, length: int) -> Tensor:
        return self.module.block_biases(self.layer, length, self.share)
