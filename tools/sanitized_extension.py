"""The CPU part of the extension (posenc_fast._C) built with AddressSanitizer and
UndefinedBehaviorSanitizer, for tools/check_sanitizers.sh: torch.utils.cpp_extension.load
with the package's sources and flags (posenc_fast/_build_config.py), -O1 -g and the
sanitizers instead of -O3 (what their documentation recommends: reports name source lines;
every undefined behaviour is fatal), into a build folder of its own, so that the package's
cache is never touched (ninja rebuilds only what changed since the last run).

    python tools/sanitized_extension.py        build (or reuse) it, load it, say so
    pytest -p sanitized_extension ...          (PYTHONPATH=tools) the tests use it

Both in a process whose first library is the ASan runtime (LD_PRELOAD, see
tools/check_sanitizers.sh): a library built with ASan aborts any other process that loads
it. The compilers run without that preload.

Environment: POSENC_FAST_SANITIZE_CACHE (default ~/.cache/posenc_fast-sanitize), MAX_JOBS.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SANITIZERS = ("address", "undefined")


def flags() -> tuple[list[str], list[str]]:
    """(compile flags, link flags): the package's, with -O1 -g and the sanitizers for -O3;
    PF_SANITIZERS names them in the module's build_info() (csrc/module_info.h)."""
    from posenc_fast import _build_config as cfg

    sanitize = "-fsanitize=" + ",".join(SANITIZERS)
    cxx = [f for f in cfg.CXX_FLAGS if not f.startswith("-O")]
    cxx += ["-O1", "-g", sanitize, "-fno-omit-frame-pointer", "-fno-sanitize-recover=undefined"]
    cxx.append("-DPF_SANITIZERS=" + "_".join(SANITIZERS))
    return cxx, [*cfg.LD_FLAGS, sanitize]


def build_dir() -> Path:
    """Per torch and Python (the ABI tag) and per checkout: two checkouts never rebuild each
    other's objects."""
    import torch

    from posenc_fast import _build_config as cfg

    base = os.environ.get("POSENC_FAST_SANITIZE_CACHE") or "~/.cache/posenc_fast-sanitize"
    checkout = hashlib.sha256(str(ROOT).encode()).hexdigest()[:8]
    return Path(base).expanduser() / f"{cfg.abi_tag(torch)}-{checkout}"


def runtime_problem() -> str | None:
    """Why this process cannot load an ASan build (None: the ASan runtime came first)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        maps = ""
    if "libasan" in maps:
        return None
    return (
        'this process did not preload the ASan runtime: LD_PRELOAD="$(c++ '
        '-print-file-name=libasan.so) $(c++ -print-file-name=libstdc++.so)" '
        "(tools/check_sanitizers.sh)"
    )


def load(verbose: bool = True):
    """Build (or reuse) the sanitized posenc_fast._C and import it in this process."""
    problem = runtime_problem()
    if problem:
        raise SystemExit(f"sanitized_extension: {problem}")
    from torch.utils import cpp_extension

    from posenc_fast import _build_config as cfg

    cxx, ld = flags()
    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    preload = os.environ.pop("LD_PRELOAD", None)  # not for the compilers
    try:
        return cpp_extension.load(
            name="posenc_fast_C",
            sources=[str(ROOT / s) for s in cfg.SOURCES["cpu"]],
            extra_cflags=cxx,
            extra_ldflags=ld,
            extra_include_paths=[str(ROOT / "csrc")],
            build_directory=str(directory),
            verbose=verbose,
        )
    finally:
        if preload is not None:
            os.environ["LD_PRELOAD"] = preload  # the tests' subprocesses keep it


def use(module) -> None:
    """Make posenc_fast's loader return ``module`` for the CPU part in this process."""
    from posenc_fast import _extension

    sys.modules[_extension.module_name("cpu")] = module
    _extension._state["cpu"].update(
        tried=True, module=module, reasons=[], origin=module.__file__, source="sanitized"
    )


def pytest_configure(config):
    """`pytest -p sanitized_extension`: every test of this run uses the sanitized build."""
    use(load(verbose=False))  # built by `python tools/sanitized_extension.py` just before


if __name__ == "__main__":
    module = load()
    info = module.build_info()
    assert info.get("sanitize") == "_".join(SANITIZERS), info
    print(f"   loaded {module.__file__} (isa {module.cpu_isa()} of {info['cpu_isa_best']})")
