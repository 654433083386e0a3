"""What the pure-PyTorch implementations share: accurate phases, row chunks and device
constants made once."""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterator

import torch

from ..tolerances import PHASE_ATOL
from ._custom_ops import onnx_exporting

TWO_PI = 2.0 * math.pi


# Temporaries of one chunk stay below this many bytes (FLOATER's precomputed stages; rows
# of LFF and the encodings: see row_chunk_bytes).
DEFAULT_CHUNK_BYTES = 64 * 2**20
# Replaces every chunk budget here when set (tests set it to a few kB: many chunks).
CHUNK_BYTES_OVERRIDE: int | None = None


def chunk_bytes() -> int:
    return CHUNK_BYTES_OVERRIDE or DEFAULT_CHUNK_BYTES


# Chunks of rows (LFF, encodings). On the CPU with one thread: small chunks whose
# temporaries stay in the caches. With more threads (and on GPUs): few large chunks, since
# every ATen op over a chunk is one parallel region, each of which waits for a core another
# process may hold (benchmarks/NOTES.md, "Kernel notes").
SERIAL_CHUNK_BYTES = 4 * 2**20
PARALLEL_CHUNK_BYTES = 256 * 2**20


def row_chunk_bytes(device_type: str) -> int:
    if CHUNK_BYTES_OVERRIDE:
        return CHUNK_BYTES_OVERRIDE
    if device_type == "cpu" and torch.get_num_threads() == 1:
        return SERIAL_CHUNK_BYTES
    return PARALLEL_CHUNK_BYTES


def row_chunks(n_rows: int, bytes_per_row: int, device_type: str = "cpu") -> Iterator[slice]:
    """Slices of at most row_chunk_bytes() / bytes_per_row rows covering range(n_rows)."""
    step = max(1, row_chunk_bytes(device_type) // max(1, bytes_per_row))
    for start in range(0, n_rows, step):
        yield slice(start, min(n_rows, start + step))


def feature_dtype(dtype: torch.dtype) -> torch.dtype:
    """Phases and trig run in float32 or better, never in half precision."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def reduced_angle(turns: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """2*pi * frac(turns) in ``dtype``: the angle reduced to (-2pi, 2pi).

    ``turns`` is float64, so for float32 results the reduction is error-free for |phase|
    up to ~1e12; the errors left are the angle's rounding to float32 (<= 2.4e-7 rad) and
    the float32 sine itself (docs/precision.md)."""
    if onnx_exporting():
        # The TorchScript-based ONNX exporter has no aten::frac; x - floor(x), in [0, 1),
        # is just as exact in float64 and the same angle modulo 2 pi (ops/_custom_ops.py).
        return (exact_scalar(TWO_PI, turns) * (turns - torch.floor(turns))).to(dtype)
    return (TWO_PI * torch.frac(turns)).to(dtype)


def exact_scalar(value: float, like: torch.Tensor):
    """``value`` for arithmetic with ``like``: the Python float itself, or while an ONNX
    export traces a 0-dim tensor of like's dtype: the dynamo exporter stores a Python float
    operand as a float32 constant, which would round 2 pi for float64 phases."""
    if onnx_exporting():
        return torch.tensor(value, dtype=like.dtype, device=like.device)
    return value


def reduced_angle_(turns: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``reduced_angle`` computed in place in ``turns``, which it overwrites (the same
    values; not for tensors autograd differentiates)."""
    torch.frac(turns, out=turns)
    return turns.mul_(TWO_PI).to(dtype)


# -- when float32 phases are accurate enough -----------------------------------------------
#
# The contract (docs/precision.md, tolerances.PHASE_ATOL): every cos/sin feature within 1e-6
# of float64 math on the same float32 inputs; the float64 path above meets it for any phase.
# A phase p_k = sum_m x_m wr_km in float32 (any order, fused or not) is within
#     gamma_M * sum_m |x_m| |wr_km|,   gamma_M = M u / (1 - M u),  u = 2^-24
# of the exact phase (Higham, "Accuracy and Stability of Numerical Algorithms", Eq. 3.5).
# sin and cos are 1-Lipschitz and the float32 sin/cos add at most TRIG_ERR (SLEEF's 1.0-ulp
# CPU functions, CUDA's sinf/cosf within 2 ulp, plus margin). With
#     B = max_k sum_m |wr_km| * max_r |x_rm|  >=  every row's sum_m |x_m| |wr_km|,
# float32 phases keep the contract when gamma_M * B + TRIG_ERR <= PHASE_ATOL: B <= 12.7 for
# M = 1, 6.4 for M = 2, 4.2 for M = 3. A NaN or inf makes B non-finite, which never passes,
# so non-finite inputs take the float64 path.

U32 = 2.0**-24
TRIG_ERR = 4 * U32


def float32_phase_limit(M: int) -> float:
    """The largest bound B (see above) for which float32 phases of M coordinates keep every
    feature within PHASE_ATOL of float64 math."""
    gamma = M * U32 / (1 - M * U32)
    return (PHASE_ATOL - TRIG_ERR) / gamma


def phase_bound(rows: torch.Tensor, wr: torch.Tensor) -> float:
    """B = max_k sum_m |wr_km| max_r |rows_rm| (float64): bounds |phase| and its terms."""
    xmax = torch.linalg.vector_norm(rows, float("inf"), dim=0, dtype=torch.float64)  # [M]
    return float((wr.abs().to(torch.float64) @ xmax).max()) if rows.shape[0] else 0.0


def float32_phases_suffice(rows: torch.Tensor, wr: torch.Tensor) -> bool:
    """Whether phases of ``rows`` [R, M] and ``wr`` [K, M] computed in float32 keep every
    cos/sin within PHASE_ATOL of float64 math: both float32 or narrower (their values are
    then exact in float32) and B <= float32_phase_limit(M)."""
    narrow = (torch.float32, torch.bfloat16, torch.float16)
    if rows.dtype not in narrow or wr.dtype not in narrow:
        return False
    return phase_bound(rows, wr) <= float32_phase_limit(rows.shape[1])


def phase_turns(rows: torch.Tensor, freq: torch.Tensor) -> torch.Tensor:
    """(rows @ freq^T) / (2 pi) in float64: [R, M] x [K, M] -> [R, K].

    The product of two float32 numbers is exact in float64, so for M = 1 this is exact
    and for small M it carries only float64 rounding (~1e-16 relative)."""
    freq = freq.to(torch.float64)
    return rows.to(torch.float64) @ (freq / exact_scalar(TWO_PI, freq)).T


# Constant tensors (frequencies, Runge-Kutta tableaux, the DFT basis) per device, made once.
# Small, but bounded all the same: the oldest entry goes when the table is full.
_DEVICE_CONSTANTS: dict = {}
_MAX_DEVICE_CONSTANTS = 256


def device_constant(
    key: Hashable, make: Callable[[torch.device], torch.Tensor], device
) -> torch.Tensor:
    """``make(device)`` made once per (key, device) and kept (a host-to-GPU copy waits).
    Shared: callers must never modify it in place. Made outside inference mode, so that
    autograd may save it later."""
    device = torch.device(device)
    full_key = (key, device)
    t = _DEVICE_CONSTANTS.get(full_key)
    if t is None:
        with torch.inference_mode(False):
            t = make(device)
        if type(t) is not torch.Tensor:
            # Made while a tracer runs (torch.export / ONNX export trace with fake tensors):
            # a graph constant, not a tensor later eager calls may use. Never kept.
            return t
        if len(_DEVICE_CONSTANTS) >= _MAX_DEVICE_CONSTANTS:
            del _DEVICE_CONSTANTS[next(iter(_DEVICE_CONSTANTS))]
        _DEVICE_CONSTANTS[full_key] = t
    return t
