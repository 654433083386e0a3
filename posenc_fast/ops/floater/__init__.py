"""FLOATER (Liu et al. 2020): position encodings as the solution of an ODE: ``floater``,
``Floater``, ``FloaterAttentionBias``.

A call: functional.py (:func:`~.functional.solve`: registry.py, the ops of op.py) ->
torch_impl.py / graphed.py or csrc/floater/. Modules: module.py (with cache.py, frozen.py),
attention_bias.py and training.py (one integration per training step for all blocks).
tape.py sizes the tape; reference.py is the specification.
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
