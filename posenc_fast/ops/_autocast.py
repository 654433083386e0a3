"""Kernels run with autocast off: precision is decided by the op's arguments.

Custom ops have no autocast kernel, so autocast would otherwise still be active for the
torch calls made inside an implementation and silently change its matmul precision. The
public functions read the autocast state themselves and pass the output dtype explicitly.
"""

from __future__ import annotations

import contextlib

import torch


def autocast_disabled(device_type: str):
    if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def autocast_dtype(device_type: str):
    """The autocast dtype active for ``device_type``, or None."""
    if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None
