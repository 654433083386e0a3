"""FLOATER (Liu et al. 2020): position encodings as the solution of an ODE: ``floater``,
``Floater``, ``FloaterAttentionBias``. The path of a call: api.py (checks) -> registry.py
(which implementation) -> op.py (the custom ops) -> torch_impl.py / graphed.py or
csrc/floater/; reference.py is the specification.
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
from .shared import BlockBiases, Slot

__all__ = [
    "ACTIVATIONS",
    "INIT_OUTPUT_SCALE",
    "METHODS",
    "BlockBiases",
    "Floater",
    "FloaterAttentionBias",
    "FloaterOptions",
    "Slot",
    "floater",
    "integrate",
    "state_dtype",
]
