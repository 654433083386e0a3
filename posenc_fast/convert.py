"""Checkpoints of the public learnable-Fourier-feature modules, to and from
:class:`~posenc_fast.LearnableFourierFeatures`.

    m = posenc_fast.convert.from_state_dict(torch.load("lff.pt"), "guimont", gamma=10.0)
    their_state = posenc_fast.convert.to_state_dict(m, "guimont")

Formats (``source``), as published (repository, the module's class; keys):

- ``"guimont"``: willGuimont/learnable_fourier_positional_encoding,
  ``LearnableFourierPositionalEncoding(G, M, F_dim, H_dim, D, gamma)``; ``Wr.weight``
  [F/2, M], ``mlp.0.weight`` [H, F], ``mlp.0.bias`` [H], ``mlp.2.weight`` [D/G, H],
  ``mlp.2.bias`` [D/G]. Initialises Wr with standard deviation gamma^-2.
- ``"jhlew"``: JHLew/Learnable-Fourier-Features, ``LearnableFourierFeatures(pos_dim, f_dim,
  h_dim, d_dim, g_dim, gamma)``; ``Wr`` [F/2, M] (a bare parameter), ``mlp.*`` as above.
  Initialises Wr with standard deviation gamma^2.
- ``"lightglue"``: cvg/LightGlue, ``LearnableFourierPositionalEncoding(M, dim, F_dim,
  gamma)``; ``Wr.weight`` [F/2, M] only (no MLP), standard deviation gamma^-2. A whole
  LightGlue checkpoint loads with ``prefix="posenc."``. LightGlue uses the features as
  rotary cos/sin, unscaled, each frequency on two neighbouring channels; the module built
  here returns the features [cos || sin] / sqrt(F) (``mlp=False``): multiply by sqrt(F)
  and split the halves to get LightGlue's cos and sin before ``repeat_interleave(2)``.
- ``"tpe"``: jnyborg/tpe (models/ltae.py), ``LearnableFourierPositionalEncoding(m, f, h, d,
  max_pos, n_head)``; ``wr.weight`` [f/2, m], ``mlp.*``. Its forward divides the positions
  by ``max_pos`` (folded into wr here, so the converted module takes the raw positions)
  and repeats the output n_head times along the last dimension (do that yourself:
  ``pe.repeat(1, 1, n_head)``). It initialises wr as nn.Linear does (no gamma).

posenc_fast follows the paper (Li et al. 2021, Eq. 3): Wr ~ N(0, gamma^-2), variance
gamma^-2, standard deviation 1/gamma. :func:`gamma_from` translates a checkpoint's gamma:
std gamma^-2 (guimont, lightglue) is our gamma**2; std gamma^2 (jhlew) is our gamma**-2.
gamma only sets the module's ``gamma`` attribute (used by ``reset_parameters`` and the KL
target); the weights come from the checkpoint.

Layouts: the public modules keep nn.Linear weights as [out, in]; posenc_fast stores them
[in, out] (the paper's layout): w1 [F, H] is ``mlp.0.weight`` transposed, w2 [H, D/G] is
``mlp.2.weight`` transposed. A weight given in the wrong layout is detected and named
wherever its shape tells (F != H for mlp.0.weight; D/G != H for mlp.2.weight). When
F == H (or D/G == H) a transposed matrix has the right shape and nothing can tell:
convert with these functions instead of copying tensors by hand, and compare an output
of both modules once (the tests here do).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

from torch import Tensor

from . import _checks
from .ops.lff import LearnableFourierFeatures
from .ops.lff.checkpoint import _WR_KEY, SOURCES, gamma_from, gamma_to

__all__ = ["SOURCES", "from_state_dict", "gamma_from", "gamma_to", "to_state_dict"]


def from_state_dict(
    state_dict: Mapping[str, Tensor],
    source: str,
    *,
    gamma: Optional[float] = None,
    groups: int = 1,
    max_pos: Optional[float] = None,
    prefix: str = "",
    backend: str = "auto",
) -> LearnableFourierFeatures:
    """A :class:`LearnableFourierFeatures` that computes what the public module ``source``
    computes with the weights in ``state_dict`` (see the module docstring for the formats).

    Args:
        state_dict: the public module's ``state_dict()`` (or a larger model's, with
            ``prefix``). Not modified; the module gets copies, in the checkpoint's dtype
            and on its device.
        source: "guimont", "jhlew", "lightglue" or "tpe".
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
    return LearnableFourierFeatures.from_state_dict(
        state_dict, source, gamma=gamma, groups=groups, max_pos=max_pos, prefix=prefix,
        backend=backend,
    )  # fmt: skip


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
    _checks.choice("source", source, SOURCES)
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
    if source == "lightglue":
        if module.mlp:
            raise ValueError(
                "a 'lightglue' encoder has no MLP: export a module built with mlp=False"
            )
    else:
        if not module.mlp:
            raise ValueError(
                f"a {source!r} module has an MLP: this module was built with mlp=False"
            )
        if module.layer_norm:
            raise ValueError(
                f"a {source!r} module has no LayerNorm: this one was built with layer_norm=True"
            )
        if module.activation != "gelu":
            raise ValueError(
                f"a {source!r} module uses GELU (erf form), this one {module.activation!r}"
            )
    wr = module.wr.detach()
    if source == "tpe":
        if max_pos is None:
            raise ValueError("max_pos is required for 'tpe': the divisor its forward applies")
        max_pos = _checks.positive_float("max_pos", max_pos)
        if module.groups != 1 or module.pos_dim != 1:
            raise ValueError(
                "a 'tpe' module encodes one group of scalar positions: need groups=1 and "
                f"pos_dim=1, got groups={module.groups}, pos_dim={module.pos_dim}"
            )
        wr = wr * max_pos
    elif max_pos is not None:
        raise ValueError(f"max_pos applies to 'tpe' only, not {source!r}")
    out = {_WR_KEY[source]: wr.clone()}
    if source != "lightglue":
        out["mlp.0.weight"] = module.w1.detach().T.contiguous()  # [F, H] -> [H, F]
        out["mlp.0.bias"] = module.b1.detach().clone()
        out["mlp.2.weight"] = module.w2.detach().T.contiguous()  # [H, D/G] -> [D/G, H]
        out["mlp.2.bias"] = module.b2.detach().clone()
    return {prefix + k: v for k, v in out.items()}
