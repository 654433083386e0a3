"""Accurate phases and their cosine / sine in float32, shared by every kernel (how, and the
error budget: the comment below)."""

from __future__ import annotations

import triton
import triton.language as tl

# A phase ``x . w`` of 1e4 radians already carries ~5e-4 rad of rounding error in float32
# (docs/precision.md), so phases are never formed as one rounded float32 number. Instead:
#
# 1. Frequencies in *turns* (w / 2pi) as an unevaluated float32 pair ``hi + lo``
#    (``turns_hi_lo``).
# 2. ``x * hi`` split exactly into ``p + e`` (two-product through ``tl.fma``), ``x * lo``
#    added to ``e``; the ``p`` of the M coordinates summed with two-sum (``accumulate_phase``).
# 3. ``sincos_turns`` removes the nearest quarter turn from ``hi`` (exactly), adds ``lo``
#    (and its quarter turns, for huge phases), evaluates cos and sin of ``2 pi f`` for
#    |f| <= 1/8 turn by polynomials, then rotates by the quarter turns.
#
# Error budget against float64 math on the same float32 inputs, |phase| <= 1e5 rad: one
# rounding of the reduced argument (~5e-8 rad) plus ~1 ulp from the polynomials: ~2e-7
# (the tests check < 1e-6). Polynomials with ``tl.fma`` rather than ``tl.cos``/``tl.sin``:
# identical arithmetic in Triton's interpreter (CI) and on the GPU, no fast-math sin.approx.
#
# Kernels using these helpers must be launched with ``enable_fp_fusion=False``: a compiler
# contracting ``x * hi`` into a later addition would break the exact error terms (~1 ulp of
# the *unreduced* phase lost). The explicit ``tl.fma`` calls are unaffected.

# 1/(2 pi) = _INV_2PI_HI + _INV_2PI_LO, each float32 (the sum carries ~2^-48 relative error).
_INV_2PI_HI = tl.constexpr(0.15915493667125702)
_INV_2PI_LO = tl.constexpr(6.4206382432985265e-09)

# Taylor coefficients of sin(2 pi f) / f and cos(2 pi f) in f^2, rounded to float32; on
# |f| <= 1/8 the omitted terms are < 2e-9, far below float32's ulp.
_S1 = tl.constexpr(6.2831854820251465)
_S3 = tl.constexpr(-41.34170150756836)
_S5 = tl.constexpr(81.6052474975586)
_S7 = tl.constexpr(-76.70585632324219)
_S9 = tl.constexpr(42.058692932128906)
_C2 = tl.constexpr(-19.739208221435547)
_C4 = tl.constexpr(64.93939208984375)
_C6 = tl.constexpr(-85.45681762695312)
_C8 = tl.constexpr(60.2446403503418)
_C10 = tl.constexpr(-26.42625617980957)


@triton.jit
def two_sum(a, b):
    """(s, e) with s = fl(a + b) and s + e = a + b exactly (Knuth's branch-free form)."""
    s = a + b
    bb = s - a
    e = (a - (s - bb)) + (b - bb)
    return s, e


@triton.jit
def turns_hi_lo(w):
    """w radians per unit (float32) -> (hi, lo) with hi + lo = w / (2 pi) to ~2^-48."""
    hi = w * _INV_2PI_HI
    lo = tl.fma(w, _INV_2PI_HI, -hi) + w * _INV_2PI_LO
    return hi, lo


@triton.jit
def phase_term(x, t_hi, t_lo):
    """x * (t_hi + t_lo) as (p, e): p = fl(x * t_hi) and e its exact remainder + x * t_lo."""
    p = x * t_hi
    e = tl.fma(x, t_hi, -p) + x * t_lo
    return p, e


@triton.jit
def accumulate_phase(s_hi, s_lo, x, t_hi, t_lo):
    """(s_hi, s_lo) + x * (t_hi + t_lo), keeping the sum unevaluated and (almost) exact."""
    p, e = phase_term(x, t_hi, t_lo)
    s, err = two_sum(s_hi, p)
    return s, s_lo + (err + e)


@triton.jit
def sincos_turns(hi, lo):
    """cos(2 pi (hi + lo)) and sin(2 pi (hi + lo)) in float32 for an unevaluated sum of turns.

    The reduction is exact up to the one rounding of f for any hi (|lo| <= ulp(hi)); the
    accuracy of hi + lo itself is the caller's (phase_term: ~2^-48 relative, i.e.
    ~3.5e-15 * |phase| rad: negligible at 1e5, 4e-7 at 1e8, 4e-5 at 1e10). NaN / inf
    inputs give NaN, like cos / sin."""
    q = tl.floor(hi * 4.0 + 0.5)  # nearest quarter turn; hi * 4 is exact
    f = (hi - q * 0.25) + lo  # hi - q/4 is exact, so this is the only rounding
    # When |hi| >= 2^22 turns, lo itself can exceed 1/8 turn: take out its quarter turns
    # too (q2 = 0 otherwise). q mod 4 first, so the quadrant sum stays a small integer.
    q2 = tl.floor(f * 4.0 + 0.5)
    f = f - q2 * 0.25
    quad = (q - 4.0 * tl.floor(q * 0.25)) + q2
    quad = quad - 4.0 * tl.floor(quad * 0.25)  # (q + q2) mod 4 in {0, 1, 2, 3}
    f2 = f * f
    sp = tl.fma(f2, _S9, _S7)
    sp = tl.fma(f2, sp, _S5)
    sp = tl.fma(f2, sp, _S3)
    sp = tl.fma(f2, sp, _S1)
    s = f * sp
    cp = tl.fma(f2, _C10, _C8)
    cp = tl.fma(f2, cp, _C6)
    cp = tl.fma(f2, cp, _C4)
    cp = tl.fma(f2, cp, _C2)
    c = tl.fma(f2, cp, 1.0)
    # Rotate by quad quarter turns: (cos, sin) -> (-sin, cos) per quarter.
    odd = (quad == 1.0) | (quad == 3.0)
    cos_out = tl.where(odd, s, c)
    sin_out = tl.where(odd, c, s)
    cos_out = tl.where((quad == 1.0) | (quad == 2.0), -cos_out, cos_out)
    sin_out = tl.where(quad >= 2.0, -sin_out, sin_out)
    return cos_out, sin_out
