"""The taped forward of the ``cpp`` and ``cuda`` backends: the solver's stage values kept
for the backward, so that it need not integrate again; what it keeps, and how much."""

# The tape: each stage's input Y_i [S, d] and pre-activation Z_i [S, H] of every substep of
# the first intervals (intervals x substeps x stages x S x (d + H) elements, state dtype),
# saved like an activation until the backward, which reads it instead of integrating those
# intervals again (bitwise the same gradients; on CUDA the weight gradients become GEMMs
# over it, csrc/floater/floater_cuda.cu). Not made when the times need a gradient (the
# tape lacks the slopes it reads). Under torch.compile decided while dynamo traces
# (functional._traced). Size: the leading intervals that fit in POSENC_FAST_FLOATER_TAPE_MB
# (default 1024, 0: off; docs/floater-training.md). On the CPU one spare block is kept for
# the next tape (csrc/cpu/spare.h): :func:`release_memory` frees it.

from __future__ import annotations

import os

import torch

from .reference import FloaterOptions
from .torch_impl import TABLEAUX

TAPE_ENV = "POSENC_FAST_FLOATER_TAPE_MB"
DEFAULT_TAPE_MB = 1024


def budget_bytes() -> int:
    """The tape's budget in bytes (``POSENC_FAST_FLOATER_TAPE_MB``, read at each call)."""
    raw = os.environ.get(TAPE_ENV, "").strip()
    if not raw:
        return DEFAULT_TAPE_MB << 20
    try:
        mb = float(raw)
    except ValueError:
        mb = -1.0
    if not mb >= 0:  # also NaN
        raise ValueError(f"{TAPE_ENV} must be a number of MiB >= 0, got {raw!r}")
    return int(mb * (1 << 20))


def numel(S: int, d: int, H: int, intervals: int, options: FloaterOptions) -> int:
    """Elements of the tape of ``intervals`` intervals (the C++ op's tape_numel)."""
    return intervals * options.substeps * TABLEAUX[options.method].stages * S * (d + H)


def intervals(p0, w1, times, options: FloaterOptions) -> int:
    """How many leading intervals a taped forward keeps within the budget (0: no tape)."""
    S, d = p0.shape
    per = numel(S, d, w1.shape[1], 1, options) * p0.element_size()
    if per == 0:
        return 0
    return min(times.shape[0], budget_bytes() // per)


def release_memory() -> int:
    """Free the memory kept for the next tape (see the module docstring); returns its
    size in bytes (0 when none is kept or the extension is not loaded)."""
    from ... import _extension

    ext = _extension.loaded_module()
    return int(ext.release_spare_memory()) if ext is not None else 0


def wanted(impl, p0, w1, b1, w2, b2, times) -> bool:
    """Whether a call with ``impl`` should tape: the implementation has a taped forward,
    autograd will want a gradient of p0 or the dynamics, and not of the times."""
    if getattr(impl, "forward_taped", None) is None or not torch.is_grad_enabled():
        return False
    if times.requires_grad:
        return False
    return any(t.requires_grad for t in (p0, w1, b1, w2, b2))
