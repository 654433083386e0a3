"""Build settings of the compiled extension ``posenc_fast._C`` (csrc/), shared by the
ahead-of-time build (setup.py) and the opt-in just-in-time build
(``posenc_fast._extension.jit_build``), and the build metadata both record beside the
binary (``_build_info.json``, read by ``posenc_fast._extension`` before loading it).

Torch-free and import-free within the package: setup.py executes this file on its own
(importing ``posenc_fast`` would import torch, which an isolated build does not have).
Why each compiler flag is there: the table in setup.py's docstring.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sysconfig

# Relative to the source root (the directory that holds csrc/ and setup.py).
CPU_SOURCES = (
    "csrc/module.cpp",
    "csrc/floater/floater_ops.cpp",
    "csrc/floater/floater_cpu.cpp",
    "csrc/fourier/fourier_ops.cpp",
    "csrc/fourier/lff_cpu.cpp",
    "csrc/fourier/encoding_cpu.cpp",
)
CUDA_SOURCES = (
    "csrc/floater/floater_cuda_ops.cpp",
    "csrc/floater/floater_cuda.cu",
)
DEFAULT_CUDA_ARCHS = "8.0;8.6;8.9;9.0+PTX"
BUILD_INFO = "_build_info.json"  # beside the binary


def cxx_flags(debug: bool = False) -> list[str]:
    """Host compiler flags."""
    opt = ["-O0", "-g"] if debug else ["-O3"]
    return [*opt, "-fopenmp", "-ffp-contract=fast", "-Wno-psabi"]


def nvcc_flags(debug: bool = False) -> list[str]:
    """nvcc flags (device code)."""
    return [*(["-O0", "-G"] if debug else ["-O3"]), "-lineinfo", "-std=c++17"]


def resolve_cuda_archs() -> str:
    """TORCH_CUDA_ARCH_LIST, or the default, set in the environment: torch reads it, and
    unset it would ask a GPU for its architecture."""
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST") or DEFAULT_CUDA_ARCHS
    os.environ["TORCH_CUDA_ARCH_LIST"] = archs
    return archs


def cuda_availability(
    torch_version: str, torch_cuda_version: str | None, cuda_home: str | None
) -> tuple[bool, str]:
    """(can the CUDA part be built?, why) from torch's build and the toolkit only: never
    asks a GPU."""
    if torch_cuda_version is None:
        return False, f"torch {torch_version} is built without CUDA"
    if cuda_home is None:
        return False, "no CUDA toolkit found (set CUDA_HOME)"
    return True, f"torch CUDA {torch_cuda_version}, toolkit at {cuda_home}"


def package_version() -> str:
    scope: dict = {}
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_version.py")) as f:
        exec(f.read(), scope)
    return scope["__version__"]


def nvcc_version(cuda_home: str | None) -> str | None:
    if not cuda_home:
        return None
    try:
        out = subprocess.run(
            [os.path.join(cuda_home, "bin", "nvcc"), "--version"],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
    except Exception:
        return None
    for line in out.splitlines():
        if "release" in line:
            return line.strip()
    return None


def build_metadata(
    *,
    torch_version: str,
    torch_cuda_version: str | None,
    with_cuda: bool,
    cuda_decision: str,
    cuda_home: str | None,
    cuda_archs: str | None,
    debug: bool,
    cxx: list[str],
    nvcc: list[str],
) -> dict:
    """The fields every build records about itself (the builder adds built, build_time,
    binary or error)."""
    return {
        "package_version": package_version(),
        "torch_version": torch_version,
        "torch_cuda_version": torch_cuda_version,
        "with_cuda": with_cuda,
        "cuda_decision": cuda_decision,
        "cuda_toolkit": nvcc_version(cuda_home) if with_cuda else None,
        "cuda_archs": cuda_archs,
        "python_version": platform.python_version(),
        "python_abi": sysconfig.get_config_var("EXT_SUFFIX"),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "debug": debug,
        "cxx_flags": cxx,
        "nvcc_flags": nvcc if with_cuda else None,
    }


def write_json_atomic(path: str | os.PathLike, record: dict) -> None:
    """Write record as JSON through a temporary file renamed over path (readers never see
    a partial file)."""
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
