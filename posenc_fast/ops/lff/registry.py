"""Who implements learnable Fourier features: backend name -> SUPPORT table + functions.

Every implementation has
    forward(x, wr, w1, b1, w2, b2, activation, out_dtype) -> y
        x [..., G, M] -> [..., G * Dg] (the features [..., G * F] without w1..b2)
    backward(grad, x, wr, w1, b1, w2, b2, activation, needs) -> [dx, dwr, dw1, db1, dw2, db2]
        None where not needed (or the weight is absent)
(the reference only ``forward``: autograd differentiates it)."""

from __future__ import annotations

from typing import Optional

import torch

from ..._dispatch import (
    ANYWHERE,
    HALF_AND_SINGLE,
    Implementation,
    OpSupport,
    extension_ops,
    register,
    triton_devices,
)
from . import plan, reference, torch_impl
from .activations import ACTIVATIONS


def _cpp_forward(x, wr, w1, b1, w2, b2, activation: str, out_dtype: torch.dtype):
    return extension_ops("cpp").lff_kernel(x, wr, w1, b1, w2, b2, str(activation), out_dtype)


def _cpp_backward(
    grad, x, wr, w1, b1, w2, b2, activation: str, needs
) -> list[Optional[torch.Tensor]]:
    needs = [bool(n) for n in needs]
    grads = extension_ops("cpp").lff_kernel_backward(
        grad, x, wr, w1, b1, w2, b2, str(activation), needs
    )
    refs = (x, wr, w1, b1, w2, b2)
    return [g if n and r is not None else None for g, n, r in zip(grads, needs, refs)]


LFF = register(
    "lff",
    Implementation("reference", ANYWHERE, reference.lff),
    Implementation(
        "torch", ANYWHERE, forward=torch_impl.lff_forward, backward=torch_impl.lff_backward
    ),
    # Two plans (plan.py chooses per shape): "fused" (one pass each way) or "gemm" (the
    # products on cuBLAS). The fused kernels' [rows, H] tiles live in registers: the size
    # limits; float64 goes to the torch backend.
    Implementation(
        "triton",
        OpSupport(
            devices=triton_devices(),
            dtypes=HALF_AND_SINGLE,
            max_sizes={
                "pos_dim": 16,
                "fourier_dim": 1024,
                "hidden_dim": 256,
                "group_out_dim": 1024,
            },
            options={"activation": ACTIVATIONS},
            input_dtypes={"x": HALF_AND_SINGLE},
        ),
        forward=plan.forward,
        backward=plan.backward,
    ),
    # float32 arithmetic throughout: float64 weights or positions go to the torch backend.
    Implementation(
        "cpp",
        OpSupport(
            devices=("cpu",),
            dtypes=HALF_AND_SINGLE,
            options={"activation": ACTIVATIONS},
            input_dtypes={"x": HALF_AND_SINGLE},
        ),
        forward=_cpp_forward,
        backward=_cpp_backward,
    ),
)
