"""Benchmark cases: one setup factory per op, shared by the speed and memory runs.

A case holds the inputs once and, for every implementation, a closure computing the op's
output (a tensor, or a tuple such as rotary's (q', k')) from them, so every implementation
runs on the very same tensors:
- "eager": the op as users write it (``_baselines``: nn.Linear + nn.GELU + torch.cat for
  LFF, the div_term table, ``x + table``); "eager-cached" for the adds: ``x + pe[:L]``
  with a table computed at construction; torchdiffeq for FLOATER; LightGlue's table and
  rotation for rotary, with "eager-rotate" (the rotation with its table computed once),
- "compile": torch.compile of the eager form (and "compile-max" with --max-autotune),
- one entry per usable posenc_fast backend ("torch", "triton", "cpp", "cuda").
The float64 reference is the specification: it is not timed; ``spec()`` gives its forward
output, against which ``bench`` reports every implementation's largest error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

import torch

import posenc_fast as _pf

from .. import _dispatch, _testing
from ..ops import encodings as enc_api
from ..ops.encodings import reference as enc_ref
from ..ops.lff import lff
from ..ops.lff import reference as lff_ref
from . import _baselines
from ._floors import Work


@dataclass
class Impl:
    """One implementation: ``fn()`` computes the output; "fwd+bwd" differentiates it with
    respect to ``leaves``; ``layout`` maps the output to the spec's layout."""

    fn: Callable[[], torch.Tensor]
    leaves: list
    layout: Optional[Callable[[torch.Tensor], torch.Tensor]] = None


@dataclass
class BenchCase:
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
    """Usable backends that "auto" could pick here, in auto's order: e.g. not the Triton
    interpreter on the CPU (TRITON_INTERPRET=1), which is for verification, not timing."""
    names = _testing.backends_for(op, device, dtype)
    return [n for n in names if _dispatch.auto_eligible(n, _dispatch.REGISTRIES[op], device)]


def _elt(dtype) -> int:
    return torch.finfo(dtype).bits // 8


def lff_case(N, M, G, F, H, D, device, dtype=torch.float32, label_extra="") -> BenchCase:
    """LFF + MLP on N positions. bf16/fp16: fp32 weights under autocast (the usual AMP
    setup), so the eager baseline is the same model under the same autocast."""
    g = _testing.generator(N + 7 * F + H)
    case = _testing.LffCase((N,), G, M, F, H, D // G)
    param_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    x, wr, w1, b1, w2, b2 = _testing.lff_inputs(case, param_dtype, device, seed=N)
    x = _testing.rand((N, G, M), g, 0.0, 64.0, x.dtype, device)  # e.g. pixel coordinates
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
    p = _testing.rand((N,), _testing.generator(N + dim), 0.0, float(N), dtype, device)
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
    x = _testing.randn((B, L, dim), _testing.generator(B * L + dim), dtype, device)
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


# rotary: name -> (B, N, heads, head_dim), positions [B, N, ROTARY_M] (also
# benchmarks/rotary.py's cases on the GPU)
ROTARY_SIZES = {
    "lightglue-512": (1, 512, 4, 64),  # LightGlue's self-attention: 4 heads of 64
    "lightglue-2048": (1, 2048, 4, 64),
    "vit-1024": (8, 1024, 12, 64),  # a ViT-like batch: 12 heads of 64
}
ROTARY_M = 2


def rotary_inputs(B: int, N: int, H: int, D: int, dtype, device, seed: int = 0):
    """(q, k, x, wr) as in LightGlue's self-attention: q and k [B, H, N, D] sliced from one
    fused qkv tensor (channel stride 3), keypoints x [B, N, 2] in (-1, 1) and wr [D/2, 2]
    of standard deviation 1 (LightGlue's gamma = 1) in float32; q and k in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, N, H, D, 3, generator=g).to(device=device, dtype=dtype).transpose(1, 2)
    q, k = qkv[..., 0], qkv[..., 1]
    x = (torch.rand(B, N, ROTARY_M, generator=g) * 2 - 1).to(device)
    wr = torch.randn(D // 2, ROTARY_M, generator=g).to(device)
    return q, k, x, wr


def rotary_case(name: str, device, dtype=torch.float32, sizes=None) -> BenchCase:
    """q and k rotated by positions (``apply_lff_rotary``); gradients to q, k and wr (as in
    training; the keypoints need none). ``sizes``: (B, N, heads, head_dim), by default
    ROTARY_SIZES[name]. With bfloat16 q and k the baselines' table is float32 (x and wr
    are), so their outputs are float32 as LightGlue's; ours are q's dtype."""
    B, N, H, D = sizes or ROTARY_SIZES[name]
    q, k, x, wr = rotary_inputs(B, N, H, D, dtype, device)
    # q and k are views of qkv: leaves of their own here, for their gradients
    for t in (q, k, wr):
        t.requires_grad_(True)
    eager = _baselines.EagerRotary.from_weights(wr.detach())
    # LightGlue's per-layer cost: the table built once beforehand; in fwd+bwd the gradient
    # goes to q, k and the table (which a training step then carries back to wr once)
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
        {"B": B, "N": N, "heads": H, "head_dim": D, "M": ROTARY_M, "dtype": str(dtype)[6:]},
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
        # elements only: q and k read from the fused qkv tensor also pull v's channels
        # through the caches, so the floor is lower than any strided reader can reach
        work={
            "fwd": Work(2 * qk + x.numel() * x.element_size()),
            # backward: read dq', dk' and x again (cos / sin recomputed), write dq and dk
            "fwd+bwd": Work(4 * qk + 2 * x.numel() * x.element_size()),
        },
    )


def cases(quick: bool, device: str, ops: list[str]) -> list[BenchCase]:
    out: list[BenchCase] = []
    cuda = device == "cuda"
    if "lff" in ops:
        if cuda:
            big = 2**20
            out += [
                lff_case(big, 2, 1, 256, 32, 768, device, torch.bfloat16, " (canonical)"),
                lff_case(big, 2, 1, 256, 32, 768, device, torch.float32),
                lff_case(big, 2, 1, 768, 256, 1024, device, torch.bfloat16, " (compute-bound)"),
                lff_case(4096, 2, 1, 256, 32, 768, device, torch.bfloat16, " (small)"),
                lff_case(65536, 1, 1, 256, 32, 768, device, torch.bfloat16, " (1-D)"),
            ]
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
        # quick: LightGlue's sizes in float32; else also the ViT-like batch, and bfloat16
        # q and k (benchmarks/RESULTS.md's rotary table: every size in float32 and bfloat16)
        names = ("lightglue-512", "lightglue-2048") if quick else tuple(ROTARY_SIZES)
        dtypes = (torch.float32,) if quick else (torch.float32, torch.bfloat16)
        out += [rotary_case(n, device, dt) for dt in dtypes for n in names]
    return out
