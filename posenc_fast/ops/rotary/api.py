"""Rotary embeddings: ``rotary``, ``rotary_table``, ``Rotary``, and the LightGlue members
``apply_lff_rotary``, ``lff_rotary``, ``LearnableFourierRotary``.

Channel pair i of q and k is rotated by the angle x . W_i (reference.py); the families
differ only in W and x (frequencies.py, ``posenc_fast.rope``). A call: checks -> registry
-> custom op ``posenc_fast::rotary`` (op.py); the backward recomputes cos / sin from x.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import torch
from torch import Tensor, nn

from ... import _checks, _dispatch
from ..._dispatch import Problem
from ..._modules import module_tensors
from .._custom_ops import autocast_dtype, run
from . import reference as _reference
from .op import ROTARY_OP, TABLE_OP, RotaryFunction, TableFunction
from .registry import LIGHTGLUE_ROTARY, LIGHTGLUE_TABLE, ROTARY, TABLE

LAYOUTS = _reference.LAYOUTS
PAIRS = _reference.PAIRS


def _float_positions(x: Tensor, freqs: Tensor) -> Tensor:
    """Integer positions as float32 (exact up to 2^24; float64 for float64 freqs)."""
    if x.is_floating_point():
        return x
    return x.to(torch.float64 if freqs.dtype == torch.float64 else torch.float32)


def _kind(freqs: Tensor) -> str:
    return "shared" if freqs.dim() == 2 else "per_head"


# ------------------------------------------------------------------------ checks
# _fast_ok: a few attribute reads; only when it fails does _explain name the bad argument.


def _fast_ok(q, k, x, freqs, pairs, layout, prefix, per_head_ok: bool) -> bool:
    try:
        qs, ks, xs, fs = q.shape, k.shape, x.shape, freqs.shape
        if not (
            q.dtype in _checks.FLOAT_DTYPE_SET and k.dtype == q.dtype
            and freqs.dtype in _checks.FLOAT_DTYPE_SET
            and x.dtype not in _checks.NOT_POSITIONS and len(qs) == 4 and len(ks) == 4
            and pairs in PAIRS and layout in LAYOUTS and type(prefix) is int
        ):  # fmt: skip
            return False
    except (AttributeError, TypeError):
        return False
    t = 2 if layout == "bhnd" else 1  # the tokens' axis
    B, N, D = qs[0], qs[t], qs[3]
    if not (ks[0] == B and ks[t] == N and ks[3] == D and 0 <= prefix <= N):
        return False
    if not ((len(xs) == 2 and xs[0] == N - prefix) or (len(xs) == 3 and xs[:2] == (B, N - prefix))):
        return False
    M = xs[-1]
    if len(fs) == 2:
        ok = fs[1] == M and fs[0] >= 1
    else:
        H = qs[3 - t]
        ok = per_head_ok and len(fs) == 3 and fs[0] == H == ks[3 - t] and fs[2] == M and fs[1] >= 1
    dev = q.device
    return ok and 2 * fs[-2] <= D and k.device == dev and x.device == dev and freqs.device == dev


_RANKS = "[F/2, M] or [H, F/2, M] (one per head)"


def _check_freqs(
    name: str, freqs, M: int, per_head_ok: bool, heads: Optional[int], ranks: str = _RANKS
) -> bool:
    """freqs [F/2, M], or [H, F/2, M] where ``per_head_ok`` (H = ``heads`` when given, else
    any); returns whether it is per head. ``ranks``: the shapes a wrong rank is told."""
    _checks.float_tensor(name, freqs)
    if per_head_ok and freqs.dim() not in (2, 3):
        raise ValueError(f"{name} must have shape {ranks}, got {list(freqs.shape)}")
    if not (per_head_ok and freqs.dim() == 3):
        _checks.frequencies(name, freqs, M)
        return False
    heads = freqs.shape[0] if heads is None else heads
    what = f"[H, F/2, M] with H = {heads} heads and M = x.shape[-1]"
    _checks.shape(name, freqs, (heads, None, M), what)
    if freqs.shape[1] == 0:
        raise ValueError(f"{name} must have F/2 >= 1 frequencies, got {list(freqs.shape)}")
    return True


def _explain(q, k, x, freqs, pairs, layout, prefix, name: str, per_head_ok: bool) -> None:
    """Raise the error that names what is wrong with a call _fast_ok refused."""
    _checks.choice("layout", layout, LAYOUTS)
    _checks.choice("pairs", pairs, PAIRS)
    _checks.float_tensor("q", q)
    _checks.float_tensor("k", k)
    spec = "[B, heads, N, head_dim]" if layout == "bhnd" else "[B, N, heads, head_dim]"
    for arg, t in (("q", q), ("k", k)):
        if t.dim() != 4:
            raise ValueError(
                f"{arg} must have shape {spec} (layout={layout!r}), got {list(t.shape)}"
            )
    t_axis = 2 if layout == "bhnd" else 1
    B, N, D = q.shape[0], q.shape[t_axis], q.shape[3]
    if (k.shape[0], k.shape[t_axis], k.shape[3]) != (B, N, D):
        raise ValueError(
            f"k must have the batch size, positions and head_dim of q {spec}: "
            f"q {list(q.shape)}, k {list(k.shape)} (layout={layout!r}; heads may differ)"
        )
    if k.dtype != q.dtype:
        raise TypeError(f"k has dtype {k.dtype} but q has {q.dtype}: q and k must share one dtype")
    if type(prefix) is not int or not 0 <= prefix <= N:
        raise ValueError(f"prefix must be an int in [0, N] with N = {N} tokens, got {prefix!r}")
    _checks.real_positions("x", x)
    n = N - prefix
    if not ((x.dim() == 3 and x.shape[:2] == (B, n)) or (x.dim() == 2 and x.shape[0] == n)):
        tokens = "N - prefix" if prefix else "N"
        raise ValueError(
            f"x must have shape [B, {tokens}, M] or [{tokens}, M] (shared by the batch) with "
            f"B = {B} and {tokens} = {n} from q, got {list(x.shape)}"
        )
    H = q.shape[3 - t_axis]
    ranks = "[F/2, M] (shared by the heads) or [H, F/2, M] (one per head)"
    per_head = _check_freqs(name, freqs, x.shape[-1], per_head_ok, H, ranks)
    if per_head and k.shape[3 - t_axis] != H:
        raise ValueError(
            f"k must have the {H} heads of q when {name} is per head {list(freqs.shape)} "
            f"(fewer key heads need {name} [F/2, M] shared by the heads), got {list(k.shape)}"
        )
    F = 2 * freqs.shape[-2]
    if F > D:
        raise ValueError(
            f"{name} rotates F = 2 * {name}.shape[-2] = {F} channels, more than head_dim = {D}"
        )
    _checks.same_device("q", q, k=k, x=x, **{name: freqs})
    raise AssertionError("rotary: the fast check refused arguments the detailed one accepts")


def _rotary_problem(op, q, k, x, freqs, pairs, layout, prefix, name, per_head_ok=True):
    """(x as floats, the Problem of the call), after the checks."""
    if not _fast_ok(q, k, x, freqs, pairs, layout, prefix, per_head_ok):
        _explain(q, k, x, freqs, pairs, layout, prefix, name, per_head_ok)
    x = _float_positions(x, freqs)
    problem = Problem(
        op=op,
        device=q.device.type,
        dtype=q.dtype,
        sizes={"pos_dim": x.shape[-1], "rotary_dim": 2 * freqs.shape[-2], "prefix": prefix},
        options={"pairs": pairs, "freqs": _kind(freqs)},
        input_dtypes={"x": x.dtype, "freqs": freqs.dtype},
    )
    return x, problem


def _table_problem(op, x, freqs, pairs, name, per_head_ok=True):
    """(x as floats, the Problem of the call), after the checks."""
    _checks.real_positions("x", x)
    if x.dim() < 2:
        raise ValueError(
            f"x must have shape [..., N, M] (at least 2 dimensions), got {list(x.shape)}"
        )
    _checks.choice("pairs", pairs, PAIRS)
    _check_freqs(name, freqs, x.shape[-1], per_head_ok, None)
    _checks.same_device(name, freqs, x=x)
    x = _float_positions(x, freqs)
    amp = autocast_dtype(x.device.type)
    out_dtype = amp if (amp is not None and freqs.dtype == torch.float32) else freqs.dtype
    problem = Problem(
        op=op,
        device=x.device.type,
        dtype=out_dtype,
        sizes={"pos_dim": x.shape[-1], "rotary_dim": 2 * freqs.shape[-2]},
        options={"pairs": pairs, "freqs": _kind(freqs)},
        input_dtypes={"x": x.dtype, "freqs": freqs.dtype},
    )
    return x, problem


# ------------------------------------------------------------------------ the op


def rotary(
    q: Tensor,
    k: Tensor,
    x: Tensor,
    freqs: Tensor,
    pairs: str = "interleaved",
    layout: str = "bhnd",
    prefix: int = 0,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """q and k rotated by the angles x . W_i of their tokens' positions, fused.

    Args:
        q, k: [B, heads, N, head_dim] (``layout="bhnd"``) or [B, N, heads, head_dim]
            (``"bnhd"``); any strides; float16, bfloat16, float32 or float64, one dtype.
            k may have fewer heads than q when freqs is shared by the heads.
        x: positions [N - prefix, M] shared by the batch, or [B, N - prefix, M] per sample
            (floating or integer).
        freqs: W [F/2, M] shared by the heads, or [H, F/2, M] one per head (any strides:
            a block's slice of a [depth, H, F/2, M] parameter). F <= head_dim.
        pairs: "interleaved" (pair i = channels 2i, 2i+1) or "half" (i, i + F/2).
        layout: "bhnd" or "bnhd", see q.
        prefix: the first ``prefix`` tokens (class, registers) pass through unchanged.
        backend: "auto", "reference", "torch", "triton" or "cpp".

    Returns:
        (q', k'): new tensors (the inputs are not modified) of q's and k's shapes, in q's
        dtype, contiguous in the given layout; channels F.. pass through. Angles in float32
        or better with accurate phases (within 1e-6 of float64 up to |phase| 1e5),
        rotations in float32 (float64 for float64 q), rounded once. Differentiable with
        respect to q, k, x and freqs.
    """
    x, problem = _rotary_problem("rotary", q, k, x, freqs, pairs, layout, prefix, "freqs")
    impl = _dispatch.choose(ROTARY, problem, backend)
    return run(RotaryFunction, ROTARY_OP, impl, q, k, x, freqs, pairs, layout, prefix)


def rotary_table(
    x: Tensor, freqs: Tensor, pairs: str = "interleaved", backend: str = "auto"
) -> Tensor:
    """The cos / sin table of the angles x . W_i, for callers that apply it themselves.

    Args:
        x: positions [..., N, M] (floating or integer).
        freqs: W [F/2, M], or [H, F/2, M] one per head.
        pairs: "interleaved" (each angle on channels 2i and 2i+1) or "half" (i, i + F/2).
        backend: "auto", "reference", "torch", "triton" or "cpp".

    Returns:
        [2, ..., N, F] (shared freqs) or [2, ..., H, N, F] (per head): ``[0]`` the cosines,
        ``[1]`` the sines. timm's concatenated embedding is ``torch.cat([t[1], t[0]], -1)``.
        The dtype is freqs' (the autocast dtype under autocast for float32 freqs); phases
        are float32 or better, reduced accurately. Differentiable in x and freqs.
    """
    x, problem = _table_problem("rotary_table", x, freqs, pairs, "freqs")
    impl = _dispatch.choose(TABLE, problem, backend)
    return run(TableFunction, TABLE_OP, impl, x, freqs, pairs, problem.dtype)


class Rotary(nn.Module):
    r"""Rotary embedding of attention heads by positions: ``m(q, k, x)`` rotates q and k
    (:func:`rotary`), ``m.table(x)`` gives the cos / sin table (:func:`rotary_table`).

    - ``freqs`` [F/2, pos_dim] shared by the heads, or [heads, F/2, pos_dim] one per head:
      a Parameter, or a buffer with ``learnable=False``. Default: axial frequencies for
      integer grid coordinates (``posenc_fast.rope.axial(rotary_dim, pos_dim,
      in_pixels=False)``); ``frequencies=`` (or :meth:`from_frequencies`) takes any.
    - ``rotary_dim`` (default head_dim): channels rotated; the others pass through.
    - ``pairs``, ``layout``, ``prefix``: as for :func:`rotary`.
    """

    def __init__(
        self,
        pos_dim: int,
        head_dim: int,
        rotary_dim: Optional[int] = None,
        heads: Optional[int] = None,
        pairs: str = "interleaved",
        layout: str = "bhnd",
        prefix: int = 0,
        learnable: bool = True,
        frequencies: Optional[Tensor] = None,
        backend: str = "auto",
        device=None,
        dtype=None,
    ):
        super().__init__()
        _checks.positive_int("pos_dim", pos_dim)
        _checks.positive_int("head_dim", head_dim)
        if heads is not None:
            _checks.positive_int("heads", heads)
        self.pairs = _checks.choice("pairs", pairs, PAIRS)
        self.layout = _checks.choice("layout", layout, LAYOUTS)
        self.prefix = _checks.size("prefix", prefix, 0)
        self.backend = _dispatch.validate_name(backend)
        if frequencies is None:
            from .frequencies import axial

            dim = head_dim - head_dim % 2 if rotary_dim is None else rotary_dim
            _checks.even_positive_int("rotary_dim", dim)
            if dim < 2 * pos_dim:
                raise ValueError(
                    f"rotary_dim ({dim}) must be >= 2 * pos_dim ({2 * pos_dim}) for the default "
                    "axial frequencies (one pair per axis); or pass frequencies="
                )
            w = axial(dim, ndim=pos_dim, in_pixels=False)
            if heads is not None:
                w = w.expand(heads, -1, -1)
        else:
            w = _checks.float_tensor("frequencies", frequencies).detach()
            if w.dim() == 3 and heads is None:
                heads = w.shape[0]
            _check_freqs("frequencies", w, pos_dim, w.dim() == 3, heads)
            if heads is not None and w.dim() == 2:
                w = w.expand(heads, -1, -1)
            if rotary_dim is not None and rotary_dim != 2 * w.shape[-2]:
                raise ValueError(
                    f"rotary_dim ({rotary_dim}) must be 2 * frequencies.shape[-2] "
                    f"= {2 * w.shape[-2]} (or None)"
                )
        rotated = 2 * w.shape[-2]
        if rotated > head_dim:
            raise ValueError(f"rotary_dim ({rotated}) must be <= head_dim ({head_dim})")
        self.pos_dim, self.head_dim, self.rotary_dim = pos_dim, head_dim, rotated
        self.heads = heads
        w = w.to(device=device, dtype=dtype).clone(memory_format=torch.contiguous_format)
        if learnable:
            self.freqs = nn.Parameter(w)
        else:
            self.register_buffer("freqs", w)

    @classmethod
    def from_frequencies(
        cls,
        freqs: Tensor,
        head_dim: Optional[int] = None,
        pairs: str = "interleaved",
        layout: str = "bhnd",
        prefix: int = 0,
        learnable: bool = True,
        backend: str = "auto",
    ) -> Rotary:
        """The module holding a copy of ``freqs`` [F/2, M] or [heads, F/2, M] (a builder's
        output, e.g. ``posenc_fast.rope.dinov3(64)``); head_dim defaults to F."""
        _checks.float_tensor("freqs", freqs)
        if freqs.dim() not in (2, 3):
            raise ValueError(
                f"freqs must have shape [F/2, M] or [H, F/2, M], got {list(freqs.shape)}"
            )
        F = 2 * freqs.shape[-2]
        return cls(
            freqs.shape[-1],
            F if head_dim is None else head_dim,
            heads=freqs.shape[0] if freqs.dim() == 3 else None,
            pairs=pairs,
            layout=layout,
            prefix=prefix,
            learnable=learnable,
            frequencies=freqs,
            backend=backend,
            device=freqs.device,
            dtype=freqs.dtype,
        )

    def forward(self, q: Tensor, k: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
        """(q', k'): q and k [B, heads, N, head_dim] (or [B, N, heads, head_dim] with layout
        "bnhd") rotated by positions x [N - prefix, pos_dim] or [B, N - prefix, pos_dim]."""
        if q.shape[-1:] != (self.head_dim,):
            raise ValueError(f"q must have head_dim={self.head_dim} channels, got {list(q.shape)}")
        (freqs,) = module_tensors(self, ("freqs",))
        return rotary(q, k, x, freqs, self.pairs, self.layout, self.prefix, self.backend)

    def table(self, x: Tensor) -> Tensor:
        """x [..., N, pos_dim] -> the cos / sin table [2, ..., N, rotary_dim] (per head
        [2, ..., heads, N, rotary_dim])."""
        (freqs,) = module_tensors(self, ("freqs",))
        return rotary_table(x, freqs, self.pairs, self.backend)

    def extra_repr(self) -> str:
        s = f"pos_dim={self.pos_dim}, head_dim={self.head_dim}"
        if self.rotary_dim != self.head_dim:
            s += f", rotary_dim={self.rotary_dim}"
        if self.heads is not None:
            s += f", heads={self.heads}"
        for name, default in (("pairs", "interleaved"), ("layout", "bhnd"), ("backend", "auto")):
            if getattr(self, name) != default:
                s += f", {name}={getattr(self, name)!r}"
        if self.prefix:
            s += f", prefix={self.prefix}"
        if not isinstance(self.freqs, nn.Parameter):
            s += ", learnable=False"
        return s


# ------------------------------------------------------------------------ LightGlue
# Interleaved pairs, shared wr [F/2, M], no prefix; the same custom ops as rotary.


def lff_rotary(x: Tensor, wr: Tensor, backend: str = "auto") -> Tensor:
    """The rotary cos / sin table of learnable Fourier features, in LightGlue's layout.

    Args:
        x: positions [..., N, M] (floating or integer), e.g. keypoints [B, N, 2].
        wr: frequencies [F/2, M] (LightGlue's ``Wr.weight``; no bias).
        backend: "auto", "reference", "torch", "triton" or "cpp".

    Returns:
        [2, ..., 1, N, F] (``rotary_table(x, wr).unsqueeze(-3)``): ``[0]`` the cosines,
        ``[1]`` the sines of x wr^T, each frequency on channels 2i and 2i+1, with a
        broadcast heads axis -- what LightGlue's ``LearnableFourierPositionalEncoding``
        returns. The dtype is wr's (the autocast dtype under autocast for float32 wr);
        phases in float32 or better, reduced accurately (docs/precision.md).
        :func:`apply_lff_rotary` rotates in one pass without the table.
    """
    x, problem = _table_problem("lff_rotary", x, wr, "interleaved", "wr", per_head_ok=False)
    impl = _dispatch.choose(LIGHTGLUE_TABLE, problem, backend)
    return run(TableFunction, TABLE_OP, impl, x, wr, "interleaved", problem.dtype).unsqueeze(-3)


def apply_lff_rotary(
    q: Tensor,
    k: Tensor,
    x: Tensor,
    wr: Tensor,
    layout: str = "bhnd",
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """q and k rotated by the learnable Fourier rotary embedding of positions x, fused:
    ``rotary(q, k, x, wr, "interleaved", layout, 0, backend)``, equal to LightGlue's
    ``apply_cached_rotary_emb`` with ``lff_rotary(x, wr)``, without the table.

    Args:
        q, k: [B, heads, N, head_dim] (``layout="bhnd"``, LightGlue's) or [B, N, heads,
            head_dim] (``"bnhd"``); any strides; float16, bfloat16, float32 or float64,
            one dtype. k may have fewer heads than q.
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
    x, problem = _rotary_problem(
        "apply_lff_rotary", q, k, x, wr, "interleaved", layout, 0, "wr", per_head_ok=False
    )
    impl = _dispatch.choose(LIGHTGLUE_ROTARY, problem, backend)
    return run(RotaryFunction, ROTARY_OP, impl, q, k, x, wr, "interleaved", layout, 0)


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
        """LightGlue's ``LearnableFourierPositionalEncoding`` as this module: ``m(x)``
        returns its [2, B, 1, N, F] table, ``m.rotate(q, k, x)`` applies it fused.
        (``convert.from_state_dict(sd, "lightglue")`` gives the Fourier *features* module.)

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
        """(q', k'): q and k [B, heads, N, head_dim] (layout "bnhd": [B, N, heads, head_dim])
        rotated by positions x [B, N, pos_dim] or [N, pos_dim]."""
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
