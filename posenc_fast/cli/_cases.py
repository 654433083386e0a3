"""Benchmark cases: one setup factory per op, shared by the speed and memory runs.

A case holds the inputs once and a closure per implementation that computes the op's
output from them, so every implementation runs on the very same tensors:
- "reference": the reference equations evaluated eagerly in the working dtype (plain
  PyTorch, what a user would write; the float64 specification itself is not a timing
  baseline),
- "compile": torch.compile of that same function (and "compile-max" with --max-autotune),
- one entry per usable posenc_fast backend ("torch", "triton", "cpp", "cuda").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .. import _testing
from .. import backends as _backends
from .. import encodings as enc_api
from ..fourier_features import lff
from ..reference import encodings as enc_ref
from ..reference import fourier_features as lff_ref


@dataclass
class BenchCase:
    op: str  # "lff", "sinusoidal", "sinusoidal_add", "dft", "dft_add", "floater"
    label: str  # the sizes, readable
    size: int  # the x axis of plots (positions N, or sequence length L)
    sizes: dict  # every size parameter, for the JSON
    leaves: list  # the inputs that require grad in "fwd+bwd" mode
    reference: Callable  # reference(*args) -> Tensor, eager, working dtype
    args: tuple  # the reference's arguments
    backends: dict  # backend name -> closure () -> Tensor
    context: Callable = contextlib.nullcontext  # e.g. autocast for bf16 cases
    floor_bytes: int = 0  # bytes a forward must move at least (for GB/s)
    extra: dict = field(default_factory=dict)


def _available(op: str, device: str, dtype) -> list[str]:
    """Usable backends that "auto" could pick here: e.g. not the Triton interpreter on the
    CPU (TRITON_INTERPRET=1), which is for verification, not timing."""
    names = _testing.backends_for(op, device, dtype)
    return [n for n in names if _backends.get(n).auto_eligible(op, device)]


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
    autocast = dtype in (torch.float16, torch.bfloat16)
    ctx = (lambda: torch.autocast(device, dtype=dtype)) if autocast else contextlib.nullcontext
    compute = torch.float32 if autocast else dtype

    def reference(x, wr, w1, b1, w2, b2):
        return lff_ref.lff(x, wr, w1, b1, w2, b2, "gelu", None, compute)

    backends = {}
    for name in _available("lff", device, dtype):
        backends[name] = lambda name=name: lff(x, wr, w1, b1, w2, b2, "gelu", name)
    out_bytes = N * D * torch.finfo(dtype).bits // 8
    label = f"N={N} M={M} G={G} F={F} H={H} D={D} {str(dtype)[6:]}{label_extra}"
    sizes = {"N": N, "M": M, "G": G, "F": F, "H": H, "D": D, "dtype": str(dtype)[6:]}
    return BenchCase(
        "lff",
        label,
        N,
        sizes,
        weights,
        reference,
        (x, *weights),
        backends,
        ctx,
        floor_bytes=out_bytes + x.numel() * x.element_size(),
    )


def encoding_case(kind: str, N: int, dim: int, device, dtype=torch.float32) -> BenchCase:
    """The table [N, dim] of N real positions (gradient to the positions)."""
    p = _testing.rand((N,), _testing.generator(N + dim), 0.0, float(N), dtype, device)
    p.requires_grad_(True)
    fn = enc_api.dft if kind == "dft" else enc_api.sinusoidal

    def reference(p):
        if kind == "dft":
            return enc_ref.dft(p, dim, compute_dtype=dtype)
        return enc_ref.sinusoidal(p, dim, compute_dtype=dtype)

    backends = {
        name: (lambda name=name: fn(p, dim, backend=name))
        for name in _available("encoding", device, dtype)
    }
    elt = torch.finfo(dtype).bits // 8
    return BenchCase(
        kind,
        f"N={N} dim={dim} {str(dtype)[6:]}",
        N,
        {"N": N, "dim": dim, "dtype": str(dtype)[6:]},
        [p],
        reference,
        (p,),
        backends,
        floor_bytes=N * dim * elt + N * elt,
    )


def encoding_add_case(
    kind: str, B: int, L: int, dim: int, device, dtype=torch.float32
) -> BenchCase:
    """x [B, L, dim] + encoding(0..L-1): the module's fused add (gradient to x)."""
    x = _testing.randn((B, L, dim), _testing.generator(B * L + dim), dtype, device)
    x.requires_grad_(True)
    positions = torch.arange(L, device=device)
    module = enc_api.DFTPE(dim) if kind == "dft" else enc_api.SinusoidalPE(dim)

    def reference(x):
        ref = enc_ref.dft if kind == "dft" else enc_ref.sinusoidal
        return x + ref(positions, dim, compute_dtype=dtype).to(x.dtype)

    backends = {}
    for name in _available("encoding", device, dtype):
        module_b = type(module)(dim, backend=name)
        backends[name] = lambda m=module_b: m(x)
    elt = torch.finfo(dtype).bits // 8
    return BenchCase(
        f"{kind}_add",
        f"B={B} L={L} dim={dim} {str(dtype)[6:]}",
        B * L,
        {"B": B, "L": L, "dim": dim, "dtype": str(dtype)[6:]},
        [x],
        reference,
        (x,),
        backends,
        floor_bytes=2 * B * L * dim * elt,
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
            sizes = (4096, 16384) if quick else (4096, 16384, 65536)
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
            out += [encoding_add_case(kind, 8, 1024 if quick else 4096, 768, device)]
    return out
