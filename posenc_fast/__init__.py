"""posenc_fast: fast, accurate positional encoders for PyTorch.

- Learnable Fourier features + grouped MLP (Li et al. 2021): :func:`lff`,
  :class:`LearnableFourierFeatures`.
- FLOATER (Liu et al. 2020), ODE-integrated encodings and Q/K/V biases: :func:`floater`,
  :class:`Floater`, :class:`FloaterAttentionBias`.
- Sinusoidal (Vaswani et al.) and DFT (Idé et al.) encodings: :func:`sinusoidal`,
  :func:`sinusoidal_nd`, :func:`dft`, :func:`dft_inverse`, :class:`SinusoidalPE`,
  :class:`SinusoidalNdPE` (Sine-2D added in one pass), :class:`DFTPE`.
- Rotary embeddings for grids, q and k rotated by x . W_i: :func:`rotary`,
  :func:`rotary_table`, :class:`Rotary`, with the frequencies of every family in
  :mod:`posenc_fast.rope` (axial / EVA-02, RoPE-Mixed, DINOv3, FLUX's N-D); LightGlue's
  learnable Fourier rotary: :func:`lff_rotary`, :func:`apply_lff_rotary`,
  :class:`LearnableFourierRotary`.
- Helpers: :func:`grid_positions`, :func:`available_backends`, :func:`onnx_phases` (the
  precision of the phases in ONNX exports: float32 by default).

Every op takes ``backend=``: "auto" (the fastest that supports the inputs), "reference"
(literal float64 equations), "torch" (pure PyTorch), "triton", "cuda", "cpp".
`python -m posenc_fast info` shows which are usable here and why the others are not.
"""

from ._dispatch import BackendError, available_backends
from ._version import __version__
from .grid import grid_positions
from .ops._export_phases import onnx_phases
from .ops.encodings import (
    DFTPE,
    SinusoidalNdPE,
    SinusoidalPE,
    dft,
    dft_inverse,
    sinusoidal,
    sinusoidal_nd,
)
from .ops.floater import Floater, FloaterAttentionBias, floater
from .ops.lff import LearnableFourierFeatures, lff
from .ops.rotary import (
    LearnableFourierRotary,
    Rotary,
    apply_lff_rotary,
    lff_rotary,
    rotary,
    rotary_table,
)
from .ops.rotary import frequencies as rope

__all__ = [
    "DFTPE",
    "BackendError",
    "Floater",
    "FloaterAttentionBias",
    "LearnableFourierFeatures",
    "LearnableFourierRotary",
    "Rotary",
    "SinusoidalNdPE",
    "SinusoidalPE",
    "__version__",
    "apply_lff_rotary",
    "available_backends",
    "dft",
    "dft_inverse",
    "floater",
    "grid_positions",
    "lff",
    "lff_rotary",
    "onnx_phases",
    "rope",
    "rotary",
    "rotary_table",
    "sinusoidal",
    "sinusoidal_nd",
]
