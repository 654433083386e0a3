"""Seeded random inputs (never zeros: they hide bugs), every op's case matrix and the
usable backends, for ``verify``, ``bench`` and the tests (tests/_helpers.py: tests only)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from .. import _dispatch


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(shape, gen, dtype=torch.float32, device="cpu", scale=1.0) -> torch.Tensor:
    if torch.device(device).type == "meta":  # no values (compiling kernels ahead: sizes only)
        return torch.empty(shape, dtype=dtype, device=device)
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(
        dtype=dtype, device=device
    )


def rand(shape, gen, low, high, dtype=torch.float32, device="cpu") -> torch.Tensor:
    if torch.device(device).type == "meta":
        return torch.empty(shape, dtype=dtype, device=device)
    u = torch.rand(shape, generator=gen, dtype=torch.float64)
    return (low + (high - low) * u).to(dtype=dtype, device=device)


def randomize_parameters(module, seed: int, scale: float = 1.0, fan_in: bool = False) -> None:
    """Overwrite ``module``'s parameters in order with :func:`randn` values seeded by ``seed``:
    std ``scale``, divided by sqrt(rows) for matrices when ``fan_in``."""
    g = generator(seed)
    with torch.no_grad():
        for p in module.parameters():
            std = scale / math.sqrt(p.shape[0]) if fan_in and p.dim() == 2 else scale
            p.copy_(randn(p.shape, g, p.dtype, p.device, std))


@dataclass(frozen=True)
class LffCase:
    batch: tuple  # leading batch shape (N, or e.g. (B, N))
    groups: int
    pos_dim: int
    fourier_dim: int
    hidden_dim: int  # 0: features only
    group_out_dim: int
    activation: str = "gelu"
    position_scale: float = 3.0

    @property
    def id(self) -> str:
        mlp = f"H{self.hidden_dim}-Dg{self.group_out_dim}" if self.hidden_dim else "features"
        b = "x".join(map(str, self.batch)) or "scalar"
        return f"N{b}-G{self.groups}-M{self.pos_dim}-F{self.fourier_dim}-{mlp}-{self.activation}"


def lff_inputs(case: LffCase, dtype, device, seed: int, x_dtype=None):
    """(x, wr, w1, b1, w2, b2); weights in ``dtype``, x in ``x_dtype`` (default fp32 / fp64)."""
    g = generator(seed)
    if x_dtype is None:
        x_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    shape = (*case.batch, case.groups, case.pos_dim)
    x = randn(shape, g, x_dtype, device, case.position_scale)
    wr = randn((case.fourier_dim // 2, case.pos_dim), g, dtype, device)
    if not case.hidden_dim:
        return x, wr, None, None, None, None
    H, Dg, F = case.hidden_dim, case.group_out_dim, case.fourier_dim
    w1 = randn((F, H), g, dtype, device, 1.0 / math.sqrt(F) * 4)
    b1 = randn((H,), g, dtype, device, 0.5)
    w2 = randn((H, Dg), g, dtype, device, 1.0 / math.sqrt(H))
    b2 = randn((Dg,), g, dtype, device, 0.5)
    return x, wr, w1, b1, w2, b2


# Odd sizes, N = 0 and 1, G and M in {1, 2, 4}, every activation, with and without the MLP
LFF_CASES: Sequence[LffCase] = (
    LffCase((37,), 1, 2, 16, 8, 12),
    LffCase((0,), 2, 2, 16, 8, 12),
    LffCase((1,), 1, 1, 8, 4, 6),
    LffCase((3, 5), 2, 2, 16, 8, 10, "gelu_tanh"),
    LffCase((19,), 4, 1, 12, 6, 5, "relu"),
    LffCase((2, 3, 4), 1, 4, 32, 16, 24),
    LffCase((11,), 2, 4, 20, 7, 9, "gelu_tanh"),
    LffCase((23,), 1, 2, 16, 0, 0),
    LffCase((2, 7), 4, 2, 8, 0, 0),
    LffCase((0,), 1, 3, 8, 0, 0),
)


@dataclass(frozen=True)
class EncodingCase:
    kind: str  # "sinusoidal" | "dft"
    shape: tuple  # positions shape
    dim: int
    position_scale: float = 50.0
    integer: bool = False

    @property
    def id(self) -> str:
        s = "x".join(map(str, self.shape)) or "scalar"
        return f"{self.kind}-P{s}-d{self.dim}" + ("-int" if self.integer else "")


def positions(case: EncodingCase, dtype, device, seed: int) -> torch.Tensor:
    g = generator(seed)
    if case.integer:
        return torch.randint(0, int(case.position_scale), case.shape, generator=g).to(device)
    return rand(case.shape, g, -case.position_scale, case.position_scale, dtype, device)


ENCODING_CASES: Sequence[EncodingCase] = tuple(
    EncodingCase(kind, shape, dim, integer=integer)
    for kind in ("sinusoidal", "dft")
    for shape, dim, integer in (
        ((17,), 8, False),
        ((0,), 6, False),
        ((1,), 2, False),
        ((3, 5), 10, False),
        ((2, 3, 4), 16, True),
        ((), 4, False),
    )
)


def implementing(op: str, device: str, dtype: Optional[torch.dtype], include_reference: bool):
    """(name, backend) implementing ``op`` on ``device`` in ``dtype``, in dispatch order."""
    registry = _dispatch.REGISTRIES[op]
    for name, b in _dispatch.BACKENDS.items():
        impl = registry.get(name)
        if impl is None or (impl.differentiable and not include_reference):
            continue
        sup = impl.support
        if not sup.implements(device):
            continue
        if dtype is not None and sup.dtypes is not None and dtype not in sup.dtypes:
            continue
        yield name, b


def backends_for(
    op: str, device: str, dtype: Optional[torch.dtype] = None, include_reference=False
) -> list[str]:
    """Backends usable here that implement ``op`` on ``device`` (and ``dtype``)."""
    return [
        name
        for name, b in implementing(op, device, dtype, include_reference)
        if not b.environment_reasons()
    ]


@dataclass(frozen=True)
class FloaterCase:
    num_states: int  # S
    dim: int  # d
    hidden_dim: int  # H
    length: int  # L sample times
    substeps: int = 3
    method: str = "rk4"
    activation: str = "tanh"
    repeat_time: bool = False  # two equal sample times: an interval of length zero

    @property
    def id(self) -> str:
        rep = "-repeat" if self.repeat_time else ""
        return (
            f"S{self.num_states}-d{self.dim}-H{self.hidden_dim}-L{self.length}-K{self.substeps}"
            f"-{self.method}-{self.activation}{rep}"
        )


def floater_inputs(case: FloaterCase, dtype, device, seed: int):
    """(p0, w1, b1, w2, b2, times): h is O(1) (a wrong step or stage shows), times
    increasing with random gaps (times[1] == times[0] when ``repeat_time``)."""
    g = generator(seed)
    S, d, H, L = case.num_states, case.dim, case.hidden_dim, case.length
    p0 = randn((S, d), g, dtype, device)
    w1 = randn((d + 1, H), g, dtype, device, 1.5 / math.sqrt(d + 1))
    b1 = randn((H,), g, dtype, device, 0.5)
    w2 = randn((H + 1, d), g, dtype, device, 1.5 / math.sqrt(H + 1))
    b2 = randn((d,), g, dtype, device, 0.5)
    gaps = rand((L,), g, 0.05, 0.3, torch.float64)
    if case.repeat_time and L > 1:
        gaps[1] = 0.0
    times = torch.cumsum(gaps, 0).to(dtype=dtype, device=device)
    return p0, w1, b1, w2, b2, times


# Odd sizes, S and L = 0 and 1, H != d, every method and activation, a zero-length interval
FLOATER_CASES: Sequence[FloaterCase] = (
    FloaterCase(3, 5, 7, 6, 3, "rk4", "relu"),
    FloaterCase(2, 4, 4, 5, 2, "rk38", "tanh", repeat_time=True),
    FloaterCase(1, 3, 6, 7, 1, "midpoint", "gelu"),
    FloaterCase(4, 6, 3, 4, 4, "euler", "identity"),
    FloaterCase(3, 2, 5, 1, 5, "rk4", "gelu"),
    FloaterCase(2, 7, 9, 0, 3, "rk38", "relu"),
    FloaterCase(0, 4, 4, 3, 2, "rk4", "tanh"),
    FloaterCase(5, 1, 2, 6, 2, "rk38", "identity"),
)


# rotary: layouts, shared positions, GQA, rotary_dim < head_dim, N, B = 0, strided q, ...
@dataclass(frozen=True)
class RotaryCase:
    batch: int
    heads_q: int
    heads_k: int
    n: int
    head_dim: int
    rotary_dim: int
    pos_dim: int
    layout: str = "bhnd"
    shared_x: bool = False  # positions [N, M] shared by the batch
    fused_qkv: bool = False  # q, k, v as slices of one [..., heads, head_dim, 3] tensor
    pairs: str = "interleaved"  # the general op's options (the LightGlue members: defaults)
    per_head: bool = False  # frequencies [H, F/2, M]
    prefix: int = 0  # tokens left unrotated

    @property
    def id(self) -> str:
        s = (
            f"B{self.batch}-H{self.heads_q}.{self.heads_k}-N{self.n}-D{self.head_dim}"
            f"-F{self.rotary_dim}-M{self.pos_dim}-{self.layout}"
        )
        s += ("-shared" if self.shared_x else "") + ("-qkv" if self.fused_qkv else "")
        s += ("-half" if self.pairs == "half" else "") + ("-perhead" if self.per_head else "")
        return s + (f"-prefix{self.prefix}" if self.prefix else "")


ROTARY_CASES: Sequence[RotaryCase] = (
    RotaryCase(2, 4, 4, 37, 16, 16, 2, fused_qkv=True),  # LightGlue's self-attention
    RotaryCase(1, 3, 1, 19, 12, 8, 3, "bnhd"),
    RotaryCase(3, 2, 2, 5, 7, 4, 1, shared_x=True),
    RotaryCase(2, 1, 2, 1, 2, 2, 4, "bnhd", shared_x=True),
    RotaryCase(1, 2, 1, 70, 164, 160, 2),  # two tiles of positions, two of frequencies
    RotaryCase(2, 2, 2, 0, 8, 8, 2),
    RotaryCase(0, 2, 2, 4, 8, 8, 2, "bnhd"),
)
ROTARY_TABLE_SHAPES = [(2, 17, 2, 16), (5, 1, 4), (2, 3, 9, 4, 8), (0, 3, 6), (1, 70, 2, 160)]
# ``pf.rotary``: every family's options, token dropping, GQA, a strided q, nothing rotated
ROTARY_FAMILY_CASES: Sequence[RotaryCase] = (
    RotaryCase(2, 3, 3, 17, 16, 16, 2, shared_x=True, prefix=1),
    RotaryCase(2, 3, 3, 17, 16, 16, 2, shared_x=True, per_head=True, prefix=1),
    RotaryCase(2, 2, 2, 21, 16, 16, 2, "bnhd", shared_x=True, pairs="half", prefix=5),
    RotaryCase(1, 2, 2, 40, 24, 18, 3, pairs="half"),
    RotaryCase(2, 2, 2, 13, 8, 8, 2, pairs="half", per_head=True, prefix=1),
    RotaryCase(1, 4, 2, 9, 8, 6, 2, "bnhd", prefix=2),
    RotaryCase(2, 2, 2, 10, 8, 8, 2, fused_qkv=True, pairs="half", per_head=True),
    RotaryCase(2, 2, 2, 1, 8, 8, 2, prefix=1),
)
# (x shape, freqs shape, pairs) of the general table (``pf.rotary_table``).
ROTARY_FAMILY_TABLES = (((17, 2), (8, 2), "half"), ((2, 9, 3), (3, 4, 3), "interleaved"),
                        ((0, 2), (4, 2), "half"))  # fmt: skip


def _rotary_qk_shape(case: RotaryCase, heads: int) -> tuple:
    if case.layout == "bhnd":
        return (case.batch, heads, case.n, case.head_dim)
    return (case.batch, case.n, heads, case.head_dim)


def rotary_inputs(case: RotaryCase, dtype, device, seed: int):
    """(q, k, x, wr): q, k in ``dtype``; x and wr float64 for float64 q, else float32."""
    g = generator(seed)
    pdt = torch.float64 if dtype == torch.float64 else torch.float32
    if case.fused_qkv:
        # LightGlue's SelfBlock: qkv [B, N, heads, head_dim, 3], q = [..., 0] (stride 3)
        qkv = randn((case.batch, case.n, case.heads_q, case.head_dim, 3), g, dtype)
        qkv = qkv.to(device).transpose(1, 2)
        q, k = qkv[..., 0], qkv[..., 1]
    else:
        q = randn(_rotary_qk_shape(case, case.heads_q), g, dtype, device)
        k = randn(_rotary_qk_shape(case, case.heads_k), g, dtype, device)
    n = case.n - case.prefix
    x_shape = (n, case.pos_dim) if case.shared_x else (case.batch, n, case.pos_dim)
    x = randn(x_shape, g, pdt, device, 3.0)
    heads = (case.heads_q,) if case.per_head else ()
    wr = randn((*heads, case.rotary_dim // 2, case.pos_dim), g, pdt, device)
    return q, k, x, wr


def rotary_family_table_inputs(x_shape, freqs_shape, dtype, device, seed):
    """(x float32 (float64 for float64), freqs in ``dtype``) of the general table."""
    g = generator(seed)
    pdt = torch.float64 if dtype == torch.float64 else torch.float32
    return randn(x_shape, g, pdt, device, 3.0), randn(freqs_shape, g, dtype, device)


def rotary_table_inputs(shape, dtype, device, seed):
    """(x [..., N, M] float32 (float64 for float64), wr [F/2, M] in ``dtype``)."""
    g = generator(seed)
    pdt = torch.float64 if dtype == torch.float64 else torch.float32
    x = randn(shape[:-1], g, pdt, device, 3.0)
    wr = randn((shape[-1] // 2, shape[-2]), g, dtype, device)
    return x, wr
