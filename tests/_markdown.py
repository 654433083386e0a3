"""The ```python blocks of the README and of the documentation pages (docs/), run as a
reader would: in order, in one namespace per file.

A block that names an optional package which is not installed (timm, transformers, the
ONNX exporter and runtime, ...) or needs a CUDA device that is not there is left out, and
the caller skips with the reason after running the others (CI installs every optional
package the blocks name, so there they all run)."""

from __future__ import annotations

import importlib.util
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYTHON_BLOCK = re.compile(r"```python\n(.*?)\n```", flags=re.S)
# import name -> the reason a block that names it is left out
OPTIONAL = {
    "timm": "timm is not installed",
    "transformers": "transformers is not installed",
    "onnxruntime": "onnxruntime is not installed",
    "onnxscript": "onnxscript is not installed",
    "onnx": "onnx is not installed",
    "torchdiffeq": "torchdiffeq is not installed",
    "matplotlib": "matplotlib is not installed",
}


def python_blocks(path: pathlib.Path) -> list[str]:
    return PYTHON_BLOCK.findall(path.read_text())


def _installed(name: str) -> bool:
    if name == "timm":
        from _timm import timm_available

        return timm_available()  # imports timm (standing in for torchvision if needed)
    return importlib.util.find_spec(name) is not None


def missing(block: str) -> list[str]:
    """Why ``block`` cannot run here ([] if it can)."""
    reasons = [
        why
        for name, why in OPTIONAL.items()
        if re.search(rf"\b{name}\b", block) and not _installed(name)
    ]
    if re.search(r"\bcuda\b", block):
        import torch

        if not torch.cuda.is_available():
            reasons.append("needs a CUDA device")
    return reasons


def run_blocks(path: pathlib.Path, min_blocks: int = 1) -> dict[int, list[str]]:
    """Run every runnable python block of ``path`` in order in one namespace; returns the
    blocks left out, {index: reasons}. A failing block raises with its index and text."""
    blocks = python_blocks(path)
    assert len(blocks) >= min_blocks, f"{path.name}: {len(blocks)} python blocks"
    name = path.relative_to(ROOT)
    skipped = {}
    namespace: dict = {"__name__": f"markdown_{path.stem}"}
    for i, block in enumerate(blocks):
        reasons = missing(block)
        if reasons:
            skipped[i] = reasons
            continue
        try:
            exec(compile(block, f"{name} python block {i}", "exec"), namespace)
        except Exception as exc:  # pragma: no cover - the message is the point
            raise AssertionError(f"{name} python block {i} failed: {exc!r}\n{block}") from exc
    return skipped


def skip_reason(path: pathlib.Path, skipped: dict[int, list[str]]) -> str:
    reasons = sorted({r for rs in skipped.values() for r in rs})
    return f"{path.relative_to(ROOT)} python blocks {sorted(skipped)} not run: {'; '.join(reasons)}"
