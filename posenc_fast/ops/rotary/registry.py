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

import torch

from ..._dispatch import (
    ANY,
    Implementation,
    OpSupport,
    extension_ops,
    lazy,
    register,
    triton_devices,
)
from . import reference, torch_impl

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_HALF_AND_SINGLE = (torch.float32, torch.bfloat16, torch.float16)
_ANYWHERE = OpSupport(devices=ANY, dtypes=_FLOATS)


def _compiled(devices: tuple, max_sizes: dict) -> OpSupport:
    """q / k / table in float32 or half precision, positions and frequencies converted to
    float32 on load (float64 ones would lose their precision in the float32 phases: the
    torch backend takes those)."""
    return OpSupport(
        devices=devices,
        dtypes=_HALF_AND_SINGLE,
        max_sizes=max_sizes,
        input_dtypes={"x": _HALF_AND_SINGLE, "wr": _HALF_AND_SINGLE},
    )


def _reference_table(x, wr, out_dtype):
    """The reference table without its broadcast heads axis, as the op returns it."""
    return reference.rotary_table(x, wr, out_dtype).squeeze(-3)


def _cpp_table_backward(grad, x, wr, need_x: bool, need_wr: bool):
    dx, dwr = extension_ops("cpp").lff_rotary_kernel_backward(
        grad, x, wr, bool(need_x), bool(need_wr)
    )
    return (dx if need_x else None), (dwr if need_wr else None)


def _cpp_apply(q, k, x, wr, layout: str):
    oq, ok = extension_ops("cpp").apply_lff_rotary_kernel(q, k, x, wr, str(layout))
    return oq, ok


def _cpp_apply_backward(gq, gk, q, k, x, wr, layout: str, needs):
    needs = [bool(n) for n in needs]
    grads = extension_ops("cpp").apply_lff_rotary_kernel_backward(
        gq, gk, q, k, x, wr, str(layout), needs
    )
    return [g if n else None for g, n in zip(grads, needs)]


def _cpp_table(x, wr, out_dtype):
    return extension_ops("cpp").lff_rotary_kernel(x, wr, out_dtype)


_TRITON = _compiled(triton_devices(), {"pos_dim": 16})  # M unrolled in the kernels
_CPP = _compiled(("cpu",), {})

TABLE = register(
    "lff_rotary",
    Implementation("reference", _ANYWHERE, differentiable=True, forward=_reference_table),
    Implementation(
        "torch", _ANYWHERE, forward=torch_impl.table_forward, backward=torch_impl.table_backward
    ),
    Implementation(
        "triton",
        _TRITON,
        forward=lazy("triton_kernels.rotary", "rotary_table_fwd"),
        backward=lazy("triton_kernels.rotary", "rotary_table_bwd"),
    ),
    Implementation("cpp", _CPP, forward=_cpp_table, backward=_cpp_table_backward),
)

APPLY = register(
    "apply_lff_rotary",
    Implementation("reference", _ANYWHERE, differentiable=True, forward=reference.apply_rotary),
    Implementation(
        "torch", _ANYWHERE, forward=torch_impl.apply_forward, backward=torch_impl.apply_backward
    ),
    Implementation(
        "triton",
        _TRITON,
        forward=lazy("triton_kernels.rotary", "rotary_apply_fwd"),
        backward=lazy("triton_kernels.rotary", "rotary_apply_bwd"),
    ),
    Implementation("cpp", _CPP, forward=_cpp_apply, backward=_cpp_apply_backward),
)
