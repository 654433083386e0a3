"""What machine and software a result was produced on (for info, bench JSON)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import torch

from .._version import __version__


def git_sha() -> str:
    """git's HEAD (+ "-dirty") where the package lies in a checkout, else "unknown"."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5
        )
        sha = out.stdout.strip()
        if out.returncode == 0 and sha:
            dirty = subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=here,
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout.strip()
            return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except Exception as exc:  # not installed or broken
        return f"unavailable ({type(exc).__name__})"


def cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else the machine type."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def cpu_family_model() -> str:
    """ "family F model M" from /proc/cpuinfo (VMs often name only the brand), else ""."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("cpu family", "model") and key not in fields:
                    fields[key] = line.split(":", 1)[1].strip()
                if not line.strip() and fields:
                    break
    except OSError:
        return ""
    if len(fields) < 2:
        return ""
    return f"family {fields['cpu family']} model {fields['model']}"


def cpu_isa() -> str:
    """The instruction set the C++ CPU kernels run with (extension loaded), else ""."""
    from .. import _extension

    ext = _extension.loaded_module()
    return str(ext.cpu_isa()) if ext is not None else ""


def describe() -> dict:
    info = {
        "posenc_fast": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": cpu_model(),
        "cpu_family_model": cpu_family_model(),
        "cpu_isa": cpu_isa(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": triton_version(),
        "git_sha": git_sha(),
        "cuda_available": torch.cuda.is_available(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET", ""),
        "threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["gpu_capability"] = f"{props.major}.{props.minor}"
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
            )
            info["driver"] = (
                out.stdout.strip().splitlines()[0] if out.returncode == 0 else "unknown"
            )
        except (OSError, subprocess.SubprocessError, IndexError):
            info["driver"] = "unknown"
    return info
