"""Who implements the rotary ops: backend name -> SUPPORT table + functions.

"rotary" (``pf.rotary``):
    forward(q, k, x, freqs, pairs, layout, prefix) -> (q', k') in q's dtype, contiguous in
        the layout of q and k
    backward(gq, gk, q, k, x, freqs, pairs, layout, prefix, needs) -> [dq, dk, dx, dfreqs],
        None where not needed
"rotary_table" (``pf.rotary_table``):
    forward(x, freqs, pairs, out_dtype) -> [2, *x.shape[:-1], F] (shared freqs) or
        [2, *x.shape[:-2], H, N, F] (per head): cos, then sin
    backward(grad, x, freqs, pairs, need_x, need_freqs) -> (dx, dfreqs), None where not needed
(the reference only ``forward``: autograd differentiates it). A call's Problem carries
sizes pos_dim (M), rotary_dim (F), prefix (rotary only) and options pairs ("interleaved" |
"half") and freqs ("shared" | "per_head"), which SUPPORT tables may restrict.
"""

from __future__ import annotations

from ..._dispatch import (
    ANYWHERE,
    HALF_AND_SINGLE,
    Implementation,
    OpSupport,
    extension_ops,
    register,
    triton_devices,
)
from . import reference, torch_impl

ROTARY = register(
    "rotary",
    Implementation("reference", ANYWHERE, reference.rotary),
    Implementation("torch", ANYWHERE, torch_impl.forward, torch_impl.backward),
)
TABLE = register(
    "rotary_table",
    Implementation("reference", ANYWHERE, reference.rotary_table),
    Implementation("torch", ANYWHERE, torch_impl.table_forward, torch_impl.table_backward),
)

# -- where the compiled kernels plug in -------------------------------------------------
# The general kernels (triton_kernels/rotary.py and csrc/rotary/, with the signatures
# above) join ROTARY and TABLE as Implementation("triton", ...) and ("cpp", ...). Until
# they do, the LightGlue members (``apply_lff_rotary``, ``lff_rotary``: interleaved pairs,
# shared frequencies, no prefix) run the kernels written for them before the general op,
# declared below for exactly that subset. A backend the general registry has wins, so the
# LightGlue registries follow ROTARY and TABLE once the general kernels are registered
# (and these functions can go).


def _lightglue_only(devices: tuple, max_sizes: dict) -> OpSupport:
    """q / k / table in float32 or half precision, positions and frequencies converted to
    float32 on load (float64 ones would lose their precision in the float32 phases: the
    torch backend takes those); interleaved pairs, shared frequencies, no prefix."""
    return OpSupport(
        devices=devices,
        dtypes=HALF_AND_SINGLE,
        max_sizes={**max_sizes, "prefix": 0},
        options={"pairs": ("interleaved",), "freqs": ("shared",)},
        input_dtypes={"x": HALF_AND_SINGLE, "freqs": HALF_AND_SINGLE},
    )


def _cpp_lightglue(q, k, x, freqs, pairs: str, layout: str, prefix: int):
    return extension_ops("cpp").apply_lff_rotary_kernel(q, k, x, freqs, str(layout))


def _cpp_lightglue_backward(gq, gk, q, k, x, freqs, pairs: str, layout: str, prefix: int, needs):
    needs = [bool(n) for n in needs]
    grads = extension_ops("cpp").apply_lff_rotary_kernel_backward(
        gq, gk, q, k, x, freqs, str(layout), needs
    )
    return [g if n else None for g, n in zip(grads, needs)]


def _cpp_lightglue_table(x, freqs, pairs: str, out_dtype):
    return extension_ops("cpp").lff_rotary_kernel(x, freqs, out_dtype)


def _cpp_lightglue_table_backward(grad, x, freqs, pairs: str, need_x: bool, need_freqs: bool):
    dx, dfreqs = extension_ops("cpp").lff_rotary_kernel_backward(
        grad, x, freqs, bool(need_x), bool(need_freqs)
    )
    return (dx if need_x else None), (dfreqs if need_freqs else None)


# The Triton launchers, imported on first use (triton is optional and slow to import).


def _triton_lightglue(q, k, x, freqs, pairs: str, layout: str, prefix: int):
    from ...triton_kernels import rotary

    return rotary.rotary_apply_fwd(q, k, x, freqs, layout)


def _triton_lightglue_backward(gq, gk, q, k, x, freqs, pairs: str, layout: str, prefix: int, needs):
    from ...triton_kernels import rotary

    return rotary.rotary_apply_bwd(gq, gk, q, k, x, freqs, layout, needs)


def _triton_lightglue_table(x, freqs, pairs: str, out_dtype):
    from ...triton_kernels import rotary

    return rotary.rotary_table_fwd(x, freqs, out_dtype)


def _triton_lightglue_table_backward(grad, x, freqs, pairs: str, need_x: bool, need_freqs: bool):
    from ...triton_kernels import rotary

    return rotary.rotary_table_bwd(grad, x, freqs, need_x, need_freqs)


_TRITON = _lightglue_only(triton_devices(), {"pos_dim": 16})  # M unrolled in the kernels
_CPP = _lightglue_only(("cpu",), {})

LIGHTGLUE_ROTARY = register(
    "apply_lff_rotary",
    *{
        "triton": Implementation("triton", _TRITON, _triton_lightglue, _triton_lightglue_backward),
        "cpp": Implementation("cpp", _CPP, _cpp_lightglue, _cpp_lightglue_backward),
        **ROTARY,
    }.values(),
)
LIGHTGLUE_TABLE = register(
    "lff_rotary",
    *{
        "triton": Implementation(
            "triton", _TRITON, _triton_lightglue_table, _triton_lightglue_table_backward
        ),
        "cpp": Implementation("cpp", _CPP, _cpp_lightglue_table, _cpp_lightglue_table_backward),
        **TABLE,
    }.values(),
)

# What the custom ops run, by the backend name a call chose from either registry.
RUN_ROTARY = {**LIGHTGLUE_ROTARY, **ROTARY}
RUN_TABLE = {**LIGHTGLUE_TABLE, **TABLE}
