"""Rotary embeddings for grids: channel pair i of q and k rotated by x . W_i. ``rotary``,
``rotary_table``, ``Rotary``; the frequency builders of every family (``frequencies``,
``posenc_fast.rope``); the LightGlue members ``lff_rotary``, ``apply_lff_rotary``,
``LearnableFourierRotary``. Kernels: triton_kernels/rotary.py, csrc/rotary/."""

from . import frequencies
from .api import (
    LAYOUTS,
    PAIRS,
    LearnableFourierRotary,
    Rotary,
    apply_lff_rotary,
    lff_rotary,
    rotary,
    rotary_table,
)

__all__ = [
    "LAYOUTS",
    "PAIRS",
    "LearnableFourierRotary",
    "Rotary",
    "apply_lff_rotary",
    "frequencies",
    "lff_rotary",
    "rotary",
    "rotary_table",
]
