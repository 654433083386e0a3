"""Where the compiled extension's binaries live and whether one may be loaded here: the
package's own build and the user cache (a folder per torch, C++ ABI, Python, machine and
sources hash), each binary with the build record beside it that says what it was built for.
Shared by the loader (_extension.py) and the first-use build (_extension_build.py)."""

from __future__ import annotations

import importlib.machinery
import json
import os
import platform
import sysconfig
from pathlib import Path
from typing import Optional

import torch

from . import _build_config as _cfg

PACKAGE_DIR = Path(__file__).resolve().parent

PARTS = tuple(_cfg.PARTS)  # ("cpu", "cuda"): the CUDA part needs the CPU part (op schemas)

BUILD_HINT = "run `python -m posenc_fast build`"

INSTALL_HINT = (
    "this installation carries no C++ sources (posenc_fast/csrc): reinstall posenc_fast "
    "from a wheel or sdist of this version, or `pip install .` from a clone"
)

_WHAT = {"cpu": "the C++ extension", "cuda": "the CUDA part of the extension"}

NO_BUILD_ENV = "POSENC_FAST_NO_BUILD"

CACHE_ENV = "POSENC_FAST_CACHE"


def flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def module_name(part: str = "cpu") -> str:
    return f"posenc_fast.{_cfg.PARTS[part][0]}"


def label(part: str) -> str:
    return f"{_WHAT[part]} ({module_name(part)})"


# ---------------------------------------------------------------------------------------
# Build records and binaries
# ---------------------------------------------------------------------------------------


def record_path(part: str, directory: Optional[Path] = None) -> Path:
    return (PACKAGE_DIR if directory is None else directory) / _cfg.PARTS[part][1]


def read_record(path: Path) -> Optional[dict]:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except Exception as exc:  # unreadable or corrupt
        return {"built": False, "error": f"unreadable build metadata {path}: {exc}"}


def read_build_info(part: str = "cpu") -> Optional[dict]:
    """The record of the package's own (ahead-of-time) build of ``part``."""
    return read_record(record_path(part))


def find_binary(part: str, directory: Path) -> Optional[Path]:
    stem = _cfg.PARTS[part][0]
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        p = directory / f"{stem}{suffix}"
        if p.exists():
            return p
    return None


def binary_path(part: str = "cpu") -> Optional[Path]:
    """The package's own (ahead-of-time) binary of ``part``."""
    return find_binary(part, PACKAGE_DIR)


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


def mismatch(info: dict) -> list[str]:
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
    built_san, want_san = list(info.get("sanitize") or []), list(sanitizers())
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


def record_reasons(part: str, info: Optional[dict], binary: Optional[Path]) -> list[str]:
    """Why the package's own build of ``part`` cannot be loaded ([] if it may)."""
    what = label(part)
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
            f"{binary.name} has no build metadata ({record_path(part).name}) to check it "
            "against this torch"
        ]
    return mismatch(info)


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


def debug() -> bool:
    return flag("POSENC_FAST_DEBUG")


def sanitizers() -> tuple[str, ...]:
    """The sanitizers POSENC_FAST_SANITIZE asks for (none when its value is refused:
    :func:`sanitize_problem` says why)."""
    return _cfg.sanitizers()[0]


def sanitize_problem() -> Optional[str]:
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
    san = "".join(f"-{name}" for name in sanitizers())
    return f"{current_abi_tag()}-src{digest[:16]}" + ("-debug" if debug() else "") + san


def cache_dir(part: str = "cpu") -> Optional[Path]:
    """Where ``part``'s build for this process lives in the cache (None: no sources)."""
    key = cache_key()
    return None if key is None else cache_root() / key / part


def cache_candidate(part: str) -> tuple[Optional[Path], list[str]]:
    """(the cached binary of ``part`` if it may be loaded, reasons it may not)."""
    directory = cache_dir(part)
    if directory is None or not directory.is_dir():
        return None, []
    info = read_record(record_path(part, directory))
    binary = find_binary(part, directory)
    if info is None or binary is None or not info.get("built"):
        return None, [f"incomplete build in the cache: {directory}"]
    stale = mismatch(info)
    return (None, [f"{binary}: {r}" for r in stale]) if stale else (binary, [])


def failure_reason(part: str, record: dict, when: str = "") -> str:
    """A remembered failed build (``<part>.failed.json``'s record) as a reason."""
    return (
        f"building {label(part)}{when} failed at {record.get('build_time')} "
        f"({_cfg.error_summary(record.get('error'))}; the log: {record.get('log')}): fix it, "
        f"then {BUILD_HINT}"
    )
