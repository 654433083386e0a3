"""Learnable Fourier features as rotary embeddings (LightGlue): ``lff_rotary``,
``apply_lff_rotary`` and the nn.Module ``LearnableFourierRotary``.

LightGlue (Lindenberger et al. 2023) encodes keypoints x with learnable Fourier features
and uses their cosines and sines as a rotary embedding of every attention head: channel
pair (2i, 2i+1) of q and k is rotated by the angle x . wr_i. reference.py states the
formulas; this module checks arguments and dispatches.

Path of a call: ``apply_lff_rotary`` -> the dispatcher picks an implementation from the
registry (registry.py) -> the custom op ``posenc_fast::apply_lff_rotary`` (op.py) -> the
implementation's kernel (torch_impl.py, triton_kernels/rotary.py,
csrc/rotary/rotary_cpu.cpp) -> backward ``posenc_fast::apply_lff_rotary_backward``,
recomputing the cos / sin from x.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import torch
from torch import Tensor, nn

from ... import _checks, _dispatch
from ..._dispatch import Problem
from .._custom_ops import autocast_dtype, run
from . import reference as _reference
from .op import APPLY_OP, TABLE_OP, ApplyFunction, TableFunction
from .registry import APPLY, TABLE

LAYOUTS = _reference.LAYOUTS


def _check_wr(wr, M: int) -> int:
    """wr [F/2, M]; returns F."""
    _checks.float_tensor("wr", wr)
    _checks.frequencies("wr", wr, M)
    return 2 * wr.shape[0]


def _float_positions(x: Tensor, wr: Tensor) -> Tensor:
    """Integer positions as float32 (exact up to 2^24; float64 for float64 wr)."""
    if x.is_floating_point():
        return x
    return x.to(torch.float64 if wr.dtype == torch.float64 else torch.float32)


def lff_rotary(x: Tensor, wr: Tensor, backend: str = "auto") -> Tensor:
    """The rotary cos / sin table of learnable Fourier features, in LightGlue's layout.

    Args:
        x: positions [..., N, M] (floating or integer), e.g. keypoints [B, N, 2].
        wr: frequencies [F/2, M] (LightGlue's ``Wr.weight``; no bias).
        backend: "auto", "reference", "torch", "triton" or "cpp".

    Returns:
        [2, ..., 1, N, F]: ``[0]`` the cosines, ``[1]`` the sines of x wr^T, each
        frequency on two neighbouring channels (2i and 2i+1), not scaled, with a
        broadcast heads axis before N -- what LightGlue's
        ``LearnableFourierPositionalEncoding`` returns, to rotate q and k of layout
        [B, heads, N, F] as ``q * t[0] + rotate_half(q) * t[1]``. The dtype is wr's (the
        autocast dtype under autocast for float32 wr); phases are always computed in
        float32 or better and reduced accurately (docs/precision.md).
        :func:`apply_lff_rotary` does the rotation in one pass without the table.
    """
    _checks.real_positions("x", x)
    if x.dim() < 2:
        raise ValueError(
            f"x must have shape [..., N, M] (at least 2 dimensions), got {list(x.shape)}"
        )
    F = _check_wr(wr, x.shape[-1])
    _checks.same_device("wr", wr, x=x)
    x = _float_positions(x, wr)
    amp = autocast_dtype(x.device.type)
    out_dtype = amp if (amp is not None and wr.dtype == torch.float32) else wr.dtype
    problem = Problem(
        op="lff_rotary",
        device=x.device.type,
        dtype=out_dtype,
        sizes={"pos_dim": x.shape[-1], "rotary_dim": F},
        input_dtypes={"x": x.dtype, "wr": wr.dtype},
    )
    impl = _dispatch.choose(TABLE, problem, backend)
    return run(TableFunction, TABLE_OP, impl, x, wr, out_dtype).unsqueeze(-3)


def _check_apply_args(q, k, x, wr, layout) -> tuple[Tensor, int]:
    _checks.choice("layout", layout, LAYOUTS)
    _checks.float_tensor("q", q)
    _checks.float_tensor("k", k)
    spec = "[B, heads, N, head_dim]" if layout == "bhnd" else "[B, N, heads, head_dim]"
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have shape {spec} (layout={layout!r}), got {list(t.shape)}"
            )
    n_axis = 2 if layout == "bhnd" else 1
    B, N, D = q.shape[0], q.shape[n_axis], q.shape[3]
    if (k.shape[0], k.shape[n_axis], k.shape[3]) != (B, N, D):
        raise ValueError(
            f"k must have the batch size, positions and head_dim of q {spec}: "
            f"q {list(q.shape)}, k {list(k.shape)} (layout={layout!r}; heads may differ)"
        )
    if k.dtype != q.dtype:
        raise TypeError(f"k has dtype {k.dtype} but q has {q.dtype}: q and k must share one dtype")
    _checks.real_positions("x", x)
    ok = (x.dim() == 3 and x.shape[:2] == (B, N)) or (x.dim() == 2 and x.shape[0] == N)
    if not ok:
        raise ValueError(
            f"x must have shape [B, N, M] or [N, M] (shared by the batch) with B = {B} and "
            f"N = {N} from q, got {list(x.shape)}"
        )
    F = _check_wr(wr, x.shape[-1])
    if F > D:
        raise ValueError(f"wr rotates F = 2 * wr.shape[0] = {F} channels, more than head_dim = {D}")
    _checks.same_device("q", q, k=k, x=x, wr=wr)
    return _float_positions(x, wr), F


def apply_lff_rotary(
    q: Tensor,
    k: Tensor,
    x: Tensor,
    wr: Tensor,
    layout: str = "bhnd",
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """q and k rotated by the learnable Fourier rotary embedding of positions x, fused.

    Equal to ``t * c + rotate_half(t) * s`` with ``c, s = lff_rotary(x, wr)`` (LightGlue's
    ``apply_cached_rotary_emb``), for t = q and t = k, without the table: the cos / sin
    of a position are computed once for all heads of q and k, and the backward recomputes
    them from x.

    Args:
        q, k: queries and keys, [B, heads, N, head_dim] (``layout="bhnd"``, LightGlue's)
            or [B, N, heads, head_dim] (``layout="bnhd"``); any strides; float16, bfloat16,
            float32 or float64, the same dtype. k may have fewer heads than q.
        x: positions [B, N, M], or [N, M] shared by the batch (floating or integer).
        wr: frequencies [F/2, M] with F <= head_dim. Channels 2i and 2i+1 are rotated by
            the angle x . wr[i]; channels F..head_dim-1 are returned unchanged.
        layout: "bhnd" or "bnhd", see q.
        backend: "auto", "reference", "torch", "triton" or "cpp".

    Returns:
        (q', k'): new tensors (the inputs are not modified) of q's and k's shapes, in q's
        dtype, contiguous in the given layout. Rotations are computed in float32 (float64
        for float64 q) and rounded once. Differentiable with respect to q, k, x and wr.
    """
    x, F = _check_apply_args(q, k, x, wr, layout)
    problem = Problem(
        op="apply_lff_rotary",
        device=q.device.type,
        dtype=q.dtype,
        sizes={"pos_dim": x.shape[-1], "rotary_dim": F},
        input_dtypes={"x": x.dtype, "wr": wr.dtype},
    )
    impl = _dispatch.choose(APPLY, problem, backend)
    return run(ApplyFunction, APPLY_OP, impl, q, k, x, wr, layout)


class LearnableFourierRotary(nn.Module):
    r"""Learnable Fourier features as a rotary embedding of attention heads (LightGlue).

    A drop-in for LightGlue's ``LearnableFourierPositionalEncoding(M, dim=head_dim)``:
    ``m(x)`` returns the same [2, ..., 1, N, F] cos / sin table (see :func:`lff_rotary`),
    and ``m.rotate(q, k, x)`` rotates q and k in one fused pass without it (see
    :func:`apply_lff_rotary`).

    - ``wr`` [rotary_dim/2, pos_dim], no bias, initialised from N(0, gamma^-2): standard
      deviation 1/gamma, as in Li et al.'s Eq. 3 and :class:`LearnableFourierFeatures`.
      LightGlue draws standard deviation gamma^-2 instead: its ``gamma=g`` is our
      ``gamma=g**2`` (both agree at the default 1). Its ``Wr.weight`` loads as ``wr``.
    - ``rotary_dim`` (default head_dim, as in LightGlue): the number of rotated channels,
      even and <= head_dim; the channels after it pass through unchanged.
    - ``layout``: "bhnd" (q, k [B, heads, N, head_dim], LightGlue's) or "bnhd".
    """

    def __init__(
        self,
        pos_dim: int,
        head_dim: int,
        rotary_dim: Optional[int] = None,
        gamma: float = 1.0,
        layout: str = "bhnd",
        backend: str = "auto",
        device=None,
        dtype=None,
    ):
        super().__init__()
        _checks.positive_int("pos_dim", pos_dim)
        _checks.positive_int("head_dim", head_dim)
        rotary_dim = head_dim - head_dim % 2 if rotary_dim is None else rotary_dim
        _checks.even_positive_int("rotary_dim", rotary_dim)
        if rotary_dim > head_dim:
            raise ValueError(f"rotary_dim ({rotary_dim}) must be <= head_dim ({head_dim})")
        self.pos_dim, self.head_dim, self.rotary_dim = pos_dim, head_dim, rotary_dim
        self.gamma = _checks.positive_float("gamma", gamma)
        self.layout = _checks.choice("layout", layout, LAYOUTS)
        self.backend = _dispatch.validate_name(backend)
        self.wr = nn.Parameter(torch.empty(rotary_dim // 2, pos_dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.wr.normal_(0.0, 1.0 / self.gamma)

    @classmethod
    def from_state_dict(
        cls,
        state_dict,
        source: str = "lightglue",
        *,
        gamma: Optional[float] = None,
        prefix: Optional[str] = None,
        head_dim: Optional[int] = None,
        layout: str = "bhnd",
        backend: str = "auto",
    ) -> LearnableFourierRotary:
        """LightGlue's ``LearnableFourierPositionalEncoding`` as this module, the one call
        for LightGlue users: ``m(x)`` returns exactly the [2, B, 1, N, F] cos / sin table
        its forward returns (what LightGlue's attention consumes), ``m.rotate(q, k, x)``
        applies it in one fused pass. (``convert.from_state_dict(sd, "lightglue")`` gives
        the Fourier *features* module instead, [cos || sin] / sqrt(F).)

        Args:
            state_dict: the encoder's state_dict (``Wr.weight`` [F/2, M]) or a whole
                LightGlue checkpoint (``posenc.Wr.weight``).
            source: "lightglue", the only rotary format.
            gamma: the gamma LightGlue's module was built with, in its convention (std
                gamma^-2; translated by convert.gamma_from); default 1.
            prefix: the encoder's key prefix; by default "" when ``Wr.weight`` is a key,
                else "posenc." (LightGlue's).
            head_dim: the attention heads' width, default F (LightGlue's F_dim = head_dim).
            layout, backend: as for the constructor.
        """
        from ..lff import checkpoint  # the LFF checkpoint formats (keys, shapes, gamma)

        _checks.choice("source", source, ("lightglue",))
        if prefix is None:
            is_encoder = isinstance(state_dict, Mapping) and "Wr.weight" in state_dict
            prefix = "" if is_encoder else "posenc."
        args, _, weights = checkpoint.parse(state_dict, source, gamma=gamma, prefix=prefix)
        pos_dim, F, our_gamma = args[0], args[1], args[5]
        wr = weights["wr"]
        m = cls(
            pos_dim,
            F if head_dim is None else head_dim,
            rotary_dim=F,
            gamma=our_gamma,
            layout=layout,
            backend=backend,
            device=wr.device,
            dtype=wr.dtype,
        )
        with torch.no_grad():
            m.wr.copy_(wr)
        return m

    def forward(self, x: Tensor) -> Tensor:
        """x [..., N, pos_dim] -> the table [2, ..., 1, N, rotary_dim]."""
        return lff_rotary(x, self.wr, backend=self.backend)

    def rotate(self, q: Tensor, k: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
        """(q', k'): q and k [B, heads, N, head_dim] (or [B, N, heads, head_dim] with
        layout "bnhd") rotated by the embedding of positions x [B, N, pos_dim] or
        [N, pos_dim]."""
        if q.shape[-1:] != (self.head_dim,):
            raise ValueError(f"q must have head_dim={self.head_dim} channels, got {list(q.shape)}")
        return apply_lff_rotary(q, k, x, self.wr, self.layout, self.backend)

    def extra_repr(self) -> str:
        s = f"pos_dim={self.pos_dim}, head_dim={self.head_dim}"
        if self.rotary_dim != self.head_dim:
            s += f", rotary_dim={self.rotary_dim}"
        s += f", gamma={self.gamma}"
        if self.layout != "bhnd":
            s += f", layout={self.layout!r}"
        if self.backend != "auto":
            s += f", backend={self.backend!r}"
        return s
