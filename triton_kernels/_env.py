"""What the kernels need of their environment, decided without importing triton.

The kernel layer states its own requirements here (the Triton interpreter's minimum
version, how TRITON_INTERPRET is read); posenc_fast's dispatcher asks this module whether
the "triton" backend can run. Nothing here imports triton at module level, so the
dispatcher can ask on a machine where triton is missing or slow to import."""

from __future__ import annotations

import os
import re
from functools import lru_cache


def interpreter_enabled() -> bool:
    """Whether TRITON_INTERPRET asks for Triton's interpreter. The one place this is
    parsed (the launchers and the dispatcher both ask)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def autotune_enabled() -> bool:
    """False when POSENC_FAST_TRITON_AUTOTUNE=0: each autotuned launcher then offers only
    its first allowed configuration (one compile per new shape). Read at every new shape."""
    return os.environ.get("POSENC_FAST_TRITON_AUTOTUNE", "1") != "0"


def parse_version(text: str) -> tuple[int, int]:
    """(major, minor) of a version string such as "3.1.0" or "3.6.0+git1234"."""
    major, minor = (int(v) for v in re.findall(r"\d+", text)[:2])
    return major, minor


# The first Triton whose interpreter runs these kernels faithfully: before 3.9 it rounds
# tl.fma twice, which destroys the phase reduction's exact error terms (_phase.py); before
# 3.7 it also fails on loops over runtime sizes with numpy >= 2.4.
INTERPRETER_MIN_TRITON = (3, 9)


def interpreter_reason(triton_version: str, numpy_version: str) -> str:
    """Why Triton ``triton_version``'s interpreter cannot run these kernels ("" if it can)."""
    version = parse_version(triton_version)
    if version >= INTERPRETER_MIN_TRITON:
        return ""
    why = "rounds tl.fma twice (fixed in Triton 3.9), which breaks the phase reduction"
    if version < (3, 7) and parse_version(numpy_version) >= (2, 4):
        why += f", and fails on loops over runtime sizes with numpy {numpy_version} (fixed in 3.7)"
    return (
        f"TRITON_INTERPRET=1 needs triton>=3.9: Triton {triton_version}'s interpreter {why} "
        "(compiled kernels on a GPU are unaffected)"
    )


@lru_cache(maxsize=1)
def installed_interpreter_reason() -> str:
    """:func:`interpreter_reason` for the installed Triton and numpy (imported here, on
    the first question: triton is optional)."""
    import numpy
    import triton

    return interpreter_reason(triton.__version__, numpy.__version__)


@lru_cache(maxsize=1)
def import_error() -> str:
    """Why triton cannot be imported ("" if it can); imports it on the first question."""
    try:
        import triton  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install
        return f"triton is not importable ({type(exc).__name__}: {exc})"
    return ""
