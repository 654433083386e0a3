"""Rotary embeddings for grids: channel pair i of q and k rotated by x . W_i. ``rotary``,
``rotary_table``, ``Rotary``; the frequency builders of every family (``frequencies``,
``posenc_fast.rope``); the LightGlue members ``lff_rotary``, ``apply_lff_rotary``,
``LearnableFourierRotary``.

    api.py          the public functions and modules (checks, dispatch)
    op.py           the custom ops rotary / rotary_table (+ backward), with autograd
    registry.py     backend name -> SUPPORT table + implementation
    reference.py    the float64 specification
    torch_impl.py   the pure-PyTorch implementation
    frequencies.py  W and positions of the families: axial, mixed, dinov3, nd, grid, augment
Kernels: triton_kernels/rotary.py; csrc/rotary/.
"""

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
