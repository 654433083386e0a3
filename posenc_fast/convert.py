"""Checkpoints of the public learnable-Fourier-feature modules, to and from
:class:`~posenc_fast.LearnableFourierFeatures` (the formats: docs/ops/lff.md; the code:
posenc_fast/ops/lff/checkpoint.py).

    m = posenc_fast.convert.from_state_dict(torch.load("lff.pt"), "guimont", gamma=10.0)
    their_state = posenc_fast.convert.to_state_dict(m, "guimont")
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

from torch import Tensor

from .ops.lff import LearnableFourierFeatures
from .ops.lff.checkpoint import SOURCES, export, gamma_from, gamma_to

__all__ = ["SOURCES", "from_state_dict", "gamma_from", "gamma_to", "to_state_dict"]


def from_state_dict(
    state_dict: Mapping[str, Tensor], source: str, **kwargs
) -> LearnableFourierFeatures:
    """A :class:`LearnableFourierFeatures` that computes what the public module ``source``
    computes with the weights in ``state_dict``.

    Args:
        state_dict: the public module's ``state_dict()`` (or a larger model's, with
            ``prefix``). Not modified; the module gets copies, in the checkpoint's dtype
            and on its device.
        source: "guimont", "jhlew", "lightglue" or "tpe".

    Keyword Args:
        gamma: the gamma the public module was built with, in its own convention
            (translated by :func:`gamma_from`); default 1. Not used for "tpe", whose
            equivalent gamma follows from max_pos and the initialisation of nn.Linear.
        groups: G, the number of position groups (guimont, jhlew; the checkpoint cannot
            tell it: the MLP is shared by the groups). The module's out_dim is G * D/G.
        max_pos: "tpe" only, required: the max_pos its module divided positions by.
        prefix: the encoder's key prefix in ``state_dict``, e.g. "posenc." for LightGlue.
        backend: passed to the module.

    Raises:
        ValueError: naming missing or unexpected keys, a shape that does not fit (and a
            weight that looks transposed), or a missing max_pos.
    """
    return LearnableFourierFeatures.from_state_dict(state_dict, source, **kwargs)


def to_state_dict(
    module: LearnableFourierFeatures,
    source: str,
    *,
    max_pos: Optional[float] = None,
    prefix: str = "",
) -> dict[str, Tensor]:
    """The public module's ``state_dict`` for ``module`` (detached copies): load it with
    ``their_module.load_state_dict(...)``. The public module must have been built with
    matching sizes (for "tpe": max_pos given here, m = 1, d = out_dim, f = fourier_dim).

    Refused (ValueError): what the public module cannot compute — layer_norm, an
    activation other than GELU (erf), an MLP for "lightglue" or none for the others, and
    for "tpe" groups or pos_dim other than 1. Dropout applies in training only and is
    not part of a state_dict.
    """
    if not isinstance(module, LearnableFourierFeatures):
        raise TypeError(
            f"module must be a posenc_fast.LearnableFourierFeatures, got {type(module).__name__}"
        )
    return export(module, source, max_pos=max_pos, prefix=prefix)
