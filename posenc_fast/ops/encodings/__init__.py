"""Fixed encodings: sinusoidal (Vaswani et al.; FLOATER Eq. 7), Sine-nD and DFT (Idé et al.).

    api.py         sinusoidal, sinusoidal_nd, dft, dft_inverse, SinusoidalPE,
                   SinusoidalNdPE, DFTPE (checks, dispatch)
    op.py          the custom ops posenc_fast::encoding / encoding_add / encoding_nd_add /
                   encoding_backward with their autograd
    registry.py    backend name -> SUPPORT table + implementation
    reference.py   the float64 specification
    torch_impl.py  the pure-PyTorch implementation
Kernels: triton_kernels/encodings.py; csrc/encodings/."""

from .api import *  # noqa: F403  (the public names: api.__all__)
from .api import __all__  # noqa: F401
