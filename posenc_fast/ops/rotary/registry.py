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
(the reference only ``forward``). Problem sizes: pos_dim, rotary_dim, prefix; options:
pairs, freqs ("shared" | "per_head"). The LightGlue members have registries of their own
holding the same implementations.
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


def _compiled(devices: tuple, max_sizes: dict) -> OpSupport:
    """float32 / half q, k, table, x and freqs (float64 x or freqs go to the torch backend:
    the kernels' float32 phases would lose their precision)."""
    return OpSupport(
        devices=devices,
        dtypes=HALF_AND_SINGLE,
        max_sizes=max_sizes,
        input_dtypes={"x": HALF_AND_SINGLE, "freqs": HALF_AND_SINGLE},
    )


# The C++ CPU kernels (csrc/rotary/).


def _cpp_rotary(q, k, x, freqs, pairs: str, layout: str, prefix: int):
    return extension_ops("cpp").rotary_kernel(q, k, x, freqs, str(pairs), str(layout), int(prefix))


def _cpp_rotary_backward(gq, gk, q, k, x, freqs, pairs: str, layout: str, prefix: int, needs):
    needs = [bool(n) for n in needs]
    grads = extension_ops("cpp").rotary_kernel_backward(
        gq, gk, q, k, x, freqs, str(pairs), str(layout), int(prefix), needs
    )
    return [g if n else None for g, n in zip(grads, needs)]


def _cpp_rotary_table(x, freqs, pairs: str, out_dtype):
    return extension_ops("cpp").rotary_table_kernel(x, freqs, str(pairs), out_dtype)


def _cpp_rotary_table_backward(grad, x, freqs, pairs: str, need_x: bool, need_freqs: bool):
    dx, dfreqs = extension_ops("cpp").rotary_table_kernel_backward(
        grad, x, freqs, str(pairs), bool(need_x), bool(need_freqs)
    )
    return (dx if need_x else None), (dfreqs if need_freqs else None)


# The Triton launchers (triton_kernels/rotary.py), imported on first use.


def _triton_rotary(q, k, x, freqs, pairs: str, layout: str, prefix: int):
    from ...triton_kernels import rotary

    return rotary.rotary_fwd(q, k, x, freqs, pairs, layout, prefix)


def _triton_rotary_backward(gq, gk, q, k, x, freqs, pairs: str, layout: str, prefix: int, needs):
    from ...triton_kernels import rotary

    return rotary.rotary_bwd(gq, gk, q, k, x, freqs, pairs, layout, prefix, needs)


def _triton_rotary_table(x, freqs, pairs: str, out_dtype):
    from ...triton_kernels import rotary

    return rotary.rotary_table_fwd(x, freqs, pairs, out_dtype)


def _triton_rotary_table_backward(grad, x, freqs, pairs: str, need_x: bool, need_freqs: bool):
    from ...triton_kernels import rotary

    return rotary.rotary_table_bwd(grad, x, freqs, pairs, need_x, need_freqs)


_TRITON = _compiled(triton_devices(), {"pos_dim": 16})  # M unrolled in the kernels
_CPP = _compiled(("cpu",), {})

ROTARY = register(
    "rotary",
    Implementation("reference", ANYWHERE, reference.rotary),
    Implementation("torch", ANYWHERE, torch_impl.forward, torch_impl.backward),
    Implementation("triton", _TRITON, _triton_rotary, _triton_rotary_backward),
    Implementation("cpp", _CPP, _cpp_rotary, _cpp_rotary_backward),
)
TABLE = register(
    "rotary_table",
    Implementation("reference", ANYWHERE, reference.rotary_table),
    Implementation("torch", ANYWHERE, torch_impl.table_forward, torch_impl.table_backward),
    Implementation("triton", _TRITON, _triton_rotary_table, _triton_rotary_table_backward),
    Implementation("cpp", _CPP, _cpp_rotary_table, _cpp_rotary_table_backward),
)

# LightGlue's members: the same implementations (the custom ops run them from ROTARY /
# TABLE by backend name), registered under their own op names.
LIGHTGLUE_ROTARY = register("apply_lff_rotary", *ROTARY.values())
LIGHTGLUE_TABLE = register("lff_rotary", *TABLE.values())
