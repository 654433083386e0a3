"""Loader of the compiled extension (csrc/): ``posenc_fast._C`` (ops, CPU kernels) and
``posenc_fast._C_cuda`` (CUDA kernels; needs _C), each loaded at most once, never on import.
A part comes from the package (setup.py), else the user cache, else
``torch.utils.cpp_extension.load`` builds it there (CPU on first use, both with ``python -m
posenc_fast build``). Each binary has a build record keyed by ABI tag and sources hash (a
mismatch is refused with the reason); a failed build is remembered; build output goes to
stderr; every failure is a reason ``info`` shows (docs/installation.md)."""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import json
import os
import shutil
import sys
import threading
import time
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any, Optional

import torch

from . import _build_config as _cfg

OPS_VERSION = 3  # must match build_info()["ops_version"] (csrc/module_info.h)

PARTS = tuple(_cfg.MODULES)  # ("cpu", "cuda"): the CUDA part needs the CPU part (op schemas)
PACKAGE_DIR = Path(__file__).resolve().parent
BUILD_HINT = "run `python -m posenc_fast build`"
DISABLE_ENV = "POSENC_FAST_DISABLE_EXTENSION"  # ignore every binary
CACHE_ENV = "POSENC_FAST_CACHE"
REQUIRE_ENV = "POSENC_FAST_REQUIRE_EXTENSION"  # CI: a part that does not build is an error

_WHAT = {"cpu": "the C++ extension", "cuda": "the CUDA part of the extension"}
# Cache builds are named posenc_fast_C: torch's loader renames a second "_C" ("_C_v1")
JIT_NAMES = {part: f"posenc_fast{name}" for part, name in _cfg.MODULES.items()}


def flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def module_name(part: str = "cpu") -> str:
    return f"posenc_fast.{_cfg.MODULES[part]}"


def label(part: str) -> str:
    return f"{_WHAT[part]} ({module_name(part)})"


def _describe(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines() or [""]
    return f"{type(exc).__name__}: {lines[0]}"


def source_root() -> Optional[Path]:
    """The folder holding csrc/: the package (installed) or its parent (checkout), or None."""
    here = Path(__file__).resolve().parent
    for root in (here, here.parent):
        if (root / "csrc" / "module.cpp").is_file():
            return root
    return None


_hashes: dict[Path, Optional[str]] = {}


def sources_hash() -> Optional[str]:
    root = source_root()
    if root is None:
        return None
    if root not in _hashes:
        _hashes[root] = _cfg.sources_hash(root)
    return _hashes[root]


def cache_root() -> Path:
    """$POSENC_FAST_CACHE, else $XDG_CACHE_HOME/posenc_fast, else ~/.cache/posenc_fast."""
    named = os.environ.get(CACHE_ENV)
    if named:
        return Path(named).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "posenc_fast"


def cache_dir(part: str = "cpu") -> Optional[Path]:
    """torch's build folder of ``part`` for this process and these sources,
    ``<cache>/<ABI tag>-src<sources hash>/posenc_fast_C`` (None: no sources to build from)."""
    digest = sources_hash()
    if digest is None:
        return None
    return cache_root() / f"{_cfg.abi_tag(torch)}-src{digest[:16]}" / JIT_NAMES[part]


def read_record(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, NotADirectoryError):
        return None
    except Exception as exc:  # unreadable or corrupt
        return {"built": False, "error": f"unreadable build record {path}: {exc}"}


def _binary(directory: Path, stem: str) -> Optional[Path]:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:  # setup.py's, or torch's ".so"
        path = directory / f"{stem}{suffix}"
        if path.is_file():
            return path
    return None


def stale(record: Optional[dict]) -> list[str]:
    """Why a binary of the package, described by its build ``record``, must not be loaded
    in this process ([] if it may): importing a binary built for another torch can crash."""
    if record is None:
        return [f"it has no build record to check it against this torch: {BUILD_HINT}"]
    if not record.get("built"):
        return [f"its build record says its build failed ({record.get('error')})"]
    if record.get("torch_version") != torch.__version__:
        return [
            f"the extension was built for torch {record.get('torch_version')}, this process "
            f"runs torch {torch.__version__}: rebuild it ({BUILD_HINT})"
        ]
    tag, now = record.get("abi_tag"), _cfg.abi_tag(torch)
    if tag != now:
        return [
            f"the extension's ABI tag {tag} (recorded at build time) is not this process's "
            f"{now}: rebuild it ({BUILD_HINT})"
        ]
    built_from, ours = record.get("sources_hash"), sources_hash()
    if ours and built_from != ours:
        return [
            f"the extension was built from other sources (hash {str(built_from)[:12]}) than "
            f"this package's csrc/ ({ours[:12]}): rebuild it ({BUILD_HINT})"
        ]
    return []


def _checked(part: str, module: ModuleType, path: Path) -> tuple[Optional[ModuleType], str]:
    """``module``, registered in sys.modules, if its op version is ours; else (None, why)."""
    built = module.build_info().get("ops_version")
    if built != OPS_VERSION:
        return None, (
            f"{path.name} has op version {built}, this package expects {OPS_VERSION}: rebuild "
            f"it ({BUILD_HINT})"
        )
    sys.modules[module_name(part)] = module
    return module, ""


def _import(part: str, path: Path) -> tuple[Optional[ModuleType], str]:
    try:  # the name's last part names its init function: _C, or posenc_fast_C from the cache
        spec = importlib.util.spec_from_file_location(
            f"posenc_fast.{path.name.split('.')[0]}", path
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as exc:  # ImportError, OSError (undefined symbol, missing library), ...
        return None, f"loading {path} failed ({_describe(exc)})"
    return _checked(part, module, path)


_explicit = False  # in `python -m posenc_fast build`: build what is missing, whatever failed
_force = False  # `build --force`: the cache's build, even where the package has a valid one


def _say(message: str) -> None:
    print(f"posenc_fast: {message}", file=sys.stderr, flush=True)


def _cuda_not_built() -> str:
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is built without CUDA"
    return (
        "`python -m posenc_fast build` builds it where a CUDA toolkit is found (CUDA_HOME); "
        "POSENC_FAST_BUILD=cuda builds it on first use"
    )


def _why_not_build(part: str, record: Optional[dict]) -> Optional[str]:
    """Why ``part`` is not built into the cache now (None: build it)."""
    if _explicit:
        return None
    what = label(part)
    if record is not None and not record.get("built"):  # not retried by every process
        error = record.get("error") or ""
        shows = " (it shows the compiler's messages)" if "Error building" in error else ""
        return (
            f"building {what} failed at {record.get('build_time')} ({error}): fix it, then "
            f"{BUILD_HINT}{shows}"
        )
    choice, refused = _cfg.build_choice()
    if refused:
        return (
            f"{what} is not built for this torch, and {refused}: no build on first use "
            f"({BUILD_HINT})"
        )
    if choice == "none":
        return (
            f"{what} is not built for this torch and POSENC_FAST_BUILD=none forbids building it "
            f"on first use: {BUILD_HINT}"
        )
    if part == "cuda" and choice != "cuda":
        return f"{what} is not built: {_cuda_not_built()}"
    return None


def _blocker(cpp_extension) -> Optional[str]:
    """Why this process cannot compile at all (None: it can try)."""
    cxx = (os.environ.get("CXX") or "c++").split()[0]
    if shutil.which(cxx) is None:
        where = "CXX" if os.environ.get("CXX") else "PATH"
        return f"no C++ compiler found ({cxx!r} from {where}): install one or set CXX"
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed (`pip install ninja`)"
    return None


@contextlib.contextmanager
def _stdout_to_stderr():
    """torch's build output (ninja's on file descriptor 1) to stderr, for the build only."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # older torch print()s its steps
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _build(part: str, directory: Path) -> tuple[Optional[ModuleType], str]:
    """Build ``part`` into ``directory`` and import it: (module, "") or (None, why not).
    torch's lock file there makes a concurrent process wait for this build."""
    from torch.utils import cpp_extension

    what = label(part)
    root = source_root()
    assert root is not None
    blocker = _blocker(cpp_extension)
    if blocker:
        return None, f"{what} is not built for this torch and cannot be built here: {blocker}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return None, (
            f"{what} is not built for this torch and the build cache {cache_root()} is not "
            f"writable ({_describe(exc)}): set {CACHE_ENV} to a writable folder, then "
            f"{BUILD_HINT}"
        )
    lock = directory / "lock"
    if lock.exists():
        _say(f"waiting for another process's build of {what} in {directory} (a build killed "
             f"hard leaves {lock} behind: delete it when no build runs)")  # fmt: skip
    else:
        jobs = os.environ.get("MAX_JOBS") or "ninja's default"
        _say(f"building {what} for torch {torch.__version__} into {directory} (once per "
             f"torch version and sources: a few minutes; MAX_JOBS={jobs}; "
             "POSENC_FAST_BUILD=none forbids first-use builds)")  # fmt: skip
    record_path = directory / _cfg.RECORDS[part]
    how = "python -m posenc_fast build" if _explicit else "first use"
    start = time.monotonic()
    try:
        with _stdout_to_stderr():
            module = cpp_extension.load(
                name=JIT_NAMES[part],
                sources=[str(root / s) for s in _cfg.SOURCES[part]],
                extra_cflags=_cfg.CXX_FLAGS,
                extra_cuda_cflags=_cfg.NVCC_FLAGS,
                extra_ldflags=_cfg.LD_FLAGS if part == "cpu" else None,
                extra_include_paths=[str(root / "csrc")],
                build_directory=str(directory),
                with_cuda=part == "cuda",
                verbose=True,
            )
    except Exception as exc:  # the first call of an op falls back, it does not crash
        record = read_record(record_path)  # the process that built it has said why
        if record is None:
            error = _describe(exc)
            if isinstance(exc, IndexError) and not os.environ.get("TORCH_CUDA_ARCH_LIST"):
                error += " (TORCH_CUDA_ARCH_LIST is unset and torch sees no GPU to build for)"
            record = _cfg.record(torch, part, root, how, built=False, error=error)
            _cfg.write_record(record_path, record)
        error = record.get("error") or ""
        if "Error building" in error:
            error += "; the compiler's messages are on stderr"
        return None, f"building {what} failed ({error}): fix it, then {BUILD_HINT}"
    binary = _binary(directory, JIT_NAMES[part])
    assert binary is not None
    seconds = time.monotonic() - start
    if not (read_record(record_path) or {}).get("built"):
        record = _cfg.record(torch, part, root, how, built=True, binary=binary.name,
                             build_seconds=round(seconds, 1))  # fmt: skip
        _cfg.write_record(record_path, record)
    _say(f"{what} ready after {seconds:.0f} s: {binary}")
    return _checked(part, module, binary)


_lock = threading.Lock()


def _fresh_state() -> dict[str, Any]:
    # origin: the binary's path; source: "package" | "cache"; ignored: refused binaries, why
    return {"tried": False, "module": None, "reasons": [], "origin": None, "source": None,
            "ignored": []}  # fmt: skip


_state: dict[str, dict[str, Any]] = {part: _fresh_state() for part in PARTS}


def _try_load(part: str) -> dict[str, Any]:
    """_state[part]'s fields after looking in the package, the cache, then building."""
    if flag(DISABLE_ENV):
        return {"reasons": [f"disabled by {DISABLE_ENV}"]}
    if part != "cpu" and load("cpu") is None:  # the ops it implements are defined there
        return {"reasons": [f"{label(part)} needs {label('cpu')}, which is unavailable"]}
    ignored = []  # found but refused, and why
    # 1. the package's own, ahead-of-time build
    record = read_record(PACKAGE_DIR / _cfg.RECORDS[part])
    binary = _binary(PACKAGE_DIR, _cfg.MODULES[part])
    if binary is not None and not _force:
        why = stale(record)
        module, why = _import(part, binary) if not why else (None, why[0])
        if module is not None:
            return {"module": module, "origin": str(binary), "source": "package"}
        ignored.append(f"{binary}: {why}")
    elif record is not None and not record.get("built"):  # setup.py skipped it or failed
        ignored.append(f"{label(part)} was not built at install time: {record.get('error')}")
    # 2. the user cache, and 3. a build into it
    directory = cache_dir(part)
    if directory is None:
        return {"ignored": ignored, "reasons": [*ignored, (
            f"{label(part)} is not built, and this installation carries no C++ sources "
            "(posenc_fast/csrc) to build it from: reinstall posenc_fast from a wheel or "
            "sdist of this version, or `pip install .` from a clone")]}  # fmt: skip
    record = read_record(directory / _cfg.RECORDS[part])
    binary = _binary(directory, JIT_NAMES[part])
    if record is not None and record.get("built") and binary is not None:
        module, why = _import(part, binary)
        if module is not None:
            return {"module": module, "origin": str(binary), "source": "cache", "ignored": ignored}
        return {"ignored": ignored, "reasons": [*ignored, f"{binary}: {why}"]}
    why = _why_not_build(part, record)
    if why is None:
        if record is not None:  # an explicit build retries a failed one
            (directory / _cfg.RECORDS[part]).unlink()
        module, why = _build(part, directory)
        if module is not None:
            origin = str(_binary(directory, JIT_NAMES[part]))
            return {"module": module, "origin": origin, "source": "cache", "ignored": ignored}
    said = [i for i in ignored if i.endswith(_cuda_not_built())]  # by the install's record
    if part == "cuda" and said and why.endswith(_cuda_not_built()):
        return {"ignored": ignored, "reasons": ignored}
    return {"ignored": ignored, "reasons": [*ignored, why]}


def load(part: str = "cpu") -> Optional[ModuleType]:
    """The module of ``part`` ("cpu": _C, "cuda": _C_cuda) or None (:func:`reasons` says
    why); loaded at most once, built where needed and allowed."""
    state = _state[part]
    if state["tried"]:  # the common case: no lock, so dynamo can trace it after the first load
        return state["module"]
    if part != "cpu":
        load("cpu")  # outside the lock: the lock is not reentrant
    with _lock:
        if not state["tried"]:
            state.update(_fresh_state(), **_try_load(part), tried=True)
            if part == "cpu" and state["module"] is not None:
                check_isa_env()
        return state["module"]


ISA_ENV = "POSENC_FAST_CPU_ISA"

ISA_NAMES = ("generic", "avx2", "avx512")  # csrc/cpu/isa.h's levels, lowest first


def check_isa_env() -> None:
    """Warn when POSENC_FAST_CPU_ISA names no known instruction set (the kernels ignore it)."""
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


def has_cuda() -> bool:
    """Whether the CUDA part is loaded (it needs no GPU to load)."""
    return load("cuda") is not None


def extension_build_metadata(part: str = "cpu") -> Optional[dict]:
    """The build record of the loaded binary of ``part``, else of the package's build."""
    origin = _state[part]["origin"]
    directory = Path(origin).parent if origin else PACKAGE_DIR
    return read_record(directory / _cfg.RECORDS[part])


_SOURCES = {
    "package": "the package's own ahead-of-time build",
    "cache": "the user cache (built on first use or by `python -m posenc_fast build`)",
}


def _part_info(part: str) -> dict:
    module = load(part)
    state = _state[part]
    directory = cache_dir(part)
    out: dict[str, Any] = {
        "module": module_name(part),
        "available": module is not None,
        "reasons": reasons(part),
        "path": state["origin"],
        "source": _SOURCES.get(state["source"] or ""),
        "ignored": list(state["ignored"]),
        "cache_dir": str(directory) if directory else None,
        "abi_tag": _cfg.abi_tag(torch),
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
    """What ``python -m posenc_fast info`` shows of each part: status, binary origin, what
    was ignored and why, build record (this module never imports the dispatcher)."""
    return {part: _part_info(part) for part in PARTS}


def build(cuda: Optional[bool] = None, force: bool = False) -> dict[str, dict[str, Any]]:
    """``python -m posenc_fast build`` (in a fresh process): load each part, building what is
    missing, a remembered failure included. cuda: None (where torch finds a toolkit, or as
    POSENC_FAST_BUILD=cpu|cuda says), False, True. force: rebuild the cache's build and prefer
    it. Per part: {"path": binary or None, "source", "skipped": why or None, "reasons"}."""
    global _explicit, _force
    if any(state["tried"] for state in _state.values()):
        raise RuntimeError(
            "the extension was already looked for in this process: build in a new one"
        )
    if cuda is None:
        cuda = {"cpu": False, "cuda": True}.get(_cfg.build_choice()[0])
    out: dict[str, dict[str, Any]] = {}
    for part in PARTS:
        skipped = None
        if part == "cuda" and cuda is False:
            skipped = "not requested"
        elif part == "cuda" and cuda is None:
            skipped = _cuda_skip()
        if skipped:
            out[part] = {"path": None, "source": None, "skipped": skipped, "reasons": []}
            continue
        directory = cache_dir(part)
        if force and directory is not None:
            shutil.rmtree(directory, ignore_errors=True)
        _explicit, _force = True, force
        try:
            load(part)
        finally:
            _explicit = _force = False
        state = _state[part]
        out[part] = {"path": state["origin"], "source": _SOURCES.get(state["source"] or ""),
                     "skipped": None, "reasons": list(state["reasons"])}  # fmt: skip
    return out


def _cuda_skip() -> Optional[str]:
    """Why the CUDA part is not built by default here (None: it is)."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is built without CUDA"
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        return "torch.utils.cpp_extension finds no CUDA toolkit (set CUDA_HOME)"
    return None
