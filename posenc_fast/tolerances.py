"""How close every backend must be to the float64 reference, per dtype and kind of output:
the one place. An output passes when, elementwise, |out - ref| <= atol + rtol * |ref|, where
``ref`` is the float64 reference evaluated on the same inputs (already rounded to their
dtype)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tol:
    atol: float
    rtol: float


def _half_precision(dtype: torch.dtype, lff_and_floater: Tol, grad: Tol) -> dict[str, Tol]:
    """The kinds in bfloat16 / float16: cos / sin outputs ("encoding", "rotary") within one
    rounding to the dtype (half its eps: 2**-8 in bfloat16, 2**-11 in float16) plus 1e-6;
    "lff" and "floater" share one tolerance in each."""
    rounding = Tol(1e-6, torch.finfo(dtype).eps / 2)
    return {
        "encoding": rounding,
        "lff": lff_and_floater,
        "floater": lff_and_floater,
        "grad": grad,
        "rotary": rounding,
    }


# The kinds of output:
# - "encoding": sines and cosines of a phase (sinusoidal, DFT, LFF features): within 1e-6
#   of float64 math for |phase| <= 1e5 in float32, about one ulp in bf16 / fp16.
# - "lff": LFF with its MLP (half precision: features and hidden layer rounded to the dtype
#   before the tensor-core matmuls).
# - "floater": ODE solutions after hundreds of solver steps (error accumulates along them).
# - "grad": gradients, compared relative to the largest finite gradient entry of the
#   reference (``mismatch`` does this unless it is given another ``scale``).
# - "rotary": q and k rotated by the cos / sin of a phase, compared relative to the largest
#   |entry| of the reference (pass it as ``scale``: an output near 0 carries the error of
#   the larger inputs). float32: "encoding"'s error times |q| plus two products and a sum;
#   half precision: the output's own rounding.
TOLERANCES: dict[torch.dtype, dict[str, Tol]] = {
    torch.float64: {
        # the float64 reference itself rounds p * freq: ~1e-16 * |phase|, 1e-11 at 1e5
        "encoding": Tol(1e-10, 1e-12),
        "lff": Tol(1e-10, 1e-10),
        "floater": Tol(1e-9, 1e-9),
        "grad": Tol(1e-9, 1e-9),
        "rotary": Tol(1e-10, 1e-12),
    },
    torch.float32: {
        "encoding": Tol(1e-6, 0.0),
        "lff": Tol(2e-5, 2e-5),
        "floater": Tol(5e-5, 5e-5),
        "grad": Tol(5e-5, 5e-5),
        "rotary": Tol(1e-7, 1e-6),
    },
    torch.bfloat16: _half_precision(
        torch.bfloat16, lff_and_floater=Tol(4e-2, 3e-2), grad=Tol(5e-2, 5e-2)
    ),
    torch.float16: _half_precision(
        torch.float16, lff_and_floater=Tol(5e-3, 5e-3), grad=Tol(1e-2, 1e-2)
    ),
}

# Phase-dependent outputs vs float64 math on the same fp32 inputs, |phase| <= 1e5.
PHASE_ATOL = 1e-6

# ONNX graphs exported with float32 phases (the default: ops/_export_phases.py), run in a
# runtime, vs float64 math on the same float32 inputs: cos / sin outputs within
# ONNX_PHASE_ATOL for |phase| up to ONNX_MAX_PHASE and integer positions below 2**24
# (measured figures: benchmarks/NOTES.md, "Kernel notes").
ONNX_PHASE_ATOL = 1e-6
ONNX_MAX_PHASE = 1e6


def tol(dtype: torch.dtype, kind: str) -> Tol:
    return TOLERANCES[dtype][kind]


def mismatch(
    out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, kind: str, scale=None
) -> str:
    """'' if ``out`` is within tolerance of ``ref``, else a report of the worst element.

    ``scale`` replaces |ref| in the relative term by one number. For ``kind == "grad"`` it
    defaults to the largest |ref| over the finite entries of ``ref`` (0 if there are none),
    so an inf in the reference cannot widen the bound to inf.
    NaNs must sit at the same places in both."""
    t = tol(dtype, kind)
    if out.shape != ref.shape:
        return f"shape {list(out.shape)} != reference {list(ref.shape)}"
    o = out.detach().to(torch.float64).cpu()
    r = ref.detach().to(torch.float64).cpu()
    if o.numel() == 0:
        return ""
    nan_o, nan_r = torch.isnan(o), torch.isnan(r)
    if not torch.equal(nan_o, nan_r):
        return (
            f"NaN pattern differs: {int(nan_o.sum())} NaNs in output, "
            f"{int(nan_r.sum())} in reference"
        )
    o = torch.where(nan_r, 0.0, o)
    r = torch.where(nan_r, 0.0, r)
    if scale is None and kind == "grad":
        finite = r[torch.isfinite(r)]
        scale = finite.abs().max().item() if finite.numel() else 0.0
    rel_base = r.abs() if scale is None else torch.full_like(r, float(scale))
    allowed = t.atol + t.rtol * rel_base
    err = (o - r).abs()
    bad = err > allowed
    if not bad.any():
        return ""
    worst = int(torch.argmax((err - allowed).flatten()))
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), r.shape))
    return (
        f"{int(bad.sum())}/{r.numel()} elements ({100.0 * bad.float().mean():.2f}%) exceed "
        f"atol={t.atol:g} + rtol={t.rtol:g}*|ref| ({kind}, {dtype}); worst at index {idx}: "
        f"out={o.flatten()[worst]:.9g} ref={r.flatten()[worst]:.9g} err={err.flatten()[worst]:.3g} "
        f"allowed={allowed.flatten()[worst]:.3g}; max err {err.max():.3g}"
    )


def assert_close(out, ref, dtype, kind: str, scale=None, what: str = "") -> None:
    msg = mismatch(out, ref, dtype, kind, scale)
    if msg:
        raise AssertionError(f"{what}: {msg}" if what else msg)
