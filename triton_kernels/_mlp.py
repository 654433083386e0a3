"""Matmul and activation helpers of the fused LFF MLP (forward and backward kernels).

Activations are evaluated in float32 on the float32 accumulators, whatever the MLP's
compute dtype; only their results are rounded to it before the next tensor-core matmul."""

from __future__ import annotations

import triton
import triton.language as tl

_INV_SQRT_2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_GELU_TANH_C = tl.constexpr(0.044715)
_GELU_TANH_3C = tl.constexpr(3.0 * 0.044715)


# Module-level constants are tl.constexpr; in the kernels they always stand to the right
# of a tensor (tensor * CONST): under the interpreter, CONST * tensor wraps the tensor in a
# constexpr and breaks the next tl.* call.


@triton.jit
def mma(a, b, acc, PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """acc + a @ b with float32 accumulation.

    PRECISION: "ieee" (float32 operands, exact float32 products) or "tf32" (only when
    torch allows TF32); bf16 / fp16 operands run on the tensor cores either way. The
    interpreter would multiply the raw bits of bfloat16 operands, so there they are
    widened to float32 first (exact, keeping their rounding to the compute dtype)."""
    if INTERPRET:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _tanh(u):
    # 1 - 2 / (exp(2u) + 1): saturates cleanly to +-1 (exp overflows to inf or to 0);
    # absolute error ~1e-7 near 0, which is what gelu_tanh needs (it multiplies by a).
    return 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)


@triton.jit
def activation(a, ACT: tl.constexpr):
    """act(a) for ACT in "gelu" (erf form), "gelu_tanh", "relu"; act(0) = 0 for all three,
    which keeps the zero-padded hidden columns zero."""
    if ACT == "gelu":
        return 0.5 * a * (1.0 + tl.erf(a * _INV_SQRT_2))
    elif ACT == "gelu_tanh":
        return 0.5 * a * (1.0 + _tanh((a + a * a * a * _GELU_TANH_C) * _SQRT_2_OVER_PI))
    else:
        return tl.maximum(a, 0.0)


@triton.jit
def activation_grad(a, ACT: tl.constexpr):
    """d act(a) / da, elementwise (the formulas of ATen's gelu_backward / threshold_backward,
    which the aten_backward entries of posenc_fast/ops/lff/activations.py call)."""
    if ACT == "gelu":
        cdf = 0.5 * (1.0 + tl.erf(a * _INV_SQRT_2))
        pdf = tl.exp(-0.5 * a * a) * _INV_SQRT_2PI
        return cdf + a * pdf
    elif ACT == "gelu_tanh":
        t = _tanh((a + a * a * a * _GELU_TANH_C) * _SQRT_2_OVER_PI)
        dinner = (1.0 + a * a * _GELU_TANH_3C) * _SQRT_2_OVER_PI
        return 0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * dinner
    else:
        return tl.where(a > 0.0, 1.0, 0.0)
