"""FLOATER Q/K/V biases (Liu et al. 2020, Eq. 12-13) in existing attention layers.

    biases = posenc_fast.integrations.attention.add_floater_biases(model)

finds the attention layers of ``model`` in module order (timm's ``Attention`` and any
layer with a fused ``qkv`` nn.Linear and ``num_heads``; torch's ``nn.MultiheadAttention``)
and adds to block n's query, key and value projections the biases ``bias[n, 0..2]`` of one
shared :class:`~posenc_fast.FloaterAttentionBias`, registered as ``model.floater_bias``.
Only the projections change, and their parameters keep their names, so a pretrained
checkpoint still loads (``strict=False`` for the new ``floater_bias.*`` entries) and, with
FLOATER's initialisation near zero, the model starts as the pretrained one (the paper's
warm start, Sec. 3.3).

Each projection computes its block's biases when it runs, from the shared module: no
per-call state is stored on any module, so the model deep-copies, pickles and compiles at
any time. In training (and under torch.compile) block n integrates only its own three
states: the blocks together do the work of one integration per forward. In eval mode or
under no_grad the shared module's cache serves every block after the first call.
Positions are the token indices 0..L-1 (class/register tokens included).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops.floater import FloaterAttentionBias, integrate


def block_bias(source: FloaterAttentionBias, n: int, length: int) -> Tensor:
    """The biases of block ``n`` for positions 0..length-1: [num_projections, L, dim],
    equal to ``source(length)[n]`` but integrating only block n's states when no cache
    applies (training, torch.compile)."""
    fl = source.floater
    training_step = fl.training and torch.is_grad_enabled()
    # A frozen source (FloaterAttentionBias.freeze) serves stored biases: never integrate.
    if (training_step or torch.compiler.is_compiling()) and not fl.frozen:
        P = source.num_projections
        out, _ = integrate(
            fl.p0[n * P : (n + 1) * P],
            fl.w1,
            fl.b1,
            fl.w2,
            fl.b2,
            fl.length_times(length),
            fl.options,
            fl.backend,
            check_values=False,  # times built from length: valid by construction
        )
        return out
    return source(length)[n]


class _Source:
    """Holds the shared bias module without registering it as a submodule of every
    projection (it is registered once, on the model): a state_dict lists it once."""

    def __init__(self, module: FloaterAttentionBias, layer: int):
        self.module, self.layer = module, layer


class FloaterQKV(nn.Linear):
    """A fused Q/K/V projection ``x [..., L, in] -> [..., L, 3 * dim]`` plus block
    ``layer``'s FLOATER biases, laid out as [q | k | v] (timm's Attention splits the
    output that way). Shares ``weight`` and ``bias`` with the nn.Linear it replaces."""

    def __init__(self, linear: nn.Linear, source: FloaterAttentionBias, layer: int):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self._source = _Source(source, layer)

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight, self.bias)
        b = block_bias(self._source.module, self._source.layer, x.shape[-2])  # [3, L, dim]
        return y + b.transpose(0, 1).flatten(1).to(y.dtype)  # [L, 3 * dim]

    def extra_repr(self) -> str:
        return super().extra_repr() + f", floater_layer={self._source.layer}"


def _no_fast_path(module, args):
    """A forward pre-hook that changes nothing. nn.TransformerEncoderLayer skips its
    inference fast path (which reads self_attn's weights directly and would skip the
    biases) when any submodule has a hook; this is its documented off switch."""
    return None


class FloaterMultiheadAttention(nn.MultiheadAttention):
    """nn.MultiheadAttention with block ``layer``'s FLOATER biases added to its query, key
    and value projections (query positions 0..L-1, key/value positions 0..S-1). Same
    arguments, outputs and parameter names as nn.MultiheadAttention (masks, need_weights,
    batch_first, kdim/vdim, unbatched inputs); add_bias_kv and add_zero_attn are not
    supported. Build it with :meth:`from_module`."""

    @classmethod
    def from_module(
        cls, mha: nn.MultiheadAttention, source: FloaterAttentionBias, layer: int
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
        new._source = _Source(source, layer)
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

        bias = block_bias(self._source.module, self._source.layer, max(L, S))  # [3, Lmax, E]
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


def _attention_layers(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute name, module) of every layer to change, in module order."""
    found = []
    for parent in model.modules():
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


def add_floater_biases(model: nn.Module, **floater_kwargs) -> FloaterAttentionBias:
    """Give every attention layer of ``model`` FLOATER Q/K/V biases (see the module
    docstring). ``floater_kwargs`` (hidden_dim, delta_t, substeps, method, activation,
    backend, device, dtype) go to :class:`~posenc_fast.FloaterAttentionBias`; device and
    dtype default to the attention weights'. Returns the shared bias module, registered
    as ``model.floater_bias``.

    Inside torch's nn.TransformerEncoder(Layer), the nested-tensor and inference fast
    paths read the attention weights directly and would skip the biases: they are
    switched off for the layers changed here.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if floater_kwargs.get("refresh_every", 1) != 1:
        raise ValueError(
            "refresh_every is not supported here: every block integrates its own states"
        )
    layers = _attention_layers(model)
    if not layers:
        raise ValueError(
            "model has no attention layer to change (timm Attention with a fused qkv "
            "nn.Linear, or nn.MultiheadAttention)"
        )
    dims = {
        c.embed_dim if isinstance(c, nn.MultiheadAttention) else c.out_features // 3
        for _, _, c in layers
    }
    if len(dims) != 1:
        raise ValueError(
            "FLOATER shares its dynamics across blocks: the attention layers must have one "
            f"width, got {sorted(dims)}"
        )
    ref = layers[0][2].weight if hasattr(layers[0][2], "weight") else layers[0][2].out_proj.weight
    floater_kwargs.setdefault("device", ref.device)
    # The ODE state stays float32 in a half-precision model (its rounding would accumulate
    # over the solver steps); the biases are cast to the projections' dtype when added.
    floater_kwargs.setdefault("dtype", ref.dtype if ref.dtype == torch.float64 else torch.float32)
    source = FloaterAttentionBias(dims.pop(), len(layers), **floater_kwargs)
    for n, (parent, name, child) in enumerate(layers):
        if isinstance(child, nn.MultiheadAttention):
            new = FloaterMultiheadAttention.from_module(child, source, n)
        else:
            new = FloaterQKV(child, source, n)
        setattr(parent, name, new)
    for m in model.modules():
        if isinstance(m, nn.TransformerEncoder):
            m.use_nested_tensor = False  # the nested-tensor path bypasses self_attn.forward
    model.floater_bias = source
    return source
