"""Loader of the compiled extension (csrc/): two modules, loaded independently, each at most
once per process, never on import of posenc_fast: the "cpp" and "cuda" backends call
:func:`load` the first time they are asked whether they can run.

- ``posenc_fast._C``, the CPU part: defines the ops and their CPU kernels ("cpp" backend);
- ``posenc_fast._C_cuda``, the CUDA part: CUDA kernels of the same ops ("cuda" backend,
  which needs both). A CUDA part that was not built, or failed to, costs nothing else.

A part is looked for in the package (an ahead-of-time build), then in the user cache, then,
for the CPU part only, built there on first use (_extension_build.py); a binary whose build
record does not match this process is ignored with a reason (_extension_cache.py). Every
failure becomes a list of reasons that ``python -m posenc_fast info`` prints.

Run-time variables: POSENC_FAST_DISABLE_EXTENSION=1 (ignore every binary),
POSENC_FAST_NO_BUILD=1 (never build on first use), POSENC_FAST_CACHE (the cache folder),
POSENC_FAST_BUILD_WAIT (seconds to wait for another process's build, default 1800),
POSENC_FAST_DEBUG=1 (first-use builds at -O0 -g, cached under their own key),
POSENC_FAST_SANITIZE=address,undefined (the CPU part built with ASan and UBSan, cached under
its own key, loaded only where the ASan runtime was preloaded: tools/check_sanitizers.sh),
MAX_JOBS.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import threading
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any, Optional

from . import _extension_build as _build
from . import _extension_cache as _cache
from ._extension_cache import PARTS, module_name

OPS_VERSION = 3  # must match build_info()["ops_version"] of csrc/module.cpp, module_cuda.cpp

_lock = threading.Lock()


def _fresh_state() -> dict[str, Any]:
    # origin: the loaded binary's path; source: where it came from ("package", "cache");
    # ignored: binaries found but refused, each with why
    return {"tried": False, "module": None, "reasons": [], "origin": None, "source": None,
            "ignored": []}  # fmt: skip


_state: dict[str, dict[str, Any]] = {part: _fresh_state() for part in PARTS}


def _import_binary(part: str, path: Optional[Path] = None) -> ModuleType:
    name = module_name(part)
    if path is None:
        return importlib.import_module(name)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def _import_checked(part: str, binary: Path, in_package: bool) -> tuple[Optional[ModuleType], str]:
    """Import ``binary`` (the package's own, or one from the cache); (module, "") or
    (None, why not)."""
    try:
        module = _import_binary(part, None if in_package else binary)
    except Exception as exc:  # ImportError, OSError (undefined symbol, missing library), ...
        return None, f"loading {binary} failed ({type(exc).__name__}: {exc})"
    built = module.build_info()
    if built.get("ops_version") != OPS_VERSION:
        return None, (
            f"{binary.name} has op version {built.get('ops_version')}, this package expects "
            f"{OPS_VERSION}: rebuild it ({_cache.BUILD_HINT})"
        )
    return module, ""


# ---------------------------------------------------------------------------------------
# Finding and loading a part
# ---------------------------------------------------------------------------------------


def _try_load(part: str = "cpu") -> tuple[Optional[ModuleType], list[str], Optional[str]]:
    """(module or None, reasons it is unavailable, origin path). Records where it came from
    and what was ignored in _state[part] ("source", "ignored")."""
    state = _state[part]
    state["source"], state["ignored"] = None, []
    if _cache.flag("POSENC_FAST_DISABLE_EXTENSION"):
        return None, ["disabled by POSENC_FAST_DISABLE_EXTENSION"], None
    problem = _cache.sanitize_problem()
    if problem:
        return None, [problem], None
    if part != "cpu" and load("cpu") is None:  # the ops it implements are defined there
        return (
            None,
            [f"{_cache.label(part)} needs {_cache.label('cpu')}, which is unavailable"],
            None,
        )

    # 1. the package's own ahead-of-time build
    binary = _cache.binary_path(part)
    info = _cache.read_build_info(part)
    package_reasons = _cache.record_reasons(part, info, binary)
    if not package_reasons:
        assert binary is not None
        module, why = _import_checked(part, binary, in_package=True)
        if module is not None:
            state["source"] = "package"
            return module, [], str(binary)
        package_reasons = [why]
    ignored = []  # what was found but refused, and why: worth telling whatever happens next
    if binary is not None:
        ignored = [f"{binary}: {r}" for r in package_reasons]
    elif info is not None:  # a record without a binary: the install's decision or failure
        ignored = list(package_reasons)
    not_built = info is not None and not info.get("built", False)

    # 2. the user cache
    cached, cache_reasons = _cache.cache_candidate(part)
    ignored += cache_reasons
    if cached is not None:
        module, why = _import_checked(part, cached, in_package=False)
        if module is not None:
            state.update(source="cache", ignored=ignored)
            return module, [], str(cached)
        ignored.append(why)

    # 3. a first-use build (the CPU part only; the CUDA part on request)
    if part == "cpu":
        built, why = _build.first_use_build(part)
        if built is not None:
            module, why = _import_checked(part, built, in_package=False)
            if module is not None:
                state.update(source="cache", ignored=ignored)
                return module, [], str(built)
        state["ignored"] = ignored
        return None, [*ignored, why], None
    state["ignored"] = ignored
    if not_built:  # the install's own decision or failure says most
        return None, ignored, None
    failure = _cached_failure(part)
    if failure:  # an explicit build (`python -m posenc_fast build`) that failed says why
        return None, [*ignored, failure], None
    how = (
        "`python -m posenc_fast build` builds it where torch has CUDA and a CUDA toolkit of "
        "the same major version is found"
    )
    return None, [*ignored, f"{_cache.label(part)} is not built: {how}"], None


def _cached_failure(part: str) -> Optional[str]:
    """The remembered failure of the last build of ``part`` into the cache for this torch
    and these sources (``<part>.failed.json``), as a reason; None if there is none."""
    target = _cache.cache_dir(part)
    record = (
        _cache.read_record(target.parent / f"{part}.failed.json") if target is not None else None
    )
    return None if record is None else _cache.failure_reason(part, record)


def load(part: str = "cpu") -> Optional[ModuleType]:
    """The module of ``part`` ("cpu": posenc_fast._C, "cuda": posenc_fast._C_cuda), or None
    (then :func:`reasons` says why). Loads each at most once, building the CPU part on
    first use where needed and allowed; "cuda" loads "cpu" first."""
    state = _state[part]
    if state["tried"]:  # the common case: no lock, so dynamo can trace it after the first load
        return state["module"]
    if part != "cpu":
        load("cpu")  # outside the lock: the lock is not reentrant
    with _lock:
        if not state["tried"]:
            module, reasons, origin = _try_load(part)
            state.update(tried=True, module=module, reasons=reasons, origin=origin)
            if part == "cpu" and module is not None:
                check_isa_env()
        return state["module"]


ISA_ENV = "POSENC_FAST_CPU_ISA"

ISA_NAMES = ("generic", "avx2", "avx512")  # csrc/cpu/isa.h's levels, lowest first


def check_isa_env() -> None:
    """Warn when POSENC_FAST_CPU_ISA names no instruction set the C++ kernels know: they
    read it once and would silently run with the best one the CPU has."""
    raw = os.environ.get(ISA_ENV)
    if raw and raw != "auto" and raw not in ISA_NAMES:
        warnings.warn(
            f"posenc_fast: {ISA_ENV}={raw!r} is not one of {', '.join(ISA_NAMES)} (or auto): "
            "ignored, the C++ kernels use the best instruction set this CPU has",
            RuntimeWarning,
            stacklevel=3,
        )


def loaded_module(part: str = "cpu") -> Optional[ModuleType]:
    """The module of ``part`` if a call already loaded it, else None (never loads or builds)."""
    state = _state[part]
    return state["module"] if state["tried"] else None


def reasons(part: str = "cpu") -> list[str]:
    """Why ``part`` is unavailable ([] when it is loaded)."""
    load(part)
    return list(_state[part]["reasons"])


def extension_build_metadata(part: str = "cpu") -> Optional[dict]:
    """The build record of the loaded binary of ``part`` (the package's or the cache's), or
    of the package's build when none is loaded."""
    origin = _state[part]["origin"]
    if origin:
        return _cache.read_record(_cache.record_path(part, Path(origin).parent))
    return _cache.read_build_info(part)


def has_cuda() -> bool:
    """Whether the CUDA part is loaded (it needs no GPU to load)."""
    return load("cuda") is not None


_SOURCES = {
    "package": "the package's own ahead-of-time build",
    "cache": "the user cache (built on first use or by `python -m posenc_fast build`)",
}


def _part_info(part: str) -> dict:
    module = load(part)
    state = _state[part]
    out: dict[str, Any] = {
        "module": module_name(part),
        "available": module is not None,
        "reasons": reasons(part),
        "path": state["origin"],
        "source": _SOURCES.get(state["source"] or ""),
        "ignored": list(state["ignored"]),
        "cache_dir": str(_cache.cache_dir(part)) if _cache.cache_dir(part) else None,
        "abi_tag": _cache.current_abi_tag(),
        "build_metadata": extension_build_metadata(part),
    }
    if module is None:
        return out
    out["build_info"] = dict(module.build_info())
    if part == "cpu":
        out["cpu_isa"] = module.cpu_isa()
    else:
        try:
            out["cuda_runtime_version"] = module.cuda_runtime_version()
        except Exception as exc:
            out["cuda_runtime_version"] = f"unavailable ({exc})"
    return out


def extension_info() -> dict:
    """What ``python -m posenc_fast info`` shows about the compiled extension: each part's
    status, where its binary came from, what was ignored and why, and its build record (the
    CLI adds what the "cpp"/"cuda" backends make of it: this module sits below the
    dispatcher and never imports it)."""
    return {part: _part_info(part) for part in PARTS}


def build(
    cuda: Optional[bool] = None, force: bool = False, verbose: bool = False
) -> dict[str, dict[str, Any]]:
    """``python -m posenc_fast build`` (_extension_build.build) in a process that has not
    loaded the extension yet; afterwards the next :func:`load` looks again, so the caller
    can report what loads now."""
    if any(_state[p]["module"] is not None for p in PARTS):
        raise RuntimeError("the extension is already loaded in this process; build in a new one")
    out = _build.build(cuda=cuda, force=force, verbose=verbose)
    for state in _state.values():
        state.update(_fresh_state())
    return out
