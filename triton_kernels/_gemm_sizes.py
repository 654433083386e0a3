"""How many rows the LFF "gemm" plan (lff_gemm.py) processes per chunk: a fixed function
of the shapes and the dtype (part of the backward's summation order), kept free of the
triton import so that the plan's cost model (posenc_fast/ops/lff/plan.py) can use it
anywhere."""

from __future__ import annotations

# Buffers of one call (features, a / h, gh / ga, gr for one chunk of rows) stay below this:
# the chunk's row count follows (at least MIN_CHUNK rows); products stay large enough for
# cuBLAS to fill a large GPU (benchmarks/NOTES.md, "Kernel notes").
BUFFER_BYTES = 512 * 2**20
MIN_CHUNK = 256


def bytes_per_row(F2: int, H: int, itemsize: int, backward: bool, split: bool) -> int:
    """Buffer bytes per row of a chunk: the features (hi and lo with ``split``), a / h,
    and for the backward gh / ga and gr (and 8 columns beside h for db2)."""
    feats = (4 if split else 2) * F2
    if not backward:
        return (feats + H) * itemsize
    return (feats + (H + 8) // 8 * 8 + H + 2 * F2) * itemsize


def chunk_rows(R: int, F2: int, H: int, itemsize: int, backward: bool, split: bool) -> int:
    """Rows per chunk: a multiple of MIN_CHUNK within BUFFER_BYTES, at most R (>= 1)."""
    per_row = bytes_per_row(F2, H, itemsize, backward, split)
    rows = max(MIN_CHUNK, BUFFER_BYTES // per_row // MIN_CHUNK * MIN_CHUNK)
    return max(1, min(rows, R))
