"""Learnable Fourier features (Li et al. 2021): ``lff``, ``LearnableFourierFeatures``.

api.py: the public function and module; op.py: the custom ops; registry.py: backend
name -> SUPPORT + implementation; reference.py: the float64 specification; torch_impl.py;
activations.py: the MLP's activations; checkpoint.py: the public LFF modules' checkpoints.
Kernels: triton_kernels/lff_forward.py, lff_backward.py; csrc/lff/."""

from .api import INIT_OUTPUT_STD, LearnableFourierFeatures, activation_moments, lff

__all__ = ["INIT_OUTPUT_STD", "LearnableFourierFeatures", "activation_moments", "lff"]
