"""Loader of the optional compiled extension ``posenc_fast._C`` (csrc/).

Importing posenc_fast never loads the binary: the "cpp" and "cuda" backends call
:func:`load` the first time they are asked whether they can run. Before importing the
binary, the build metadata written beside it (``_build_info.json``, see setup.py) is
checked, so a binary built for another torch is reported, not loaded (loading it could
fail with undefined symbols or worse). Every failure becomes a list of reasons that
``python -m posenc_fast info`` prints and the dispatcher reports.

Building:
- ahead of time: ``pip install --no-build-isolation -e .`` (setup.py);
- just in time, opt-in, for a source checkout: :func:`jit_build` or
  ``python -m posenc_fast._extension build`` (torch.utils.cpp_extension.load, ninja).
  It is never triggered by importing posenc_fast or by collecting the tests.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import json
import os
import platform
import shutil
import sys
import sysconfig
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Optional

import torch

from . import _build_config as _cfg

PACKAGE_DIR = Path(__file__).resolve().parent
BUILD_INFO = PACKAGE_DIR / _cfg.BUILD_INFO
MODULE_NAME = "posenc_fast._C"
OPS_VERSION = 2  # must match csrc/module.cpp build_info()["ops_version"]
INSTALL_HINT = "build it with `pip install --no-build-isolation -e .` (torch must be installed)"

_lock = threading.Lock()
_state: dict[str, Any] = {"tried": False, "module": None, "reasons": [], "origin": None}


def _read_build_info(path: Path = BUILD_INFO) -> Optional[dict]:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except Exception as exc:  # unreadable or corrupt
        return {"built": False, "error": f"unreadable build metadata {path}: {exc}"}


def _binary_path() -> Optional[Path]:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        p = PACKAGE_DIR / f"_C{suffix}"
        if p.exists():
            return p
    return None


def _mismatch(info: dict) -> list[str]:
    """Reasons why a binary described by ``info`` must not be loaded in this process."""
    reasons = []
    built_torch = info.get("torch_version")
    if built_torch != torch.__version__:
        reasons.append(
            f"the extension was built for torch {built_torch}, this process runs torch "
            f"{torch.__version__}: rebuild it ({INSTALL_HINT})"
        )
    built_abi = info.get("python_abi")
    if built_abi and built_abi != sysconfig.get_config_var("EXT_SUFFIX"):
        reasons.append(
            f"the extension was built for Python {info.get('python_version')} ({built_abi}), "
            f"this is Python {platform.python_version()}: rebuild it"
        )
    return reasons


def _import_binary(path: Optional[Path] = None) -> ModuleType:
    if path is None:
        return importlib.import_module(MODULE_NAME)
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[MODULE_NAME] = module
    return module


def _try_load() -> tuple[Optional[ModuleType], list[str], Optional[str]]:
    if os.environ.get("POSENC_FAST_DISABLE_EXTENSION", "") not in ("", "0"):
        return None, ["disabled by POSENC_FAST_DISABLE_EXTENSION"], None
    info = _read_build_info()
    binary = _binary_path()
    if info is None and binary is None:
        return None, [f"the C++/CUDA extension is not built: {INSTALL_HINT}"], None
    if info is not None and not info.get("built", False):
        err = (info.get("error") or "unknown error").strip().splitlines()[-1]
        return None, [f"building the extension failed at install time ({err})"], None
    if binary is None:
        return (
            None,
            [
                f"no compiled extension for this Python ({sysconfig.get_config_var('EXT_SUFFIX')}) "
                f"in {PACKAGE_DIR}: {INSTALL_HINT}"
            ],
            None,
        )
    if info is None:
        return (
            None,
            [
                f"{binary.name} has no build metadata ({BUILD_INFO.name}) to check it against this "
                f"torch; {INSTALL_HINT}"
            ],
            None,
        )
    reasons = _mismatch(info)
    if reasons:
        return None, reasons, None
    try:
        module = _import_binary()
    except Exception as exc:  # ImportError, OSError (undefined symbol, missing library), ...
        return None, [f"loading {binary.name} failed ({type(exc).__name__}: {exc})"], None
    built = module.build_info()
    if built.get("ops_version") != OPS_VERSION:
        return (
            None,
            [
                f"the extension has op version {built.get('ops_version')}, this package expects "
                f"{OPS_VERSION}: rebuild it"
            ],
            None,
        )
    return module, [], str(binary)


def load() -> Optional[ModuleType]:
    """The extension module, or None (then :func:`reasons` says why). Loads at most once."""
    if _state["tried"]:  # the common case: no lock, so dynamo can trace it after the first load
        return _state["module"]
    with _lock:
        if not _state["tried"]:
            _state["tried"] = True
            module, reasons, origin = _try_load()
            _state.update(module=module, reasons=reasons, origin=origin)
        return _state["module"]


def reasons() -> list[str]:
    """Why the extension is unavailable ([] when it is loaded)."""
    load()
    return list(_state["reasons"])


def extension_build_metadata() -> Optional[dict]:
    """The build metadata recorded beside the binary (setup.py), or None."""
    return _read_build_info()


def has_cuda() -> bool:
    m = load()
    return bool(m is not None and m.build_info().get("with_cuda"))


def extension_info() -> dict:
    """What ``python -m posenc_fast info`` shows about the compiled extension."""
    module = load()
    out: dict[str, Any] = {
        "available": module is not None,
        "reasons": reasons(),
        "path": _state["origin"],
        "build_metadata": _read_build_info(),
    }
    if module is not None:
        out["build_info"] = dict(module.build_info())
        out["cpu_isa"] = module.cpu_isa()
        if out["build_info"].get("with_cuda") and hasattr(module, "cuda_runtime_version"):
            try:
                out["cuda_runtime_version"] = module.cuda_runtime_version()
            except Exception as exc:
                out["cuda_runtime_version"] = f"unavailable ({exc})"
    from .backends import extension_backends as eb

    out["backends"] = {
        "cpp": eb.CppBackend().environment_reasons(),
        "cuda": eb.CudaBackend().environment_reasons(),
    }
    return out


# ---------------------------------------------------------------------------------------
# Opt-in just-in-time build (source checkouts)
# ---------------------------------------------------------------------------------------

SOURCE_ROOT = PACKAGE_DIR.parent


def jit_build(
    with_cuda: Optional[bool] = None, verbose: bool = False, install: bool = True
) -> ModuleType:
    """Compile the extension from csrc/ with torch.utils.cpp_extension.load and load it.

    with_cuda: None builds the CUDA part when torch has CUDA and a toolkit is found.
    install: copy the binary into the package with its build metadata, so later processes
    load it like an ahead-of-time build. Raises if this process already loaded one.
    """
    from torch.utils import cpp_extension

    if not (SOURCE_ROOT / "csrc" / "module.cpp").exists():
        raise RuntimeError(f"no csrc/ beside {PACKAGE_DIR}: the JIT build needs a source checkout")
    with _lock:
        if _state["module"] is not None:
            raise RuntimeError(
                "the extension is already loaded in this process; build in a new process"
            )
    if with_cuda is None:
        with_cuda, cuda_decision = _cfg.cuda_availability(
            torch.__version__, torch.version.cuda, cpp_extension.CUDA_HOME
        )
    else:
        cuda_decision = f"jit_build(with_cuda={with_cuda})"
    sources = [str(SOURCE_ROOT / s) for s in _cfg.CPU_SOURCES]
    cflags = _cfg.cxx_flags()
    nvcc_flags = _cfg.nvcc_flags()
    archs = None
    if with_cuda:
        archs = _cfg.resolve_cuda_archs()
        sources += [str(SOURCE_ROOT / s) for s in _cfg.CUDA_SOURCES]
        cflags += ["-DPOSENC_FAST_WITH_CUDA", f'-DPOSENC_FAST_CUDA_ARCHS="{archs}"']
        nvcc_flags += ["-DPOSENC_FAST_WITH_CUDA"]
    build_dir = (
        SOURCE_ROOT / "build" / f"jit-{sys.implementation.cache_tag}-torch{torch.__version__}"
    )
    build_dir.mkdir(parents=True, exist_ok=True)
    name = "_C"
    module = cpp_extension.load(
        name=name,
        sources=sources,
        extra_cflags=cflags,
        extra_cuda_cflags=nvcc_flags,
        extra_ldflags=["-fopenmp"],
        extra_include_paths=[str(SOURCE_ROOT / "csrc")],
        build_directory=str(build_dir),
        with_cuda=with_cuda,
        is_python_module=True,
        verbose=verbose,
    )
    if install:
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        built = Path(module.__file__)
        shutil.copy2(built, PACKAGE_DIR / f"_C{suffix}")
        record = _cfg.build_metadata(
            torch_version=torch.__version__,
            torch_cuda_version=torch.version.cuda,
            with_cuda=with_cuda,
            cuda_decision=cuda_decision,
            cuda_home=cpp_extension.CUDA_HOME,
            cuda_archs=archs,
            debug=False,
            cxx=cflags,
            nvcc=nvcc_flags,
        )
        record.update(
            built=True,
            binary=f"_C{suffix}",
            build_time=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            how="jit_build (torch.utils.cpp_extension.load)",
        )
        _cfg.write_json_atomic(BUILD_INFO, record)
    with _lock:
        sys.modules[MODULE_NAME] = module
        _state.update(
            tried=True, module=module, reasons=[], origin=str(getattr(module, "__file__", ""))
        )
    return module


def _main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m posenc_fast._extension")
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser(
        "build", help="JIT-build the extension from csrc/ and install it into the package"
    )
    b.add_argument("--cuda", choices=("auto", "yes", "no"), default="auto")
    b.add_argument("--no-install", action="store_true")
    b.add_argument("-v", "--verbose", action="store_true")
    sub.add_parser("info", help="print the extension's status as JSON")
    args = parser.parse_args(argv)
    if args.cmd == "build":
        with_cuda = {"auto": None, "yes": True, "no": False}[args.cuda]
        m = jit_build(with_cuda=with_cuda, verbose=args.verbose, install=not args.no_install)
        print(json.dumps(dict(m.build_info()), indent=2, sort_keys=True))
        return 0
    print(json.dumps(extension_info(), indent=2, sort_keys=True, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
