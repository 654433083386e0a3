"""Fixed encodings: sinusoidal (Vaswani et al.; FLOATER Eq. 7), Sine-nD and DFT (Idé et al.).

api.py: the public functions and modules; op.py: the custom ops; registry.py: backend
name -> SUPPORT + implementation; reference.py: the float64 specification; torch_impl.py.
Kernels: triton_kernels/encodings.py; csrc/encodings/."""

from .api import *  # noqa: F403  (the public names: api.__all__)
from .api import __all__  # noqa: F401
