"""The one dispatcher: which implementation runs a call, and why the others cannot.

``BACKENDS`` (can each run in this process; where "auto" may pick it) and each op's
registry (``ops/<op>/registry.py``: name -> :class:`Implementation` with its SUPPORT table).
:func:`choose` returns the first of ``AUTO_ORDER`` with no reasons against the call, else
a :class:`BackendError` listing them; ``POSENC_FAST_BACKEND`` replaces "auto".
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, NamedTuple, Optional

import torch

from . import _extension
from .triton_kernels import _env as _triton_env

ANY = None  # in a declaration: no restriction
_NONE: Mapping = MappingProxyType({})


class BackendError(RuntimeError):
    """No backend (or not the requested one) can run a call; the message says why."""


class Problem(NamedTuple):
    """The metadata of one call that backends decide on (never the tensors themselves)."""

    op: str  # "lff" | "encoding" | "encoding_nd" | "floater" | "rotary" | ...
    device: str  # torch device type: "cpu", "cuda", "meta", ...
    dtype: torch.dtype  # output / compute dtype
    sizes: Mapping[str, int] = _NONE
    options: Mapping[str, object] = _NONE
    input_dtypes: Mapping[str, torch.dtype] = _NONE


@dataclass(frozen=True)
class OpSupport:
    """What one backend supports for one op. ``ANY`` (None) means unrestricted."""

    devices: Optional[tuple[str, ...]] = ANY
    dtypes: Optional[tuple[torch.dtype, ...]] = ANY
    max_sizes: Mapping[str, int] = field(default_factory=dict)
    options: Mapping[str, tuple] = field(default_factory=dict)
    input_dtypes: Mapping[str, tuple[torch.dtype, ...]] = field(default_factory=dict)

    def implements(self, device: str) -> bool:
        return self.devices is ANY or device in self.devices


# The dtype sets the SUPPORT tables name.
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
HALF_AND_SINGLE = (torch.float32, torch.bfloat16, torch.float16)  # the compiled kernels'
INTEGERS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
ANYWHERE = OpSupport(devices=ANY, dtypes=FLOATS)  # the reference's and torch's, mostly


@dataclass
class Implementation:
    """One backend's implementation of one op (signatures: the op's registry). ``backward``
    None: autograd differentiates ``forward`` (the reference), run without the custom op."""

    name: str
    support: OpSupport
    forward: Callable
    backward: Optional[Callable] = None

    @property
    def differentiable(self) -> bool:
        return self.backward is None


Registry = dict  # backend name -> Implementation (one per op)

# op -> its registry, filled as the op packages' registry modules are imported.
REGISTRIES: dict[str, Registry] = {}


def register(op: str, *implementations: Implementation) -> Registry:
    """The registry of ``op``: its implementations by backend name."""
    registry = {impl.name: impl for impl in implementations}
    REGISTRIES[op] = registry
    return registry


def extension_ops(backend: str):
    """``torch.ops.posenc_fast`` with the extension's parts that ``backend`` needs loaded
    (the csrc kernels: ``lff_kernel``, ``floater_integrate``, ...)."""
    for part in BACKENDS[backend].parts:
        if _extension.load(part) is None:
            why = "; ".join(BACKENDS[backend].environment_reasons())
            raise RuntimeError(f"posenc_fast: backend {backend!r} is unavailable: {why}")
    return torch.ops.posenc_fast


# -- backend availability: per backend, for every op ------------------------------------


def device_capability() -> tuple[int, int]:
    """Compute capability of the current CUDA device (the one place: tests fake it)."""
    major, minor = torch.cuda.get_device_capability()
    return int(major), int(minor)


def capability_reasons(minimum: tuple[int, int], why: str = "") -> list[str]:
    """Why the current CUDA device cannot run a backend that needs compute capability
    ``minimum``: too old, or its capability cannot be read."""
    try:
        major, minor = device_capability()
    except Exception as exc:
        return [f"cannot read the CUDA device's compute capability ({type(exc).__name__}: {exc})"]
    if (major, minor) < minimum:
        need = f"{minimum[0]}.{minimum[1]}{why}"
        return [f"needs a GPU of compute capability >= {need}, this one is {major}.{minor}"]
    return []


def triton_devices() -> tuple[str, ...]:
    """Devices the Triton kernels run on: CUDA, and CPU tensors under the interpreter."""
    return ("cuda", "cpu") if _triton_env.interpreter_enabled() else ("cuda",)


def _triton_reasons() -> list[str]:
    err = _triton_env.import_error()
    if err:
        return [err]
    if _triton_env.interpreter_enabled():
        reason = _triton_env.installed_interpreter_reason()
        return [reason] if reason else []
    if not torch.cuda.is_available():
        return ["no CUDA device and TRITON_INTERPRET is not set"]
    reasons = capability_reasons((8, 0), " (bf16 tensor cores)")  # "auto" warns; info shows
    if reasons:
        return reasons
    # Imported here: it imports triton, importable by now, and only a GPU needs it.
    from .triton_kernels import _configs

    major, minor = device_capability()
    reason = _configs.target_reason(10 * major + minor)
    return [reason] if reason else []


CUDA_VALIDATED = False  # until a GPU passes the tests: only with POSENC_FAST_CUDA_UNVALIDATED=1
CUDA_GATE_ENV = "POSENC_FAST_CUDA_UNVALIDATED"


def _cuda_reasons() -> list[str]:
    for part in ("cpu", "cuda"):  # the CPU module defines the ops, the CUDA one implements them
        reasons = _extension.reasons(part)
        if reasons:
            return reasons
    if not torch.cuda.is_available():
        return ["no CUDA device available"]
    too_old = capability_reasons((7, 0))
    if too_old:  # an environment reason: "auto" warns and info shows it
        return too_old
    if not CUDA_VALIDATED and os.environ.get(CUDA_GATE_ENV, "") in ("", "0"):
        return [
            "the CUDA kernels have not passed the test matrix on a GPU yet; "
            f"set {CUDA_GATE_ENV}=1 to use them"
        ]
    return []


@dataclass
class Backend:
    """Whether a backend can run at all in this process, whatever the op."""

    name: str
    summary: str
    environment_reasons: Callable[[], list[str]] = list
    auto_devices: Optional[tuple[str, ...]] = None  # where "auto" may pick it (None: all)
    warn_when_unavailable: bool = False  # warn once when "auto" skips it as unavailable
    parts: tuple[str, ...] = ()  # the extension's modules it needs


BACKENDS: dict[str, Backend] = {
    "reference": Backend(
        "reference", "literal float64 equations: the specification every backend is tested against"
    ),
    "torch": Backend(
        "torch", "pure PyTorch, chunked and recomputing: the fallback on every device"
    ),
    "triton": Backend(
        "triton",
        "fused Triton kernels (CUDA; CPU tensors under TRITON_INTERPRET=1)",
        _triton_reasons,
        auto_devices=("cuda",),  # the interpreter on CPU tensors is for verification
        warn_when_unavailable=True,
    ),
    "cuda": Backend(
        "cuda",
        "CUDA kernels of the compiled extension (FLOATER integrator, one persistent launch)",
        _cuda_reasons,
        warn_when_unavailable=True,
        parts=("cpu", "cuda"),
    ),
    "cpp": Backend(
        "cpp",
        "C++ CPU kernels of the extension (FLOATER integrator, LFF, encodings, rotary)",
        lambda: _extension.reasons(),
        warn_when_unavailable=True,
        parts=("cpu",),
    ),
}
# Priority of "auto", fastest first; SUPPORT tables restrict it per op and device.
AUTO_ORDER = ["cuda", "triton", "cpp", "torch"]
ENV_VAR = "POSENC_FAST_BACKEND"
# os.environ.get raises and catches a KeyError when unset: slow for a small call's path
_ENV_DATA = getattr(os.environ, "_data", None)
_ENV_KEY = os.environ.encodekey(ENV_VAR) if _ENV_DATA is not None else None


def requested_backend() -> Optional[str]:
    """POSENC_FAST_BACKEND's value, None when unset."""
    if _ENV_DATA is None:
        return os.environ.get(ENV_VAR)
    value = _ENV_DATA.get(_ENV_KEY)
    return None if value is None else os.environ.decodevalue(value)


_warned: set[str] = set()


def _names() -> str:
    return ", ".join(map(repr, BACKENDS))


# -- choosing ------------------------------------------------------------------------------


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def support_reasons(sup: OpSupport, problem: Problem) -> list[str]:
    """Why a backend whose SUPPORT table for ``problem.op`` is ``sup`` refuses it."""
    out = []
    if not sup.implements(problem.device):
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
            out.append(f"{key}={value!r} not supported (supports {', '.join(map(repr, allowed))})")
    return out


def supports(sup: OpSupport, problem: Problem) -> bool:
    """Whether :func:`support_reasons` finds nothing (the test "auto" makes per call)."""
    if sup.devices is not ANY and problem.device not in sup.devices:
        return False
    if sup.dtypes is not ANY and problem.dtype not in sup.dtypes:
        return False
    for arg, dt in problem.input_dtypes.items():
        allowed = sup.input_dtypes.get(arg)
        if allowed is not None and dt not in allowed:
            return False
    for key, value in problem.sizes.items():
        limit = sup.max_sizes.get(key)
        if limit is not None and value > limit:
            return False
    for key, value in problem.options.items():
        allowed = sup.options.get(key)
        if allowed is not None and value not in allowed:
            return False
    return True


def reasons(name: str, registry: Registry, problem: Problem) -> list[str]:
    """Why backend ``name`` cannot run ``problem`` ([] if it can)."""
    env = BACKENDS[name].environment_reasons()
    if env:
        return env
    impl = registry.get(name)
    if impl is None:
        return [f"does not implement {problem.op}"]
    return support_reasons(impl.support, problem)


def auto_eligible(name: str, registry: Registry, device: str) -> bool:
    """Whether "auto" may consider backend ``name`` for the op of ``registry`` on ``device``."""
    impl = registry.get(name)
    auto_devices = BACKENDS[name].auto_devices
    allowed = auto_devices is None or device in auto_devices
    return allowed and impl is not None and impl.support.implements(device)


def _report(registry: Registry, problem: Problem) -> str:
    lines = []
    for name in BACKENDS:
        rs = reasons(name, registry, problem)
        lines.append(f"  {name}: " + ("; ".join(rs) if rs else "ok"))
    return "\n".join(lines)


def choose(registry: Registry, problem: Problem, requested: str = "auto") -> Implementation:
    """The implementation that runs ``problem``; BackendError explains a refusal."""
    if not isinstance(requested, str):
        raise TypeError(f"backend must be a str, got {type(requested).__name__}")
    if requested == "auto":
        requested = requested_backend() or "auto"
    if requested == "auto":
        device = problem.device
        for name in AUTO_ORDER:
            impl = registry.get(name)
            backend = BACKENDS[name]
            if impl is None or (
                backend.auto_devices is not None and device not in backend.auto_devices
            ):
                continue
            if not impl.support.implements(device):
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
            if supports(impl.support, problem):
                return impl
        raise BackendError(
            f"posenc_fast: no backend can run {problem.op} on these inputs "
            f"(device={problem.device}, dtype={problem.dtype}):\n"
            f"{_report(registry, problem)}"
        )
    if requested not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {_names()}; got {requested!r}")
    if reasons(requested, registry, problem):
        raise BackendError(
            f"posenc_fast: backend {requested!r} cannot run {problem.op} on these inputs "
            f"(device={problem.device}, dtype={problem.dtype}). Reasons per backend:\n"
            f"{_report(registry, problem)}"
        )
    return registry[requested]


def resolve_env(backend: str) -> str:
    """``backend``, with "auto" replaced by the name in POSENC_FAST_BACKEND when set."""
    if backend == "auto":
        return requested_backend() or "auto"
    return backend


def validate_name(backend) -> str:
    """Check a ``backend=`` argument early (modules store it before any call)."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__}")
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {_names()}; got {backend!r}")
    return backend


def available_backends(verbose: bool = False) -> dict[str, list[str]] | list[str]:
    """Backends usable in this process: their names, or with ``verbose=True`` every
    backend's name -> the reasons it is unavailable ([] when usable)."""
    info = {name: b.environment_reasons() for name, b in BACKENDS.items()}
    if verbose:
        return info
    return [name for name, rs in info.items() if not rs]
