"""Learnable Fourier features as rotary embeddings (LightGlue): ``lff_rotary``,
``apply_lff_rotary``, ``LearnableFourierRotary``.

    api.py         the public functions and module (checks, dispatch)
    op.py          the custom ops posenc_fast::lff_rotary / apply_lff_rotary and their
                   backward ops, with autograd
    registry.py    backend name -> SUPPORT table + implementation, for both ops
    reference.py   the float64 specification
    torch_impl.py  the pure-PyTorch implementation
Kernels: triton_kernels/rotary.py; csrc/rotary/rotary_cpu.cpp.
"""

from .api import LAYOUTS, LearnableFourierRotary, apply_lff_rotary, lff_rotary

__all__ = ["LAYOUTS", "LearnableFourierRotary", "apply_lff_rotary", "lff_rotary"]
