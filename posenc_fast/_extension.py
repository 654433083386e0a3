"""Loader of the compiled extension (csrc/): two modules, loaded independently, and the
first-use build that compiles it where no usable binary exists.

- ``posenc_fast._C``, the CPU part: defines the ops and their CPU kernels ("cpp" backend);
- ``posenc_fast._C_cuda``, the CUDA part: CUDA kernels of the same ops ("cuda" backend,
  which needs both). A CUDA part that was not built, or failed to, costs nothing else.

Importing posenc_fast never loads or builds a binary: the "cpp" and "cuda" backends call
:func:`load` the first time they are asked whether they can run. A part is looked for in
this order:

1. the package itself: an ahead-of-time build (``pip install --no-build-isolation``,
   setup.py), with its build record beside it (``_build_info.json``,
   ``_build_info_cuda.json``);
2. the user cache (:func:`cache_root`), under a key of the running torch, its C++ ABI,
   Python, the machine and the hash of the sources (:func:`cache_key`);
3. for the CPU part only, a first-use build into that cache: the sources ship in every
   wheel and sdist (posenc_fast/csrc/), compiled by torch.utils.cpp_extension with ninja
   in a child process, with progress on stderr, under a file lock so that concurrent
   processes (DDP ranks, DataLoader workers) build once and the others wait. The CUDA part
   (minutes more of nvcc, and a matching toolkit) is built only on request:
   ``python -m posenc_fast build``.

Before a binary is imported its build record is checked (torch version, Python ABI, the
ABI tag, the sources hash), so a binary built for another torch or from other sources is
ignored with a reason, not loaded (loading it could fail with undefined symbols or worse).
Every failure becomes a list of reasons that ``python -m posenc_fast info`` prints and the
dispatcher reports (one warning when "auto" falls back).

Run-time variables: POSENC_FAST_DISABLE_EXTENSION=1 (ignore every binary),
POSENC_FAST_NO_BUILD=1 (never build on first use), POSENC_FAST_CACHE (the cache folder),
POSENC_FAST_BUILD_WAIT (seconds to wait for another process's build, default 1800),
POSENC_FAST_DEBUG=1 (first-use builds at -O0 -g, cached under their own key),
POSENC_FAST_SANITIZE=address,undefined (the CPU part built with ASan and UBSan, cached under
its own key, loaded only where the ASan runtime was preloaded: tools/check_sanitizers.sh),
MAX_JOBS.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import importlib.machinery
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Optional

import torch

from . import _build_config as _cfg

PACKAGE_DIR = Path(__file__).resolve().parent
PARTS = tuple(_cfg.PARTS)  # ("cpu", "cuda"): the CUDA part needs the CPU part (op schemas)
OPS_VERSION = 3  # must match build_info()["ops_version"] of csrc/module.cpp, module_cuda.cpp
BUILD_HINT = "run `python -m posenc_fast build`"
INSTALL_HINT = (
    "this installation carries no C++ sources (posenc_fast/csrc): reinstall posenc_fast "
    "from a wheel or sdist of this version, or `pip install .` from a clone"
)
_WHAT = {"cpu": "the C++ extension", "cuda": "the CUDA part of the extension"}
NO_BUILD_ENV = "POSENC_FAST_NO_BUILD"
CACHE_ENV = "POSENC_FAST_CACHE"
WAIT_ENV = "POSENC_FAST_BUILD_WAIT"
DEFAULT_WAIT_S = 1800.0  # a full -O3 build took 13 min on a busy 2-core machine

_lock = threading.Lock()


def _fresh_state() -> dict[str, Any]:
    # origin: the loaded binary's path; source: where it came from ("package", "cache");
    # ignored: binaries found but refused, each with why
    return {"tried": False, "module": None, "reasons": [], "origin": None, "source": None,
            "ignored": []}  # fmt: skip


_state: dict[str, dict[str, Any]] = {part: _fresh_state() for part in PARTS}


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def module_name(part: str = "cpu") -> str:
    return f"posenc_fast.{_cfg.PARTS[part][0]}"


def _what(part: str) -> str:
    return f"{_WHAT[part]} ({module_name(part)})"


# ---------------------------------------------------------------------------------------
# Build records and binaries
# ---------------------------------------------------------------------------------------


def _record_path(part: str, directory: Optional[Path] = None) -> Path:
    return (PACKAGE_DIR if directory is None else directory) / _cfg.PARTS[part][1]


def _read_record(path: Path) -> Optional[dict]:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except Exception as exc:  # unreadable or corrupt
        return {"built": False, "error": f"unreadable build metadata {path}: {exc}"}


def _read_build_info(part: str = "cpu") -> Optional[dict]:
    """The record of the package's own (ahead-of-time) build of ``part``."""
    return _read_record(_record_path(part))


def _find_binary(part: str, directory: Path) -> Optional[Path]:
    stem = _cfg.PARTS[part][0]
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        p = directory / f"{stem}{suffix}"
        if p.exists():
            return p
    return None


def _binary_path(part: str = "cpu") -> Optional[Path]:
    """The package's own (ahead-of-time) binary of ``part``."""
    return _find_binary(part, PACKAGE_DIR)


def source_root() -> Optional[Path]:
    """The directory holding csrc/: the package itself where it was installed from a wheel
    or sdist (package data posenc_fast/csrc/), its parent in a source checkout (editable
    install, PYTHONPATH); None where neither has the sources."""
    for root in (PACKAGE_DIR, PACKAGE_DIR.parent):
        if (root / "csrc" / "module.cpp").is_file():
            return root
    return None


_hash_cache: dict[str, Optional[str]] = {}


def sources_hash() -> Optional[str]:
    """Hash of the sources this package would build from (None: it has none)."""
    root = source_root()
    if root is None:
        return None
    key = str(root)
    if key not in _hash_cache:
        _hash_cache[key] = _cfg.sources_hash(root)
    return _hash_cache[key]


def current_abi_tag() -> str:
    """The ABI tag of this process (see _build_config.abi_tag), compared with the one each
    binary recorded at build time."""
    return _cfg.abi_tag(torch.__version__, getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", None))


def _mismatch(info: dict) -> list[str]:
    """Reasons why a binary described by ``info`` must not be loaded in this process."""
    reasons = []
    built_torch = info.get("torch_version")
    if built_torch != torch.__version__:
        reasons.append(
            f"the extension was built for torch {built_torch}, this process runs torch "
            f"{torch.__version__}: rebuild it ({BUILD_HINT})"
        )
    built_abi = info.get("python_abi")
    if built_abi and built_abi != sysconfig.get_config_var("EXT_SUFFIX"):
        reasons.append(
            f"the extension was built for Python {info.get('python_version')} ({built_abi}), "
            f"this is Python {platform.python_version()}: rebuild it ({BUILD_HINT})"
        )
    tag, now = info.get("abi_tag"), current_abi_tag()
    if not reasons and tag and tag != now:  # older records have none: the checks above
        reasons.append(
            f"the extension's ABI tag {tag} (recorded at build time) is not this process's "
            f"{now}: rebuild it ({BUILD_HINT})"
        )
    built_san, want_san = list(info.get("sanitize") or []), list(_sanitizers())
    if built_san != want_san:
        built_with = ",".join(built_san) or "no sanitizer"
        reasons.append(
            f"the extension was built with {built_with}, this process asks for "
            f"{','.join(want_san) or 'none'} ({_cfg.SANITIZE_ENV})"
        )
    built_from, ours = info.get("sources_hash"), sources_hash()
    if built_from and ours and built_from != ours:
        reasons.append(
            f"the extension was built from other sources (hash {built_from[:12]}) than this "
            f"package's csrc/ ({ours[:12]}): rebuild it ({BUILD_HINT})"
        )
    return reasons


def _record_reasons(part: str, info: Optional[dict], binary: Optional[Path]) -> list[str]:
    """Why the package's own build of ``part`` cannot be loaded ([] if it may)."""
    what = _what(part)
    if info is None and binary is None:
        return [f"{what} is not built"]
    if info is not None and not info.get("built", False):
        if info.get("attempted", True) is False:  # decided at build time not to build it
            return [f"{what} was not built: {info.get('cuda_decision') or 'not requested'}"]
        return [f"building {what} failed at install time ({_cfg.error_summary(info.get('error'))})"]
    if binary is None:
        return [
            f"no compiled {what} for this Python ({sysconfig.get_config_var('EXT_SUFFIX')}) "
            f"in {PACKAGE_DIR}"
        ]
    if info is None:
        return [
            f"{binary.name} has no build metadata ({_record_path(part).name}) to check it "
            "against this torch"
        ]
    return _mismatch(info)


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
            f"{OPS_VERSION}: rebuild it ({BUILD_HINT})"
        )
    return module, ""


# ---------------------------------------------------------------------------------------
# The user cache
# ---------------------------------------------------------------------------------------


def cache_root() -> Path:
    """$POSENC_FAST_CACHE, else $XDG_CACHE_HOME/posenc_fast, else ~/.cache/posenc_fast."""
    named = os.environ.get(CACHE_ENV)
    if named:
        return Path(named).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "posenc_fast"


def _debug() -> bool:
    return _flag("POSENC_FAST_DEBUG")


def _sanitizers() -> tuple[str, ...]:
    """The sanitizers POSENC_FAST_SANITIZE asks for (none when its value is refused:
    :func:`_sanitize_problem` says why)."""
    return _cfg.sanitizers()[0]


def _sanitize_problem() -> Optional[str]:
    """Why a sanitized build cannot load in this process (None: it can, or none is asked
    for): a value of POSENC_FAST_SANITIZE the build does not offer, or AddressSanitizer
    asked for without its runtime loaded first (a library built with it aborts the process
    on import otherwise)."""
    names, problem = _cfg.sanitizers()
    if problem:
        return problem
    if "address" in names:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            maps = ""
        if "libasan" not in maps:
            return (
                f"{_cfg.SANITIZE_ENV}=address needs the ASan runtime loaded before anything "
                "else: LD_PRELOAD=$(c++ -print-file-name=libasan.so) (tools/check_sanitizers.sh)"
            )
    return None


def cache_key() -> Optional[str]:
    """The cache folder's name for this process: ABI tag (torch version and C++ ABI, Python,
    machine), then the sources' hash, so that a build is reused only where it is valid.
    None where there are no sources (nothing to build, nothing to look up)."""
    digest = sources_hash()
    if digest is None:
        return None
    san = "".join(f"-{name}" for name in _sanitizers())
    return f"{current_abi_tag()}-src{digest[:16]}" + ("-debug" if _debug() else "") + san


def cache_dir(part: str = "cpu") -> Optional[Path]:
    """Where ``part``'s build for this process lives in the cache (None: no sources)."""
    key = cache_key()
    return None if key is None else cache_root() / key / part


def _cache_candidate(part: str) -> tuple[Optional[Path], list[str]]:
    """(the cached binary of ``part`` if it may be loaded, reasons it may not)."""
    directory = cache_dir(part)
    if directory is None or not directory.is_dir():
        return None, []
    info = _read_record(_record_path(part, directory))
    binary = _find_binary(part, directory)
    if info is None or binary is None or not info.get("built"):
        return None, [f"incomplete build in the cache: {directory}"]
    stale = _mismatch(info)
    return (None, [f"{binary}: {r}" for r in stale]) if stale else (binary, [])


# ---------------------------------------------------------------------------------------
# Finding and loading a part
# ---------------------------------------------------------------------------------------


def _try_load(part: str = "cpu") -> tuple[Optional[ModuleType], list[str], Optional[str]]:
    """(module or None, reasons it is unavailable, origin path). Records where it came from
    and what was ignored in _state[part] ("source", "ignored")."""
    state = _state[part]
    state["source"], state["ignored"] = None, []
    if _flag("POSENC_FAST_DISABLE_EXTENSION"):
        return None, ["disabled by POSENC_FAST_DISABLE_EXTENSION"], None
    problem = _sanitize_problem()
    if problem:
        return None, [problem], None
    if part != "cpu" and load("cpu") is None:  # the ops it implements are defined there
        return None, [f"{_what(part)} needs {_what('cpu')}, which is unavailable"], None

    # 1. the package's own ahead-of-time build
    binary = _binary_path(part)
    info = _read_build_info(part)
    package_reasons = _record_reasons(part, info, binary)
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
    cached, cache_reasons = _cache_candidate(part)
    ignored += cache_reasons
    if cached is not None:
        module, why = _import_checked(part, cached, in_package=False)
        if module is not None:
            state.update(source="cache", ignored=ignored)
            return module, [], str(cached)
        ignored.append(why)

    # 3. a first-use build (the CPU part only; the CUDA part on request)
    if part == "cpu":
        built, why = _first_use_build(part)
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
    return None, [*ignored, f"{_what(part)} is not built: {how}"], None


def _cached_failure(part: str) -> Optional[str]:
    """The remembered failure of the last build of ``part`` into the cache for this torch
    and these sources (``<part>.failed.json``), as a reason; None if there is none."""
    target = cache_dir(part)
    record = _read_record(target.parent / f"{part}.failed.json") if target is not None else None
    return None if record is None else _failure_reason(part, record)


def _failure_reason(part: str, record: dict, when: str = "") -> str:
    """A remembered failed build (``<part>.failed.json``'s record) as a reason."""
    return (
        f"building {_what(part)}{when} failed at {record.get('build_time')} "
        f"({_cfg.error_summary(record.get('error'))}; the log: {record.get('log')}): fix it, "
        f"then {BUILD_HINT}"
    )


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
        return _read_record(_record_path(part, Path(origin).parent))
    return _read_build_info(part)


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
        "cache_dir": str(cache_dir(part)) if cache_dir(part) else None,
        "abi_tag": current_abi_tag(),
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


# ---------------------------------------------------------------------------------------
# Building into the cache
# ---------------------------------------------------------------------------------------


def _say(message: str) -> None:
    print(f"posenc_fast: {message}", file=sys.stderr, flush=True)


def _build_blockers() -> Optional[str]:
    """Why this process cannot compile at all (None: it can try)."""
    if source_root() is None:
        return INSTALL_HINT
    cxx, why = _cfg.find_cxx()
    if cxx is None:
        return f"{why}: install one (e.g. g++) or set CXX, then {BUILD_HINT}"
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        return f"ninja is not installed (`pip install ninja`), then {BUILD_HINT}"
    return None


def _first_use_build(part: str) -> tuple[Optional[Path], str]:
    """Build ``part`` into the cache on first use, where allowed: (binary, "") or (None,
    why it is unavailable, saying how to build)."""
    what = _what(part)
    if _flag(NO_BUILD_ENV):
        return None, (
            f"{what} is not built for this torch and {NO_BUILD_ENV} forbids building it on "
            f"first use: {BUILD_HINT}"
        )
    blocker = _build_blockers()
    if blocker:
        return None, f"{what} is not built for this torch and cannot be built here: {blocker}"
    try:
        return build_part(part, first_use=True)
    except Exception as exc:  # the first call of an op must fall back, not crash
        return None, (
            f"building {what} on first use failed ({type(exc).__name__}: {exc}): {BUILD_HINT}"
        )


def _wait_limit() -> float:
    try:
        return float(os.environ.get(WAIT_ENV, DEFAULT_WAIT_S))
    except ValueError:
        return DEFAULT_WAIT_S


@contextlib.contextmanager
def _exclusive(lock_path: Path, wait_s: float, waiting: Callable[[], None]):
    """Hold an exclusive flock on ``lock_path``: yields True once held, False when another
    holder kept it for ``wait_s`` seconds (``waiting()`` is called once, when it must wait).
    flock, not a lock file's existence: the lock dies with its process, so a crashed build
    never blocks the next one."""
    import fcntl

    with open(lock_path, "a+") as f:
        deadline = time.monotonic() + wait_s
        told = False
        while True:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    yield False
                    return
                if not told:
                    waiting()
                    told = True
                time.sleep(0.5)
        try:
            yield True
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def build_part(
    part: str = "cpu",
    *,
    first_use: bool = False,
    force: bool = False,
    verbose: bool = False,
    plan: Optional[dict] = None,
) -> tuple[Optional[Path], str]:
    """Compile ``part`` into the cache folder of this process (:func:`cache_dir`) unless a
    valid build is already there; (binary, "") or (None, why not). Safe across processes:
    one builds under an exclusive lock on ``<key>/<part>.lock``, the others wait for it
    (POSENC_FAST_BUILD_WAIT seconds) and load its result. The build runs in a temporary
    folder renamed into place when complete, so no process ever sees half a build.

    first_use: a failed build is remembered (``<part>.failed.json``) and not retried on
    first use, only by an explicit build (otherwise every process, every DataLoader worker,
    would spend minutes failing again). force: rebuild even where a valid build exists.
    plan: _build_config.plan_build's result to build from (default: this process's)."""
    what = _what(part)
    target = cache_dir(part)
    if target is None:
        return None, f"{what} is not built and cannot be: {INSTALL_HINT}"
    key_dir = target.parent
    failed = key_dir / f"{part}.failed.json"
    try:
        key_dir.mkdir(parents=True, exist_ok=True)
        lock_path = key_dir / f"{part}.lock"
        lock_path.touch()
    except OSError as exc:
        return None, (
            f"{what} is not built for this torch and the build cache {cache_root()} is not "
            f"writable ({type(exc).__name__}: {exc}): set {CACHE_ENV} to a writable folder, "
            f"then {BUILD_HINT}"
        )
    wait_s = _wait_limit()

    def waiting():
        _say(f"another process is building {what} into {target}; waiting for it (up to "
             f"{wait_s:.0f} s, {WAIT_ENV})")  # fmt: skip

    with _exclusive(lock_path, wait_s, waiting) as held:
        if not held:
            return None, (
                f"another process has been building {what} into {target} for over "
                f"{wait_s:.0f} s ({WAIT_ENV}): using the fallback in this process"
            )
        if not force:
            cached, _stale = _cache_candidate(part)
            if cached is not None:  # built by another process meanwhile, or earlier
                if not first_use:
                    _say(f"{what} is already built for this torch and these sources: {cached}")
                return cached, ""
            record = _read_record(failed)
            if first_use and record is not None:
                return None, _failure_reason(part, record, " on first use")
        return _compile_into(part, target, failed, verbose=verbose, plan=plan)


# The child process that compiles. torch.utils.cpp_extension.load() also imports what it
# built; the CUDA part cannot be imported without the CPU part (it implements ops defined
# there), and the parent imports the binary from its final place anyway: the import is
# replaced by a no-op (a private function of torch: where it is renamed, load() imports
# the CPU part harmlessly and the CUDA part's import error fails the build, not silently).
_CHILD = """
import json, sys
from torch.utils import cpp_extension
spec = json.loads(sys.argv[1])
cuda_home = spec.pop("cuda_home")
if cuda_home:  # the toolkit _build_config.find_cuda_toolkit found, not torch's guess
    cpp_extension.CUDA_HOME = cuda_home
cpp_extension._import_module_from_library = lambda *args, **kwargs: None
cpp_extension.load(verbose=True, **spec)
"""

_NINJA_STEP = re.compile(r"^\[(\d+)/(\d+)\]\s+(.*)$")


def _step(line: str) -> Optional[str]:
    """A ninja progress line ("[3/10] c++ ... -c /x/csrc/lff/lff_cpu.cpp -o lff_cpu.o") as
    "[3/10] compiled lff_cpu.cpp"; None for any other line. Into a pipe, ninja prints a
    step's line when the step has finished ([finished/total])."""
    m = _NINJA_STEP.match(line.strip())
    if not m:
        return None
    n, total, command = m.groups()
    src = re.search(r"\s-c\s+(\S+)", command)
    done = f"compiled {os.path.basename(src.group(1))}" if src else "linked"
    return f"[{n}/{total}] {done}"


def _compile_into(
    part: str, target: Path, failed: Path, verbose: bool, plan: Optional[dict]
) -> tuple[Optional[Path], str]:
    """Compile ``part`` in a child process into a temporary folder beside ``target``, then
    rename it into place (under the caller's lock)."""
    what = _what(part)
    root = source_root()
    assert root is not None
    plan = plan or _cfg.plan_build(
        torch_version=torch.__version__,
        torch_cuda_version=torch.version.cuda,
        debug=_debug(),
        no_cuda="first-use build: CPU part only" if part == "cpu" else None,
        cxx11_abi=getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", None),
        source_root=root,
        sanitize=_sanitizers(),
    )
    spec = plan[part]
    tmp = Path(tempfile.mkdtemp(prefix=f".{part}.tmp", dir=target.parent))
    build_dir, out_dir = tmp / "build", tmp / "out"
    build_dir.mkdir()
    out_dir.mkdir()
    child = {
        "name": spec["module"],
        "sources": [str(root / s) for s in spec["sources"]],
        # load() writes these into its ninja file unquoted (setup.py's builds quote them):
        # the shell would strip the quotes of -DPOSENC_FAST_CUDA_ARCHS="..." and split at ';'
        "extra_cflags": [shlex.quote(flag) for flag in spec["cxx"]],
        "extra_cuda_cflags": spec.get("nvcc") if part == "cuda" else None,
        "extra_ldflags": spec["ldflags"] if part == "cpu" else None,
        "extra_include_paths": [str(root / "csrc")],
        "build_directory": str(build_dir),
        "with_cuda": part == "cuda",
        "is_python_module": True,
    }
    child["cuda_home"] = plan["toolkit"]["root"] if part == "cuda" else None
    # The child imports torch only; PYTHONPATH is not needed (it never imports posenc_fast).
    jobs = os.environ.get("MAX_JOBS") or "ninja's default"
    _say(f"building {what} for torch {torch.__version__} into {target} (once per torch "
         f"version and sources; a few minutes; MAX_JOBS={jobs}; {NO_BUILD_ENV}=1 forbids "
         "first-use builds)")  # fmt: skip
    start = time.monotonic()
    log_path = target.parent / f"{part}.build.log"
    tail: collections.deque[str] = collections.deque(maxlen=400)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, json.dumps(child)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            env=dict(os.environ, PYTHONUNBUFFERED="1"),  # torch's messages as they come
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            log.flush()  # the log is what to read while a build seems slow
            tail.append(line)
            step = _step(line)
            if verbose:
                print(line, end="", file=sys.stderr, flush=True)
            elif step:
                _say(step)
        rc = proc.wait()
    seconds = time.monotonic() - start
    built = build_dir / f"{spec['module']}.so"
    record = dict(
        spec["record"],
        how="first-use build (posenc_fast._extension, torch.utils.cpp_extension.load)",
        build_time=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        build_seconds=round(seconds, 1),
        log=str(log_path),
    )
    if rc != 0 or not built.is_file():
        error = "".join(tail) or f"the compiler process exited with status {rc}"
        record.update(built=False, error=_cfg.error_record(error))
        _cfg.write_json_atomic(failed, record)
        shutil.rmtree(tmp, ignore_errors=True)
        summary = _cfg.error_summary(error)
        _say(f"building {what} failed after {seconds:.0f} s ({summary}); the log: {log_path}")
        return (
            None,
            f"building {what} failed ({summary}; the log: {log_path}): fix it, then {BUILD_HINT}",
        )
    binary = out_dir / f"{spec['module']}{sysconfig.get_config_var('EXT_SUFFIX')}"
    os.replace(built, binary)
    _cfg.write_json_atomic(
        _record_path(part, out_dir), dict(record, built=True, binary=binary.name)
    )
    if target.exists():  # a forced rebuild, or a build refused as incomplete: set aside
        os.replace(target, tmp / "old")  # processes that mapped the old binary keep it
    os.replace(out_dir, target)  # atomic: other processes see no build or a complete one
    shutil.rmtree(tmp, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        failed.unlink()
    _say(f"built {what} in {seconds:.0f} s: {target}")
    return target / binary.name, ""


def build(
    cuda: Optional[bool] = None, force: bool = False, verbose: bool = False
) -> dict[str, dict[str, Any]]:
    """``python -m posenc_fast build``: build what this process lacks into the cache, with
    progress, whatever POSENC_FAST_NO_BUILD says (it is explicit). The CPU part unless the
    package's own build is valid here (force: in any case); the CUDA part where torch has
    CUDA and a matching toolkit is found (cuda None; POSENC_FAST_NO_CUDA and
    POSENC_FAST_FORCE_CUDA apply as in setup.py), never (False) or in any case (True).
    Must run before this process loads the extension. Returns per part {"built": path or
    None, "skipped": why not built or None, "error": why the build failed or None}."""
    from torch.utils import cpp_extension

    if any(_state[p]["module"] is not None for p in PARTS):
        raise RuntimeError("the extension is already loaded in this process; build in a new one")
    blocker = _build_blockers()
    if blocker:
        raise RuntimeError(f"posenc_fast: cannot build {_what('cpu')} here: {blocker}")
    plan = _cfg.plan_build(
        torch_version=torch.__version__,
        torch_cuda_version=torch.version.cuda,
        debug=_debug(),
        no_cuda=(
            "not requested (--cuda no)"
            if cuda is False
            else "POSENC_FAST_NO_CUDA is set"
            if cuda is None and _flag("POSENC_FAST_NO_CUDA")
            else None
        ),
        force_cuda=(
            "requested (--cuda yes)"
            if cuda
            else "POSENC_FAST_FORCE_CUDA is set"
            if cuda is None and _flag("POSENC_FAST_FORCE_CUDA")
            else None
        ),
        cxx11_abi=getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", None),
        source_root=source_root(),
        sanitize=_sanitizers(),
    )
    if plan["cuda"]["build"]:
        _cfg.use_toolkit(cpp_extension, plan["toolkit"])
    out: dict[str, dict[str, Any]] = {}
    for part in PARTS:
        result: dict[str, Any] = {"built": None, "skipped": None, "error": None}
        out[part] = result
        if part == "cuda" and not plan["cuda"]["build"]:
            result["skipped"] = plan["cuda"]["record"]["cuda_decision"]
            continue
        package_ok = not _record_reasons(part, _read_build_info(part), _binary_path(part))
        if part == "cpu" and not force and package_ok:
            result["skipped"] = (
                f"the package's own build {_binary_path(part)} is valid for this torch "
                "(--force builds into the cache anyway)"
            )
            continue
        if part == "cuda" and out["cpu"]["error"]:
            result["skipped"] = "the CPU part failed to build"
            continue
        path, why = build_part(part, force=force, verbose=verbose, plan=plan)
        result["built"], result["error"] = (str(path), None) if path else (None, why)
    # Load what there is now, so the caller can report it.
    for state in _state.values():
        state.update(_fresh_state())
    return out
