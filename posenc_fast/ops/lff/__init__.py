"""Learnable Fourier features (Li et al. 2021): ``lff``, ``LearnableFourierFeatures``.

    api.py         the public function and module (checks, dtype policy, dispatch)
    op.py          the custom ops posenc_fast::lff / lff_backward with their autograd
    registry.py    backend name -> SUPPORT table + implementation
    reference.py   the float64 specification
    torch_impl.py  the pure-PyTorch implementation
    activations.py the MLP's activations, one table (formula, ATen op, nn.Module)
    checkpoint.py  the public LFF modules' checkpoints, read and written
Kernels: triton_kernels/lff_forward.py, lff_backward.py; csrc/lff/."""

from .api import INIT_OUTPUT_STD, LearnableFourierFeatures, activation_moments, lff

__all__ = ["INIT_OUTPUT_STD", "LearnableFourierFeatures", "activation_moments", "lff"]
