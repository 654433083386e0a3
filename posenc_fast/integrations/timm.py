"""timm models with posenc_fast:

- ``use_lff(model, gamma=2.0)`` / ``use_sine2d(model)``: a VisionTransformer's learned
  table becomes an encoding of each patch's (row, col), so any grid size works;
- ``use_fast_rope(model)``: timm's Eva-family models (EVA-02, RoPE-ViT axial and Mixed,
  DINOv3, MRoPE) and NaFlexViT rotate q and k with the fused op, without the table.
"""

# How both plug in (instance overrides; timm 1.0's contracts): docs/integrations.md.

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _checks, _dispatch
from ..grid import grid_positions
from ..ops.encodings import sinusoidal_nd
from ..ops.lff import LearnableFourierFeatures
from ..ops.rotary import frequencies as rope
from ..ops.rotary import rotary


class _GridEncoding(nn.Module):
    """Adds an encoding of the (row, col) patch indices to patch tokens."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def encode(self, coords: Tensor) -> Tensor:  # [N, 2] float32 -> [N, dim]
        raise NotImplementedError

    def forward(self, x: Tensor, grid_size: tuple[int, int]) -> Tensor:
        """x [B, H, W, C], or [B, H*W, C] with (H, W) = grid_size (read per call) -> x + pe."""
        if x.shape[-1] != self.dim:  # else a reshape of the encoding fails obscurely
            raise ValueError(
                f"patch tokens must have embed_dim={self.dim} channels (the model's width), "
                f"got {list(x.shape)}"
            )
        if x.dim() == 4:
            h, w = x.shape[1], x.shape[2]
        else:
            h, w = grid_size
            if x.dim() != 3 or x.shape[1] != h * w:
                raise ValueError(
                    f"patch tokens must be [B, H, W, C] or [B, H*W={h * w}, C] for the "
                    f"{h}x{w} grid, got {list(x.shape)}; for other image sizes build the "
                    "model with dynamic_img_size=True or call model.set_input_size(...)"
                )
        coords = grid_positions(h, w, normalize=False, device=x.device, dtype=torch.float32)
        pe = self.encode(coords)  # [H*W, C]
        return x + pe.to(x.dtype).reshape(x.shape[1:])


class LFFGridEncoding(_GridEncoding):
    """Learnable Fourier features of the patch indices: ``lff`` is a
    :class:`~posenc_fast.LearnableFourierFeatures` (pos_dim 2, one group, out_dim C)."""

    def __init__(self, dim: int, gamma: float, **lff_kwargs):
        super().__init__(dim)
        lff_kwargs.setdefault("fourier_dim", 256)
        lff_kwargs.setdefault("hidden_dim", 32)
        for name in ("pos_dim", "out_dim", "groups"):
            if name in lff_kwargs:
                raise TypeError(f"{name} is set by the model (2, embed_dim, 1): do not pass it")
        self.lff = LearnableFourierFeatures(pos_dim=2, out_dim=dim, gamma=gamma, **lff_kwargs)

    def encode(self, coords: Tensor) -> Tensor:
        return self.lff(coords[:, None, :])


class SineGridEncoding(_GridEncoding):
    """Sine-2D: ``sinusoidal_nd`` of the patch indices, C/2 channels per axis (row first),
    interleaved sin/cos with frequencies base^(-2i/(C/2)). No parameters."""

    def __init__(self, dim: int, base: float = 10000.0):
        super().__init__(dim)
        if dim % 4:
            raise ValueError(
                f"Sine-2D needs embed_dim divisible by 4 (sin/cos per axis), got {dim}"
            )
        self.base = _checks.positive_float("base", base)

    def encode(self, coords: Tensor) -> Tensor:
        return sinusoidal_nd(coords, self.dim // 2, self.base)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base}"


class _PosEmbed:
    """Instance override of ``model._pos_embed``: encoding, the class's own, pos_drop."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, x: Tensor) -> Tensor:
        m = self.model
        x = m.pos_encoding(x, m.patch_embed.grid_size)
        x = type(m)._pos_embed(m, x)  # pos_embed is None: prefix tokens + flatten only
        drop = getattr(m, "pos_drop", None)
        return x if drop is None else drop(x)


def _check_model(model) -> int:
    """embed_dim of a timm-style VisionTransformer, or a TypeError."""
    needed = ("patch_embed", "pos_embed", "_pos_embed", "embed_dim")
    if not isinstance(model, nn.Module) or not all(hasattr(model, a) for a in needed):
        raise TypeError(
            "model must be a timm VisionTransformer (an nn.Module with patch_embed, "
            f"pos_embed, _pos_embed and embed_dim), got {type(model).__name__}"
        )
    grid = getattr(model.patch_embed, "grid_size", None)
    if grid is None or len(grid) != 2:
        raise TypeError("model.patch_embed must be timm's 2-D PatchEmbed (with grid_size)")
    return int(model.embed_dim)


def _install(model: nn.Module, encoding: _GridEncoding) -> _GridEncoding:
    # The device and dtype of the learned table, else of the patch embedding's weights.
    tensors = [model.pos_embed] if isinstance(model.pos_embed, Tensor) else []
    tensors += [p for p in model.patch_embed.parameters() if p.is_floating_point()]
    if tensors:
        encoding.to(device=tensors[0].device, dtype=tensors[0].dtype)
    model.pos_embed = None  # timm skips the table everywhere
    model.pos_encoding = encoding
    model.__dict__["_pos_embed"] = _PosEmbed(model)  # instance attribute: wins over the method
    return encoding


def use_lff(model: nn.Module, gamma: float = 2.0, **lff_kwargs) -> LFFGridEncoding:
    """Give a timm VisionTransformer learnable-Fourier-feature position encodings.

    Args:
        model: a timm ``VisionTransformer`` (modified in place).
        gamma: kernel width in patches: the features of two patches at distance r have
            similarity about exp(-r^2 / (2 gamma^2)) at initialisation (0.88 for
            neighbours at gamma = 2, 0.14 four patches apart).
        lff_kwargs: passed to :class:`~posenc_fast.LearnableFourierFeatures` (defaults
            fourier_dim=256, hidden_dim=32; also activation, learnable, layer_norm, ...).

    Returns the encoding module, also at ``model.pos_encoding``; it is created on the
    device and in the dtype of the model's learned table (or patch embedding).
    """
    dim = _check_model(model)
    _checks.positive_float("gamma", gamma)
    return _install(model, LFFGridEncoding(dim, gamma, **lff_kwargs))


def use_sine2d(model: nn.Module, base: float = 10000.0) -> SineGridEncoding:
    """Give a timm VisionTransformer fixed Sine-2D position encodings of the patch
    indices (embed_dim must be divisible by 4). Returns the encoding module."""
    return _install(model, SineGridEncoding(_check_model(model), base))


# -- the fused rotary op in timm's Eva-family models -----------------------------------------
# Overrides rope.get_embed (coordinates, not the table) and each attention's forward.

# timm's rotary module class -> the family, and what is read of it
_ROPE_FAMILIES = {
    "RotaryEmbeddingCat": "axial",
    "RotaryEmbeddingMixed": "mixed",
    "RotaryEmbeddingDinoV3": "dinov3",
    "RotaryEmbeddingMRope": "mrope",
}
_AUGMENT = ("aug_active", "shift_coords", "jitter_coords", "rescale_coords")
_ROPE_ATTRIBUTES = {
    "axial": ("bands", "feat_shape", "grid_type", "ref_feat_shape", "grid_offset",
              "grid_indexing", "normalize_coords", "rotate_half"),
    "mixed": ("freqs", "depth", "num_heads", "feat_shape", "grid_indexing"),
    "dinov3": ("periods", "feat_shape", "grid_offset", "grid_indexing", "normalize_coords",
               "rotate_half"),
    "mrope": ("inv_freq", "axis", "grid_indexing"),
}  # fmt: skip
# timm's attention classes -> the attributes their forward is made of
_ATTENTION_COMMON = (
    "num_heads", "head_dim", "scale", "num_prefix_tokens", "fused_attn", "rotate_half", "qkv",
    "q_proj", "k_proj", "v_proj", "q_norm", "k_norm", "attn_drop", "norm", "gate", "proj",
    "proj_drop",
)  # fmt: skip
_ATTENTION_ATTRIBUTES = {
    "EvaAttention": (*_ATTENTION_COMMON, "q_bias", "k_bias", "v_bias", "qkv_bias_separate"),
    "AttentionRope": (*_ATTENTION_COMMON, "num_kv_heads", "num_kv_groups"),
}
# the model classes -> the flag by which their blocks index per-block (Mixed) embeddings
_MODELS = {"Eva": "rope_mixed", "NaFlexVit": "rope_is_mixed"}


def _missing(module: nn.Module, names) -> list[str]:
    return [n for n in names if not hasattr(module, n)]


def centered_grid(shape, offset=0.0, indexing="ij", normalize="separate", device=None) -> Tensor:
    """``posenc_fast.rope.grid(shape, "centered", ...)`` that keeps symbolic sizes symbolic
    (rope.grid's ``float(size)`` would fix them at the traced value; export with dynamic
    image sizes). Concrete sizes and "min" / "max" normalisations go to rope.grid."""
    if normalize != "separate" or not any(isinstance(s, torch.SymInt) for s in shape):
        return rope.grid(shape, "centered", offset=offset, indexing=indexing,
                         normalize=normalize, device=device)  # fmt: skip
    cells = rope.grid(shape, "index", offset=0.5 + offset, indexing=indexing, device=device)
    sizes = list(shape) if indexing == "ij" else [shape[1], shape[0], *shape[2:]]
    coords = torch.stack([cells[:, a] / s for a, s in enumerate(sizes)], dim=-1)
    return 2.0 * coords - 1.0  # [0, 1] -> [-1, 1]


class _RopeCoordinates:
    """Instance override of ``rope.get_embed(shape=None, dtype=None)``: the patch tokens'
    coordinates [N, 2] float32 in timm's grid, augmented in training as timm does; for
    Mixed a [depth, 1, N, 2] view. ``dtype`` (the table's) is ignored."""

    def __init__(self, rope: nn.Module, family: str):
        self.rope, self.family = rope, family

    def __call__(self, shape=None, dtype=None) -> Tensor:
        r, family = self.rope, self.family
        fixed = getattr(r, "feat_shape", None)
        if family == "axial" and fixed is not None:
            shape = fixed  # timm's cached mode: the cached grid, whatever shape says
        elif shape is None:
            shape = fixed
        if shape is None:
            raise ValueError(
                "the rotary module has no fixed grid (feat_shape): get_embed needs shape=(H, W)"
            )
        if family == "axial":
            coords = rope.grid(
                shape, r.grid_type, r.ref_feat_shape, r.grid_offset, r.grid_indexing,
                r.normalize_coords, device=r.bands.device,
            )  # fmt: skip
        elif family == "dinov3":  # built and augmented on the CPU, as timm does
            coords = centered_grid(shape, r.grid_offset, r.grid_indexing, r.normalize_coords)
        else:
            device = (r.freqs if family == "mixed" else r.inv_freq).device
            coords = rope.grid(shape, indexing=r.grid_indexing, device=device)
        if r.training and r.aug_active:
            coords = rope.augment(coords, r.shift_coords, r.jitter_coords, r.rescale_coords)
        if family == "dinov3":
            coords = coords.to(r.periods.device)
        elif family == "mixed":
            coords = coords.expand(r.depth, 1, *coords.shape)
        return coords


class _NaFlexCoordinates:
    """Instance override of NaFlexVit's ``_generate_rope_naflex(x, patch_coord)``: per
    sample its grid's coordinates (one get_embed per distinct size, in timm's order, so the
    same augmentation draws), zero for padding: [B, 1, N - prefix, 2] (Mixed: [depth, ...])."""

    def __init__(self, model: nn.Module, family: str):
        self.model, self.family = model, family

    @torch.compiler.disable  # per-sample sizes read back from patch_coord, as timm's
    def __call__(self, x: Tensor, patch_coord: Tensor) -> Tensor:
        m = self.model
        sizes = [tuple(s) for s in (patch_coord.amax(dim=1) + 1).tolist()]  # (rows, cols)
        shape = (x.shape[0], x.shape[1] - m.num_prefix_tokens, 2)
        out = torch.zeros(shape, dtype=torch.float32, device=x.device)
        made: dict = {}
        for b, size in enumerate(sizes):
            if size not in made:
                coords = m.rope.get_embed(shape=size)
                made[size] = coords[0, 0] if self.family == "mixed" else coords
            out[b, : made[size].shape[0]] = made[size]
        out = out.unsqueeze(1)
        return out.expand(m.rope.depth, *out.shape) if self.family == "mixed" else out


def _rope_frequencies(r: nn.Module, family: str, block: int) -> Tensor:
    """W [F/2, 2] of a block from timm's buffers (Mixed: [heads, F/2, 2], a view of the
    parameter ``freqs`` [2, depth, heads, F/2]), so that angle i = coords . W[i] is timm's."""
    if family == "mixed":
        return r.freqs[:, block].permute(1, 2, 0)
    if family == "mrope":  # frequency i on axis[i]: 1 = rows, 2 = columns, 0 = time (none)
        axis = r.axis
        return (
            torch.stack([axis == 1, axis == 2], dim=-1).to(r.inv_freq.dtype) * r.inv_freq[:, None]
        )
    bands = r.bands if family == "axial" else (2 * math.pi) / r.periods  # [F/4] per axis
    zero = torch.zeros_like(bands)
    return torch.stack([torch.cat([bands, zero]), torch.cat([zero, bands])], dim=-1)


class _RopeAttention:
    """Instance override of EvaAttention's / AttentionRope's ``forward(x, rope=None,
    attn_mask=None, is_causal=False)`` (timm 1.0.31), ``rope`` being the coordinates of
    ``_RopeCoordinates``; q and k rotated by ``posenc_fast.rotary``."""

    def __init__(self, attn: nn.Module, rope: nn.Module, family: str, block: int, backend: str):
        self.attn, self.rope, self.family, self.block = attn, rope, family, block
        self.backend = backend
        self.pairs = "half" if attn.rotate_half else "interleaved"
        self.eva = "EvaAttention" in _class_names(attn)

    def _qkv(self, x: Tensor):
        """q [B, heads, N, head_dim], k and v [B, kv heads, N, head_dim] (views)."""
        a = self.attn
        B, N, _ = x.shape
        if a.qkv is None:
            kv_heads = a.num_heads if self.eva else a.num_kv_heads
            q = a.q_proj(x).reshape(B, N, a.num_heads, -1).transpose(1, 2)
            k = a.k_proj(x).reshape(B, N, kv_heads, -1).transpose(1, 2)
            v = a.v_proj(x).reshape(B, N, kv_heads, -1).transpose(1, 2)
            return q, k, v
        if self.eva and a.q_bias is not None:  # k has no bias (a zero buffer)
            bias = torch.cat((a.q_bias, a.k_bias, a.v_bias))
            separate = a.qkv_bias_separate
            qkv = a.qkv(x) + bias if separate else F.linear(x, a.qkv.weight, bias)
        else:
            qkv = a.qkv(x)
        return qkv.reshape(B, N, 3, a.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)

    def _positions(self, coords: Tensor) -> Tensor:
        """[N, 2], [1, N, 2] or [B, 1, n, 2] (token dropping) -> [N, 2] or [B, n, 2]."""
        if not isinstance(coords, Tensor) or coords.dim() < 2 or coords.shape[-1] != 2:
            got = list(coords.shape) if isinstance(coords, Tensor) else type(coords).__name__
            raise ValueError(
                "rope must be the patch tokens' coordinates [.., N, 2] that the converted "
                f"model's rope.get_embed gives (use_fast_rope), not timm's table; got {got}"
            )
        if coords.dim() > 2:
            coords = coords.reshape(-1, *coords.shape[-2:])
            if coords.shape[0] == 1:
                coords = coords[0]
        return coords

    def __call__(
        self,
        x: Tensor,
        rope: Optional[Tensor] = None,
        attn_mask: Optional[Tensor] = None,
        is_causal: bool = False,
    ) -> Tensor:
        a = self.attn
        B, N, _ = x.shape
        gate = None if a.gate is None else a.gate(x).sigmoid()
        q, k, v = self._qkv(x)
        q, k = a.q_norm(q), a.k_norm(k)
        if rope is not None:
            freqs = _rope_frequencies(self.rope, self.family, self.block)
            q, k = rotary(
                q, k, self._positions(rope), freqs, self.pairs, "bhnd", a.num_prefix_tokens,
                self.backend,
            )  # fmt: skip
            if q.dtype != v.dtype:  # timm's .type_as(v) (a q_norm in float32 under autocast)
                q, k = q.to(v.dtype), k.to(v.dtype)
        groups = 1 if self.eva else a.num_kv_groups
        if groups > 1:  # grouped-query attention: kv head h // groups serves q head h
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if a.fused_attn:
            dropout = a.attn_drop.p if a.training else 0.0
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, dropout_p=dropout, is_causal=is_causal
            )
        else:
            from timm.layers import maybe_add_mask, resolve_self_attn_mask

            scores = (q * a.scale) @ k.transpose(-2, -1)
            bias = resolve_self_attn_mask(N, scores, attn_mask, is_causal=is_causal)
            out = a.attn_drop(maybe_add_mask(scores, bias).softmax(dim=-1)) @ v
        out = a.norm(out.transpose(1, 2).reshape(B, N, -1))
        if gate is not None:
            out = out * gate
        return a.proj_drop(a.proj(out))


def _class_names(module) -> set[str]:
    return {c.__name__ for c in type(module).__mro__}


def _rope_family(model: nn.Module) -> str:
    """The family of the model's rotary module; TypeError / ValueError if not convertible."""
    kinds = [name for name in _MODELS if name in _class_names(model)]
    if not isinstance(model, nn.Module) or not kinds:
        raise TypeError(
            "use_fast_rope converts timm's Eva-family models (timm.models.eva.Eva: EVA-02, "
            "vit_*_rope_*, vit_*_rope_mixed_*, vit_*_dinov3*) and NaFlexVit, got "
            f"{type(model).__name__}; other models have no rotary embedding of this kind"
        )
    missing = _missing(model, ("rope", "blocks", _MODELS[kinds[0]]))
    if missing:
        raise TypeError(
            f"{type(model).__name__} lacks {missing}: its structure differs from timm 1.0.31's, "
            "which use_fast_rope follows"
        )
    r = model.rope
    if r is None:
        raise ValueError(
            f"this {type(model).__name__} has no rotary embedding (model.rope is None: built "
            "without use_rot_pos_emb / rope_type): there is nothing to convert"
        )
    family = next((_ROPE_FAMILIES[n] for n in _class_names(r) if n in _ROPE_FAMILIES), None)
    if family is None:
        raise TypeError(
            f"model.rope is a {type(r).__name__}; use_fast_rope converts "
            f"{', '.join(_ROPE_FAMILIES)} (timm's rope_type 'cat', 'mixed', 'dinov3', "
            "'mrope'); RotaryEmbedding ('base') gives separate sin / cos, which Eva's "
            "attention does not take"
        )
    missing = _missing(r, (*_ROPE_ATTRIBUTES[family], *_AUGMENT))
    if missing:
        raise TypeError(
            f"model.rope ({type(r).__name__}) lacks {missing}: its structure differs from "
            "timm 1.0.31's, which use_fast_rope follows"
        )
    if (family == "mixed") != bool(getattr(model, _MODELS[kinds[0]])):
        raise ValueError(
            f"model.{_MODELS[kinds[0]]} must be {family == 'mixed'} for a {type(r).__name__}"
        )
    return family


def _check_attention(attn, family: str, r: nn.Module, block: int, rotated: int) -> None:
    names = [n for n in _ATTENTION_ATTRIBUTES if n == type(attn).__name__]
    if not names:
        raise TypeError(
            f"blocks[{block}].attn is a {type(attn).__name__}; use_fast_rope converts timm's "
            f"{' and '.join(_ATTENTION_ATTRIBUTES)} (not subclasses: their forward may differ)"
        )
    missing = _missing(attn, _ATTENTION_ATTRIBUTES[names[0]])
    if missing:
        raise TypeError(
            f"blocks[{block}].attn lacks {missing}: its structure differs from timm 1.0.31's "
            f"{names[0]}, which use_fast_rope follows"
        )
    half = {"mixed": False, "mrope": True}.get(family, getattr(r, "rotate_half", None))
    if bool(attn.rotate_half) != half:
        raise ValueError(
            f"blocks[{block}].attn.rotate_half={attn.rotate_half} but model.rope "
            f"({type(r).__name__}) lays its table out for rotate_half={half}: timm mixes the "
            "two layouts, which no rotation reproduces"
        )
    if rotated != attn.head_dim:
        raise ValueError(
            f"model.rope rotates {rotated} channels but blocks[{block}].attn has head_dim "
            f"{attn.head_dim}: timm cannot apply that table either"
        )
    if family == "mixed":
        heads = r.freqs.shape[2]
        kv = getattr(attn, "num_kv_heads", attn.num_heads)
        if attn.num_heads != heads or kv != heads:
            raise ValueError(
                f"model.rope (Mixed) has frequencies for {heads} heads; blocks[{block}].attn "
                f"has {attn.num_heads} query and {kv} key heads (Mixed needs one W per head "
                "of q and of k)"
            )
        if block >= r.depth:
            raise ValueError(
                f"model.rope (Mixed) has frequencies for {r.depth} blocks, not {block + 1}"
            )


def use_fast_rope(model: nn.Module, backend: str = "auto") -> nn.Module:
    """Rotate q and k of every attention block of a timm Eva-family model with
    ``posenc_fast.rotary`` (one fused pass, prefix tokens passed through) instead of timm's
    sin / cos table, in place.

    Args:
        model: a timm ``Eva`` with a rotary embedding: EVA-02 (``eva02_*``), RoPE-ViT axial
            (``vit_*_patch16_rope_*``, RotaryEmbeddingCat) and Mixed
            (``vit_*_patch16_rope_mixed_*``, RotaryEmbeddingMixed), DINOv3
            (``vit_*_patch16_dinov3*``), MRoPE (``rope_type="mrope"``); or a NaFlexVit
            with one. Its attention modules must be timm's EvaAttention / AttentionRope.
        backend: the rotary op's backend ("auto", "torch", "triton", "cpp", "reference").

    Same outputs and gradients within float32 rounding, in training (timm's augmentation
    draws) and evaluation, any image size, token dropping; state_dict keys unchanged.
    ``model.rope.get_embed`` then returns coordinates, not the table. Returns the model.
    """
    family = _rope_family(model)
    backend = _dispatch.validate_name(backend)
    r = model.rope
    rotated = 2 * _rope_frequencies(r, family, 0).shape[-2]
    attentions = []
    for i, blk in enumerate(model.blocks):
        attn = getattr(blk, "attn", None)
        if attn is None:
            raise TypeError(f"blocks[{i}] ({type(blk).__name__}) has no attn: not a timm EvaBlock")
        _check_attention(attn, family, r, i, rotated)
        attentions.append(attn)
    r.__dict__["get_embed"] = _RopeCoordinates(r, family)  # instance attributes win
    if "NaFlexVit" in _class_names(model):
        model.__dict__["_generate_rope_naflex"] = _NaFlexCoordinates(model, family)
    for i, attn in enumerate(attentions):
        attn.__dict__["forward"] = _RopeAttention(attn, r, family, i, backend)
    return model
