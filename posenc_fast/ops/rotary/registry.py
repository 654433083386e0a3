"""Who implements the learnable Fourier rotary embeddings: backend name -> SUPPORT table
+ functions, for the two ops "lff_rotary" (the table) and "apply_lff_rotary" (q and k).

"lff_rotary":
    forward(x, wr, out_dtype) -> [2, *x.shape[:-1], F]: cos, then sin, each frequency on
        two neighbouring channels
    backward(grad, x, wr, need_x, need_wr) -> (dx, dwr), None where not needed
"apply_lff_rotary":
    forward(q, k, x, wr, layout) -> (q', k') in q's dtype, contiguous in the layout of q, k
    backward(gq, gk, q, k, x, wr, layout, needs) -> [dq, dk, dx, dwr], None where not needed
(the reference only ``forward``: autograd differentiates it).
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
    """q / k / table in float32 or half precision, positions and frequencies converted to
    float32 on load (float64 ones would lose their precision in the float32 phases: the
    torch backend takes those)."""
    return OpSupport(
        devices=devices,
        dtypes=HALF_AND_SINGLE,
        max_sizes=max_sizes,
        input_dtypes={"x": HALF_AND_SINGLE, "wr": HALF_AND_SINGLE},
    )


def _reference_table(x, wr, out_dtype):
    """The reference table without its broadcast heads axis, as the op returns it."""
    return reference.rotary_table(x, wr, out_dtype).squeeze(-3)


# The compiled kernels of the general rotary ops:
#   "rotary":       forward(q, k, x, freqs, pairs, layout, prefix) -> (q', k')
#                   backward(gq, gk, q, k, x, freqs, pairs, layout, prefix, needs)
#                       -> [dq, dk, dx, dfreqs], None where not needed
#   "rotary_table": forward(x, freqs, pairs, out_dtype) -> [2, ..., F]
#                   backward(grad, x, freqs, pairs, need_x, need_freqs) -> (dx, dfreqs)
# freqs [F/2, M] shared by the heads or [H, F/2, M] one per head, any strides. The
# LightGlue ops below are the case pairs="interleaved", prefix=0, shared freqs.


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


# The Triton launchers, imported on first use (triton is optional and slow to import).


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


# LightGlue's ops on the general kernels.


def _cpp_table(x, wr, out_dtype):
    return extension_ops("cpp").rotary_table_kernel(x, wr, "interleaved", out_dtype)


def _cpp_table_backward(grad, x, wr, need_x: bool, need_wr: bool):
    dx, dwr = extension_ops("cpp").rotary_table_kernel_backward(
        grad, x, wr, "interleaved", bool(need_x), bool(need_wr)
    )
    return (dx if need_x else None), (dwr if need_wr else None)


def _cpp_apply(q, k, x, wr, layout: str):
    return extension_ops("cpp").rotary_kernel(q, k, x, wr, "interleaved", str(layout), 0)


def _cpp_apply_backward(gq, gk, q, k, x, wr, layout: str, needs):
    needs = [bool(n) for n in needs]
    grads = extension_ops("cpp").rotary_kernel_backward(
        gq, gk, q, k, x, wr, "interleaved", str(layout), 0, needs
    )
    return [g if n else None for g, n in zip(grads, needs)]


def _triton_table(x, wr, out_dtype):
    from ...triton_kernels import rotary

    return rotary.rotary_table_fwd(x, wr, "interleaved", out_dtype)


def _triton_table_backward(grad, x, wr, need_x: bool, need_wr: bool):
    from ...triton_kernels import rotary

    return rotary.rotary_table_bwd(grad, x, wr, "interleaved", need_x, need_wr)


def _triton_apply(q, k, x, wr, layout: str):
    from ...triton_kernels import rotary

    return rotary.rotary_fwd(q, k, x, wr, "interleaved", layout, 0)


def _triton_apply_backward(gq, gk, q, k, x, wr, layout: str, needs):
    from ...triton_kernels import rotary

    return rotary.rotary_bwd(gq, gk, q, k, x, wr, "interleaved", layout, 0, needs)


_TRITON = _compiled(triton_devices(), {"pos_dim": 16})  # M unrolled in the kernels
_CPP = _compiled(("cpu",), {})

TABLE = register(
    "lff_rotary",
    Implementation("reference", ANYWHERE, _reference_table),
    Implementation("torch", ANYWHERE, torch_impl.table_forward, torch_impl.table_backward),
    Implementation("triton", _TRITON, _triton_table, _triton_table_backward),
    Implementation("cpp", _CPP, _cpp_table, _cpp_table_backward),
)
APPLY = register(
    "apply_lff_rotary",
    Implementation("reference", ANYWHERE, reference.apply_rotary),
    Implementation("torch", ANYWHERE, torch_impl.apply_forward, torch_impl.apply_backward),
    Implementation("triton", _TRITON, _triton_apply, _triton_apply_backward),
    Implementation("cpp", _CPP, _cpp_apply, _cpp_apply_backward),
)
