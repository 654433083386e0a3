"""The one dispatcher: which backend runs a call, and why the others do not.

Backends, fastest first for what they support:
- ``cuda``:   C++/CUDA kernels of the compiled extension (FLOATER integrator), CUDA tensors.
- ``triton``: fused Triton kernels (LFF, encodings), CUDA tensors; CPU tensors only under
  ``TRITON_INTERPRET=1`` (how CI verifies the kernels; never picked by "auto" there).
- ``cpp``:    C++ CPU kernels of the compiled extension (FLOATER integrator, LFF, encodings).
- ``torch``:  pure PyTorch, chunked and memory-efficient: the fallback on every device.
- ``reference``: the literal float64 equations; the specification, never picked by "auto".

``POSENC_FAST_BACKEND=<name>`` replaces "auto" by that backend for every call.
"""

from __future__ import annotations

import os
import warnings

from ._base import ANY, Backend, OpSupport, Problem

__all__ = [
    "ANY",
    "BACKEND_NAMES",
    "Backend",
    "BackendError",
    "OpSupport",
    "Problem",
    "available_backends",
    "choose",
    "get",
    "resolve_env",
]

BACKEND_NAMES = ("reference", "torch", "triton", "cuda", "cpp")
# Priority of "auto", fastest first. Backends only appear in a choice for the ops and
# devices their SUPPORT table declares, so one list serves every op.
AUTO_ORDER = ("cuda", "triton", "cpp", "torch")
ENV_VAR = "POSENC_FAST_BACKEND"
_NAMES = ", ".join(map(repr, BACKEND_NAMES))

_instances: dict[str, Backend] = {}
_warned: set[str] = set()


class BackendError(RuntimeError):
    """No backend (or not the requested one) can run a call; the message says why."""


def get(name: str) -> Backend:
    """The backend object called ``name`` (imported on first use)."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"backend must be 'auto' or one of {_NAMES}; got {name!r}")
    inst = _instances.get(name)
    if inst is None:
        if name == "reference":
            from .reference import ReferenceBackend as cls
        elif name == "torch":
            from .torch_backend import TorchBackend as cls
        elif name == "triton":
            from .triton_backend import TritonBackend as cls
        elif name == "cuda":
            from .extension_backends import CudaBackend as cls
        else:
            from .extension_backends import CppBackend as cls
        inst = _instances[name] = cls()
    return inst


def _report(reasons: dict[str, list[str]]) -> str:
    lines = []
    for name, rs in reasons.items():
        lines.append(f"  {name}: " + ("; ".join(rs) if rs else "ok"))
    return "\n".join(lines)


def _all_reasons(problem: Problem) -> dict[str, list[str]]:
    return {name: get(name).reasons(problem) for name in BACKEND_NAMES}


def choose(problem: Problem, requested: str = "auto") -> str:
    """Name of the backend that runs ``problem``; BackendError explains a refusal."""
    if not isinstance(requested, str):
        raise TypeError(f"backend must be a str, got {type(requested).__name__}")
    requested = resolve_env(requested)
    if requested == "auto":
        for name in AUTO_ORDER:
            backend = get(name)
            if not backend.auto_eligible(problem.op, problem.device):
                continue
            env = backend.environment_reasons()
            if env:
                if backend.warn_when_unavailable and name not in _warned:
                    _warned.add(name)
                    warnings.warn(
                        f"posenc_fast: backend {name!r} is unavailable ({'; '.join(env)}); "
                        "falling back to a slower backend. `python -m posenc_fast info` explains.",
                        RuntimeWarning,
                        stacklevel=3,
                    )
                continue
            if not backend.reasons(problem):
                return name
        raise BackendError(
            f"posenc_fast: no backend can run {problem.op} on these inputs "
            f"(device={problem.device}, dtype={problem.dtype}):\n"
            f"{_report(_all_reasons(problem))}"
        )
    backend = get(requested)
    if backend.reasons(problem):
        raise BackendError(
            f"posenc_fast: backend {requested!r} cannot run {problem.op} on these inputs "
            f"(device={problem.device}, dtype={problem.dtype}). Reasons per backend:\n"
            f"{_report(_all_reasons(problem))}"
        )
    return requested


def resolve_env(backend: str) -> str:
    """``backend``, with "auto" replaced by the name in POSENC_FAST_BACKEND when set."""
    if backend == "auto":
        return os.environ.get(ENV_VAR, "auto") or "auto"
    return backend


def validate_name(backend) -> str:
    """Check a ``backend=`` argument early (modules store it before any call)."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__}")
    if backend != "auto" and backend not in BACKEND_NAMES:
        raise ValueError(f"backend must be 'auto' or one of {_NAMES}; got {backend!r}")
    return backend


def available_backends(verbose: bool = False) -> dict[str, list[str]] | list[str]:
    """Backends usable in this process.

    Returns the list of usable names, or with ``verbose=True`` a dict mapping every
    backend name to the reasons it is unavailable ([] when usable).
    """
    info = {name: get(name).environment_reasons() for name in BACKEND_NAMES}
    if verbose:
        return info
    return [name for name, reasons in info.items() if not reasons]
