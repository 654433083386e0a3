"""Argument validation shared by every public op and module.

Every check raises with the argument's name and what was expected, so a bad call fails
at the API boundary with a readable message instead of deep inside a kernel.
TypeError: not a tensor, or a dtype of the wrong kind. ValueError: shapes, sizes, values."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
FLOAT_DTYPE_SET = frozenset(FLOAT_DTYPES)
NOT_POSITIONS = frozenset((torch.bool, torch.complex32, torch.complex64, torch.complex128))


def tensor(name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def real_positions(name: str, value) -> torch.Tensor:
    """Positions: any real floating or integer dtype (integers are converted later)."""
    if not isinstance(value, torch.Tensor) or value.dtype in NOT_POSITIONS:
        tensor(name, value)
        if value.dtype == torch.bool:
            raise TypeError(f"{name} must be a floating or integer tensor, got torch.bool")
        raise TypeError(
            f"{name} must be real (floating or integer), got complex dtype {value.dtype}"
        )
    return value


def float_tensor(name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype not in FLOAT_DTYPE_SET:
        tensor(name, value)
        raise TypeError(
            f"{name} must have a floating dtype (float16, bfloat16, float32 or float64), "
            f"got {value.dtype}"
        )
    return value


def float_dtype(name: str, value) -> torch.dtype:
    if not isinstance(value, torch.dtype) or value not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be a floating torch.dtype (float16, bfloat16, float32 or float64), "
            f"got {value!r}"
        )
    return value


def shape(
    name: str, value: torch.Tensor, expected: Sequence[Optional[int]], what: str = ""
) -> None:
    """Check rank and sizes; None in ``expected`` accepts any size."""
    sizes = value.shape
    if len(sizes) == len(expected):
        for e, n in zip(expected, sizes):
            if e is not None and e != n:
                break
        else:
            return
    spec = "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
    extra = f" ({what})" if what else ""
    raise ValueError(f"{name} must have shape {spec}{extra}, got {list(sizes)}")


def frequencies(name: str, value: torch.Tensor, M: int) -> None:
    """The frequency matrix of LFF and LFF rotary: [F/2, M] with at least one frequency."""
    shape(name, value, (None, M), "[F/2, M] with M = x.shape[-1]")
    if value.shape[0] == 0:
        raise ValueError(
            f"{name} must have shape [F/2, M] with F/2 >= 1 frequencies, got {list(value.shape)}"
        )


def same_device(
    reference_name: str, reference: torch.Tensor, **others: Optional[torch.Tensor]
) -> None:
    for name, t in others.items():
        if t is not None and t.device != reference.device:
            raise ValueError(
                f"{name} is on {t.device} but {reference_name} is on {reference.device}: "
                "all tensors must be on the same device"
            )


def same_dtype(
    reference_name: str, reference: torch.Tensor, **others: Optional[torch.Tensor]
) -> None:
    for name, t in others.items():
        if t is not None and t.dtype != reference.dtype:
            raise TypeError(
                f"{name} has dtype {t.dtype} but {reference_name} has {reference.dtype}: "
                "all weights must share one dtype"
            )


def positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def size(name: str, value, minimum: int = 1):
    """A size: an int >= ``minimum``, or a symbolic size (``torch.SymInt``: a dynamic
    dimension under torch.export or torch.compile(dynamic=True)). A symbolic size cannot
    be read; its bound is recorded as a constraint instead (checked when the exported or
    compiled program runs), so tracing does not specialise on its value."""
    if isinstance(value, torch.SymInt):
        torch._check(value >= minimum, lambda: f"{name} must be >= {minimum}, got {value}")
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        what = "positive" if minimum == 1 else f">= {minimum}"
        raise ValueError(f"{name} must be {what}, got {value}")
    return value


def even_positive_int(name: str, value) -> int:
    positive_int(name, value)
    if value % 2:
        raise ValueError(f"{name} must be even, got {value}")
    return value


def positive_float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"{name} must be a finite positive number, got {value}")
    return float(value)


def choice(name: str, value, allowed: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")
    return value


def finite_float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite, got {value}")
    return value
