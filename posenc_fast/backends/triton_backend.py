"""The "triton" backend: fused Triton kernels (triton_kernels/, shipped as
posenc_fast.triton_kernels). CUDA tensors; CPU tensors only under TRITON_INTERPRET=1,
which is how CI (no GPU) verifies the kernels.

Kernels are not written yet (issue 4): until they are, this backend reports itself
unavailable.
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch

from ._base import Backend, OpSupport


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@lru_cache(maxsize=1)
def _import_error() -> str:
    try:
        import triton  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install
        return f"triton is not importable ({type(exc).__name__}: {exc})"
    return ""


class TritonBackend(Backend):
    name = "triton"
    summary = "fused Triton kernels (CUDA; CPU tensors under TRITON_INTERPRET=1)"
    SUPPORT: dict[str, OpSupport] = {}

    def environment_reasons(self) -> list[str]:
        err = _import_error()
        if err:
            return [err]
        if not (torch.cuda.is_available() or interpreter_enabled()):
            return ["no CUDA device and TRITON_INTERPRET is not set"]
        return ["kernels not implemented yet"]
