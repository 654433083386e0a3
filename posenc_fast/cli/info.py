"""``python -m posenc_fast info``: what is usable here, and why the rest is not."""

from __future__ import annotations

import json

from .. import backends
from ._environment import describe


def _extension_info() -> dict:
    try:
        from .._extension import extension_info
    except ImportError:
        return {}
    try:
        return extension_info()
    except Exception as exc:  # info must never crash
        return {"error": f"{type(exc).__name__}: {exc}"}


def run(args) -> int:
    env = describe()
    status = backends.available_backends(verbose=True)
    ext = _extension_info()
    if getattr(args, "json", False):
        print(json.dumps({"environment": env, "backends": status, "extension": ext}, indent=2))
        return 0
    print(f"posenc_fast {env['posenc_fast']}  (git {env['git_sha']})")
    print(
        f"python {env['python']}  torch {env['torch']} (CUDA {env['torch_cuda']})  "
        f"triton {env['triton']}"
    )
    print(f"platform {env['platform']}, {env['cpu_count']} CPUs, {env['threads']} torch threads")
    if env["cuda_available"]:
        print(
            f"GPU {env['gpu']} (sm_{env['gpu_capability'].replace('.', '')}), "
            f"driver {env.get('driver')}"
        )
    else:
        print("GPU none visible to torch")
    if env["triton_interpret"]:
        print(
            f"TRITON_INTERPRET={env['triton_interpret']} "
            "(Triton kernels run on CPU tensors, slowly)"
        )
    print("\nbackends:")
    for name, reasons in status.items():
        state = "available" if not reasons else "unavailable: " + "; ".join(reasons)
        print(f"  {name:<10} {state}")
        print(f"  {'':<10} {backends.get(name).summary}")
    if ext:
        print("\nC++/CUDA extension:")
        for key, value in ext.items():
            print(f"  {key}: {value}")
    return 0
