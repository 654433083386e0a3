"""Who implements the fixed encodings: backend name -> SUPPORT table + functions.

"encoding" (kind "sinusoidal" | "dft"):
    forward(positions, dim, kind, base, block, out_dtype) -> [*P, dim]
    backward(grad, positions, dim, kind, base) -> d positions
"encoding_add" (the fused add of SinusoidalPE and DFTPE):
    forward(x, positions, kind, base, block) -> x + pe  (positions broadcast to x.shape[:-1])
"encoding_nd" (the Sine-nD add of SinusoidalNdPE):
    forward(x [..., M * n], coords [..., M], kind, base) -> x + pe_nd
The adds' backward is the encoding's (the op's backward sums the gradient over the
broadcast dimensions first); the reference has none: autograd differentiates it."""

from __future__ import annotations

from ..._dispatch import (
    ANYWHERE,
    HALF_AND_SINGLE,
    INTEGERS,
    Implementation,
    OpSupport,
    extension_ops,
    register,
    triton_devices,
)
from . import reference, torch_impl

_KINDS = ("sinusoidal", "dft")


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


# The Triton launchers, imported on first use (triton is optional and slow to import).


def _triton_forward(positions, dim, kind, base, block, out_dtype):
    from ...triton_kernels import encodings

    return encodings.encoding_fwd(positions, kind, base, block, out_dtype, dim=dim)


def _triton_add(x, positions, kind, base, block):
    from ...triton_kernels import encodings

    return encodings.encoding_fwd(positions, kind, base, block, x=x)


def _triton_backward(grad, positions, dim, kind, base):
    from ...triton_kernels import encodings

    return encodings.encoding_bwd(grad, positions, dim, kind, base)


def _triton_nd_add(x, coords, kind: str, base: float):
    from ...triton_kernels import encodings

    x_axes = x.unflatten(-1, (coords.shape[-1], x.shape[-1] // coords.shape[-1]))
    return encodings.encoding_fwd(coords, kind, base, None, x=x_axes).flatten(-2)


def _torch_nd_add(x, coords, kind: str, base: float):
    """The Sine-nD add from the 1-D fused add: x [..., M * n] viewed as [..., M, n], axis
    m's columns getting the encoding of coords[..., m] (one read of x, one write)."""
    x_axes = x.unflatten(-1, (coords.shape[-1], x.shape[-1] // coords.shape[-1]))
    return torch_impl.encoding_add(x_axes, coords, kind, base, None).flatten(-2)


def _compiled(devices: tuple, positions: str) -> OpSupport:
    """The compiled kernels' table (Triton and C++ alike): float32 phases, so float64
    positions would lose their precision (the torch backend takes those)."""
    return OpSupport(
        devices=devices,
        dtypes=HALF_AND_SINGLE,
        options={"kind": _KINDS},
        input_dtypes={positions: HALF_AND_SINGLE + INTEGERS},
    )


_TRITON = _compiled(triton_devices(), "positions")
_CPP = _compiled(("cpu",), "positions")

ENCODING = register(
    "encoding",
    Implementation("reference", ANYWHERE, reference.encoding_forward),
    Implementation("torch", ANYWHERE, torch_impl.encoding_forward, torch_impl.encoding_backward),
    Implementation("triton", _TRITON, _triton_forward, _triton_backward),
    Implementation("cpp", _CPP, _cpp_forward, _cpp_backward),
)
ENCODING_ADD = register(
    "encoding_add",
    Implementation("reference", ANYWHERE, reference.encoding_add),
    Implementation("torch", ANYWHERE, torch_impl.encoding_add, torch_impl.encoding_backward),
    Implementation("triton", _TRITON, _triton_add, _triton_backward),
    Implementation("cpp", _CPP, _cpp_add, _cpp_backward),
)
ENCODING_ND = register(
    "encoding_nd",
    Implementation("reference", ANYWHERE, reference.encoding_nd_add),
    Implementation("torch", ANYWHERE, _torch_nd_add, torch_impl.encoding_backward),
    Implementation(
        "triton", _compiled(triton_devices(), "coords"), _triton_nd_add, _triton_backward
    ),
)
