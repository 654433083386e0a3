"""FLOATER (Liu et al. 2020): position encodings as the solution of an ODE: ``floater``,
``Floater``, ``FloaterAttentionBias``.

The path of a call: functional.py (``floater``; :func:`~.functional.solve` chooses the
implementation, registry.py, and calls the custom ops, op.py) -> torch_impl.py /
graphed.py or csrc/floater/. The modules: module.py (Floater, with its result cache,
cache.py, and frozen states, frozen.py), attention_bias.py (FloaterAttentionBias) and
training.py (one integration per training forward for all blocks). tape.py sizes the
taped forward's tape; reference.py is the specification.
"""

from .attention_bias import BlockBiases, FloaterAttentionBias
from .functional import floater, integrate, state_dtype
from .module import INIT_OUTPUT_SCALE, Floater
from .reference import ACTIVATIONS, METHODS, FloaterOptions
from .training import Slot

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
