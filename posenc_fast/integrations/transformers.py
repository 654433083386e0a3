"""Hugging Face transformers models with posenc_fast encodings, one call each.

    from posenc_fast.integrations.attention import add_floater_biases
    biases = add_floater_biases(bert)                 # FLOATER Q/K/V biases (also in this module)

    import posenc_fast.integrations.transformers as pf_hf
    pf_hf.use_lff(vit, gamma=2.0)                     # ViT / DeiT: LFF of the patch grid
    pf_hf.use_fast_rotary(lightglue)                  # LightGlue: the fused LFF rotary table
    model = pf_hf.from_pretrained(RobertaForSequenceClassification, path)  # reload all of it

Nothing here imports transformers except :func:`from_pretrained` (which needs its
loaders): the functions work on the modules they are given, recognised by their class
names (and their base classes' names, so that a subclass is recognised too).

FLOATER biases. :func:`add_floater_biases` of posenc_fast.integrations.attention finds
the self-attention layers of the classes in :data:`SUPPORTED_ATTENTION` (separate query,
key and value nn.Linear projections: ``query``/``key``/``value``, ``q_proj``/``k_proj``/
``v_proj`` or ``q_lin``/``k_lin``/``v_lin``) beside timm's and torch's layers. Each
projection becomes a :class:`FloaterProjection` (the same weight and bias parameters,
under the same names: checkpoints load as before) that adds its block's bias. The biases
of a block are fetched once per call of its attention layer, by a forward pre-hook on the
layer, through :func:`~posenc_fast.integrations.attention.block_bias`: one integration per
training step shared by every block (and its backward), the module's cache in eval mode,
the stored states of a frozen module, refresh_every and the rest exactly as for timm. A
forward hook (run also when the forward raises) empties the layer's slot again, so no
tensor stays on the model between calls (copies, pickles and checkpoints at any time).

- Positions: the token indices 0..L-1, or the ``position_ids`` the model passes to its
  attention layers (BERT, RoBERTa and XLM-R pass the ``position_ids`` given to their
  forward; DistilBERT and ViT pass none): then block n's biases are those of positions
  0..max(position_ids), gathered per sequence. Reading that maximum is a host
  synchronisation (under torch.compile, a graph break). RoBERTa-style position_ids
  start at padding_idx + 1: passed explicitly, FLOATER sees them so (shifted by 2).
- Masks: untouched. Padding, causal and packed-sequence masks are applied by the
  model's own attention function (eager, sdpa, flash, flex: whichever the config
  selects), after the projections.
- Not supported: cross-attention (its keys and values have the other sequence's
  positions) and incremental decoding with a key/value cache (its positions continue
  from the cache): both raise, naming the reason.
- ``model.config.posenc_fast`` records the options (save_pretrained writes them to
  config.json), which :func:`from_pretrained` reads to rebuild the model.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _checks
from ..ops.floater import FloaterAttentionBias
from ..ops.rotary import lff_rotary
from .attention import _Source, block_bias
from .timm import LFFGridEncoding

# -- FLOATER biases in self-attention with separate q / k / v projections ---------------------

# Self-attention classes of transformers (5.x) whose three projections get FLOATER biases;
# each is tested in tests/common/test_integrations_transformers.py.
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
FLOATER_NAME = "floater_bias"  # add_floater_biases registers the bias module as model.floater_bias
LFF_NAME = "pos_encoding"  # use_lff: embeddings.pos_encoding


def _class_names(module: nn.Module) -> set[str]:
    return {c.__name__ for c in type(module).__mro__}


def _projection_names(module: nn.Module) -> Optional[tuple[str, str, str]]:
    children = module._modules
    for names in _PROJECTION_NAMES:
        if all(isinstance(children.get(n), nn.Linear) for n in names):
            return names
    return None


def supported_attention(module: nn.Module) -> Optional[tuple[str, str, str]]:
    """The names of the q / k / v projections of a supported transformers self-attention
    layer (:data:`SUPPORTED_ATTENTION`), else None. Raises if it already has FLOATER
    biases."""
    if not _class_names(module) & set(SUPPORTED_ATTENTION):
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


class _LayerSlot:
    """Block n's biases during one call of its attention layer ([3, L, dim], or
    [B, 3, L, dim] gathered by position_ids), else None. Copies and pickles get an empty
    slot (the tensor, with its autograd graph, is derived data)."""

    def __init__(self):
        self.biases: Optional[Tensor] = None

    def __deepcopy__(self, memo) -> _LayerSlot:
        return _LayerSlot()

    def __reduce__(self):
        return (_LayerSlot, ())


def _layer_biases(src: _Source, length: int, position_ids: Optional[Tensor]) -> Tensor:
    """Block ``src.layer``'s biases for a sequence of ``length`` tokens: [3, L, dim] at
    positions 0..L-1, or [B or 1, 3, L, dim] at ``position_ids`` [B or 1, L]."""
    if position_ids is None:
        return block_bias(src.module, src.layer, length, src.share)
    pos = position_ids if position_ids.dim() == 2 else position_ids.reshape(1, -1)
    if pos.is_floating_point() or pos.is_complex() or pos.shape[-1] != length:
        raise ValueError(
            f"position_ids must be integer [B, L] with L = {length} (the sequence), got "
            f"{pos.dtype} {list(position_ids.shape)}"
        )
    low, high = torch.aminmax(pos)
    if int(low) < 0:  # one host read of both (a graph break under torch.compile)
        raise ValueError(f"position_ids must be >= 0 for FLOATER biases, got {int(low)}")
    table = block_bias(src.module, src.layer, int(high) + 1, src.share)  # [3, P, dim]
    return table[:, pos].movedim(1, 0)  # [B, 3, L, dim]


class _SetBiases:
    """Forward pre-hook of a supported attention layer: its block's biases into the slot."""

    def __init__(self, source: _Source, slot: _LayerSlot):
        self.source, self.slot = source, slot

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
        self.slot.biases = _layer_biases(self.source, hidden.shape[-2], kwargs.get("position_ids"))


class _ClearBiases:
    """Forward hook (always called): the slot holds nothing between calls."""

    def __init__(self, slot: _LayerSlot):
        self.slot = slot

    def __call__(self, module, args, kwargs, output):
        self.slot.biases = None


class FloaterProjection(nn.Linear):
    """A query, key or value projection ``x [..., L, in] -> [..., L, out]`` plus the
    FLOATER bias ``index`` (0: query, 1: key, 2: value) of block ``layer``. Shares
    ``weight`` and ``bias`` with the nn.Linear it replaces; its attention layer's
    pre-hook provides the biases (called on its own, it fetches them itself, for
    positions 0..L-1)."""

    def __init__(self, linear: nn.Linear, source: _Source, slot: _LayerSlot, index: int) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self._source, self._slot, self.index = source, slot, index

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight, self.bias)
        biases = self._slot.biases
        if biases is None:
            src = self._source
            biases = block_bias(src.module, src.layer, x.shape[-2], src.share)
        b = biases[..., self.index, :, :]  # [L, dim] or [B, L, dim]
        if b.shape[-2] != x.shape[-2]:
            raise ValueError(
                f"FLOATER biases for {b.shape[-2]} positions, but this projection got "
                f"{x.shape[-2]} tokens (cross-attention is not supported)"
            )
        return y + b.to(y.dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", floater_layer={self._source.layer}, index={self.index}"


def install_floater(
    module: nn.Module,
    names: tuple[str, str, str],
    source: FloaterAttentionBias,
    layer: int,
    share: bool,
) -> None:
    """Give a supported attention layer block ``layer``'s biases (add_floater_biases)."""
    src, slot = _Source(source, layer, share), _LayerSlot()
    for j, name in enumerate(names):
        setattr(module, name, FloaterProjection(module._modules[name], src, slot, j))
    module._floater_slot = slot  # a plain attribute: found by copies, saved by nothing
    module.register_forward_pre_hook(_SetBiases(src, slot), with_kwargs=True)
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
    _record(model, "floater_biases", {name: getattr(fl, name) for name in _RECORDED})


def _record(model: nn.Module, key: str, options: dict) -> None:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return
    recorded = dict(getattr(config, CONFIG_KEY, None) or {})
    recorded[key] = options
    setattr(config, CONFIG_KEY, recorded)


def add_floater_biases(model: nn.Module, share_integration: bool = True, **floater_kwargs):
    """posenc_fast.integrations.attention.add_floater_biases (the same function): FLOATER
    Q/K/V biases in every supported attention layer of ``model``."""
    from .attention import add_floater_biases as add

    return add(model, share_integration=share_integration, **floater_kwargs)


# -- learnable Fourier features of a ViT's patch grid ----------------------------------------

SUPPORTED_EMBEDDINGS = ("ViTEmbeddings", "DeiTEmbeddings")


class _Embed:
    """Instance override of a ViT/DeiT embeddings module's forward: the patch embedding,
    the mask token, the LFF encoding of the patch grid on the patch tokens, then the
    prefix tokens (class, distillation: no position encoding) and dropout."""

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
    found = [m for m in model.modules() if _class_names(m) & set(classes)]
    if len(found) != 1:
        raise TypeError(
            f"model must contain exactly one {what} ({', '.join(classes)}), found "
            f"{len(found)} in {type(model).__name__}"
        )
    return found[0]


def use_lff(model: nn.Module, gamma: float = 2.0, **lff_kwargs) -> LFFGridEncoding:
    """Give a Hugging Face ViT-family model (ViTModel, ViTForImageClassification,
    DeiTModel, ...) learnable-Fourier-feature position encodings of its patch grid.

    The learned table ``embeddings.position_embeddings`` is set to None and the encoding
    is ``embeddings.pos_encoding`` (an LFFGridEncoding, as for timm): each patch's (row,
    col) index in patch units goes through :class:`~posenc_fast.LearnableFourierFeatures`
    (``gamma``: the kernel width in patches; ``lff_kwargs``: fourier_dim=256,
    hidden_dim=32 by default, ...). The class and distillation tokens get no position
    encoding. Images of another size (multiples of the patch size) need
    ``interpolate_pos_encoding=True``, as before; nothing is interpolated: the encoding of
    the new grid is computed. Returns the encoding module."""
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
    _record(model, "lff", options)
    return encoding


def _json_options(options: dict) -> dict:
    """The options that config.json can hold (device and dtype are the model's)."""
    return {k: v for k, v in options.items() if isinstance(v, (bool, int, float, str, type(None)))}


# -- LightGlue: the fused LFF rotary table ---------------------------------------------------


class FastLightGluePositionalEncoder(nn.Module):
    """LightGlue's positional encoder with its cos / sin table from posenc_fast's fused
    ``lff_rotary`` op. ``projector`` is LightGlue's own nn.Linear(2, head_dim / 2,
    bias=False) (its weight is the frequencies wr; the state_dict keys are unchanged).
    Same outputs: ``((cos, sin),)`` each [..., N, head_dim], and the projected keypoints
    as a second element when ``output_hidden_states``."""

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
    """Replace the positional encoder of a ``LightGlueForKeypointMatching`` by
    :class:`FastLightGluePositionalEncoder`, which computes the same cos / sin table in
    one fused op with the projector's weights (outputs equal within float32 rounding; the
    phases are reduced more accurately). Returns the new encoder."""
    old = getattr(model, "positional_encoder", None)
    if old is None or "LightGluePositionalEncoder" not in _class_names(old):
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
    from .attention import add_floater_biases as add

    unknown = set(recorded) - {"lff", "floater_biases"}
    if unknown:
        raise ValueError(f"config.{CONFIG_KEY} holds unknown entries {sorted(unknown)}")
    if "lff" in recorded:
        use_lff(model, **recorded["lff"])
    if "floater_biases" in recorded:
        add(model, **recorded["floater_biases"])


def from_pretrained(model_class, pretrained_model_name_or_path=None, *, state_dict=None, **kwargs):
    """``model_class.from_pretrained`` for a model saved with posenc_fast encodings.

    ``model_class.from_pretrained`` alone builds the model without them and drops their
    weights (reported as unexpected keys). This builds the model from the config, applies
    what ``config.posenc_fast`` records (use_lff, add_floater_biases with their options),
    and loads every weight, the encodings' (frozen FLOATER states included) strictly.
    The integrations are applied to the whole model, as they were when it was saved (a
    model whose FLOATER biases were added to a submodule gets an error naming the keys).

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
    """Zeros for the learned tables use_lff removed (not in the checkpoint), so that
    transformers loads without reporting them as newly initialised; use_lff then drops
    them again. Their shapes come from the model built on the meta device (no memory)."""
    with torch.device("meta"):
        build = getattr(model_class, "from_config", None)  # Auto classes
        probe = build(config) if build is not None else model_class(config)
    tables = {}
    for name, module in probe.named_modules():
        if _class_names(module) & set(SUPPORTED_EMBEDDINGS):
            key = f"{name}.position_embeddings" if name else "position_embeddings"
            table = module.position_embeddings
            if key not in plain and isinstance(table, Tensor):
                tables[key] = torch.zeros(table.shape, dtype=table.dtype)
    return tables


def _is_ours(key: str) -> bool:
    """Whether a state_dict key belongs to a module posenc_fast added (add_floater_biases
    registers ``floater_bias`` on the model, use_lff ``pos_encoding`` on the embeddings)."""
    return any(f".{name}." in f".{key}" for name in (FLOATER_NAME, LFF_NAME))
