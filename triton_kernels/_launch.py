"""What every launcher needs: interpreter detection, dtypes, device guard, grid sizes, and
autotuners pruned by the rules of _configs.py."""

from __future__ import annotations

import contextlib
from functools import cache

import torch
import triton
import triton.language as tl

from . import _configs, _env
from ._env import interpreter_enabled

# Decided once: Triton itself reads TRITON_INTERPRET when the kernels are defined.
INTERPRET = interpreter_enabled()

_TL_DTYPES = {
    torch.float32: tl.float32,
    torch.bfloat16: tl.bfloat16,
    torch.float16: tl.float16,
}


def tl_dtype(dtype: torch.dtype):
    return _TL_DTYPES[dtype]


def tf32_allowed() -> bool:
    """Whether torch's settings let float32 matmuls use TF32, as cuBLAS reads them:
    ``matmul.fp32_precision`` ("tf32" / "ieee") first (torch 2.9+ raises on reading
    ``allow_tf32`` once that is set), else ``matmul.allow_tf32``."""
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)
    if precision in ("tf32", "ieee"):
        return precision == "tf32"
    return bool(matmul.allow_tf32)


def dot_precision(compute_dtype: torch.dtype):
    """input_precision of tl.dot: float32 MLPs are IEEE-exact float32 unless the user's
    torch settings allow TF32 (``tf32_allowed``: the same switch torch.mm obeys); bf16 /
    fp16 operands use the tensor cores natively (the argument does not apply: None)."""
    if compute_dtype != torch.float32:
        return None
    return "tf32" if tf32_allowed() else "ieee"


def matmul_kind(compute_dtype: torch.dtype) -> str:
    """What runs a matmul of this compute dtype: "mma16" (bf16 / fp16 tensor cores),
    "tf32" (float32 on tensor cores, where allowed) or "ieee" (float32 FMA)."""
    if compute_dtype != torch.float32:
        return "mma16"
    return dot_precision(compute_dtype)


def device_guard(t: torch.Tensor):
    """Launch on the tensor's device (Triton launches on the current device's current
    stream, so a tensor on cuda:1 needs cuda:1 to be current)."""
    if t.device.type == "cuda":
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


@cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 2  # the interpreter: a couple of programs exercise the partial sums
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def device_name(device: torch.device) -> str:
    """The GPU's name as torch reports it ("NVIDIA H200"); "cpu (Triton interpreter)" for
    CPU tensors."""
    if device.type != "cuda":
        return "cpu (Triton interpreter)"
    return _device_name(device.index if device.index is not None else torch.cuda.current_device())


def capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is capturing a CUDA graph (nothing may synchronise
    or time then); False for CPU tensors."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def pow2(n: int, lo: int = 16, hi: int = 1 << 30) -> int:
    """next power of two >= n, clamped to [lo, hi] (tl.dot needs dimensions >= 16)."""
    return max(lo, min(hi, triton.next_power_of_2(max(1, int(n)))))


def rows_view(t: torch.Tensor, width: int, rows: int = -1) -> torch.Tensor:
    """t as a 2-D [rows, width] view whose last dimension has stride 1 (copies only when
    no such view exists). Kernels take the row stride, so batch strides are free. rows
    is inferred unless given (it must be given for width 0)."""
    r = t.reshape(rows, width)
    if r.stride(-1) != 1 and r.shape[-1] > 1:
        r = r.contiguous()
    return r


def interpreter_blocks(R: int, K: int, D: int | None = None) -> dict:
    """Block sizes under the interpreter, which pays per program and per loop iteration,
    not per element: few programs, large blocks. R rows, K frequencies, D output columns
    (BLOCK_D only for kernels that have one)."""
    blocks = {"BLOCK_R": pow2(R, 16, 64), "BLOCK_K": pow2(K, 16, 64)}
    if D is not None:
        blocks["BLOCK_D"] = pow2(D, 16, 128)
    return blocks


def time_ms(fn, device: torch.device, repeats: int = 3) -> float:
    """Median milliseconds of fn() on ``device`` (CUDA events; the host clock for CPU
    tensors), after one untimed call that compiles and autotunes. Synchronises: only
    for measured choices (posenc_fast/ops/lff/plan.py), never during graph capture."""
    import time

    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return sorted(times)[len(times) // 2]


def _tensor_device(values) -> torch.device:
    return next(v.device for v in values if isinstance(v, torch.Tensor))


class _Autotuned:
    """An autotuned kernel built on first use: some Triton versions (3.2) ask the GPU
    driver when an autotuner is created, which must not happen when the kernels are only
    imported (a machine without a GPU)."""

    def __init__(self, build):
        self._build = build
        self._tuner = None

    @property
    def tuner(self):
        if self._tuner is None:
            self._tuner = self._build()
        return self._tuner

    def __getitem__(self, grid):
        return self.tuner[grid]


def autotuned(kernel, name: str, configs: list, key: list, select=None) -> _Autotuned:
    """``kernel`` autotuned over ``configs`` on the GPU: only what _configs allows on the
    call's device (``name``: the kernel's name there) and ``select(configs, meta)`` keeps;
    a configuration whose compilation raises is dropped, not fatal. With
    POSENC_FAST_TRITON_AUTOTUNE=0 only the first allowed configuration is offered."""

    def early_prune(candidates, named_args, **kwargs):
        meta = {**named_args, **kwargs}
        if select is not None:
            candidates = select(candidates, meta)
        arch = _configs.device_arch(_tensor_device(named_args.values()))
        kept, why = _configs.prune(name, candidates, meta, arch)
        if not kept:
            raise RuntimeError(
                f"posenc_fast: no {name} configuration can be compiled for sm_{arch} with "
                f"Triton {triton.__version__}: " + "; ".join(why)
            )
        return kept if _env.autotune_enabled() else kept[:1]

    def build():
        tuner = triton.autotune(
            configs=configs, key=key, prune_configs_by={"early_config_prune": early_prune}
        )(kernel)
        return _configs.guard_autotuner(tuner, name)

    return _Autotuned(build)
