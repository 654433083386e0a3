"""Hugging Face transformers models with posenc_fast encodings: add_floater_biases, use_lff,
use_fast_rotary (LightGlue), use_fast_rope (DINOv3 ViT), and from_pretrained. Modules are
recognised by class name; only from_pretrained imports transformers (docs/integrations.md).
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Optional

import torch
from torch import Tensor, nn

from .. import _checks, _dispatch
from ..ops.rotary import frequencies as rope
from ..ops.rotary import lff_rotary, rotary
from .attention import add_floater_biases
from .timm import LFFGridEncoding, centered_grid
from .transformers_floater import (  # noqa: F401 (the FLOATER layers' names, also here)
    CONFIG_KEY,
    SUPPORTED_ATTENTION,
    FloaterProjection,
    attention_width,
    class_names,
    install_floater,
    record,
    record_floater,
    supported_attention,
)

FLOATER_NAME = "floater_bias"  # add_floater_biases registers the bias module as model.floater_bias
LFF_NAME = "pos_encoding"  # use_lff: embeddings.pos_encoding


# -- learnable Fourier features of a ViT's patch grid ----------------------------------------

SUPPORTED_EMBEDDINGS = ("ViTEmbeddings", "DeiTEmbeddings")


class _Embed:
    """Instance override of ViT/DeiT embeddings' forward: patches, mask token, the LFF
    encoding, then the prefix tokens (no position encoding) and dropout."""

    def __init__(self, embeddings: nn.Module):
        self.embeddings = embeddings

    def __call__(
        self,
        pixel_values: Tensor,
        bool_masked_pos: Optional[Tensor] = None,
        interpolate_pos_encoding: bool = False,
    ) -> Tensor:
        m = self.embeddings
        height, width = pixel_values.shape[-2:]
        if not interpolate_pos_encoding and (height, width) != tuple(m.image_size):
            raise ValueError(
                f"Input image size ({height}*{width}) doesn't match model "
                f"({m.image_size[0]}*{m.image_size[1]}); with LFF position encodings any size "
                "that is a multiple of the patch size works: pass interpolate_pos_encoding=True"
            )
        x = m.patch_embeddings(pixel_values)  # [B, N, C]
        batch, n = x.shape[:2]
        if bool_masked_pos is not None:
            mask = bool_masked_pos.unsqueeze(-1).type_as(x)
            x = x * (1.0 - mask) + m.mask_token.expand(batch, n, -1) * mask
        ph, pw = _pair(m.patch_embeddings.patch_size)
        x = m.pos_encoding(x, (height // ph, width // pw))
        prefix = [m.cls_token.expand(batch, -1, -1)]
        if getattr(m, "distillation_token", None) is not None:
            prefix.append(m.distillation_token.expand(batch, -1, -1))
        return m.dropout(torch.cat([*prefix, x], dim=1))


def _pair(size) -> tuple[int, int]:
    return (int(size[0]), int(size[1])) if isinstance(size, (tuple, list)) else (size, size)


def _find(model: nn.Module, classes: tuple[str, ...], what: str) -> nn.Module:
    found = [m for m in model.modules() if class_names(m) & set(classes)]
    if len(found) != 1:
        raise TypeError(
            f"model must contain exactly one {what} ({', '.join(classes)}), found "
            f"{len(found)} in {type(model).__name__}"
        )
    return found[0]


def use_lff(model: nn.Module, gamma: float = 2.0, **lff_kwargs) -> LFFGridEncoding:
    """Give a Hugging Face ViT-family model (ViTModel, ViTForImageClassification,
    DeiTModel, ...) learnable-Fourier-feature position encodings of its patch grid.

    ``embeddings.position_embeddings`` becomes None; the encoding is
    ``embeddings.pos_encoding`` (an LFFGridEncoding, as for timm) of each patch's (row,
    col) index. ``gamma``: the kernel width in patches; ``lff_kwargs``: for
    :class:`~posenc_fast.LearnableFourierFeatures` (fourier_dim=256, hidden_dim=32 by
    default). Prefix tokens get no encoding. Other image sizes (multiples of the patch
    size) need ``interpolate_pos_encoding=True``; the new grid's encoding is computed.
    Returns the encoding module."""
    emb = _find(model, SUPPORTED_EMBEDDINGS, "ViT embeddings module")
    _checks.positive_float("gamma", gamma)
    table = emb.position_embeddings
    if not isinstance(table, Tensor):
        raise ValueError("the model's position_embeddings is not a table (use_lff ran already?)")
    encoding = LFFGridEncoding(table.shape[-1], gamma, **lff_kwargs)
    encoding.to(device=table.device, dtype=table.dtype)
    emb.position_embeddings = None  # transformers' own init skips a None table
    setattr(emb, LFF_NAME, encoding)
    emb.__dict__["forward"] = _Embed(emb)  # an instance attribute wins over the method
    options = {"gamma": float(gamma), **_json_options(lff_kwargs)}
    record(model, "lff", options)
    return encoding


def _json_options(options: dict) -> dict:
    """The options that config.json can hold (device and dtype are the model's)."""
    return {k: v for k, v in options.items() if isinstance(v, (bool, int, float, str, type(None)))}


# -- LightGlue: the fused LFF rotary table ---------------------------------------------------


class FastLightGluePositionalEncoder(nn.Module):
    """LightGlue's positional encoder on the fused ``lff_rotary`` op, its ``projector``
    nn.Linear(2, head_dim / 2, bias=False) as wr. Same outputs and state_dict keys."""

    def __init__(self, projector: nn.Linear, backend: str = "auto"):
        super().__init__()
        self.projector = projector
        self.backend = backend

    def forward(self, keypoints: Tensor, output_hidden_states: Optional[bool] = False):
        table = lff_rotary(keypoints, self.projector.weight, backend=self.backend)
        table = table.squeeze(-3)  # [2, ..., N, head_dim]: no heads axis in LightGlue
        embeddings = (table[0], table[1])
        if output_hidden_states:
            return embeddings, self.projector(keypoints)
        return (embeddings,)


def use_fast_rotary(model: nn.Module, backend: str = "auto") -> FastLightGluePositionalEncoder:
    """Replace a ``LightGlueForKeypointMatching``'s positional encoder by
    :class:`FastLightGluePositionalEncoder` (equal within float32 rounding). Returns it."""
    old = getattr(model, "positional_encoder", None)
    if old is None or "LightGluePositionalEncoder" not in class_names(old):
        raise TypeError(
            "model must be a LightGlueForKeypointMatching (with a LightGluePositionalEncoder "
            f"at positional_encoder), got {type(model).__name__}"
        )
    projector = old.projector
    if projector.bias is not None or projector.in_features != 2:
        raise ValueError("LightGlue's projector must be nn.Linear(2, head_dim / 2, bias=False)")
    new = FastLightGluePositionalEncoder(projector, backend)
    new.train(old.training)
    model.positional_encoder = new
    return new


# -- DINOv3 ViT: the fused rotary op ---------------------------------------------------------
# (transformers 5.24.) Overrides the position embedding's forward (coordinates, not the
# table) and each DINOv3ViTAttention's (the fused op, then transformers' attention).

ROPE_EMBEDDING = "DINOv3ViTRopePositionEmbedding"
ROPE_ATTENTION = "DINOv3ViTAttention"
_EMBEDDING_ATTRIBUTES = ("config", "inv_freq")
_ATTENTION_ATTRIBUTES = ("config", "num_heads", "head_dim", "scaling", "dropout", "q_proj",
                         "k_proj", "v_proj", "o_proj")  # fmt: skip
_CONFIG_ATTRIBUTES = ("patch_size", "num_register_tokens", "pos_embed_shift", "pos_embed_jitter",
                      "pos_embed_rescale", "_attn_implementation")  # fmt: skip


class _Dinov3Coordinates:
    """Instance override of ``DINOv3ViTRopePositionEmbedding.forward(pixel_values)``: patch
    centres [H/p * W/p, 2] in [-1, 1] float32, augmented in training as transformers does."""

    def __init__(self, embedding: nn.Module):
        self.embedding = embedding

    def __call__(self, pixel_values: Tensor) -> Tensor:
        m = self.embedding
        config = m.config
        ph, pw = _pair(config.patch_size)
        height, width = pixel_values.shape[-2:]
        coords = centered_grid((height // ph, width // pw), device=pixel_values.device)
        if m.training:
            coords = rope.augment(
                coords, config.pos_embed_shift, config.pos_embed_jitter, config.pos_embed_rescale
            )
        return coords


class _Dinov3Attention:
    """Instance override of ``DINOv3ViTAttention.forward``: q and k rotated by
    ``posenc_fast.rotary`` (W = 2 pi inv_freq per axis), then transformers' attention."""

    def __init__(self, attention: nn.Module, embedding: nn.Module, backend: str):
        self.attention, self.embedding, self.backend = attention, embedding, backend

    def __call__(self, hidden_states, attention_mask=None, position_embeddings=None, **kwargs):
        a = self.attention
        B, N, _ = hidden_states.shape
        q, k, v = (
            proj(hidden_states).view(B, N, a.num_heads, a.head_dim).transpose(1, 2)
            for proj in (a.q_proj, a.k_proj, a.v_proj)
        )
        coords = position_embeddings
        if not isinstance(coords, Tensor) or coords.dim() != 2 or coords.shape[-1] != 2:
            got = list(coords.shape) if isinstance(coords, Tensor) else type(coords).__name__
            raise ValueError(
                "position_embeddings must be the patch coordinates [N, 2] that the converted "
                f"model's rope_embeddings gives (use_fast_rope), not a cos / sin table; got {got}"
            )
        bands = (2 * math.pi) * self.embedding.inv_freq  # [head_dim / 4] per axis
        zero = torch.zeros_like(bands)
        freqs = torch.stack([torch.cat([bands, zero]), torch.cat([zero, bands])], dim=-1)
        prefix = 1 + a.config.num_register_tokens  # the class and register tokens
        q, k = rotary(q, k, coords, freqs, "half", "bhnd", prefix, self.backend)
        modeling = sys.modules[type(a).__module__]
        attend = modeling.ALL_ATTENTION_FUNCTIONS.get_interface(
            a.config._attn_implementation, modeling.eager_attention_forward
        )
        out, weights = attend(
            a, q, k, v, attention_mask, dropout=a.dropout if a.training else 0.0,
            scaling=a.scaling, **kwargs,
        )  # fmt: skip
        return a.o_proj(out.reshape(B, N, -1).contiguous()), weights


def use_fast_rope(model: nn.Module, backend: str = "auto") -> nn.Module:
    """Rotate q and k of every attention layer of a transformers DINOv3 ViT
    (``DINOv3ViTModel``, ``DINOv3ViTBackbone``) with ``posenc_fast.rotary``, in place: the
    same outputs and gradients within float32 rounding, training augmentations included;
    state_dict keys unchanged; ``model.rope_embeddings`` then returns coordinates. Returns
    the model."""
    backend = _dispatch.validate_name(backend)
    embedding = _find(model, (ROPE_EMBEDDING,), "DINOv3 ViT rotary position embedding")
    attentions = [m for m in model.modules() if ROPE_ATTENTION in class_names(m)]
    for module, names in [(embedding, _EMBEDDING_ATTRIBUTES)] + [
        (a, _ATTENTION_ATTRIBUTES) for a in attentions
    ]:
        missing = [n for n in names if not hasattr(module, n)]
        if missing or type(module).__name__ not in (ROPE_EMBEDDING, ROPE_ATTENTION):
            raise TypeError(
                f"{type(module).__name__} lacks {missing} or is a subclass: its structure "
                "differs from transformers 5.24's DINOv3 ViT, which use_fast_rope follows"
            )
    if not attentions:
        raise TypeError(f"{type(model).__name__} has no {ROPE_ATTENTION}")
    missing = [n for n in _CONFIG_ATTRIBUTES if not hasattr(embedding.config, n)]
    if missing:
        raise TypeError(
            f"the model's config lacks {missing}: it differs from transformers 5.24's "
            "DINOv3ViTConfig, which use_fast_rope follows"
        )
    embedding.__dict__["forward"] = _Dinov3Coordinates(embedding)  # instance attributes win
    for a in attentions:
        a.__dict__["forward"] = _Dinov3Attention(a, embedding, backend)
    record(model, "fast_rope", {"backend": backend})
    return model


# -- checkpoints -----------------------------------------------------------------------------


def _read_checkpoint(path: str) -> dict[str, Tensor]:
    """Every tensor of a local save_pretrained directory (safetensors, sharded or not;
    else pytorch_model.bin)."""
    from safetensors.torch import load_file

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        state: dict[str, Tensor] = {}
        for shard in shards:
            state.update(load_file(os.path.join(path, shard)))
        return state
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return load_file(single)
    binary = os.path.join(path, "pytorch_model.bin")
    if os.path.isfile(binary):
        return torch.load(binary, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"no model.safetensors(.index.json) or pytorch_model.bin in {path}")


def apply_recorded(model: nn.Module, recorded: dict) -> None:
    """Apply what ``config.posenc_fast`` records (use_lff, add_floater_biases) to a model
    built without it."""
    unknown = set(recorded) - {"lff", "floater_biases", "fast_rope"}
    if unknown:
        raise ValueError(f"config.{CONFIG_KEY} holds unknown entries {sorted(unknown)}")
    if "lff" in recorded:
        use_lff(model, **recorded["lff"])
    if "floater_biases" in recorded:
        add_floater_biases(model, **recorded["floater_biases"])
    if "fast_rope" in recorded:
        use_fast_rope(model, **recorded["fast_rope"])


def from_pretrained(model_class, pretrained_model_name_or_path=None, *, state_dict=None, **kwargs):
    """``model_class.from_pretrained`` for a model saved with posenc_fast encodings.

    Builds the model from the config, applies what ``config.posenc_fast`` records (to the
    whole model, as when saved) and loads every weight strictly, the encodings' (frozen
    FLOATER states) included; plain ``from_pretrained`` would drop them.

    Args:
        model_class: a transformers model class (``RobertaForSequenceClassification``,
            ``ViTForImageClassification``, an Auto class).
        pretrained_model_name_or_path: a local directory written by save_pretrained;
            or None with ``config=`` and ``state_dict=`` (as for transformers).
        state_dict: the weights, instead of the directory's.
        kwargs: for ``model_class.from_pretrained`` (config, dtype, attn_implementation, ...).
    """
    from transformers import AutoConfig

    config = kwargs.pop("config", None)
    if pretrained_model_name_or_path is not None:
        if state_dict is not None:
            raise ValueError("pass a directory or state_dict, not both (as for transformers)")
        if not os.path.isdir(pretrained_model_name_or_path):
            raise ValueError(
                "pretrained_model_name_or_path must be a local directory written by "
                f"save_pretrained, got {pretrained_model_name_or_path!r}"
            )
        state_dict = _read_checkpoint(pretrained_model_name_or_path)
        if config is None:
            config = AutoConfig.from_pretrained(pretrained_model_name_or_path)
    if config is None or state_dict is None:
        raise ValueError("pass a directory, or config= and state_dict=")
    recorded = getattr(config, CONFIG_KEY, None) or {}
    ours = {k: v for k, v in state_dict.items() if _is_ours(k)}
    plain = {k: v for k, v in state_dict.items() if k not in ours}
    if "lff" in recorded:
        plain.update(_removed_tables(model_class, config, plain))
    model = model_class.from_pretrained(None, config=config, state_dict=plain, **kwargs)
    if not recorded:
        if ours:
            raise ValueError(
                f"the checkpoint holds posenc_fast weights ({sorted(ours)[:3]}...) but its "
                f"config has no {CONFIG_KEY} entry saying how to add them"
            )
        return model
    apply_recorded(model, recorded)
    # torch's loader, so that a frozen Floater's states are restored (Floater's hook)
    result = model.load_state_dict(ours, strict=False)
    missing = sorted(k for k in result.missing_keys if _is_ours(k))
    if result.unexpected_keys or missing:
        raise ValueError(
            f"the checkpoint does not match config.{CONFIG_KEY}: unexpected keys "
            f"{sorted(result.unexpected_keys)}, missing {missing}"
        )
    return model


def _removed_tables(model_class, config, plain: dict) -> dict[str, Tensor]:
    """Zeros for the tables use_lff removed, so transformers does not report them as newly
    initialised (shapes from a meta-device build); use_lff drops them again."""
    with torch.device("meta"):
        build = getattr(model_class, "from_config", None)  # Auto classes
        probe = build(config) if build is not None else model_class(config)
    tables = {}
    for name, module in probe.named_modules():
        if class_names(module) & set(SUPPORTED_EMBEDDINGS):
            key = f"{name}.position_embeddings" if name else "position_embeddings"
            table = module.position_embeddings
            if key not in plain and isinstance(table, Tensor):
                tables[key] = torch.zeros(table.shape, dtype=table.dtype)
    return tables


def _is_ours(key: str) -> bool:
    """Whether a state_dict key belongs to a module posenc_fast added (add_floater_biases
    registers ``floater_bias`` on the model, use_lff ``pos_encoding`` on the embeddings)."""
    return any(f".{name}." in f".{key}" for name in (FLOATER_NAME, LFF_NAME))
