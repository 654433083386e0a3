"""The benchmark cases (``bench``, benchmarks/test_bench.py, the GPU scripts): per op the
inputs and, per implementation, a closure computing the output from those tensors."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

import torch

import posenc_fast as _pf

from .. import _dispatch
from ..ops import encodings as enc_api
from ..ops.encodings import reference as enc_ref
from ..ops.floater import floater
from ..ops.floater import reference as floater_ref
from ..ops.lff import lff
from ..ops.lff import reference as lff_ref
from ..ops.rotary import frequencies as rope
from ..tolerances import mismatch
from . import _baselines, _inputs
from ._floors import Work


@dataclass
class Impl:
    """``fn()``: the output (differentiated to ``leaves``); ``layout``: to the spec's layout."""

    fn: Callable[[], torch.Tensor]
    leaves: list
    layout: Optional[Callable[[torch.Tensor], torch.Tensor]] = None


@dataclass
class BenchCase:
    """One op at one size: inputs, implementations, and ``spec()`` (float64, not timed)."""

    op: str  # "lff", "sinusoidal", "sinusoidal_add", "dft", "dft_add", "floater", "rotary"
    label: str  # the sizes, readable
    size: int  # the x axis of plots (positions N, or sequence length L)
    sizes: dict  # every size parameter, for the JSON
    eager: Callable  # the op as users write it (module or function): eager(*args)
    args: tuple  # eager's arguments
    leaves: list  # the tensors eager (and its torch.compile) differentiates in "fwd+bwd"
    spec: Callable[[], torch.Tensor]  # the float64 specification's forward output
    backends: dict  # posenc_fast backend name -> Impl
    baselines: dict = field(default_factory=dict)  # further baselines: name -> Impl
    context: Callable = contextlib.nullcontext  # e.g. autocast for bf16 cases
    work: dict = field(default_factory=dict)  # mode -> Work (the floor's bytes and GEMMs)
    extra: dict = field(default_factory=dict)


def _available(op: str, device: str, dtype) -> list[str]:
    """Usable backends "auto" could pick here (not the Triton interpreter), in its order."""
    names = _inputs.backends_for(op, device, dtype)
    return [n for n in names if _dispatch.auto_eligible(n, _dispatch.REGISTRIES[op], device)]


def _elt(dtype) -> int:
    return torch.finfo(dtype).bits // 8


# benchmarks/lff_gpu.py's cases (bench --device cuda: LFF_BENCH_LABELS'): (N, M, G, F, H, D)
LFF_GPU_SHAPES = {
    "canonical": (2**20, 2, 1, 256, 32, 768, "bfloat16"),
    "canonical-fp32": (2**20, 2, 1, 256, 32, 768, "float32"),
    "compute": (2**20, 2, 1, 768, 256, 1024, "bfloat16"),
    "compute-fp32": (2**20, 2, 1, 768, 256, 1024, "float32"),
    "small": (4096, 2, 1, 256, 32, 768, "bfloat16"),
    "seq1d": (65536, 1, 1, 256, 32, 768, "bfloat16"),
    "boxes-G1": (2**20, 4, 1, 256, 32, 768, "bfloat16"),
    "boxes-G2": (2**20, 4, 2, 256, 32, 768, "bfloat16"),
    "boxes-G4": (2**20, 4, 4, 256, 32, 768, "bfloat16"),
}
LFF_BENCH_LABELS = {  # name -> bench's label suffix
    "canonical": " (canonical)",
    "canonical-fp32": "",
    "compute": " (compute-bound)",
    "small": " (small)",
    "seq1d": " (1-D)",
}


def lff_case(N, M, G, F, H, D, device, dtype=torch.float32, label_extra="") -> BenchCase:
    """LFF + MLP on N positions; bf16/fp16: fp32 weights under autocast, eager alike."""
    g = _inputs.generator(N + 7 * F + H)
    case = _inputs.LffCase((N,), G, M, F, H, D // G)
    param_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    x, wr, w1, b1, w2, b2 = _inputs.lff_inputs(case, param_dtype, device, seed=N)
    x = _inputs.rand((N, G, M), g, 0.0, 64.0, x.dtype, device)  # e.g. pixel coordinates
    weights = [wr, w1, b1, w2, b2]
    for t in weights:
        t.requires_grad_(True)
    eager = _baselines.EagerLFF.from_weights(*(t.detach() for t in weights))
    autocast = dtype in (torch.float16, torch.bfloat16)
    ctx = (lambda: torch.autocast(device, dtype=dtype)) if autocast else contextlib.nullcontext
    compute = dtype if autocast else param_dtype  # the MLP's GEMM dtype

    def spec():
        return lff_ref.lff(x, *(t.detach() for t in weights), "gelu")

    backends = {
        name: Impl(lambda name=name: lff(x, *weights, "gelu", name), weights)
        for name in _available("lff", device, dtype)
    }
    R, Dg = N * G, D // G
    x_bytes, y_bytes = R * M * x.element_size(), N * D * _elt(dtype)
    gemms = ((R, F, H), (R, H, Dg))
    label = f"N={N} M={M} G={G} F={F} H={H} D={D} {str(dtype)[6:]}{label_extra}"
    return BenchCase(
        "lff",
        label,
        N,
        {"N": N, "M": M, "G": G, "F": F, "H": H, "D": D, "dtype": str(dtype)[6:]},
        eager,
        (x,),
        list(eager.parameters()),
        spec,
        backends,
        context=ctx,
        work={
            "fwd": Work(x_bytes + y_bytes, gemms, compute),
            # backward: read dY and x again; per layer the product, dW and d(input)
            "fwd+bwd": Work(2 * x_bytes + 2 * y_bytes, gemms * 3, compute),
        },
    )


def encoding_case(kind: str, N: int, dim: int, device, dtype=torch.float32) -> BenchCase:
    """The table [N, dim] of N real positions (gradient to the positions)."""
    p = _inputs.rand((N,), _inputs.generator(N + dim), 0.0, float(N), dtype, device)
    p.requires_grad_(True)
    fn = enc_api.dft if kind == "dft" else enc_api.sinusoidal

    def spec():
        ref = enc_ref.dft if kind == "dft" else enc_ref.sinusoidal
        return ref(p.detach(), dim)

    backends = {
        name: Impl(lambda name=name: fn(p, dim, backend=name), [p])
        for name in _available("encoding", device, dtype)
    }
    table, positions = N * dim * _elt(dtype), N * _elt(dtype)
    return BenchCase(
        kind,
        f"N={N} dim={dim} {str(dtype)[6:]}",
        N,
        {"N": N, "dim": dim, "dtype": str(dtype)[6:]},
        _baselines.table_module(kind, dim, device),
        (p,),
        [p],
        spec,
        backends,
        # backward: read dY and the positions, write their gradient
        work={"fwd": Work(table + positions), "fwd+bwd": Work(2 * table + 3 * positions)},
    )


def encoding_add_case(
    kind: str, B: int, L: int, dim: int, device, dtype=torch.float32
) -> BenchCase:
    """x [B, L, dim] + encoding(0..L-1): the module's fused add (gradient to x)."""
    x = _inputs.randn((B, L, dim), _inputs.generator(B * L + dim), dtype, device)
    x.requires_grad_(True)

    def spec():
        ref = enc_ref.dft if kind == "dft" else enc_ref.sinusoidal
        return x.detach().double() + ref(torch.arange(L, device=device), dim)

    backends = {}
    for name in _available("encoding", device, dtype):
        module = (
            enc_api.DFTPE(dim, backend=name)
            if kind == "dft"
            else enc_api.SinusoidalPE(dim, backend=name)
        )
        backends[name] = Impl(lambda m=module: m(x), [x])
    cached = _baselines.EagerCachedAdd(_baselines.table_module(kind, dim, device), L, dtype, device)
    # read x, write the sum; the gradient of an add passes through untouched
    io = 2 * B * L * dim * _elt(dtype)
    return BenchCase(
        f"{kind}_add",
        f"B={B} L={L} dim={dim} {str(dtype)[6:]}",
        B * L,
        {"B": B, "L": L, "dim": dim, "dtype": str(dtype)[6:]},
        _baselines.EagerAdd(_baselines.table_module(kind, dim, device)),
        (x,),
        [x],
        spec,
        backends,
        baselines={"eager-cached": Impl(lambda: cached(x), [x])},
        work={"fwd": Work(io), "fwd+bwd": Work(io)},
    )


# rotary (also benchmarks/rotary.py's): name -> (B, N, heads, head_dim); x [B, N, ROTARY_M]
ROTARY_SIZES = {
    "lightglue-512": (1, 512, 4, 64),  # LightGlue's self-attention: 4 heads of 64
    "lightglue-2048": (1, 2048, 4, 64),
    "vit-1024": (8, 1024, 12, 64),  # a ViT-like batch: 12 heads of 64
}
ROTARY_M = 2


def rotary_inputs(B: int, N: int, H: int, D: int, dtype, device, seed: int = 0):
    """(q, k, x, wr) as in LightGlue's self-attention: q, k [B, H, N, D] in ``dtype`` sliced
    from a fused qkv (channel stride 3); x [B, N, 2] in (-1, 1), wr [D/2, 2] ~ N(0, 1), fp32."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, N, H, D, 3, generator=g).to(device=device, dtype=dtype).transpose(1, 2)
    q, k = qkv[..., 0], qkv[..., 1]
    x = (torch.rand(B, N, ROTARY_M, generator=g) * 2 - 1).to(device)
    wr = torch.randn(D // 2, ROTARY_M, generator=g).to(device)
    return q, k, x, wr


def rotary_case(name: str, device, dtype=torch.float32, sizes=None) -> BenchCase:
    """``apply_lff_rotary``, gradients to q, k and wr; ``sizes`` default ROTARY_SIZES[name].
    With bf16 q, k the baselines output float32 (as LightGlue's), ours q's dtype."""
    B, N, H, D = sizes or ROTARY_SIZES[name]
    q, k, x, wr = rotary_inputs(B, N, H, D, dtype, device)
    # q and k are views of qkv: leaves of their own here, for their gradients
    for t in (q, k, wr):
        t.requires_grad_(True)
    eager = _baselines.EagerRotary.from_weights(wr.detach())
    # LightGlue's per-layer cost: the table built once beforehand, gradients to q, k, table
    table = eager.table(x).detach().requires_grad_(True)

    def spec():
        args = (t.detach().double() for t in (q, k, x, wr))
        return torch.stack(_pf.apply_lff_rotary(*args, backend="reference"))

    backends = {
        name: Impl(lambda name=name: _pf.apply_lff_rotary(q, k, x, wr, backend=name), [q, k, wr])
        for name in _available("apply_lff_rotary", device, dtype)
    }
    qk = 2 * q.numel() * _elt(dtype)  # q and k (or q' and k', dq', dk', dq, dk)
    return BenchCase(
        "rotary",
        f"{name} B={B} N={N} heads={H} head_dim={D} {str(dtype)[6:]}",
        B * N,
        {
            "family": "lightglue",
            "B": B,
            "N": N,
            "heads": H,
            "head_dim": D,
            "M": ROTARY_M,
            "dtype": str(dtype)[6:],
        },
        eager,
        (q, k, x),
        [q, k, eager.wr.weight],
        spec,
        backends,
        baselines={
            "eager-rotate": Impl(
                lambda: tuple(_baselines.apply_cached_rotary(table, t) for t in (q, k)),
                [q, k, table],
            )
        },
        # elements only: strided q, k also pull v's channels through the caches (floor low)
        work={
            "fwd": Work(2 * qk + x.numel() * x.element_size()),
            # backward: read dq', dk' and x again (cos / sin recomputed), write dq and dk
            "fwd+bwd": Work(4 * qk + 2 * x.numel() * x.element_size()),
        },
    )


# rotary families (also benchmarks/rotary.py's): ViT-B/16's heads; grid -> (batch, grid)
ROTARY_HEADS, ROTARY_HEAD_DIM = 12, 64
ROTARY_GRIDS = {
    "vit224": (8, (14, 14)),  # 224 px
    "vit448": (2, (28, 28)),  # 448 px
    "grid8192": (1, (64, 128)),  # a 2-D grid of the video's 8192 tokens
    "video": (1, (8, 32, 32)),  # frames x rows x columns
}
ROTARY_FAMILIES = {  # family -> its grids (--quick: the first)
    "axial": ("vit224", "vit448", "grid8192"),
    "mixed": ("vit224", "vit448", "grid8192"),
    "dinov3": ("vit224", "vit448", "grid8192"),
    "nd": ("vit224", "vit448", "video"),
}
# prefix tokens: 1 class token (vit_*_rope_*, EVA-02), 1 class + 4 registers (DINOv3)
ROTARY_PREFIX = {"axial": 1, "mixed": 1, "dinov3": 5, "nd": 0}
ROTARY_ND_AXES = (16, 24, 24)  # FLUX's split of a head (16, 56, 56 of 128) for 64 channels


def _family_inputs(family: str, grid, D: int, H: int, g: torch.Generator, device):
    """(x, freqs, pairs, eager module, its extra args) of a family, as timm 1.0.31 and FLUX."""
    prefix = ROTARY_PREFIX[family]
    if family == "axial":  # RotaryEmbeddingCat, in_pixels=False, temperature 100, xy grid
        x = rope.grid(grid, "index", indexing="xy", device=device)
        w = rope.axial(D, 2, in_pixels=False, temperature=100.0, device=device)
        table = _baselines.timm_axial_table(x, w[: D // 4, 0])
        return x, w, "interleaved", _baselines.EagerTableRotary(table, prefix, False), ()
    if family == "mixed":  # one block's [2, heads, F/2] of the learnable freqs, xy grid
        x = rope.grid(grid, indexing="xy", device=device)
        w = rope.mixed(D, 1, H, 10.0, generator=g)[0].to(device).permute(2, 0, 1).contiguous()
        eager = _baselines.EagerMixedRotary(w, prefix)
        return x, w, "interleaved", eager, (x[:, 0].contiguous(), x[:, 1].contiguous())
    if family == "dinov3":  # centered grid in [-1, 1], periods 100^(2j / (F/2)), rotate-half
        x = rope.grid(grid, "centered", device=device)
        w = rope.dinov3(D, 100.0, device=device)
        periods = 100.0 ** (2.0 * torch.arange(D // 4, dtype=torch.float32) / (D // 2))
        table = _baselines.timm_dinov3_table(x, periods.to(device), True)
        return x, w, "half", _baselines.EagerTableRotary(table, prefix, True), ()
    # nd: FLUX's ids (t, row, col); an image is frame 0
    x = rope.grid(grid, device=device)
    if x.shape[1] == 2:
        x = torch.cat([torch.zeros_like(x[:, :1]), x], dim=1)
    w = rope.nd(ROTARY_ND_AXES, device=device)
    pe = _baselines.flux_embed_nd(x, ROTARY_ND_AXES)
    return x, w, "interleaved", _baselines.EagerFluxRotary(pe), ()


def rotary_family_case(
    family: str, grid_name: str, device, dtype=torch.float32, sizes=None
) -> BenchCase:
    """One block's q, k [B, heads, N, 64] (views of a fused qkv) rotated by a family's angles,
    gradients to q, k (and Mixed's freqs); ``sizes`` default ROTARY_GRIDS[grid_name]."""
    B, grid = sizes or ROTARY_GRIDS[grid_name]
    H, D, prefix = ROTARY_HEADS, ROTARY_HEAD_DIM, ROTARY_PREFIX[family]
    cells = 1
    for s in grid:
        cells *= s
    N = prefix + cells
    g = torch.Generator().manual_seed(N * 31 + B)
    qkv = torch.randn(B, N, 3, H, D, generator=g).to(device=device, dtype=dtype)
    q, k = qkv.permute(2, 0, 3, 1, 4)[:2]  # [B, H, N, D], as timm's qkv.unbind(0)
    x, w, pairs, eager, extra = _family_inputs(family, grid, D, H, g, device)
    learnable = family == "mixed"
    for t in (q, k, *((w,) if learnable else ())):
        t.requires_grad_(True)

    def freqs():  # ours: W [F/2, M], or Mixed's [heads, F/2, 2] view of timm's layout
        return w.permute(1, 2, 0) if learnable else w

    def spec():
        args = (t.detach().double() for t in (q, k, x, freqs()))
        return torch.stack(_pf.rotary(*args, pairs, "bhnd", prefix, backend="reference"))

    leaves = [q, k, w] if learnable else [q, k]
    backends = {
        name: Impl(
            lambda name=name: _pf.rotary(q, k, x, freqs(), pairs, "bhnd", prefix, name), leaves
        )
        for name in _available("rotary", device, dtype)
    }
    qk = 2 * q.numel() * _elt(dtype)  # q and k (or q', k', dq', dk', dq, dk)
    small = x.numel() * x.element_size() + w.numel() * w.element_size()  # positions, W
    shape = "x".join(str(s) for s in grid)
    return BenchCase(
        "rotary",
        f"{family} {grid_name} B={B} grid={shape} prefix={prefix} heads={H} head_dim={D} "
        f"{str(dtype)[6:]}",
        cells,
        {
            "family": family,
            "grid_name": grid_name,
            "B": B,
            "grid": list(grid),
            "N": N,
            "prefix": prefix,
            "heads": H,
            "head_dim": D,
            "M": x.shape[1],
            "pairs": pairs,
            "dtype": str(dtype)[6:],
        },
        eager,
        (q, k, *extra),
        [q, k, eager.freqs] if learnable else [q, k],
        spec,
        backends,
        # read q, k (and x, W), write q', k'; backward: read dq', dk', write dq, dk (and dW)
        work={"fwd": Work(2 * qk + small), "fwd+bwd": Work(4 * qk + 2 * small)},
    )


def rotary_cases(quick: bool, device: str, dtypes=(torch.float32,)) -> list[BenchCase]:
    """Every family on its grids (--quick: the first grid of each)."""
    return [
        rotary_family_case(family, grid, device, dt)
        for dt in dtypes
        for family, grids in ROTARY_FAMILIES.items()
        for grid in (grids[:1] if quick else grids)
    ]


def cases(quick: bool, device: str, ops: list[str]) -> list[BenchCase]:
    out: list[BenchCase] = []
    cuda = device == "cuda"
    if "lff" in ops:
        if cuda:
            for name, extra in LFF_BENCH_LABELS.items():
                N, M, G, F, H, D, dtype = LFF_GPU_SHAPES[name]
                out += [lff_case(N, M // G, G, F, H, D, device, getattr(torch, dtype), extra)]
            # smaller boxes than benchmarks/lff_gpu.py's: every case in seconds
            out += [
                lff_case(2**18, 4 // G, G, 128, 32, 256, device, torch.bfloat16, " (boxes)")
                for G in (1, 2, 4)
            ]
            if quick:
                out = out[:1] + out[3:4]
        else:
            # 196: a 14 x 14 ViT grid, where per-call overhead shows
            sizes = (196, 4096, 16384) if quick else (196, 4096, 16384, 65536)
            out += [lff_case(n, 2, 1, 256, 32, 768, device) for n in sizes]
            if not quick:
                out += [lff_case(65536, 1, 1, 256, 32, 768, device, label_extra=" (1-D)")]
                out += [lff_case(16384, 2, 2, 128, 32, 256, device, label_extra=" (boxes)")]
    for kind in ("sinusoidal", "dft"):
        if kind not in ops:
            continue
        if cuda:
            n_sizes = (4096, 2**19) if quick else (4096, 2**16, 2**19, 2**20)
            out += [encoding_case(kind, n, 768, device) for n in n_sizes]
            out += [encoding_add_case(kind, 8, 4096, 768, device, torch.bfloat16)]
            if not quick:
                out += [encoding_add_case(kind, 64, 8192, 768, device, torch.bfloat16)]
        else:
            n_sizes = (16384,) if quick else (4096, 16384, 65536)
            out += [encoding_case(kind, n, 768, device) for n in n_sizes]
            out += [encoding_add_case(kind, 8, 1024, 768, device)]
            if not quick:
                out += [encoding_add_case(kind, 8, 4096, 768, device)]
    if "rotary" in ops:
        # quick: LightGlue's sizes in float32; else all sizes in float32 and bfloat16
        names = ("lightglue-512", "lightglue-2048") if quick else tuple(ROTARY_SIZES)
        dtypes = (torch.float32,) if quick else (torch.float32, torch.bfloat16)
        out += [rotary_case(n, device, dt) for dt in dtypes for n in names]
        # the families (timm's Eva models, FLUX), float32 on the CPU; bfloat16 too on CUDA
        out += rotary_cases(quick, device, (torch.float32, torch.bfloat16) if cuda else dtypes[:1])
    return out


# FLOATER (also benchmarks/floater_gpu.py's): H = d, times i * 0.01, 5 rk38 steps, ReLU
FLOATER_STATES = 12
FLOATER_DELTA_T = 0.01
FLOATER_SUBSTEPS = 5


def floater_inputs(S: int, d: int, L: int, dtype, device: str, seed: int):
    """(p0, w1, b1, w2, b2, times), w1 * 0.5 and w2 * 0.3: states O(1) up to L = 512."""
    case = _inputs.FloaterCase(S, d, d, L)
    p0, w1, b1, w2, b2, _ = _inputs.floater_inputs(case, dtype, device, seed)
    with torch.no_grad():
        w1.mul_(0.5)
        w2.mul_(0.3)
    times = (torch.arange(L, dtype=torch.float64, device=device) * FLOATER_DELTA_T).to(dtype)
    return p0, w1, b1, w2, b2, times


def floater_case(
    L: int, d: int, device: str, dtype=torch.float32, S: int = FLOATER_STATES
) -> BenchCase:
    """The plain loop ("eager") and torchdiffeq on our step grid: the same steps everywhere."""
    K = FLOATER_SUBSTEPS
    *weights, times = floater_inputs(S, d, L, dtype, device, seed=L + d)
    leaves = [t.requires_grad_(True) for t in weights]

    def eager(p0, w1, b1, w2, b2):
        return _baselines.plain_floater(p0, w1, b1, w2, b2, times, K)

    def spec():
        w64 = [t.detach().double() for t in leaves]
        return floater_ref.floater(*w64, times.double(), K, "rk38", "relu")

    impls = {
        name: Impl(
            lambda name=name: floater(*leaves, times, K, "rk38", "relu", backend=name), leaves
        )
        for name in _available("floater", device, dtype)
    }
    return BenchCase(
        "floater",
        f"S={S} L={L} d={d} H={d} K={K} rk38 {str(dtype)[6:]}",
        L,
        {"S": S, "L": L, "d": d, "H": d, "substeps": K, "method": "rk38", "dtype": str(dtype)[6:]},
        eager,
        tuple(leaves),
        leaves,
        spec,
        impls,
        baselines={  # [L, S, d]: layout gives the spec's [S, L, d]
            name: Impl(fn, leaves, lambda y: y.transpose(0, 1))
            for name, fn in _baselines.torchdiffeq_baselines(*leaves, times, K).items()
        },
        # latency-bound (a chain of L*K*4 dependent small layers): no byte or GEMM floor
        extra={"steps": L * K, "dependent_layers": L * K * 4 * 2},
    )


def floater_cases(quick: bool, device: str, sizes=None) -> list[BenchCase]:
    """The FLOATER cases of ``bench``; ``sizes``: (L, d) pairs replacing the defaults."""
    if sizes is None:
        # quick: one small case (the many-op baselines make the peak-memory pass slow)
        sizes = [(64, 16)] if quick else [(64, 16), (64, 128), (512, 16), (512, 128)]
        if device == "cuda" and not quick:
            sizes.append((1024, 512))  # docs/performance.md's FLOATER case
    return [floater_case(L, d, device) for L, d in sizes]


def agreement(case: BenchCase) -> str:
    """'' when every implementation of a FLOATER case agrees with the eager loop, else why."""
    with torch.no_grad():
        want = case.eager(*case.args)
        for name, impl in {**case.backends, **case.baselines}.items():
            got = impl.fn()
            if impl.layout is not None:
                got = impl.layout(got)
            msg = mismatch(got, want, want.dtype, "floater")
            if msg:
                return f"{name}: {msg}"
    return ""
