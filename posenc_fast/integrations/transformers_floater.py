"""FLOATER Q/K/V biases in Hugging Face transformers' self-attention layers (separate
query / key / value projections): found, changed and recorded in ``model.config`` for
add_floater_biases. Imports neither transformers nor the rest of the integrations.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops.floater import BlockBiases, FloaterAttentionBias, Slot

# transformers (5.x) self-attention classes that get FLOATER biases (each one tested).
SUPPORTED_ATTENTION = (
    "BertSelfAttention",
    "RobertaSelfAttention",
    "XLMRobertaSelfAttention",
    "CamembertSelfAttention",
    "ElectraSelfAttention",
    "DistilBertSelfAttention",
    "ViTAttention",
    "DeiTAttention",
)
_PROJECTION_NAMES = (
    ("query", "key", "value"),
    ("q_proj", "k_proj", "v_proj"),
    ("q_lin", "k_lin", "v_lin"),
)
_CACHE_ARGS = ("cache", "past_key_values", "past_key_value")
CONFIG_KEY = "posenc_fast"  # model.config.posenc_fast: what was added, with its options


def class_names(module: nn.Module) -> set[str]:
    return {c.__name__ for c in type(module).__mro__}


def _projection_names(module: nn.Module) -> Optional[tuple[str, str, str]]:
    children = module._modules
    for names in _PROJECTION_NAMES:
        if all(isinstance(children.get(n), nn.Linear) for n in names):
            return names
    return None


def supported_attention(module: nn.Module) -> Optional[tuple[str, str, str]]:
    """The q / k / v projections' names of a :data:`SUPPORTED_ATTENTION` layer, else None
    (a ValueError if it has FLOATER biases already)."""
    if not class_names(module) & set(SUPPORTED_ATTENTION):
        return None
    names = _projection_names(module)
    if names is None:
        return None
    if any(isinstance(module._modules[n], FloaterProjection) for n in names):
        raise ValueError("the model already has FLOATER biases (add_floater_biases ran)")
    return names


def attention_width(module: nn.Module, names: tuple[str, str, str]) -> int:
    """The projections' common output width (FLOATER's dim), or a ValueError."""
    widths = {module._modules[n].out_features for n in names}
    if len(widths) != 1:  # grouped-query attention: keys and values are narrower
        raise ValueError(
            f"{type(module).__name__}: the query, key and value projections must have one "
            f"width for FLOATER biases, got {[module._modules[n].out_features for n in names]}"
        )
    return widths.pop()


def _layer_biases(block: BlockBiases, length: int, position_ids: Optional[Tensor]) -> Tensor:
    """The block's biases for a sequence of ``length`` tokens: [3, L, dim] at positions
    0..L-1, or [B or 1, 3, L, dim] at ``position_ids`` [B or 1, L]."""
    if position_ids is None:
        return block(length)
    pos = position_ids if position_ids.dim() == 2 else position_ids.reshape(1, -1)
    if pos.is_floating_point() or pos.is_complex() or pos.shape[-1] != length:
        raise ValueError(
            f"position_ids must be integer [B, L] with L = {length} (the sequence), got "
            f"{pos.dtype} {list(position_ids.shape)}"
        )
    low, high = torch.aminmax(pos)
    if int(low) < 0:  # one host read of both (a graph break under torch.compile)
        raise ValueError(f"position_ids must be >= 0 for FLOATER biases, got {int(low)}")
    table = block(int(high) + 1)  # [3, P, dim]
    return table[:, pos].movedim(1, 0)  # [B, 3, L, dim]


class _SetBiases:
    """Forward pre-hook of a supported attention layer: its block's biases into the slot."""

    def __init__(self, block: BlockBiases, slot: Slot):
        self.block, self.slot = block, slot

    def __call__(self, module, args, kwargs):
        hidden = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(hidden, Tensor):
            raise TypeError(f"{type(module).__name__}: hidden_states must be a tensor")
        for name in _CACHE_ARGS:
            if kwargs.get(name) is not None:
                raise ValueError(
                    "FLOATER biases do not support incremental decoding with a key/value cache "
                    "(positions would restart at 0): call the model with use_cache=False"
                )
        if kwargs.get("encoder_hidden_states") is not None:
            raise ValueError("FLOATER biases are for self-attention, not cross-attention")
        self.slot.value = _layer_biases(self.block, hidden.shape[-2], kwargs.get("position_ids"))


class _ClearBiases:
    """Forward hook (always called): the slot holds nothing between calls."""

    def __init__(self, slot: Slot):
        self.slot = slot

    def __call__(self, module, args, kwargs, output):
        self.slot.value = None


class FloaterProjection(nn.Linear):
    """A q, k or v projection ``x [..., L, in] -> [..., L, out]`` plus block ``layer``'s
    FLOATER bias ``index`` (0: q, 1: k, 2: v), sharing the replaced nn.Linear's parameters;
    the layer's pre-hook provides the biases (alone, it fetches them for 0..L-1)."""

    def __init__(self, linear: nn.Linear, block: BlockBiases, slot: Slot, index: int):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self._block, self._slot, self.index = block, slot, index

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight, self.bias)
        biases = self._slot.value
        if biases is None:
            biases = self._block(x.shape[-2])
        b = biases[..., self.index, :, :]  # [L, dim] or [B, L, dim]
        if b.shape[-2] != x.shape[-2]:
            raise ValueError(
                f"FLOATER biases for {b.shape[-2]} positions, but this projection got "
                f"{x.shape[-2]} tokens (cross-attention is not supported)"
            )
        return y + b.to(y.dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", floater_layer={self._block.layer}, index={self.index}"


def install_floater(
    module: nn.Module,
    names: tuple[str, str, str],
    source: FloaterAttentionBias,
    layer: int,
    share: bool,
) -> None:
    """Give a supported attention layer block ``layer``'s biases (add_floater_biases)."""
    block, slot = source.block(layer, share), Slot()
    for j, name in enumerate(names):
        setattr(module, name, FloaterProjection(module._modules[name], block, slot, j))
    module._floater_slot = slot  # a plain attribute: found by copies, saved by nothing
    module.register_forward_pre_hook(_SetBiases(block, slot), with_kwargs=True)
    module.register_forward_hook(_ClearBiases(slot), with_kwargs=True, always_call=True)


_RECORDED = (
    "hidden_dim",
    "delta_t",
    "substeps",
    "method",
    "activation",
    "refresh_every",
    "init_scale",
)


def record_floater(model: nn.Module, source: FloaterAttentionBias) -> None:
    """Write the options into ``model.config.posenc_fast`` (a transformers model's
    config: save_pretrained keeps them in config.json, from_pretrained reads them)."""
    fl = source.floater
    record(model, "floater_biases", {name: getattr(fl, name) for name in _RECORDED})


def record(model: nn.Module, key: str, options: dict) -> None:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return
    recorded = dict(getattr(config, CONFIG_KEY, None) or {})
    recorded[key] = options
    setattr(config, CONFIG_KEY, recorded)
