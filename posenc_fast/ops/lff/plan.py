"""Which plan runs a call of the Triton LFF backend: ``fused`` (one Triton kernel per pass;
memory-bound shapes, small inputs) or ``gemm`` (cuBLAS products chunked over rows, Triton
for features, activation and phase chain rule: triton_kernels/lff_gemm.py; compute-bound).

POSENC_FAST_LFF_PLAN=auto|fused|gemm|measure (default auto): ``auto`` takes the plan the
cost model (``predict``) says is faster; ``measure`` also times both on a shape bucket's
first call (never during CUDA graph capture) and remembers the faster per GPU and torch /
Triton version in <POSENC_FAST_CACHE>/lff_plans.json. Decisions are logged once per bucket
at DEBUG; ``info`` and benchmarks/lff_predict.py print them. No tensor data is read, no
synchronisation (but the opt-in measurement). Model: benchmarks/NOTES.md (LFF on the GPU)."""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

PLANS = ("fused", "gemm")
ENV_PLAN = "POSENC_FAST_LFF_PLAN"
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ceilings:
    """Achievable rates of one GPU (copy: bytes read + written), and their source."""

    gpu: str
    copy_GBps: float
    mma16_TFLOPs: float  # bf16 / fp16 operands, float32 accumulation
    tf32_TFLOPs: float
    fp32_TFLOPs: float  # IEEE float32 (FMA units)
    source: str

    def matmul_TFLOPs(self, kind: str) -> float:
        return {"mma16": self.mma16_TFLOPs, "tf32": self.tf32_TFLOPs}.get(kind, self.fp32_TFLOPs)

    @property
    def fp32_ops(self) -> float:
        """FP32 instructions per second: half the float32 matmul rate (an FMA is two FLOPs)."""
        return self.fp32_TFLOPs * 1e12 / 2


# From benchmarks/results/gpu_2026-11-27/proof/ceilings.json (TF32: half of bf16, assumed).
H200 = Ceilings(
    "NVIDIA H200",
    4275.4,
    686.36,
    686.36 / 2,
    50.93,
    "measured: benchmarks/results/gpu_2026-11-27/proof/ceilings.json (TF32: half of bf16, assumed)",
)
RECORDED = {H200.gpu: H200}


def ceilings_for(gpu: str) -> Ceilings:
    """The recorded ceilings of ``gpu``; for another GPU the H200's, named as such (the
    choice depends mostly on the matmul-rate-to-bandwidth ratio, similar on recent GPUs)."""
    if gpu in RECORDED:
        return RECORDED[gpu]
    c = H200
    return Ceilings(
        gpu,
        c.copy_GBps,
        c.mma16_TFLOPs,
        c.tf32_TFLOPs,
        c.fp32_TFLOPs,
        f"not recorded for {gpu}: the H200's ({c.source})",
    )


# The cost model's constants (derivations: benchmarks/NOTES.md). Fused kernels' weight
# re-reads from L2, calibrated on benchmarks/results/gpu_2026-11-27/proof/lff_gpu.json.
L2_REREAD_GBps = 1726.0
FUSED_MMA_FRACTION = 0.5  # fused kernels' matmul work, fraction of the ceiling (assumed)
# cuBLAS products, fraction of the ceiling (from lff_gpu.json's torch.compile rows; assumed)
GEMM_FRACTION = {"mma16": 0.6, "tf32": 0.6, "ieee": 0.95}
STREAM_FRACTION = 0.85  # elementwise kernels, fraction of the copy rate (assumed)
LAUNCH_US = 4.0  # per dependent kernel launch, on the device's timeline (assumed)


def sincos_instructions(M: int) -> int:
    """FP32 instructions per (row, frequency) of _phase_tiles.cos_sin_tile, counted from the
    source: phase 4 + 12 (M - 1), sincos_turns ~43, scaling and rounding 4."""
    return 4 + 12 * (M - 1) + 43 + 4


@dataclass(frozen=True)
class Work:
    """One call of the Triton LFF backend, as the plans see it (shapes and kinds only)."""

    mode: str  # "fwd" | "bwd"
    rows: int  # R = positions x groups
    M: int
    F2: int  # frequencies (F = 2 * F2 features)
    H: int  # hidden width (0: features only)
    Dg: int  # output width per group
    kind: str  # "mma16" | "tf32" | "ieee" (_launch.matmul_kind)
    itemsize: int  # bytes per element of the compute dtype
    split: bool = False  # relu with a half-precision MLP: features hi + lo
    needs: tuple = (True,) * 6  # backward: (dx, dwr, dw1, db1, dw2, db2)

    def bucket(self) -> str:
        """The key of a measured choice: every field, rows rounded up to a power of two."""
        rows = 1 << max(0, (self.rows - 1).bit_length())
        needs = "".join("1" if n else "0" for n in self.needs) if self.mode == "bwd" else "-"
        return (
            f"{self.mode} rows<={rows} M={self.M} F2={self.F2} H={self.H} Dg={self.Dg} "
            f"{self.kind}/{self.itemsize} split={int(self.split)} needs={needs}"
        )


@dataclass
class Estimate:
    """A plan's predicted time (ms) and the terms it is made of (ms each)."""

    ms: float
    terms: dict = field(default_factory=dict)

    def binding(self) -> str:
        return max(self.terms, key=self.terms.get) if self.terms else ""


def _kernel_ms(
    c: Ceilings, kind: str, *, hbm=0.0, l2=0.0, flops=0.0, mma_fraction=1.0, fp32_ops=0.0
) -> float:
    """One kernel: the largest of its memory, L2, matmul and FP32-instruction times."""
    return 1e3 * max(
        hbm / (c.copy_GBps * 1e9),
        l2 / (L2_REREAD_GBps * 1e9),
        flops / (mma_fraction * c.matmul_TFLOPs(kind) * 1e12),
        fp32_ops / c.fp32_ops,
    )


# The fused kernels' largest row tiles (lff_forward._CONFIGS, lff_backward_fused).
def _fused_rows(w: Work, backward: bool) -> int:
    if w.kind != "mma16":
        return 32 if w.H <= 64 or not backward else 16
    if w.H <= 64:
        return 128
    return 64 if (w.H <= 128 or not backward) else 32


def _predict_fused(w: Work, c: Ceilings) -> Estimate:
    R, M, F2, H, Dg, e = w.rows, w.M, w.F2, w.H, w.Dg, w.itemsize
    F, sc = 2 * F2, sincos_instructions(w.M)
    width = Dg if H else F

    def kernel_ms(**traffic) -> float:  # one kernel of the fused path (its MMA fraction)
        return _kernel_ms(c, w.kind, mma_fraction=FUSED_MMA_FRACTION, **traffic)

    if w.mode == "fwd":
        t = _fused_rows(w, False)
        weights = (F * H + H * Dg) * e
        flops = 2 * R * (F * H * (2 if w.split else 1) + H * Dg)
        ms = kernel_ms(
            hbm=R * (4 * M + width * e),
            l2=math.ceil(R / t) * weights,
            flops=flops,
            fp32_ops=R * F2 * sc,
        )
        return Estimate(ms + LAUNCH_US * 1e-3, {"fused pass": ms, "launch": LAUNCH_US * 1e-3})
    # backward: the fused kernel, or its split-K path (lff_backward._SPLIT_K_BYTES)
    _, dwr, dw1, _, dw2, _ = w.needs
    partials = 4 * ((F * H if dw1 else 0) + (H * Dg if dw2 else 0) + (F2 * M if dwr else 0))
    flops = 2 * R * (F * H + 2 * H * Dg + 2 * F * H)
    if H and (dw1 or dw2) and partials > 256 * 1024:
        first = kernel_ms(
            hbm=R * (4 * M + Dg * e + 2 * H * e),
            l2=math.ceil(R / 64) * (F * H + H * Dg) * e,
            flops=2 * R * (F * H + H * Dg),
            fp32_ops=R * F2 * sc * math.ceil(H / 128),
        )
        phase = kernel_ms(
            hbm=R * (8 * M + H * e),
            l2=math.ceil(R / 128) * F * H * e,
            flops=2 * R * F * H,
            fp32_ops=R * F2 * sc,
        )
        wgrad2 = kernel_ms(hbm=R * (Dg + H) * e, flops=2 * R * H * Dg)
        wgrad1 = kernel_ms(
            hbm=R * (H * e + 4 * M),
            flops=2 * R * F * H,
            fp32_ops=R * F2 * sc,
        )
        chunks = math.ceil(R / max(1, (128 * 2**20) // (2 * H * e)))
        launch = LAUNCH_US * 1e-3 * (4 * chunks + 4)
        terms = {
            "first pass": first,
            "phase": phase,
            "dw2": wgrad2,
            "dw1": wgrad1,
            "launches": launch,
        }
        return Estimate(sum(terms.values()), terms)
    t = _fused_rows(w, True)
    # per row tile: w1 twice, w2 once, and the read-modify-write of float32 partials
    per_tile = (2 * F * H + H * Dg) * e + 8 * (partials // 4 + H + Dg)
    ms = kernel_ms(
        hbm=R * (8 * M + width * e),
        l2=math.ceil(R / t) * per_tile,
        flops=flops,
        fp32_ops=2 * R * F2 * sc,
    )
    launch = LAUNCH_US * 1e-3 * 4  # the pass and the partial sums
    return Estimate(ms + launch, {"fused pass": ms, "launches": launch})


def _gemm_chunks(w: Work) -> int:
    from ...triton_kernels import _gemm_sizes  # (imports no triton)

    return math.ceil(
        w.rows / _gemm_sizes.chunk_rows(w.rows, w.F2, w.H, w.itemsize, w.mode == "bwd", w.split)
    )


def _predict_gemm(w: Work, c: Ceilings) -> Estimate:
    R, M, F2, H, Dg, e, kind = w.rows, w.M, w.F2, w.H, w.Dg, w.itemsize, w.kind
    F = 2 * F2
    Fk = 2 * F if w.split else F  # the first product's K (hi and lo features)
    frac = GEMM_FRACTION.get(kind, 0.6)

    def stream(nbytes, ops=0.0):
        return _kernel_ms(c, kind, hbm=nbytes / STREAM_FRACTION, fp32_ops=ops)

    def gemm(m, n, kk, out_bytes):
        return _kernel_ms(
            c, kind, hbm=(m * kk + kk * n) * e + out_bytes, flops=2 * m * n * kk, mma_fraction=frac
        )

    terms = {
        "features": stream(R * (4 * M + Fk * e), R * F2 * sincos_instructions(M)),
        "a = r w1": gemm(R, H, Fk, R * H * e),
    }
    if w.mode == "fwd":
        terms["act"] = stream(2 * R * H * e)
        terms["y = h w2"] = gemm(R, Dg, H, R * Dg * e)
        launches = 4
    else:
        dx, dwr, dw1, _, dw2, db2 = w.needs
        phase = dx or dwr
        terms["gh = dY w2^T"] = gemm(R, H, Dg, R * H * e)
        terms["act'"] = stream(4 * R * H * e)
        launches = 3
        if dw2 or db2:
            terms["[dw2; db2]"] = gemm(H + 8, Dg, R, 4 * (H + 8) * Dg)
            launches += 1
        if dw1:
            terms["dw1"] = gemm(F, H, R, 4 * F * H)
            launches += 1
        if phase:
            terms["gr = ga w1^T"] = gemm(R, F, H, R * F * e)
            terms["phase"] = stream(R * (2 * F * e + 8 * M), R * F2 * (4 + 4 * M))
            launches += 2
    chunks = _gemm_chunks(w)
    terms["launches"] = LAUNCH_US * 1e-3 * launches * chunks
    return Estimate(sum(terms.values()), terms)


def predict(w: Work, c: Ceilings) -> dict[str, Estimate]:
    """The model's time of each plan that can run ``w`` (the gemm plan needs the MLP)."""
    out = {"fused": _predict_fused(w, c)}
    if w.H:
        out["gemm"] = _predict_gemm(w, c)
    return out


@dataclass
class Decision:
    plan: str
    how: str  # "forced" | "measured" | "model" | "only"
    why: str
    estimates: dict
    measured: Optional[dict] = None

    def line(self, w: Work) -> str:
        est = ", ".join(
            f"{p} {e.ms:.3f} ms ({e.binding()})" for p, e in sorted(self.estimates.items())
        )
        meas = ""
        if self.measured:
            meas = "; measured " + ", ".join(f"{p} {ms:.3f} ms" for p, ms in self.measured.items())
        return (
            f"posenc_fast lff {w.mode}: plan {self.plan} ({self.how}: {self.why}) for "
            f"{w.bucket()}; predicted {est}{meas}"
        )


def requested_plan() -> str:
    """POSENC_FAST_LFF_PLAN, checked."""
    plan = os.environ.get(ENV_PLAN, "auto").strip() or "auto"
    if plan not in ("auto", *PLANS, "measure"):
        raise ValueError(f"{ENV_PLAN}={plan!r}: expected one of auto, {', '.join(PLANS)}, measure")
    return plan


def gemm_refusal(w: Work) -> str:
    """Why the gemm plan cannot run ``w`` ("" if it can)."""
    if not w.H:
        return "features only (no MLP): one kernel, nothing to multiply"
    if torch.are_deterministic_algorithms_enabled() and os.environ.get(
        "CUBLAS_WORKSPACE_CONFIG"
    ) not in (":4096:8", ":16:8"):
        return (
            "torch.use_deterministic_algorithms is on and CUBLAS_WORKSPACE_CONFIG is not "
            ":4096:8 or :16:8, which cuBLAS products need to be reproducible (torch raises)"
        )
    return ""


_lock = threading.Lock()
_memo: dict[tuple, Decision] = {}  # (device name, Work) -> the decision (this process)
_printed: set = set()


def measuring() -> bool:
    """POSENC_FAST_LFF_PLAN=measure: a bucket's first call times the candidates."""
    return requested_plan() == "measure"


def cache_path() -> str:
    """The measured choices' file, in posenc_fast's cache folder."""
    from ..._extension import cache_root

    return str(cache_root() / "lff_plans.json")


def environment_key(gpu: str) -> str:
    """Measured choices are valid for one GPU model and one torch / Triton pair."""
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # triton missing: the key still names torch
        triton_version = "none"
    return f"{gpu} | torch {torch.__version__} | triton {triton_version}"


def load_measured(gpu: str) -> dict:
    """The measured choices on disk for this GPU and these versions: bucket -> record."""
    try:
        with open(cache_path()) as f:
            return json.load(f).get(environment_key(gpu), {})
    except (OSError, ValueError):
        return {}


def _store_measured(gpu: str, bucket: str, record: dict) -> None:
    path = cache_path()
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        data = {}
    data.setdefault(environment_key(gpu), {})[bucket] = record
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def forget() -> None:
    """Drop this process's remembered decisions (tests; after changing the settings)."""
    with _lock:
        _memo.clear()
        _printed.clear()


def decide(w: Work, gpu: str, measure: Optional[Callable[[list], dict]] = None) -> Decision:
    """The plan for ``w`` on ``gpu``. ``measure(plans) -> {plan: ms}`` times candidates on
    the device (None: measuring is not possible now, e.g. during graph capture)."""
    requested = requested_plan()
    refusal = gemm_refusal(w)
    key = (gpu, w, requested, refusal)
    with _lock:
        if key in _memo:
            return _memo[key]
    estimates = predict(w, ceilings_for(gpu))
    candidates = [p for p in PLANS if p in estimates and not (p == "gemm" and refusal)]
    if requested in PLANS and w.H:
        if requested == "gemm" and refusal:
            raise RuntimeError(f"posenc_fast: {ENV_PLAN}=gemm cannot run: {refusal}")
        decision = Decision(requested, "forced", f"{ENV_PLAN}={requested}", estimates)
    elif len(candidates) == 1:
        why = refusal or "the only plan"
        decision = Decision(candidates[0], "only", why, estimates)
    else:
        decision = _measured_or_model(w, gpu, candidates, estimates, measure, requested)
    if not (decision.how == "model" and requested == "measure" and measure is None):
        with _lock:  # (a bucket to measure is decided again once measuring is possible)
            _memo[key] = decision
    if key not in _printed and _log.isEnabledFor(logging.DEBUG):
        _printed.add(key)
        _log.debug(decision.line(w))
    return decision


def _measured_or_model(w, gpu, candidates, estimates, measure, requested) -> Decision:
    bucket = w.bucket()
    measure_on = requested == "measure"
    record = load_measured(gpu).get(bucket) if measure_on else None
    if record is None and measure_on and measure is not None:
        times = measure(candidates)
        record = {"plan": min(times, key=times.get), "ms": times}
        try:
            _store_measured(gpu, bucket, record)
        except OSError as exc:  # a read-only cache: decide anyway, say so
            _log.warning(
                "posenc_fast: could not remember the LFF plan in %s: %s", cache_path(), exc
            )
    if record is not None and record.get("plan") in candidates:
        ms = record.get("ms", {})
        why = "faster when measured on this GPU" + (f" ({cache_path()})" if ms else "")
        return Decision(record["plan"], "measured", why, estimates, ms)
    best = min(candidates, key=lambda p: estimates[p].ms)
    other = [p for p in candidates if p != best]
    why = f"predicted faster than {', '.join(other)} by the cost model"
    return Decision(best, "model", why, estimates)


def _work(mode, x, wr, w1, w2, compute: torch.dtype, activation: str, needs=None) -> Work:
    from ...triton_kernels import _launch, lff_forward

    M = x.shape[-1]
    return Work(
        mode,
        x.numel() // M if M else 0,
        M,
        wr.shape[0],
        w1.shape[1] if w1 is not None else 0,
        w2.shape[1] if w2 is not None else 0,
        _launch.matmul_kind(compute),
        compute.itemsize,
        w1 is not None and lff_forward.split_features(activation, compute),
        tuple(bool(n) for n in needs) if needs is not None else (True,) * 6,
    )


def _decide(w: Work, device: torch.device, runners: dict, args: tuple) -> str:
    """The plan for ``w``; with measuring on, ``runners`` are timed on a bucket's first call."""
    from ...triton_kernels import _launch

    measure = None
    if measuring() and not _launch.capturing(device):

        def measure(plans: list) -> dict:
            return {p: _launch.time_ms(lambda f=runners[p]: f(*args), device) for p in plans}

    return decide(w, _launch.device_name(device), measure).plan


def forward(x, wr, w1, b1, w2, b2, activation: str, out_dtype: torch.dtype):
    """The triton backend's forward: the chosen plan's (imports triton on first use)."""
    from ...triton_kernels import lff_forward, lff_gemm

    args = (x, wr, w1, b1, w2, b2, activation, out_dtype)
    w = _work("fwd", x, wr, w1, w2, out_dtype, activation)
    runners = {"fused": lff_forward.lff_fwd, "gemm": lff_gemm.gemm_fwd}
    if _decide(w, x.device, runners, args) == "gemm":
        return lff_gemm.gemm_fwd(*args)
    return lff_forward.lff_fwd(*args)


def backward(grad, x, wr, w1, b1, w2, b2, activation: str, needs):
    """The triton backend's backward: the chosen plan's."""
    from ...triton_kernels import lff_backward, lff_gemm

    args = (grad, x, wr, w1, b1, w2, b2, activation, needs)
    # Decided for all six gradients: a gradient alone is bitwise the one computed with others
    w = _work("bwd", x, wr, w1, w2, grad.dtype, activation)
    runners = {"fused": lff_backward.lff_bwd, "gemm": lff_gemm.gemm_bwd}
    if _decide(w, x.device, runners, args) == "gemm":
        return lff_gemm.gemm_bwd(*args)
    return lff_backward.lff_bwd(*args)


# The benchmark shapes (benchmarks/lff_gpu.py): name -> (rows, M, F2, H, Dg)
REFERENCE_SHAPES = {
    "canonical": (2**20, 2, 128, 32, 768),
    "compute": (2**20, 2, 384, 256, 1024),
    "small": (4096, 2, 128, 32, 768),
    "seq1d": (65536, 1, 128, 32, 768),
}


def report_lines(gpu: Optional[str] = None) -> list[str]:
    """What `python -m posenc_fast info` says about the LFF plans."""
    gpu = gpu or H200.gpu
    c = ceilings_for(gpu)
    lines = [
        f"{ENV_PLAN}={os.environ.get(ENV_PLAN, 'auto')}",
        f"ceilings for {gpu}: copy {c.copy_GBps:.0f} GB/s, bf16 {c.mma16_TFLOPs:.0f}, "
        f"tf32 {c.tf32_TFLOPs:.0f}, fp32 {c.fp32_TFLOPs:.1f} TFLOP/s ({c.source})",
    ]
    measured = load_measured(gpu)
    lines.append(f"measured choices for this GPU and versions: {len(measured)} in {cache_path()}")
    refusal = gemm_refusal(Work("fwd", 1, 1, 1, 1, 1, "mma16", 2))
    if refusal:
        lines.append(f"gemm plan unavailable: {refusal}")
    for name, (R, M, F2, H, Dg) in REFERENCE_SHAPES.items():
        for dtype, kind in (("bf16", "mma16"), ("fp32", "ieee")):
            for mode in ("fwd", "bwd"):
                w = Work(mode, R, M, F2, H, Dg, kind, 2 if dtype == "bf16" else 4)
                est = predict(w, c)
                best = min(est, key=lambda p: est[p].ms)
                pred = ", ".join(f"{p} {e.ms:.3f} ms" for p, e in est.items())
                lines.append(f"{name:<9} {dtype} {mode}: model picks {best:<5} ({pred})")
    return lines
