"""FLOATER (Liu et al. 2020): position encodings as the solution of an ODE: ``floater``,
``Floater``, ``FloaterAttentionBias``.

    api.py         the public function and modules (checks, dispatch, the module's cache)
    op.py          the custom ops posenc_fast::floater / floater_taped / floater_backward /
                   floater_cached with their autograd
    tape.py        how much of the solver's work the cpp and cuda backends keep for the backward
    registry.py    backend name -> SUPPORT table + implementation
    reference.py   the float64 specification (and FloaterOptions)
    torch_impl.py  the pure-PyTorch integrator and its discrete adjoint
    graphed.py     the same captured in CUDA graphs (the torch backend on CUDA)
    cache.py       the result cache shared by the eager module and the compiled op
Kernels: csrc/floater/.
"""

from .api import (
    ACTIVATIONS,
    INIT_OUTPUT_SCALE,
    METHODS,
    Floater,
    FloaterAttentionBias,
    floater,
    integrate,
    state_dtype,
)
from .reference import FloaterOptions

__all__ = [
    "ACTIVATIONS",
    "INIT_OUTPUT_SCALE",
    "METHODS",
    "Floater",
    "FloaterAttentionBias",
    "FloaterOptions",
    "floater",
    "integrate",
    "state_dtype",
]
