"""FLOATER Q/K/V biases (Liu et al. 2020, Eq. 12-13) in existing attention layers (timm's
Attention or any fused ``qkv`` with ``num_heads``, nn.MultiheadAttention, transformers):
``add_floater_biases(model)``. Parameter names are kept (checkpoints load) and FLOATER
starts near zero. Shared training integration: docs/floater-training.md.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops.floater import Floater, FloaterAttentionBias
from . import transformers_floater as hf


class FloaterQKV(nn.Linear):
    """A fused projection ``x [..., L, in] -> [..., L, 3 * dim]`` plus block ``layer``'s
    biases as [q | k | v] (timm's split), sharing the replaced nn.Linear's parameters."""

    def __init__(
        self, linear: nn.Linear, source: FloaterAttentionBias, layer: int, share: bool = True
    ):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self._block = source.block(layer, share)

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight, self.bias)
        b = self._block(x.shape[-2])  # [3, L, dim]
        return y + b.transpose(0, 1).flatten(1).to(y.dtype)  # [L, 3 * dim]

    def extra_repr(self) -> str:
        return super().extra_repr() + f", floater_layer={self._block.layer}"


def _no_fast_path(module, args):
    """A no-op pre-hook: nn.TransformerEncoderLayer's inference fast path (which would skip
    the biases) is off when a submodule has a hook."""
    return None


class FloaterMultiheadAttention(nn.MultiheadAttention):
    """nn.MultiheadAttention with block ``layer``'s FLOATER biases on its q / k / v
    projections (positions 0..L-1 and 0..S-1). Same arguments, outputs and parameter names
    (not add_bias_kv, add_zero_attn). Build it with :meth:`from_module`."""

    @classmethod
    def from_module(
        cls,
        mha: nn.MultiheadAttention,
        source: FloaterAttentionBias,
        layer: int,
        share: bool = True,
    ) -> FloaterMultiheadAttention:
        """A FloaterMultiheadAttention sharing ``mha``'s parameters (and out_proj)."""
        if mha.bias_k is not None or mha.add_zero_attn:
            raise ValueError(
                "add_floater_biases does not support nn.MultiheadAttention with "
                "add_bias_kv=True or add_zero_attn=True"
            )
        if mha.embed_dim != source.floater.dim:
            raise ValueError(
                f"embed_dim {mha.embed_dim} differs from the FLOATER dim {source.floater.dim}"
            )
        ref = mha.out_proj.weight
        new = cls(
            mha.embed_dim, mha.num_heads, mha.dropout, mha.in_proj_bias is not None,
            kdim=mha.kdim, vdim=mha.vdim, batch_first=mha.batch_first,
            device="meta", dtype=ref.dtype,
        )  # fmt: skip
        for name, p in mha.named_parameters(recurse=False):
            setattr(new, name, p)
        new.out_proj = mha.out_proj
        new.train(mha.training)
        new._block = source.block(layer, share)
        new.register_forward_pre_hook(_no_fast_path)
        return new

    def _projections(self) -> tuple[Tensor, Tensor, Tensor]:
        if self._qkv_same_embed_dim:
            return self.in_proj_weight.chunk(3)
        return self.q_proj_weight, self.k_proj_weight, self.v_proj_weight

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Optional[Tensor] = None,
        need_weights: bool = True,
        attn_mask: Optional[Tensor] = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Optional[Tensor]]:
        batched = query.dim() == 3
        if not batched:  # [L, E]: one sequence
            query, key, value = (t.unsqueeze(0) for t in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:  # [L, B, E] -> [B, L, E]
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        if is_causal and attn_mask is None:
            raise RuntimeError(
                "need attn_mask if specifying the is_causal hint (as nn.MultiheadAttention)"
            )
        B, L = query.shape[:2]
        S = key.shape[1]
        heads, hd = self.num_heads, self.head_dim

        bias = self._block(max(L, S))  # [3, Lmax, E]
        b_in = (None,) * 3 if self.in_proj_bias is None else self.in_proj_bias.chunk(3)
        out = []
        for j, (x, w, n) in enumerate(zip((query, key, value), self._projections(), (L, S, S))):
            y = F.linear(x, w, b_in[j])
            y = y + bias[j, :n].to(y.dtype)
            out.append(y.unflatten(-1, (heads, hd)).transpose(1, 2))  # [B, heads, n, hd]
        q, k, v = out

        mask = _merge_masks(attn_mask, key_padding_mask, B, heads, L, S, q.dtype)
        p = self.dropout if self.training else 0.0
        if need_weights:
            scores = (q @ k.transpose(-2, -1)) * hd**-0.5
            if mask is not None:
                scores = scores + mask
            weights = F.dropout(scores.softmax(-1), p) if p > 0 else scores.softmax(-1)
            y = weights @ v
        else:
            causal = is_causal and key_padding_mask is None
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=None if causal else mask, dropout_p=p, is_causal=causal
            )
            weights = None
        y = self.out_proj(y.transpose(1, 2).flatten(2))  # [B, L, E]
        if weights is not None and average_attn_weights:
            weights = weights.mean(1)
        if not batched:
            return y.squeeze(0), None if weights is None else weights.squeeze(0)
        if not self.batch_first:
            y = y.transpose(0, 1)
        return y, weights


def _merge_masks(attn_mask, key_padding_mask, B, heads, L, S, dtype) -> Optional[Tensor]:
    """nn.MultiheadAttention's masks (bool: True = may not attend; float: added) as one
    additive float mask broadcastable to [B, heads, L, S]."""

    def additive(m: Tensor) -> Tensor:
        if m.dtype == torch.bool:
            return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(m, float("-inf"))
        return m.to(dtype)

    mask = None
    if attn_mask is not None:
        m = additive(attn_mask)
        mask = m.view(B, heads, L, S) if m.dim() == 3 else m.view(1, 1, L, S)
    if key_padding_mask is not None:
        kp = additive(key_padding_mask).view(B, 1, 1, S)
        mask = kp if mask is None else mask + kp
    return mask


def _attention_layers(model: nn.Module) -> list[tuple[nn.Module, Optional[str], nn.Module]]:
    """(parent, attribute name, module) of every layer to change, in module order; for a
    transformers self-attention layer (layer, projection names, layer)."""
    found = []
    inside = set()  # the projections of transformers layers already found
    for parent in model.modules():
        if id(parent) in inside:
            continue
        names = hf.supported_attention(parent)
        if names is not None:
            found.append((parent, names, parent))
            inside.update(id(parent._modules[n]) for n in names)
            continue
        for name, child in parent.named_children():
            if isinstance(child, (FloaterQKV, FloaterMultiheadAttention)):
                raise ValueError("the model already has FLOATER biases (add_floater_biases ran)")
            fused_qkv = (
                name == "qkv"
                and isinstance(child, nn.Linear)
                and hasattr(parent, "num_heads")
                and child.out_features % 3 == 0
            )
            if fused_qkv or isinstance(child, nn.MultiheadAttention):
                found.append((parent, name, child))
    return found


def _width(parent: nn.Module, name, child: nn.Module) -> int:
    if isinstance(child, nn.MultiheadAttention):
        return child.embed_dim
    if isinstance(name, tuple):  # transformers: separate projections
        return hf.attention_width(parent, name)
    return child.out_features // 3


def _weight(parent: nn.Module, name, child: nn.Module) -> Tensor:
    if isinstance(child, nn.MultiheadAttention):
        return child.out_proj.weight
    if isinstance(name, tuple):
        return parent._modules[name[0]].weight
    return child.weight


def _no_layer_message() -> str:
    return (
        "model has no attention layer to change. Supported: timm's Attention (or any layer "
        "with a fused qkv nn.Linear and num_heads), torch's nn.MultiheadAttention, and the "
        "Hugging Face transformers self-attention classes "
        + ", ".join(hf.SUPPORTED_ATTENTION)
        + " (separate query/key/value projections)"
    )


def add_floater_biases(
    model: nn.Module, share_integration: bool = True, **floater_kwargs
) -> FloaterAttentionBias:
    """Give every attention layer of ``model`` FLOATER Q/K/V biases (see the module
    docstring). ``floater_kwargs`` (hidden_dim, delta_t, substeps, method, activation,
    backend, refresh_every, init_scale, device, dtype) go to
    :class:`~posenc_fast.FloaterAttentionBias`; device and dtype default to the attention
    weights'. Returns the shared bias module, registered as ``model.floater_bias``.

    The paper's training options (Sec. 4.4): ``init_scale`` (w2's initialisation scale,
    default 0.01), ``refresh_every=k`` (biases recomputed on one training step in k,
    detached in between) and :func:`floater_param_groups` (a larger learning rate).
    ``share_integration=False``: every block integrates its own states in training (for
    reentrant checkpointing of some blocks).

    nn.TransformerEncoder(Layer)'s fast paths, which would skip the biases, are switched
    off for the changed layers. Hugging Face models (BERT, ViT, ...): positions from
    ``position_ids``, options recorded in ``model.config`` (integrations.transformers).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(share_integration, bool):
        raise TypeError(f"share_integration must be a bool, got {type(share_integration).__name__}")
    if not share_integration and floater_kwargs.get("refresh_every", 1) != 1:
        # per block, every block would count as a call of refresh_every's schedule
        raise ValueError("refresh_every needs share_integration=True (one call per step)")
    layers = _attention_layers(model)
    if not layers:
        raise ValueError(_no_layer_message())
    dims = {_width(*layer) for layer in layers}
    if len(dims) != 1:
        raise ValueError(
            "FLOATER shares its dynamics across blocks: the attention layers must have one "
            f"width, got {sorted(dims)}"
        )
    ref = _weight(*layers[0])
    floater_kwargs.setdefault("device", ref.device)
    # float32 ODE state in a half-precision model; biases cast to the projections' dtype.
    floater_kwargs.setdefault("dtype", ref.dtype if ref.dtype == torch.float64 else torch.float32)
    source = FloaterAttentionBias(dims.pop(), len(layers), **floater_kwargs)
    transformers_layers = False
    for n, (parent, name, child) in enumerate(layers):
        if isinstance(name, tuple):
            hf.install_floater(parent, name, source, n, share_integration)
            transformers_layers = True
            continue
        if isinstance(child, nn.MultiheadAttention):
            new = FloaterMultiheadAttention.from_module(child, source, n, share_integration)
        else:
            new = FloaterQKV(child, source, n, share_integration)
        setattr(parent, name, new)
    for m in model.modules():
        if isinstance(m, nn.TransformerEncoder):
            m.use_nested_tensor = False  # the nested-tensor path bypasses self_attn.forward
    model.floater_bias = source
    if transformers_layers:
        hf.record_floater(model, source)
    return source


def floater_param_groups(model: nn.Module, lr: float, flow_lr_scale: float) -> list[dict]:
    """Optimizer parameter groups giving FLOATER a larger learning rate (the paper's
    "update the flow models with a larger learning rate", Sec. 4.4)::

        groups = floater_param_groups(model, lr=1e-3, flow_lr_scale=10.0)
        opt = torch.optim.AdamW(groups, weight_decay=0.05)

    Returns ``[{"params": [every other parameter], "lr": lr}, {"params": [every Floater's
    parameters], "lr": lr * flow_lr_scale}]``: each trainable parameter once, in module
    order; an empty group is left out. Other options are the optimizer's defaults.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    for name, value in (("lr", lr), ("flow_lr_scale", flow_lr_scale)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name} must be a positive float, got {value!r}")
    flow_ids = {id(p) for m in model.modules() if isinstance(m, Floater) for p in m.parameters()}
    if not flow_ids:
        raise ValueError("model has no FLOATER module (add_floater_biases, Floater, ...)")
    seen, rest, flow = set(), [], []
    for p in model.parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        (flow if id(p) in flow_ids else rest).append(p)
    groups = [{"params": rest, "lr": float(lr)}, {"params": flow, "lr": float(lr * flow_lr_scale)}]
    return [g for g in groups if g["params"]]
