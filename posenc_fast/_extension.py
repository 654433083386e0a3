"""Loader of the optional compiled extension (csrc/): two modules, loaded independently.

- ``posenc_fast._C``, the CPU part: defines the ops and their CPU kernels ("cpp" backend);
- ``posenc_fast._C_cuda``, the CUDA part: CUDA kernels of the same ops ("cuda" backend,
  which needs both). A CUDA part that was not built, or failed to, costs nothing else.

Importing posenc_fast never loads a binary: the "cpp" and "cuda" backends call :func:`load`
the first time they are asked whether they can run. Before importing a binary, the build
record written beside it (``_build_info.json``, ``_build_info_cuda.json``: see setup.py) is
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
import shlex
import shutil
import sys
import sysconfig
import threading
import time
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any, Optional

import torch

from . import _build_config as _cfg

PACKAGE_DIR = Path(__file__).resolve().parent
PARTS = tuple(_cfg.PARTS)  # ("cpu", "cuda"): the CUDA part needs the CPU part (op schemas)
OPS_VERSION = 3  # must match build_info()["ops_version"] of csrc/module.cpp, module_cuda.cpp
INSTALL_HINT = "build it with `pip install --no-build-isolation -e .` (torch must be installed)"
_WHAT = {"cpu": "the C++ extension", "cuda": "the CUDA part of the extension"}

_lock = threading.Lock()
_state: dict[str, dict[str, Any]] = {
    part: {"tried": False, "module": None, "reasons": [], "origin": None} for part in PARTS
}


def module_name(part: str = "cpu") -> str:
    return f"posenc_fast.{_cfg.PARTS[part][0]}"


def _what(part: str) -> str:
    return f"{_WHAT[part]} ({module_name(part)})"


def _record_path(part: str) -> Path:
    return PACKAGE_DIR / _cfg.PARTS[part][1]


def _read_build_info(part: str = "cpu") -> Optional[dict]:
    path = _record_path(part)
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except Exception as exc:  # unreadable or corrupt
        return {"built": False, "error": f"unreadable build metadata {path}: {exc}"}


def _binary_path(part: str = "cpu") -> Optional[Path]:
    stem = _cfg.PARTS[part][0]
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        p = PACKAGE_DIR / f"{stem}{suffix}"
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


def _record_reasons(part: str, info: Optional[dict], binary: Optional[Path]) -> list[str]:
    """Why the part cannot be loaded, from its build record and binary alone ([] if it may)."""
    what = _what(part)
    if info is None and binary is None:
        return [f"{what} is not built: {INSTALL_HINT}"]
    if info is not None and not info.get("built", False):
        if info.get("attempted", True) is False:  # decided at build time not to build it
            return [f"{what} was not built: {info.get('cuda_decision') or 'not requested'}"]
        return [f"building {what} failed at install time ({_cfg.error_summary(info.get('error'))})"]
    if binary is None:
        return [
            f"no compiled {what} for this Python ({sysconfig.get_config_var('EXT_SUFFIX')}) "
            f"in {PACKAGE_DIR}: {INSTALL_HINT}"
        ]
    if info is None:
        return [
            f"{binary.name} has no build metadata ({_record_path(part).name}) to check it "
            f"against this torch; {INSTALL_HINT}"
        ]
    return _mismatch(info)


def _try_load(part: str = "cpu") -> tuple[Optional[ModuleType], list[str], Optional[str]]:
    if os.environ.get("POSENC_FAST_DISABLE_EXTENSION", "") not in ("", "0"):
        return None, ["disabled by POSENC_FAST_DISABLE_EXTENSION"], None
    binary = _binary_path(part)
    reasons = _record_reasons(part, _read_build_info(part), binary)
    if reasons:
        return None, reasons, None
    assert binary is not None
    if part != "cpu" and load("cpu") is None:  # the ops it implements are defined there
        return None, [f"{_what(part)} needs {_what('cpu')}, which is unavailable"], None
    try:
        module = _import_binary(part)
    except Exception as exc:  # ImportError, OSError (undefined symbol, missing library), ...
        return None, [f"loading {binary.name} failed ({type(exc).__name__}: {exc})"], None
    built = module.build_info()
    if built.get("ops_version") != OPS_VERSION:
        return (
            None,
            [
                f"{binary.name} has op version {built.get('ops_version')}, this package expects "
                f"{OPS_VERSION}: rebuild it"
            ],
            None,
        )
    return module, [], str(binary)


def load(part: str = "cpu") -> Optional[ModuleType]:
    """The module of ``part`` ("cpu": posenc_fast._C, "cuda": posenc_fast._C_cuda), or None
    (then :func:`reasons` says why). Loads each at most once; "cuda" loads "cpu" first."""
    state = _state[part]
    if state["tried"]:  # the common case: no lock, so dynamo can trace it after the first load
        return state["module"]
    if part != "cpu":
        load("cpu")  # outside the lock: the lock is not reentrant
    with _lock:
        if not state["tried"]:
            module, reasons, origin = _try_load(part)
            state.update(tried=True, module=module, reasons=reasons, origin=origin)
        return state["module"]


def reasons(part: str = "cpu") -> list[str]:
    """Why ``part`` is unavailable ([] when it is loaded)."""
    load(part)
    return list(_state[part]["reasons"])


def extension_build_metadata(part: str = "cpu") -> Optional[dict]:
    """The build record written beside ``part``'s binary (setup.py, jit_build), or None."""
    return _read_build_info(part)


def has_cuda() -> bool:
    """Whether the CUDA part is loaded (it needs no GPU to load)."""
    return load("cuda") is not None


def _part_info(part: str) -> dict:
    module = load(part)
    out: dict[str, Any] = {
        "module": module_name(part),
        "available": module is not None,
        "reasons": reasons(part),
        "path": _state[part]["origin"],
        "build_metadata": _read_build_info(part),
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
    status, reasons and build record (the CLI adds what the "cpp"/"cuda" backends make of
    it: this module sits below the dispatcher and never imports it)."""
    return {part: _part_info(part) for part in PARTS}


# ---------------------------------------------------------------------------------------
# Opt-in just-in-time build (source checkouts)
# ---------------------------------------------------------------------------------------

SOURCE_ROOT = PACKAGE_DIR.parent


def _install_jit(part: str, record: dict, built: Optional[Path]) -> None:
    """Put a JIT build into the package like an ahead-of-time one: the binary (or, after a
    failure, no binary) and its build record."""
    stem, suffix = _cfg.PARTS[part][0], sysconfig.get_config_var("EXT_SUFFIX")
    target = PACKAGE_DIR / f"{stem}{suffix}"
    if built is not None:
        tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
        shutil.copy2(built, tmp)
        os.replace(tmp, target)  # processes that mapped the old binary keep its inode
        record = dict(record, binary=target.name)
    elif target.exists():
        target.unlink()  # an earlier build's binary, which the record no longer describes
    record = dict(record, build_time=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    _cfg.write_json_atomic(_record_path(part), record)


def _jit_part(part: str, plan: dict, build_root: Path, verbose: bool) -> ModuleType:
    from torch.utils import cpp_extension

    spec = plan[part]
    build_dir = build_root / part
    build_dir.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        name=spec["module"],
        sources=[str(SOURCE_ROOT / s) for s in spec["sources"]],
        # load() writes these into its ninja file unquoted (setup.py's builds quote them):
        # the shell would strip the quotes of -DPOSENC_FAST_CUDA_ARCHS="..." and split at ';'
        extra_cflags=[shlex.quote(flag) for flag in spec["cxx"]],
        extra_cuda_cflags=spec.get("nvcc"),
        extra_ldflags=["-fopenmp"] if part == "cpu" else None,
        extra_include_paths=[str(SOURCE_ROOT / "csrc")],
        build_directory=str(build_dir),
        with_cuda=part == "cuda",
        is_python_module=True,
        verbose=verbose,
    )


def jit_build(
    with_cuda: Optional[bool] = None, verbose: bool = False, install: bool = True
) -> ModuleType:
    """Compile the extension from csrc/ with torch.utils.cpp_extension.load and load it:
    the CPU part, then the CUDA part where the checks allow it (with_cuda None), never
    (False) or in any case (True). A CPU failure raises; a CUDA failure is recorded and
    warned about, and the CPU part stays. Returns the CPU module.

    install: copy the binaries into the package with their build records, so later
    processes load them like an ahead-of-time build. Raises if this process already
    loaded a part.
    """
    from torch.utils import cpp_extension

    if not (SOURCE_ROOT / "csrc" / "module.cpp").exists():
        raise RuntimeError(f"no csrc/ beside {PACKAGE_DIR}: the JIT build needs a source checkout")
    with _lock:
        if any(_state[p]["module"] is not None for p in PARTS):
            raise RuntimeError(
                "the extension is already loaded in this process; build in a new process"
            )
    plan = _cfg.plan_build(
        torch_version=torch.__version__,
        torch_cuda_version=torch.version.cuda,
        no_cuda="jit_build(with_cuda=False)" if with_cuda is False else None,
        force_cuda="jit_build(with_cuda=True)" if with_cuda else None,
    )
    if plan["cuda"]["build"]:
        _cfg.use_toolkit(cpp_extension, plan["toolkit"])
    build_root = (
        SOURCE_ROOT / "build" / f"jit-{sys.implementation.cache_tag}-torch{torch.__version__}"
    )
    how = {"how": "jit_build (torch.utils.cpp_extension.load)"}
    modules: dict[str, Optional[ModuleType]] = {"cpu": None, "cuda": None}
    errors: dict[str, str] = {}
    for part in PARTS:
        record = dict(plan[part]["record"], **how)
        if part == "cuda" and not plan["cuda"]["build"]:
            if install:
                _install_jit(part, dict(record, built=False), None)
            errors[part] = f"{_what(part)} was not built: {record['cuda_decision']}"
            continue
        try:
            modules[part] = _jit_part(part, plan, build_root, verbose)
        except Exception as exc:
            error = _cfg.describe_error(exc)
            if install:
                _install_jit(part, dict(record, built=False, error=_cfg.error_record(error)), None)
            if part == "cpu":
                raise
            errors[part] = f"building {_what(part)} failed ({_cfg.error_summary(error)})"
            warnings.warn(f"posenc_fast: {errors[part]}; the CPU part is built", stacklevel=2)
            continue
        if install:
            _install_jit(part, dict(record, built=True), Path(modules[part].__file__))
    with _lock:
        for part in PARTS:
            module = modules[part]
            if module is not None:
                sys.modules[module_name(part)] = module
            _state[part].update(
                tried=True,
                module=module,
                reasons=[errors[part]] if part in errors else [],
                origin=str(getattr(module, "__file__", "")) if module is not None else None,
            )
    return modules["cpu"]


def _main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m posenc_fast._extension")
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser(
        "build", help="JIT-build the extension from csrc/ and install it into the package"
    )
    b.add_argument(
        "--cuda",
        choices=("auto", "yes", "no"),
        default="auto",
        help="the CUDA part: where torch and the toolkit allow it (auto), attempted in any "
        "case (yes), not built (no)",
    )
    b.add_argument("--no-install", action="store_true")
    b.add_argument("-v", "--verbose", action="store_true")
    sub.add_parser("info", help="print the extension's status as JSON")
    args = parser.parse_args(argv)
    if args.cmd == "build":
        with_cuda = {"auto": None, "yes": True, "no": False}[args.cuda]
        jit_build(with_cuda=with_cuda, verbose=args.verbose, install=not args.no_install)
        status = {
            part: {"available": load(part) is not None, "reasons": reasons(part)} for part in PARTS
        }
        print(json.dumps(status, indent=2, sort_keys=True))
        return 0
    print(json.dumps(extension_info(), indent=2, sort_keys=True, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
