"""Phases of an exported graph in float32 only: the kernels' error-free reduction in ATen.

While an ONNX exporter traces a model, every custom op runs its plain-ATen composition
(ops/_custom_ops.py). A float64 reduction (the torch backend's) would put float64 tensors
into the graph, which TensorRT and other float32-only runtimes cannot run, so by default the
compositions compute phases the way the Triton and C++ kernels do (triton_kernels/_phase.py,
csrc/cpu/phase.h: the same constants and steps), with ops every ONNX opset since 11 has:

1. Frequencies in *turns* (w / 2pi) as an unevaluated float32 pair ``hi + lo``
   (``turns_of``; constant frequencies are split on the host).
2. Each ``x * hi`` as ``p + e``, ``e`` its exact rounding error (Dekker's two-product on
   Veltkamp splits: ONNX has no fma), ``x * lo`` added to ``e``; the ``p`` summed with
   Knuth's two-sum.
3. The nearest quarter turn removed exactly from ``hi``, ``lo`` added (one rounding), the
   runtime's Cos / Sin of 2pi f (|2pi f| <= pi/4, where every runtime's float32 sine is
   accurate), rotated back by the quarter turns.

Rounding-order safety: a runtime that contracts a product and a sum into an fma computes
the same values (the Veltkamp split forms 4097 a as ``a * 4096 + a``, 4096 a being exact,
and never subtracts from a bare product; Dekker's partial products are exact). A runtime
that reassociates sums (fast-math) would undo the error terms and is not supported.

Accuracy: the float64 graph's bound (tolerances.PHASE_ATOL) for |phase| <= 1e5 rad
(tests/common/test_onnx.py). ``onnx_phases(torch.float64)`` selects the float64 reduction."""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from ._custom_ops import onnx_exporting
from ._torch_math import phase_turns, reduced_angle

# 1/(2 pi) = INV_2PI_HI + INV_2PI_LO, each float32: triton_kernels/_phase.py's constants.
INV_2PI_HI = 0.15915493667125702
INV_2PI_LO = 6.4206382432985265e-09
# 2 pi rounded to float32: the reduced angle's factor (|f| <= 1/8 turn, so its relative
# error of 2.8e-8 costs at most 2.2e-8 rad)
TWO_PI_F32 = float(np.float32(2.0 * math.pi))

_PHASES = {"dtype": torch.float32}


@contextlib.contextmanager
def onnx_phases(dtype: torch.dtype):
    """Within the block, ONNX exports reduce phases in ``dtype``: torch.float32 (the
    default: error-free float32 transformations, a graph without float64 tensors that
    float32-only runtimes such as TensorRT run) or torch.float64 (the torch backend's
    exact float64 reduction; the graph then holds float64 MatMul / Mul / Floor / Sub /
    Cast nodes). Example::

        with posenc_fast.onnx_phases(torch.float64):
            torch.onnx.export(model, args, dynamo=True)

    Process-wide while the block runs (an export traces in the calling thread)."""
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype!r}")
    before = _PHASES["dtype"]
    _PHASES["dtype"] = dtype
    try:
        yield
    finally:
        _PHASES["dtype"] = before


_NARROW = (torch.float32, torch.bfloat16, torch.float16)


def float32_graph(*tensors: Tensor) -> bool:
    """Whether an ONNX export is tracing and should compute the phases of ``tensors``
    (positions, frequencies) in float32: none of them is float64 (a float64 input makes
    the graph float64 anyway) and onnx_phases did not ask for float64."""
    if not onnx_exporting() or _PHASES["dtype"] != torch.float32:
        return False
    return all(t.dtype in _NARROW or not t.is_floating_point() for t in tensors)


# -- error-free transformations on float32 tensors ---------------------------------------


def split(a: Tensor) -> tuple[Tensor, Tensor]:
    """Veltkamp's split a = hi + lo, hi with at most 12 significant bits and lo with at
    most 12 (so a product of two parts is exact in float32). 4097 a is formed as
    a * 4096 + a: the same float32 number whether or not a runtime fuses it into an fma."""
    c = a * 4096.0 + a
    hi = c - (c - a)
    return hi, a - hi


def product_error(p: Tensor, a_split, b_split) -> Tensor:
    """a * b - p exactly, for p = fl(a * b) and the splits of a and b (Dekker's
    two-product): every partial product is exact, and so is every difference."""
    ah, al = a_split
    bh, bl = b_split
    return ((ah * bh - p) + ah * bl + al * bh) + al * bl


class Turns(NamedTuple):
    """Frequencies in turns per unit as float32 pairs hi + lo, with hi's split."""

    hi: Tensor
    lo: Tensor
    hi_hi: Tensor
    hi_lo: Tensor


def _split_host(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """split() in numpy float32 (the same operations, so the same parts)."""
    a = a.astype(np.float32)
    c = a * np.float32(4096.0) + a
    hi = c - (c - a)
    return hi, a - hi


_INV_SPLIT = tuple(float(v[0]) for v in _split_host(np.float32([INV_2PI_HI])))


def turns_of(w: Tensor) -> Turns:
    """w (radians per unit, float32, any shape) -> w / (2pi) as float32 pairs, to ~2^-48
    relative: triton_kernels/_phase.py's turns_hi_lo with the fma replaced by Dekker."""
    w = w.to(torch.float32)
    hi = w * INV_2PI_HI
    lo = product_error(hi, split(w), _INV_SPLIT) + w * INV_2PI_LO
    return Turns(hi, lo, *split(hi))


def constant_turns(turns, device) -> Turns:
    """Frequencies known on the host, in turns (K float64 values), as graph constants of
    shape [K, 1]: hi = the float32 rounding, lo = the float32 rounding of the rest (float64
    host math: the pair within ~2^-48 relative, as the Triton encodings' table)."""
    nu = np.asarray(turns, dtype=np.float64)
    hi = nu.astype(np.float32)
    lo = (nu - hi.astype(np.float64)).astype(np.float32)
    parts = (hi, lo, *_split_host(hi))
    return Turns(*(torch.tensor(p[:, None], dtype=torch.float32, device=device) for p in parts))


def product_turns(x: Tensor, t: Turns) -> tuple[Tensor, Tensor]:
    """x * (t.hi + t.lo) as (p, e): p = fl(x * t.hi) and e its exact rounding error plus
    x * t.lo (triton_kernels/_phase.py's phase_term), x broadcasting against t."""
    p = x * t.hi
    return p, product_error(p, split(x), (t.hi_hi, t.hi_lo)) + x * t.lo


def two_sum(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """(s, e) with s = fl(a + b) and s + e = a + b exactly (Knuth's branch-free form)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def sum_turns(p: Tensor, e: Tensor) -> tuple[Tensor, Tensor]:
    """The products of a phase's M coordinates, p and e [..., M] (product_turns), summed
    over the last axis as an unevaluated pair (hi, lo) in turns: the p with two-sum, so
    nothing is lost (triton_kernels/_phase.py's accumulate_phase)."""
    hi, lo = p.select(-1, 0), e.select(-1, 0)  # select: one Gather (unbind: Slice + Squeeze)
    for m in range(1, p.shape[-1]):
        hi, err = two_sum(hi, p.select(-1, m))
        lo = lo + (err + e.select(-1, m))
    return hi, lo


def sincos_turns(hi: Tensor, lo: Tensor) -> tuple[Tensor, Tensor]:
    """cos and sin of 2pi (hi + lo) in float32, as triton_kernels/_phase.py's sincos_turns
    (step 3 of the module docstring); the rotation by r quarter turns uses cos / sin of
    r pi/2 computed arithmetically: no comparisons or Where in the graph."""
    d = hi - torch.round(hi)  # exact, in [-1/2, 1/2] (ONNX Round: half to even)
    r = torch.round(d * 4.0)  # quarter turns, in {-2, ..., 2}; d * 4 is exact
    f = (d - r * 0.25) + lo  # d - r/4 is exact, so this is the only rounding
    angle = f * TWO_PI_F32
    c, s = torch.cos(angle), torch.sin(angle)
    a = torch.abs(r)
    cr, sr = 1.0 - a, r * (2.0 - a)  # cos(r pi/2), sin(r pi/2) for r in {-2, ..., 2}
    return c * cr - s * sr, s * cr + c * sr


# -- what the compositions call ----------------------------------------------------------


def rows_cos_sin(rows: Tensor, wr: Tensor) -> tuple[Tensor, Tensor]:
    """cos and sin of rows wr^T in float32: rows [R, M], wr [K, M] (radians per unit) ->
    two [R, K] tensors (LFF features, rotary tables)."""
    x = rows.to(torch.float32).unsqueeze(1)  # [R, 1, M]
    return sincos_turns(*sum_turns(*product_turns(x, turns_of(wr))))  # [R, K, M] products


def cos_sin_graph(rows: Tensor, wr: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin of rows wr^T in ``dtype`` (float32 or float64) for the compositions of
    ops/_custom_ops.py: float32 phases (rows_cos_sin) while an ONNX export traces a float32
    graph (float32_graph), else the torch backend's float64 reduction (a double
    backward, float64 weights, onnx_phases(torch.float64))."""
    if dtype == torch.float32 and float32_graph(rows, wr):
        return rows_cos_sin(rows, wr)
    angle = reduced_angle(phase_turns(rows, wr), dtype)
    return torch.cos(angle), torch.sin(angle)


def position_parts(positions: Tensor) -> list[Tensor]:
    """Positions as float32 parts summing to them exactly: a floating position is one part;
    an integer one is hi = its float32 rounding and lo = the (integer) rest, exact up to
    ~2^48 as in the Triton encodings."""
    if positions.is_floating_point():
        return [positions.to(torch.float32)]
    p = positions.to(torch.int64)
    hi = p.to(torch.float32)
    return [hi, (p - hi.to(torch.int64)).to(torch.float32)]


def positions_cos_sin(parts: list[Tensor], turns, device) -> tuple[Tensor, Tensor]:
    """cos and sin of positions times constant frequencies (``turns``, float64 values
    in turns per unit, [K]): parts of positions [...] (position_parts) -> two [..., K]."""
    t = constant_turns(turns, device)
    x = torch.stack(parts, dim=-1).unsqueeze(-2)  # [..., 1, parts]
    return sincos_turns(*sum_turns(*product_turns(x, t)))  # [..., K, parts] products
