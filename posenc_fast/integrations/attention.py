"""FLOATER Q/K/V biases (Liu et al. 2020, Eq. 12-13) in existing attention layers.

    biases = posenc_fast.integrations.attention.add_floater_biases(model)

finds the attention layers of ``model`` in module order (timm's ``Attention`` and any
layer with a fused ``qkv`` nn.Linear and ``num_heads``; torch's ``nn.MultiheadAttention``;
the Hugging Face transformers self-attention classes of
posenc_fast.integrations.transformers, with separate q / k / v projections)
and adds to block n's query, key and value projections the biases ``bias[n, 0..2]`` of one
shared :class:`~posenc_fast.FloaterAttentionBias`, registered as ``model.floater_bias``.
Only the projections change, and their parameters keep their names, so a pretrained
checkpoint still loads (``strict=False`` for the new ``floater_bias.*`` entries) and, with
FLOATER's initialisation near zero, the model starts as the pretrained one (the paper's
warm start, Sec. 3.3).

Each projection asks for its block's biases when it runs (:func:`block_bias`).

- Training (train mode, gradients enabled): ONE integration of all S = num_layers * 3
  states per forward, shared by every block of that forward and by its backward (one
  discrete-adjoint pass for all blocks). The first layer (layer 0) integrates all states
  and leaves the result, a tensor with its autograd graph, in the bias module's slot (a
  plain attribute, ``_floater_share``, that copies and pickles of the module leave empty:
  the model deep-copies and pickles at any time, a copy integrates its own, and
  state_dict, DDP and FSDP see only parameters); the other layers take their slice of it
  when it still describes the module: the same length, the same parameter tensors at the
  same version counters, and not yet consumed by a backward (a tensor hook on the result
  empties the slot when its gradient arrives, i.e. when the backward of the integration
  runs and its graph is freed). Every forward starts afresh at layer 0 (gradient
  accumulation, several forwards before one backward, parameters changed by fused
  optimizers that keep version counters all work); a layer that finds no valid shared
  result integrates only its own three states (the per-block path).
  On the cpp backend outputs are bitwise those of the per-block path, the states'
  gradients too; the weight gradients are the same sums in another order (within the
  "grad" tolerance of posenc_fast/tolerances.py; on the torch backend everything is within
  it: its products of 9 and of 3 rows may round differently). Tested in
  tests/common/test_floater_training.py.
- Activation checkpointing: non-reentrant (torch.utils.checkpoint's default) recomputes
  a block during the backward with the shared result, which is still valid then (the
  integration's gradient arrives last): the same operations as its forward. Reentrant
  checkpointing runs the forward under no_grad; its recomputation (inside the backward)
  never stores a shared result, each block integrates its own states. Reentrant
  checkpointing of only some blocks is not supported: a recomputed block would backpropagate
  through the shared integration early (pass ``share_integration=False``).
- torch.compile: the same sharing, traced. Layer 0 integrates all states and writes the
  result to the slot; dynamo records the write, so the later layers read the traced
  tensor (one graph) or the stored one (graph breaks, blocks compiled one by one): one
  integration and one adjoint per step. The eager key (pointers, version counters) and
  the hook cannot be traced, so there a result serves the layers that follow layer 0 in
  its forward (and the blocks a checkpoint recomputes), which layer 0 running first in
  every forward makes right. Activation checkpointing under torch.compile: dynamo refuses
  a write from inside a checkpointed block with ``fullgraph=True`` ("Unsafe side effect");
  set ``torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True`` (the
  write is not needed when the backward recomputes) or pass ``share_integration=False``.
  Without fullgraph the checkpoints run eagerly, recomputing from the shared result.
- Eval mode or no_grad: the shared module's cache serves every block after the first
  call (no integration at all after the first call).
- ``refresh_every=k`` (the paper's "cache the positional bias vectors for some
  iterations"): one call of the shared module per training forward, so the biases are
  recomputed, with gradients, on one training step in k; on the k - 1 steps in between
  they are the last refresh's values, detached: the FLOATER parameters get no gradient
  at all on those steps (``.grad`` stays None, or unchanged when accumulating), every
  other parameter trains normally. (DDP then needs find_unused_parameters=True.)

Positions are the token indices 0..L-1 (class/register tokens included).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..ops._torch_common import onnx_export_running
from ..ops.floater import FloaterAttentionBias, integrate


def _per_block(source: FloaterAttentionBias, n: int, length: int) -> Tensor:
    """Block n's biases from an integration of its own three states only."""
    fl = source.floater
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
    return out.to(fl.p0.dtype)


def _all_blocks(source: FloaterAttentionBias, length: int) -> Tensor:
    """``source(length)`` of a training call, by the same operations, without the refresh
    bookkeeping of ``refresh_every`` (used only to recompute a forward)."""
    fl = source.floater
    out = fl._compute(fl.length_times(length)).to(fl.p0.dtype)
    return out.unflatten(0, (source.num_layers, source.num_projections))


@dataclass(eq=False)
class _Shared:
    """One training forward's biases of all blocks [N, P, L, dim] and what they describe
    (``key`` None: made under torch.compile, which cannot compute the eager key)."""

    biases: Tensor
    key: Optional[tuple]


class _Slot:
    """Where a bias module's current training forward leaves its shared result (``entry``,
    a :class:`_Shared` or None). A plain attribute of the bias module (``_floater_share``),
    so torch.compile traces reads and writes of it; copies and pickles of the module get an
    empty slot of their own (the result is derived data, and its tensor, with an autograd
    graph, could not be deep-copied)."""

    def __init__(self):
        self.entry: Optional[_Shared] = None

    def __deepcopy__(self, memo) -> _Slot:
        return _Slot()

    def __reduce__(self):
        return (_Slot, ())


_SLOT = "_floater_share"


def _slot(source: FloaterAttentionBias) -> Optional[_Slot]:
    """The bias module's slot, made on first use outside torch.compile (None under it when
    no eager call or projection made it: the per-block path then)."""
    slot = getattr(source, _SLOT, None)
    if slot is None and not torch.compiler.is_compiling():
        slot = _Slot()
        object.__setattr__(source, _SLOT, slot)  # a plain attribute, not a submodule
    return slot


def _share_key(source: FloaterAttentionBias, length: int) -> tuple:
    fl = source.floater
    params = tuple(
        (p.data_ptr(), p._version, p.dtype, p.device) for p in (fl.p0, fl.w1, fl.b1, fl.w2, fl.b2)
    )
    return (length, fl.options, fl.backend, fl.refresh_every, params)


def _drop_when_consumed(slot: _Slot, entry: _Shared):
    """A hook on ``entry.biases``: its gradient arrives when the backward reaches the
    integration, whose graph is then freed: the entry must not serve another forward."""
    slot_ref, entry_ref = weakref.ref(slot), weakref.ref(entry)

    def hook(grad):
        current = slot_ref()
        if current is not None and current.entry is not None and current.entry is entry_ref():
            current.entry = None

    return hook


def _in_backward() -> bool:
    """Whether autograd's engine runs this code (activation checkpointing recomputes)."""
    return torch._C._current_graph_task_id() != -1


def _compiled_block(source: FloaterAttentionBias, n: int, length: int, share: bool) -> Tensor:
    """block_bias of a training forward traced by torch.compile: layer 0 integrates all
    blocks' states and leaves the result in the slot, where the later layers of the same
    forward find it (within one graph, the traced tensor itself; across graph breaks, a
    graph input). The eager key (pointers, version counters) and the consumption hook
    cannot be traced: here a result serves the layers that follow layer 0 in its
    forward, and the blocks a non-reentrant checkpoint recomputes in its backward."""
    slot = _slot(source)
    if not share or slot is None:
        return _per_block(source, n, length)
    if n == 0:
        biases = source(length)
        slot.entry = _Shared(biases, None)
        return biases[0]
    entry = slot.entry  # (its key is never read here: a guard on it would recompile each step)
    if entry is None or entry.biases.shape[2] != length:
        return _per_block(source, n, length)
    return entry.biases[n]


def block_bias(source: FloaterAttentionBias, n: int, length: int, share: bool = True) -> Tensor:
    """The biases of block ``n`` for positions 0..length-1: [num_projections, L, dim],
    equal to ``source(length)[n]``. In training, one integration of all blocks' states per
    forward serves every block (``share=False``: block n integrates its own states); see
    the module docstring."""
    fl = source.floater
    # A frozen source (FloaterAttentionBias.freeze) serves stored biases: never integrate.
    # An ONNX export goes through the module too, which refuses to export an unfrozen one.
    if fl.frozen or onnx_export_running():
        return source(length)[n]
    training_step = fl.training and torch.is_grad_enabled()
    if not training_step:
        return source(length)[n]
    if torch.compiler.is_compiling():
        return _compiled_block(source, n, length, share)
    if not share:
        return _per_block(source, n, length)
    slot = _slot(source)
    entry = slot.entry
    valid = entry is not None and entry.key == _share_key(source, length)
    if _in_backward():  # activation checkpointing recomputes; nothing new is shared here
        if not valid:  # reentrant: the forward ran under no_grad
            return _per_block(source, n, length)
        if n == 0 and entry.biases.requires_grad:
            # Non-reentrant checkpointing wants the forward's operations again: layer 0
            # integrated all states (values only fill the forward's saved tensors).
            return _all_blocks(source, length)[n]
        return entry.biases[n]
    if valid and n != 0:
        return entry.biases[n]
    if n != 0 and fl.refresh_every == 1:  # layer 0 did not run first in this forward
        return _per_block(source, n, length)
    biases = source(length)  # all blocks: one integration (or the refresh bookkeeping)
    entry = _Shared(biases, _share_key(source, length))
    slot.entry = entry
    if biases.requires_grad:
        biases.register_hook(_drop_when_consumed(slot, entry))
    return biases[n]


class _Source:
    """Holds the shared bias module without registering it as a submodule of every
    projection (it is registered once, on the model): a state_dict lists it once."""

    def __init__(self, module: FloaterAttentionBias, layer: int, share: bool = True):
        self.module, self.layer, self.share = module, layer, share
        _slot(module)  # made now, so that a first forward under torch.compile shares too


class FloaterQKV(nn.Linear):
    """A fused Q/K/V projection ``x [..., L, in] -> [..., L, 3 * dim]`` plus block
    ``layer``'s FLOATER biases, laid out as [q | k | v] (timm's Attention splits the
    output that way). Shares ``weight`` and ``bias`` with the nn.Linear it replaces."""

    def __init__(
        self, linear: nn.Linear, source: FloaterAttentionBias, layer: int, share: bool = True
    ):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self._source = _Source(source, layer, share)

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight, self.bias)
        src = self._source
        b = block_bias(src.module, src.layer, x.shape[-2], src.share)  # [3, L, dim]
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
        new._source = _Source(source, layer, share)
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

        src = self._source
        bias = block_bias(src.module, src.layer, max(L, S), src.share)  # [3, Lmax, E]
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
    transformers self-attention layer (separate q / k / v projections) the layer itself
    with the projections' names: (layer, names, layer)."""
    from . import transformers as hf  # never imports the transformers library

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
        from . import transformers as hf

        return hf.attention_width(parent, name)
    return child.out_features // 3


def _weight(parent: nn.Module, name, child: nn.Module) -> Tensor:
    if isinstance(child, nn.MultiheadAttention):
        return child.out_proj.weight
    if isinstance(name, tuple):
        return parent._modules[name[0]].weight
    return child.weight


def _no_layer_message() -> str:
    from . import transformers as hf

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
    default 0.01: the biases start near zero), ``refresh_every=k`` (biases recomputed on
    one training step in k, detached constants in between: no gradient reaches the
    FLOATER parameters on those steps) and :func:`floater_param_groups` (a larger learning
    rate for the FLOATER parameters). ``share_integration=False``: every block integrates
    its own three states in training (the per-block path; only for reentrant
    checkpointing of some blocks).

    Inside torch's nn.TransformerEncoder(Layer), the nested-tensor and inference fast
    paths read the attention weights directly and would skip the biases: they are
    switched off for the layers changed here. Hugging Face transformers models
    (BERT, RoBERTa, XLM-R, DistilBERT, ViT, DeiT, ...): see
    posenc_fast.integrations.transformers (positions from ``position_ids``, the options
    recorded in ``model.config``).
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
    # The ODE state stays float32 in a half-precision model (its rounding would accumulate
    # over the solver steps); the biases are cast to the projections' dtype when added.
    floater_kwargs.setdefault("dtype", ref.dtype if ref.dtype == torch.float64 else torch.float32)
    source = FloaterAttentionBias(dims.pop(), len(layers), **floater_kwargs)
    transformers_layers = False
    for n, (parent, name, child) in enumerate(layers):
        if isinstance(name, tuple):
            from . import transformers as hf

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

    Returns ``[{"params": [every other parameter], "lr": lr}, {"params": [the parameters of
    every FLOATER module in model (p0, w1, b1, w2, b2 of each Floater)], "lr": lr *
    flow_lr_scale}]``, each trainable (requires_grad) parameter exactly once, in module
    order; a group without parameters is left out. Other options (weight_decay, betas)
    are the optimizer's defaults for both groups; set them per group on the result.
    """
    from ..ops.floater import Floater  # the modules that hold FLOATER's parameters

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
