"""One integration per training forward, shared by the attention blocks a
FloaterAttentionBias serves: layer 0 integrates all blocks' states, the later layers take
their slice while it still describes the module (docs/floater-training.md)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from .module import Floater


@dataclass(eq=False)
class _Shared:
    """One training forward's biases of all blocks [N, P, L, dim] and what they describe
    (``key`` None: made under torch.compile, which cannot compute the eager key)."""

    biases: Tensor
    key: Optional[tuple]


class Slot:
    """A holder (``value``, here a :class:`_Shared`) that copies and pickles leave empty (a
    tensor with a graph cannot be deep-copied); a plain attribute, so torch.compile traces it."""

    def __init__(self):
        self.value = None

    def __deepcopy__(self, memo) -> Slot:
        return type(self)()

    def __reduce__(self):
        return (type(self), ())


def _key(fl: Floater, length: int) -> tuple:
    """What a shared result describes: the length, the options and the parameter tensors
    at their version counters (an in-place optimizer step bumps them)."""
    params = (fl.p0, fl.w1, fl.b1, fl.w2, fl.b2)
    versions = tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in params)
    return (length, fl.options, fl.backend, fl.refresh_every, versions)


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


def _one_block(P: int, n: int) -> slice:
    """Block n's rows among the Floater's states."""
    return slice(n * P, (n + 1) * P)


def block_biases(
    fl: Floater, layers: int, P: int, step: Slot, n: int, length: int, share: bool
) -> Tensor:
    """Block n's biases [P, L, dim] in a training step of the ``layers`` blocks that ``fl``
    serves, P projections each: from the step's one integration of all blocks (made by
    layer 0, kept in ``step``) while valid, else integrated for the block alone (always
    with ``share=False``)."""
    if not share:
        return fl.integrate_states(length, _one_block(P, n))
    if torch.compiler.is_compiling():
        return _compiled_block(fl, layers, P, step, n, length)
    entry = step.value
    valid = entry is not None and entry.key == _key(fl, length)
    if _in_backward():  # activation checkpointing recomputes; nothing new is shared here
        if not valid:  # reentrant: the forward ran under no_grad
            return fl.integrate_states(length, _one_block(P, n))
        if n == 0 and entry.biases.requires_grad:
            # Non-reentrant checkpointing wants the forward's operations again: layer 0
            # integrated all states (values only fill the forward's saved tensors).
            return fl.integrate_states(length).unflatten(0, (layers, P))[n]
        return entry.biases[n]
    if valid and n != 0:
        return entry.biases[n]
    if n != 0 and fl.refresh_every == 1:  # layer 0 did not run first
        return fl.integrate_states(length, _one_block(P, n))
    biases = fl(length).unflatten(0, (layers, P))  # all blocks: one integration (or a refresh's)
    entry = _Shared(biases, _key(fl, length))
    step.value = entry
    if biases.requires_grad:
        biases.register_hook(_drop_when_consumed(step, entry))
    return biases[n]


def _compiled_block(fl: Floater, layers: int, P: int, step: Slot, n: int, length: int) -> Tensor:
    """Under torch.compile: layer 0 leaves all blocks' biases in ``step`` for the later
    layers and checkpoint recomputation (the eager key and hook cannot be traced)."""
    if n == 0:
        biases = fl(length).unflatten(0, (layers, P))
        step.value = _Shared(biases, None)
        return biases[0]
    entry = step.value  # (its key is never read here: a guard on it would recompile each step)
    if entry is None or entry.biases.shape[2] != length:
        return fl.integrate_states(length, _one_block(P, n))
    return entry.biases[n]
