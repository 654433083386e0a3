"""Checkpoints of the public learnable-Fourier-feature modules, both ways: their formats,
gamma conventions and checks, reading (:func:`parse`, which
``LearnableFourierFeatures.from_state_dict`` builds a module from) and writing
(:func:`export`). ``posenc_fast.convert`` is the public face; docs/ops/lff.md the user's page."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Optional

from torch import Tensor

from ... import _checks

# The formats (``source``; keys and gamma conventions: docs/ops/lff.md's table):
# - "guimont": willGuimont/learnable_fourier_positional_encoding; Wr.weight [F/2, M] and
#   mlp.0 / mlp.2 (nn.Linear); Wr has std gamma^-2.
# - "jhlew": JHLew/Learnable-Fourier-Features; Wr [F/2, M] (a bare parameter), mlp.* as
#   above; Wr has std gamma^2.
# - "lightglue": cvg/LightGlue; Wr.weight [F/2, M] only (std gamma^-2; prefix="posenc." in
#   a whole checkpoint). LightGlue uses the features as rotary cos / sin, unscaled; the
#   module built here (mlp=False) returns [cos || sin] / sqrt(F).
# - "tpe": jnyborg/tpe (models/ltae.py); wr.weight [f/2, m], mlp.*. Its forward divides the
#   positions by max_pos (folded into wr here) and repeats the output n_head times (left to
#   the caller); wr initialised as nn.Linear does (no gamma).
# posenc_fast: Wr std 1/gamma (the paper's Eq. 3); gamma only sets the module's ``gamma``
# (re-initialisation, KL target). The public modules keep nn.Linear weights [out, in],
# posenc_fast [in, out]: w1 = mlp.0.weight^T, w2 = mlp.2.weight^T (when F == H a transposed
# weight cannot be told by its shape, so convert with these functions).
SOURCES = ("guimont", "jhlew", "lightglue", "tpe")

# The frequency matrix's key in each format; the MLP keys are shared by the formats that
# have an MLP.
_WR_KEY = {"guimont": "Wr.weight", "jhlew": "Wr", "lightglue": "Wr.weight", "tpe": "wr.weight"}
_MLP_KEYS = ("mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias")


def _keys(source: str) -> tuple[str, ...]:
    wr = (_WR_KEY[source],)
    return wr if source == "lightglue" else wr + _MLP_KEYS


def _looks_like(keys) -> list[str]:
    """The formats whose keys are exactly ``keys`` (to say what a checkpoint probably is)."""
    return [s for s in SOURCES if set(_keys(s)) == set(keys)]


def gamma_from(source: str, gamma: float) -> float:
    """posenc_fast's gamma (standard deviation 1/gamma) for a checkpoint's ``gamma`` in its
    own convention: std gamma^-2 (guimont, lightglue) -> gamma**2; std gamma^2 (jhlew) ->
    gamma**-2. (tpe has no gamma: its wr is initialised as nn.Linear does.)"""
    _checks.choice("source", source, SOURCES)
    gamma = _checks.positive_float("gamma", gamma)
    if source == "tpe":
        raise ValueError("the 'tpe' module has no gamma (it initialises wr as nn.Linear does)")
    return gamma**-2 if source == "jhlew" else gamma**2


def gamma_to(source: str, gamma: float) -> float:
    """The inverse of :func:`gamma_from`: the public module's gamma for ours."""
    _checks.choice("source", source, SOURCES)
    gamma = _checks.positive_float("gamma", gamma)
    if source == "tpe":
        raise ValueError("the 'tpe' module has no gamma (it initialises wr as nn.Linear does)")
    return gamma**-0.5 if source == "jhlew" else gamma**0.5


def _select(state_dict, source: str, prefix: str) -> dict[str, Tensor]:
    """The entries of this format under ``prefix`` (prefix removed); missing or (without a
    prefix) unexpected keys are named."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping of names to tensors, got {type(state_dict)}")
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
    ours = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
    expected = _keys(source)
    missing = [prefix + k for k in expected if k not in ours]
    # With a prefix the checkpoint may be a whole model (LightGlue's): other keys are its
    # other layers. Without one, every key must belong to the encoder.
    unexpected = [] if prefix else [k for k in ours if k not in expected]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append("missing keys " + ", ".join(repr(k) for k in missing))
        if unexpected:
            parts.append("unexpected keys " + ", ".join(repr(k) for k in unexpected))
        msg = f"state_dict is not a {source!r} checkpoint: " + "; ".join(parts)
        guess = [s for s in _looks_like(ours) if s != source]
        if guess:
            msg += f" (its keys are those of a {' or '.join(repr(s) for s in guess)} checkpoint)"
        elif not prefix and any("." in k for k in ours):
            msg += " (pass prefix=... to load the encoder out of a larger model's checkpoint)"
        raise ValueError(msg)
    out = {k: ours[k] for k in expected}
    for k, v in out.items():
        _checks.float_tensor(f"state_dict[{prefix + k!r}]", v)
    return out


def _linear_weight(name: str, w: Tensor, in_dim: int, in_name: str) -> int:
    """Check an nn.Linear weight [out, in] whose input size is known; returns out."""
    if w.dim() != 2:
        raise ValueError(f"{name} must be a matrix [out, in], got shape {list(w.shape)}")
    if w.shape[1] != in_dim:
        hint = ""
        if w.shape[0] == in_dim:
            hint = (
                f": it looks transposed ([in, out], posenc_fast's layout); the public modules "
                f"store nn.Linear weights as [out, in] = [*, {in_dim}]"
            )
        raise ValueError(
            f"{name} must have shape [out, {in_dim}] ({in_name} = {in_dim}), "
            f"got {list(w.shape)}{hint}"
        )
    return w.shape[0]


def parse(
    state_dict: Mapping[str, Tensor],
    source: str,
    *,
    gamma: Optional[float] = None,
    groups: int = 1,
    max_pos: Optional[float] = None,
    prefix: str = "",
    backend: str = "auto",
) -> tuple[tuple, dict, dict[str, Tensor]]:
    """(args, kwargs, weights by parameter name in posenc_fast's layout) for
    ``LearnableFourierFeatures`` from a public module's checkpoint, after every check
    (the arguments: :func:`posenc_fast.convert.from_state_dict`)."""
    _checks.choice("source", source, SOURCES)
    _checks.positive_int("groups", groups)
    if source == "tpe":
        if max_pos is None:
            raise ValueError(
                "max_pos is required for a 'tpe' checkpoint: its forward divides positions "
                "by max_pos (365 + 2 * max_temporal_shift, or 10000 with GDD positions)"
            )
        max_pos = _checks.positive_float("max_pos", max_pos)
        if gamma is not None:
            raise ValueError("the 'tpe' module has no gamma; leave gamma unset")
        if groups != 1:
            raise ValueError(
                f"a 'tpe' module encodes one group of 1-D positions, got groups={groups}"
            )
    elif max_pos is not None:
        raise ValueError(f"max_pos applies to 'tpe' checkpoints only, not {source!r}")
    entries = _select(state_dict, source, prefix)
    wr = entries[_WR_KEY[source]]
    if wr.dim() != 2:
        raise ValueError(
            f"state_dict[{prefix + _WR_KEY[source]!r}] must be a matrix [F/2, M], "
            f"got shape {list(wr.shape)}"
        )
    half, pos_dim = wr.shape
    F = 2 * half
    if source == "tpe":
        if pos_dim != 1:
            raise ValueError(
                f"state_dict[{prefix}'wr.weight'] must be [f/2, 1]: the 'tpe' module "
                f"encodes scalar positions, got {list(wr.shape)}"
            )
        # nn.Linear(1, f/2)'s initialisation U(-1, 1) has std 1/sqrt(3); positions / max_pos.
        our_gamma = math.sqrt(3.0) * max_pos
        wr = wr / max_pos
    else:
        our_gamma = 1.0 if gamma is None else gamma_from(source, gamma)
    factory = {"device": wr.device, "dtype": wr.dtype}
    if source == "lightglue":
        # hidden_dim is unused without the MLP
        args = (pos_dim, F, 0, groups * F, groups, our_gamma)
        return args, {"mlp": False, "backend": backend, **factory}, {"wr": wr}
    w1, b1, w2, b2 = (entries[k] for k in _MLP_KEYS)
    H = _linear_weight(f"state_dict[{prefix}'mlp.0.weight']", w1, F, "F = 2 * Wr rows")
    _checks.shape(f"state_dict[{prefix}'mlp.0.bias']", b1, (H,), f"[H], H = {H}")
    Dg = _linear_weight(f"state_dict[{prefix}'mlp.2.weight']", w2, H, "H")
    _checks.shape(f"state_dict[{prefix}'mlp.2.bias']", b2, (Dg,), f"[D/G], D/G = {Dg}")
    args = (pos_dim, F, H, groups * Dg)
    kwargs = {"groups": groups, "gamma": our_gamma, "backend": backend, **factory}
    # [H, F] -> [F, H] and [D/G, H] -> [H, D/G]: posenc_fast's [in, out] layout
    return args, kwargs, {"wr": wr, "w1": w1.T, "b1": b1, "w2": w2.T, "b2": b2}


def export(module, source: str, *, max_pos: Optional[float] = None, prefix: str = ""):
    """The public module's ``state_dict`` for a ``LearnableFourierFeatures`` (detached
    copies, their [out, in] layout), after refusing what the public module cannot compute
    (see :func:`posenc_fast.convert.to_state_dict`)."""
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
