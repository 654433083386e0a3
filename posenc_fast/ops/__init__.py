"""Registers the posenc_fast:: custom ops (import side effect).

Their signatures spell lists ``typing.List[...]``: torch 2.5's ``infer_schema`` accepts
``List[bool]`` / ``List[Tensor]`` but raises on ``list[bool]`` / ``list[Tensor]`` (accepted
from torch 2.7), and the package supports torch >= 2.5 (tests/test_compat.py checks it).
"""

from . import encodings, floater, fourier_features, rotary

__all__ = ["encodings", "floater", "fourier_features", "rotary"]
