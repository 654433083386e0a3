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

from ... import _dispatch
from ..._dispatch import ANYWHERE, HALF_AND_SINGLE, INTEGERS, Implementation, OpSupport, register
from . import reference, torch_impl

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
    return _dispatch.extension_ops("cpp").encoding_kernel(
        positions, int(dim), str(kind), float(base), _block(block), out_dtype
    )


def _cpp_add(x, positions, kind, base, block):
    return _dispatch.extension_ops("cpp").encoding_add_kernel(
        x, positions, str(kind), float(base), _block(block)
    )


def _cpp_backward(grad, positions, dim, kind, base):
    return _dispatch.extension_ops("cpp").encoding_kernel_backward(
        grad, positions, int(dim), str(kind), float(base)
    )


def _compiled(devices: tuple, positions: str) -> OpSupport:
    """The compiled kernels' table (Triton and C++ alike): float32 phases, so float64
    positions would lose their precision (the torch backend takes those)."""
    return OpSupport(
        devices=devices,
        dtypes=HALF_AND_SINGLE,
        options={"kind": _KINDS},
        input_dtypes={positions: HALF_AND_SINGLE + INTEGERS},
    )


_triton_add = _dispatch.lazy("triton_kernels.encodings", "encoding_add_fwd")

ENCODING = register(
    "encoding",
    Implementation(
        "reference",
        ANYWHERE,
        differentiable=True,
        forward=reference.encoding_forward,
        add=reference.encoding_add,
        inverse=reference.lattice_inverse,
    ),
    Implementation(
        "torch",
        ANYWHERE,
        forward=torch_impl.encoding_forward,
        add=torch_impl.encoding_add,
        backward=torch_impl.encoding_backward,
        inverse=torch_impl.lattice_inverse,
    ),
    Implementation(
        "triton",
        _compiled(_dispatch.triton_devices(), "positions"),
        forward=_dispatch.lazy("triton_kernels.encodings", "encoding_fwd"),
        add=_triton_add,
        backward=_dispatch.lazy("triton_kernels.encodings", "encoding_bwd"),
        inverse=torch_impl.lattice_inverse,
    ),
    Implementation(
        "cpp",
        _compiled(("cpu",), "positions"),
        forward=_cpp_forward,
        add=_cpp_add,
        backward=_cpp_backward,
        inverse=torch_impl.lattice_inverse,
    ),
)

ENCODING_ND = register(
    "encoding_nd",
    Implementation("reference", ANYWHERE, differentiable=True, nd_add=reference.encoding_nd_add),
    Implementation("torch", ANYWHERE, nd_add=per_axis(torch_impl.encoding_add)),
    Implementation(
        "triton", _compiled(_dispatch.triton_devices(), "coords"), nd_add=per_axis(_triton_add)
    ),
)
