"""Position encodings of a timm VisionTransformer's patch grid from posenc_fast: the
learned table becomes an encoding of each patch's (row, col), so any grid size works::

    posenc_fast.integrations.timm.use_lff(model, gamma=2.0)    # or use_sine2d(model)
"""

#     model = timm.create_model("vit_small_patch16_224", dynamic_img_size=True)
#     posenc_fast.integrations.timm.use_lff(model, gamma=2.0)    # or use_sine2d(model)
#
# The learned table ``model.pos_embed`` is replaced by an encoding of each patch's (row,
# col) index (in patch units, so ``gamma`` is the kernel width in patches): any grid size
# works, including sizes never seen in training (with ``dynamic_img_size=True``, or after
# ``model.set_input_size``). timm keeps doing everything else: class and register tokens,
# patch dropout, pos_drop, the blocks.
#
# How it plugs in (timm 1.0's ``VisionTransformer._pos_embed(x)`` contract: x is the patch
# embedding's output, [B, H, W, C] with ``dynamic_img_size`` or [B, H*W, C] otherwise; the
# result is [B, prefix + H*W, C] with the prefix tokens first):
#
# - ``model.pos_embed`` is set to None, so timm's own code (``_pos_embed``, ``init_weights``,
#   ``set_input_size``) skips the table; the encoding is the submodule
#   ``model.pos_encoding`` (its parameters are in ``state_dict`` under that name).
# - ``model._pos_embed`` is overridden on this instance by a small callable that adds the
#   encoding to the patch tokens, then calls the class's own ``_pos_embed`` (which
#   concatenates the class/register tokens) and ``model.pos_drop``. No other state: the
#   model deep-copies, pickles and compiles (``torch.compile(fullgraph=True)``) as before.
#
# Prefix tokens (class, register, distillation) get no position encoding, whatever
# ``no_embed_class`` says: with ``no_embed_class=False`` timm adds a learned vector to each,
# which is redundant with the learned tokens themselves. A checkpoint with a learned
# ``pos_embed`` loads into the converted model with ``strict=False`` (the table is unused).

from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import _checks
from ..grid import grid_positions
from ..ops.encodings import sinusoidal_nd
from ..ops.lff import LearnableFourierFeatures


class _GridEncoding(nn.Module):
    """Adds an encoding of the (row, col) patch indices to patch tokens."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def encode(self, coords: Tensor) -> Tensor:  # [N, 2] float32 -> [N, dim]
        raise NotImplementedError

    def forward(self, x: Tensor, grid_size: tuple[int, int]) -> Tensor:
        """x [B, H, W, C], or [B, H*W, C] with (H, W) = grid_size (the patch embedding's,
        read at every call: ``model.set_input_size`` changes it) -> x + encoding."""
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
    """Instance override of ``model._pos_embed``: encoding on the patch tokens, then the
    class's own token handling, then pos_drop (as timm's learned-table path does)."""

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
