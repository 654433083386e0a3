"""The "cpp" and "cuda" backends: the compiled C++/CUDA extension (FLOATER integrators).

Not built yet (issue 5): both report themselves unavailable.
"""

from __future__ import annotations

from ._base import Backend, OpSupport


class CppBackend(Backend):
    name = "cpp"
    summary = "C++ CPU kernels of the compiled extension"
    SUPPORT: dict[str, OpSupport] = {}

    def environment_reasons(self) -> list[str]:
        return ["the C++ extension is not part of this build yet"]


class CudaBackend(Backend):
    name = "cuda"
    summary = "CUDA kernels of the compiled extension"
    SUPPORT: dict[str, OpSupport] = {}

    def environment_reasons(self) -> list[str]:
        return ["the CUDA extension is not part of this build yet"]
