"""FloaterAttentionBias: FLOATER's Q/K/V biases for every attention block from one shared
dynamics (the paper's Eq. 12-13), and :class:`BlockBiases`, what one block holds."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from ... import _checks
from .._custom_ops import onnx_export_running
from . import training
from .cache import FloaterCacheInfo
from .module import Floater


class FloaterAttentionBias(nn.Module):
    r"""FLOATER's compatible form (Eq. 12-13): position-dependent biases for the Q/K/V
    projections of every attention block, all driven by one shared dynamics.

    ``forward(length)`` -> [num_layers, num_projections, L, dim]: bias[n, j] is added to
    projection j (0: Q, 1: K, 2: V by convention) of block n. One :class:`Floater` with
    num_states = num_layers * num_projections holds the initial values; ``floater_kwargs``
    (hidden_dim, delta_t, substeps, method, activation, backend, refresh_every, init_scale,
    device, dtype) go to it. The biases start near zero (a pretrained model warm-starts).

    Example (``posenc_fast.integrations.attention.add_floater_biases`` does this for
    existing models)::

        pos = posenc_fast.FloaterAttentionBias(dim=256, num_layers=4)
        bias = pos(x.shape[1])  # [4, 3, L, 256]
        for n, block in enumerate(blocks):  # x [B, L, 256]
            qkv = block.qkv(x).unflatten(-1, (3, -1)) + bias[n].transpose(0, 1)
            q, k, v = qkv.unbind(-2)  # each [B, L, 256] with block n's Q/K/V biases
            x = x + block.proj(attend(q, k, v))  # heads split, SDPA, heads merged
    """

    def __init__(self, dim: int, num_layers: int, num_projections: int = 3, **floater_kwargs):
        super().__init__()
        _checks.positive_int("num_layers", num_layers)
        _checks.positive_int("num_projections", num_projections)
        self.num_layers, self.num_projections = num_layers, num_projections
        self.floater = Floater(dim, num_layers * num_projections, **floater_kwargs)
        self._step = training.Slot()  # a training forward's one integration (training.py)

    def reset_parameters(self) -> None:
        self.floater.reset_parameters()

    def forward(self, length: Optional[int] = None, times: Optional[Tensor] = None) -> Tensor:
        """length: int >= 0, or times [L] -> [num_layers, num_projections, L, dim]."""
        out = self.floater(length, times)
        return out.unflatten(0, (self.num_layers, self.num_projections))

    def block(self, layer: int, share: bool = True) -> BlockBiases:
        """What an attention block holds to get its biases: ``block(n)(length)`` is
        :meth:`block_biases` of block n."""
        return BlockBiases(self, layer, share)

    def block_biases(self, n: int, length: int, share: bool = True) -> Tensor:
        """Block ``n``'s biases [num_projections, L, dim] = ``self(length)[n]``. A training
        step shares one integration of all blocks (``share=False``: per block); otherwise
        the cache or frozen states serve it (docs/floater-training.md)."""
        fl = self.floater
        if fl.frozen or onnx_export_running() or not (fl.training and torch.is_grad_enabled()):
            # the Floater called directly: a frame fewer to the kernel
            return fl(length).unflatten(0, (self.num_layers, self.num_projections))[n]
        return training.block_biases(
            self.floater, self.num_layers, self.num_projections, self._step, n, length, share
        )

    def extra_repr(self) -> str:
        return f"num_layers={self.num_layers}, num_projections={self.num_projections}"

    # -- inference: the Floater's, see Floater.freeze --------------------------------------

    @property
    def frozen(self) -> bool:
        return self.floater.frozen

    def freeze(self, length: int) -> FloaterAttentionBias:
        """Store the biases of positions 0..length-1 (Floater.freeze): the model then runs
        and exports without integrating. Returns the module."""
        self.floater.freeze(length)
        return self

    def unfreeze(self) -> FloaterAttentionBias:
        self.floater.unfreeze()
        return self

    def cache_info(self) -> FloaterCacheInfo:
        """Floater.cache_info of the shared Floater."""
        return self.floater.cache_info()


class BlockBiases:
    """Block ``layer``'s biases: ``biases(length)`` = ``module(length)[layer]``; holds the
    module unregistered (registered once, on the model)."""

    def __init__(self, module: FloaterAttentionBias, layer: int, share: bool = True):
        self.module, self.layer, self.share = module, layer, share

    def __call__(self, length: int) -> Tensor:
        return self.module.block_biases(self.layer, length, self.share)
