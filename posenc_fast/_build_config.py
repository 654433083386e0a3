"""What the extension (csrc/) is built from, for setup.py and posenc_fast/_extension.py:
modules, sources, flags, the build record, POSENC_FAST_BUILD. Torch-free and import-free
within the package: setup.py executes this file on its own (an isolated build has no torch)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time

# _C: op definitions and CPU kernels; _C_cuda apart, so a failed CUDA build spares the CPU part
MODULES = {"cpu": "_C", "cuda": "_C_cuda"}
RECORDS = {"cpu": "_build_info.json", "cuda": "_build_info_cuda.json"}

# Relative to the folder holding csrc/; base names must be unique (objects are named after them).
SOURCES = {
    "cpu": (
        "csrc/module.cpp",
        "csrc/floater/floater_ops.cpp",
        "csrc/floater/floater_cpu.cpp",
        "csrc/lff/lff_ops.cpp",
        "csrc/lff/lff_cpu.cpp",
        "csrc/encodings/encodings_ops.cpp",
        "csrc/encodings/encodings_cpu.cpp",
        "csrc/rotary/rotary_ops.cpp",
        "csrc/rotary/rotary_cpu.cpp",
    ),
    "cuda": (
        "csrc/module_cuda.cpp",
        "csrc/floater/floater_cuda_ops.cpp",
        "csrc/floater/floater_cuda.cu",
    ),
}

# -fopenmp: at::parallel_for is inline OpenMP (reuses torch's libgomp). -ffp-contract=fast:
# -std=c++17 turns GCC's FMA contraction off, the kernels want it. -Wno-psabi: vectors never
# cross calls. No -march=native: instruction sets are chosen at run time (csrc/cpu/isa.h).
# nvcc: no fast math (approximate exp/erf/tanh would break the accuracy goals).
CXX_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=fast", "-Wno-psabi"]
LD_FLAGS = ["-fopenmp"]
NVCC_FLAGS = ["-O3", "-lineinfo", "-std=c++17"]

# POSENC_FAST_BUILD: what is compiled (auto, cpu, cuda, none: docs/installation.md's table).
BUILD_ENV = "POSENC_FAST_BUILD"
BUILD_CHOICES = ("auto", "cpu", "cuda", "none")


def build_choice(environ=None) -> tuple[str, str | None]:
    """(POSENC_FAST_BUILD's choice, None or why its value is refused: then "none")."""
    env = os.environ if environ is None else environ
    value = (env.get(BUILD_ENV) or "auto").strip().lower()
    if value in BUILD_CHOICES:
        return value, None
    return "none", f"{BUILD_ENV}={value!r} is not one of {', '.join(BUILD_CHOICES)}"


def sources_hash(source_root: str | os.PathLike) -> str | None:
    """SHA-256 of csrc/'s sources under ``source_root`` (paths and contents, sorted), or
    None without csrc/: part of each build record and of the user cache's key."""
    csrc = os.path.join(os.fspath(source_root), "csrc")
    if not os.path.isfile(os.path.join(csrc, "module.cpp")):
        return None
    digest = hashlib.sha256()
    files = []
    for folder, _dirs, names in os.walk(csrc):
        files += [
            os.path.join(folder, n) for n in names if n.endswith((".cpp", ".cu", ".h", ".cuh"))
        ]
    for path in sorted(files, key=lambda p: os.path.relpath(p, csrc).replace(os.sep, "/")):
        digest.update(os.path.relpath(path, csrc).replace(os.sep, "/").encode() + b"\0")
        with open(path, "rb") as f:
            digest.update(f.read())
        digest.update(b"\0")
    return digest.hexdigest()


def abi_tag(torch) -> str:
    """What a binary is tied to: torch's version and C++ ABI, the Python ABI, the machine."""
    abi = getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", None)
    return (
        f"torch{torch.__version__}-cxx11abi{'unknown' if abi is None else int(bool(abi))}-"
        f"{sys.implementation.cache_tag}-{platform.machine() or 'unknown'}"
    )


def record(torch, part: str, source_root, how: str, **more) -> dict:
    """The build record of ``part``, checked before importing a binary and shown by `info`."""
    fields = {
        "part": part,
        "module": f"posenc_fast.{MODULES[part]}",
        "torch_version": torch.__version__,
        "torch_cuda_version": torch.version.cuda,
        "abi_tag": abi_tag(torch),
        "sources_hash": sources_hash(source_root),
        "build_time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "how": how,
        **more,
    }
    if part == "cuda":  # torch's default: the architectures of the GPUs it sees
        fields.setdefault("cuda_archs", os.environ.get("TORCH_CUDA_ARCH_LIST") or "visible GPUs'")
    return fields


def write_record(path: str | os.PathLike, fields: dict) -> None:
    """Write a record through a temporary file renamed over ``path`` (never half a file)."""
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(fields, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
