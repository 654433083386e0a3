"""Rounding float32 to the storage / compute dtype, identically on the GPU and in CI.

On the GPU ``x.to(tl.bfloat16)`` rounds to nearest even; Triton's interpreter (CI)
truncates and flushes subnormals, so there the rounding to bfloat16 is done here, on the
bits. float16 conversions are correctly rounded in both places."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """x (float32) rounded to DTYPE, to nearest even."""
    # (constexpr on the left of ==: a constexpr compares by value with anything)
    if INTERPRET and DTYPE == tl.bfloat16:  # noqa: SIM300
        bits = x.to(tl.uint32, bitcast=True)
        # Add just under half an ulp of bf16, plus one if the kept part is odd (ties to
        # even), then keep the 16 high bits. NaNs get their quiet bit set
        # so that truncation cannot turn them into infinities.
        bits = tl.where(x != x, bits | 0x400000, bits + 0x7FFF + ((bits >> 16) & 1))
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


@triton.jit
def load_as(ptrs, mask, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """Masked load (0 where masked) converted to DTYPE: a no-op when the memory already
    holds DTYPE, else via float32 with round-to-nearest-even (e.g. float32 weights under
    autocast feeding a bf16 matmul)."""
    x = tl.load(ptrs, mask=mask, other=0.0)
    if DTYPE == x.dtype:  # noqa: SIM300  (constexpr first, see round_to)
        return x
    else:
        return round_to(x.to(tl.float32), DTYPE, INTERPRET)
