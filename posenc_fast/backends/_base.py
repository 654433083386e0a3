"""What a backend is: a declaration of what it supports, plus the implementations.

Each backend module states, in one ``SUPPORT`` table at its top, the devices, dtypes, size
limits and options it handles for every op (the xformers pattern). ``Backend.reasons``
turns that table into human-readable refusals; the dispatcher (``backends/__init__.py``)
walks a priority list and either picks the first backend with no reasons or raises one
error that lists every backend's reasons.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Optional

import torch

ANY = None  # in a declaration: no restriction


@dataclass(frozen=True)
class Problem:
    """The metadata of one call that backends decide on (never the tensors themselves)."""

    op: str  # "lff" | "encoding" | "encoding_nd" | "floater"
    device: str  # torch device type: "cpu", "cuda", "meta", ...
    dtype: torch.dtype  # output / compute dtype
    sizes: Mapping[str, int] = field(default_factory=dict)
    options: Mapping[str, object] = field(default_factory=dict)
    input_dtypes: Mapping[str, torch.dtype] = field(default_factory=dict)


@dataclass(frozen=True)
class OpSupport:
    """What one backend supports for one op. ``ANY`` (None) means unrestricted."""

    devices: Optional[tuple[str, ...]] = ANY
    dtypes: Optional[tuple[torch.dtype, ...]] = ANY
    max_sizes: Mapping[str, int] = field(default_factory=dict)
    options: Mapping[str, tuple] = field(default_factory=dict)
    input_dtypes: Mapping[str, tuple[torch.dtype, ...]] = field(default_factory=dict)


def device_capability() -> tuple[int, int]:
    """Compute capability of the current CUDA device. The one place backends ask, so tests
    can simulate a GPU older than the kernels support (tests/test_degradation.py)."""
    major, minor = torch.cuda.get_device_capability()
    return int(major), int(minor)


def capability_reasons(minimum: tuple[int, int], why: str = "") -> list[str]:
    """Why the current CUDA device cannot run a backend that needs compute capability
    ``minimum``: too old, or torch reports a device whose capability cannot be read (no
    driver, a CPU build of torch, a process that faked torch.cuda.is_available)."""
    try:
        major, minor = device_capability()
    except Exception as exc:
        return [f"cannot read the CUDA device's compute capability ({type(exc).__name__}: {exc})"]
    if (major, minor) < minimum:
        need = f"{minimum[0]}.{minimum[1]}{why}"
        return [f"needs a GPU of compute capability >= {need}, this one is {major}.{minor}"]
    return []


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


class Backend:
    name: ClassVar[str]
    summary: ClassVar[str]
    SUPPORT: ClassVar[dict[str, OpSupport]]
    # When "auto" skips this backend because it is unavailable here (not because of the
    # inputs), warn once: the user probably expected it (e.g. a missing C++ extension).
    warn_when_unavailable: ClassVar[bool] = False
    # Devices on which "auto" may pick this backend (None: every device it implements).
    # The Triton interpreter runs on CPU tensors for verification, not for speed.
    auto_devices: ClassVar[Optional[tuple[str, ...]]] = None

    def environment_reasons(self) -> list[str]:
        """Why this backend cannot run at all in this process ([] if it can)."""
        return []

    def extra_reasons(self, problem: Problem) -> list[str]:
        """Input-dependent refusals that a declaration table cannot express."""
        return []

    def auto_eligible(self, op: str, device: str) -> bool:
        """Whether "auto" may consider this backend for ``op`` on ``device``."""
        allowed = self.auto_devices is None or device in self.auto_devices
        return allowed and self.implements(op, device)

    def implements(self, op: str, device: str) -> bool:
        sup = self.SUPPORT.get(op)
        return sup is not None and (sup.devices is ANY or device in sup.devices)

    def reasons(self, problem: Problem) -> list[str]:
        env = self.environment_reasons()
        if env:
            return env
        sup = self.SUPPORT.get(problem.op)
        if sup is None:
            return [f"does not implement {problem.op}"]
        out = []
        if sup.devices is not ANY and problem.device not in sup.devices:
            out.append(f"runs on {'/'.join(sup.devices)} tensors, got {problem.device}")
        if sup.dtypes is not ANY and problem.dtype not in sup.dtypes:
            names = ", ".join(_dtype_name(d) for d in sup.dtypes)
            out.append(f"supports dtypes {names}, got {_dtype_name(problem.dtype)}")
        for arg, dt in problem.input_dtypes.items():
            allowed = sup.input_dtypes.get(arg, ANY)
            if allowed is not ANY and dt not in allowed:
                names = ", ".join(_dtype_name(d) for d in allowed)
                out.append(f"{arg} dtype must be one of {names}, got {_dtype_name(dt)}")
        for key, value in problem.sizes.items():
            limit = sup.max_sizes.get(key)
            if limit is not None and value > limit:
                out.append(f"{key}={value} exceeds its limit {limit}")
        for key, value in problem.options.items():
            allowed = sup.options.get(key, ANY)
            if allowed is not ANY and value not in allowed:
                out.append(
                    f"{key}={value!r} not supported (supports {', '.join(map(repr, allowed))})"
                )
        return out + self.extra_reasons(problem)

    def encoding_nd_add(self, x, coords, kind: str, base: float):
        """x [..., M * n] + the encodings of coords [..., M], axis m in columns
        [m n, (m + 1) n): the backend's fused 1-D add on the [..., M, n] view of x (one
        read of x, one write), for backends that declare "encoding_nd" in SUPPORT."""
        axes = coords.shape[-1]
        x_axes = x.unflatten(-1, (axes, x.shape[-1] // axes))
        return self.encoding_add(x_axes, coords, kind, base, None).flatten(-2)
