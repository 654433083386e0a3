"""``python -m posenc_fast info``: what is usable here, and why the rest is not."""

from __future__ import annotations

import json
import os

from .. import _dispatch, _extension
from ._environment import describe


def _extension_info() -> dict:
    """``_extension.extension_info()`` and the "cpp" / "cuda" backends' reasons."""
    try:
        out = _extension.extension_info()
        out["backends"] = {
            name: _dispatch.BACKENDS[name].environment_reasons() for name in ("cpp", "cuda")
        }
        return out
    except Exception as exc:  # info must never crash
        return {"error": f"{type(exc).__name__}: {exc}"}


def _lff_plan_lines(env: dict) -> list[str]:
    """The triton backend's LFF plans for the benchmark shapes (ops/lff/plan.py)."""
    try:
        from ..ops.lff import plan

        return plan.report_lines(env.get("gpu") if env.get("cuda_available") else None)
    except Exception as exc:  # info must never crash
        return [f"error: {type(exc).__name__}: {exc}"]


def run(args) -> int:
    env = describe()
    status = _dispatch.available_backends(verbose=True)
    ext = _extension_info()
    plans = _lff_plan_lines(env)
    if getattr(args, "json", False):
        record = {"environment": env, "backends": status, "extension": ext, "lff_plans": plans}
        print(json.dumps(record, indent=2))
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
        print(f"  {'':<10} {_dispatch.BACKENDS[name].summary}")
    where = env["gpu"] if env["cuda_available"] else "no GPU here: as on an H200"
    print(f"\nLFF plans of the triton backend ({where}; fused pass or cuBLAS products):")
    for line in plans:
        print(f"  {line}")
    if ext:
        print("\nC++/CUDA extension (two modules, built and loaded independently):")
        for line in _extension_lines(ext):
            print(f"  {line}")
    return 0


def _extension_lines(ext: dict) -> list[str]:
    """Each part's status and reason, and how it was built (--json shows everything)."""
    if "error" in ext:
        return [f"error: {ext['error']}"]
    lines = []
    for part in ("cpu", "cuda"):
        info = ext.get(part) or {}
        state = "available" if info.get("available") else "unavailable"
        why = "; ".join(info.get("reasons") or [])
        lines.append(f"{part:<5} {info.get('module')}: {state}" + (f": {why}" if why else ""))
        meta = info.get("build_metadata") or {}
        labels = {"build_time": "built" if meta.get("built") else "recorded",
                  "torch_version": "for torch", "cuda_archs": "archs", "how": "by"}  # fmt: skip
        built = [f"{label} {meta[key]}" for key, label in labels.items() if meta.get(key)]
        if info.get("path"):
            built.insert(0, f"{info['path']} (from {info.get('source')})")
        if info.get("cpu_isa"):
            built.append(f"cpu isa {info['cpu_isa']}")
        if built:
            lines.append(f"{'':<5} " + ", ".join(built))
        lines += [f"{'':<5} ignored: {why}" for why in info.get("ignored") or []]
    if ext.get("cpu", {}).get("cache_dir"):
        cpu = ext["cpu"]
        key_dir = os.path.dirname(cpu["cache_dir"])
        lines.append(f"build cache {key_dir} (ABI tag {cpu.get('abi_tag')})")
    return lines
