"""Who implements the fixed encodings: backend name -> SUPPORT table + functions.

"encoding" (kind "sinusoidal" | "dft"), every implementation has
    forward(positions, dim, kind, base, block, out_dtype) -> [*P, dim]
    add(x, positions, kind, base, block) -> x + pe   (positions broadcast to x.shape[:-1])
    backward(grad, positions, dim, kind, base) -> d positions
    inverse(encoding) -> the inverse DFT over the lattice (dft_inverse)
(the reference no backward: autograd differentiates it).
"encoding_nd" (the Sine-nD add of SinusoidalNdPE):
    nd_add(x [..., M * n], coords [..., M], kind, base) -> x + pe_nd
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
_INTEGERS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_KINDS = ("sinusoidal", "dft")


def per_axis(add):
    """The Sine-nD add from a 1-D fused add: x [..., M * n] viewed as [..., M, n], axis m's
    columns getting the encoding of coords[..., m] (one read of x, one write)."""

    def nd_add(x, coords, kind: str, base: float):
        axes = coords.shape[-1]
        x_axes = x.unflatten(-1, (axes, x.shape[-1] // axes))
        return add(x_axes, coords, kind, base, None).flatten(-2)

    return nd_add


def _block(block):
    return None if block is None else float(block)


def _cpp_forward(positions, dim, kind, base, block, out_dtype):
    return extension_ops("cpp").encoding_kernel(
        positions, int(dim), str(kind), float(base), _block(block), out_dtype
    )


def _cpp_add(x, positions, kind, base, block):
    return extension_ops("cpp").encoding_add_kernel(
        x, positions, str(kind), float(base), _block(block)
    )


def _cpp_backward(grad, positions, dim, kind, base):
    return extension_ops("cpp").encoding_kernel_backward(
        grad, positions, int(dim), str(kind), float(base)
    )


def _triton_support(positions: str) -> OpSupport:
    return OpSupport(
        devices=triton_devices(),
        dtypes=_HALF_AND_SINGLE,
        options={"kind": _KINDS},
        input_dtypes={positions: _HALF_AND_SINGLE + _INTEGERS},
    )


_triton_add = lazy("triton_kernels.encodings", "encoding_add_fwd")

ENCODING = register(
    "encoding",
    Implementation(
        "reference",
        OpSupport(devices=ANY, dtypes=_FLOATS),
        differentiable=True,
        forward=reference.encoding_forward,
        add=reference.encoding_add,
        inverse=reference.lattice_inverse,
    ),
    Implementation(
        "torch",
        OpSupport(devices=ANY, dtypes=_FLOATS),
        forward=torch_impl.encoding_forward,
        add=torch_impl.encoding_add,
        backward=torch_impl.encoding_backward,
        inverse=torch_impl.lattice_inverse,
    ),
    Implementation(
        "triton",
        _triton_support("positions"),
        forward=lazy("triton_kernels.encodings", "encoding_fwd"),
        add=_triton_add,
        backward=lazy("triton_kernels.encodings", "encoding_bwd"),
        inverse=torch_impl.lattice_inverse,
    ),
    Implementation(
        "cpp",
        OpSupport(
            devices=("cpu",),
            dtypes=_HALF_AND_SINGLE,
            options={"kind": _KINDS},
            input_dtypes={"positions": _HALF_AND_SINGLE + _INTEGERS},
        ),
        forward=_cpp_forward,
        add=_cpp_add,
        backward=_cpp_backward,
        inverse=torch_impl.lattice_inverse,
    ),
)

ENCODING_ND = register(
    "encoding_nd",
    Implementation(
        "reference",
        OpSupport(devices=ANY, dtypes=_FLOATS),
        differentiable=True,
        nd_add=reference.encoding_nd_add,
    ),
    Implementation(
        "torch", OpSupport(devices=ANY, dtypes=_FLOATS), nd_add=per_axis(torch_impl.encoding_add)
    ),
    Implementation("triton", _triton_support("coords"), nd_add=per_axis(_triton_add)),
)
