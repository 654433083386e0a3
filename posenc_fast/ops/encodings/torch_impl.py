"""Sinusoidal and DFT encodings in pure PyTorch (the CPU fallback).

Both are sines and cosines of the position times a few frequencies (in turns, float64;
the formulas: reference.py). Phases are reduced in float64 before a float32 (or float64)
trig, as for LFF, and written straight into their output columns (no scatter, no concat).
``encoding_add`` with the positions 0..L-1 (the modules' default) keeps the table (up
to KEPT_TABLES_BYTES of them, oldest out first): the add is then one pass, like a module
holding its table in a buffer."""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np
import torch

from .. import _export_phases
from .._torch_math import (
    TWO_PI,
    device_constant,
    feature_dtype,
    reduced_angle,
    reduced_angle_,
    row_chunks,
)
from . import reference


def _make_turns(kind: str, dim: int, base: float) -> torch.Tensor:
    if kind == "sinusoidal":
        i = torch.arange(dim // 2, dtype=torch.float64)
        return base ** (-2.0 * i / dim) / TWO_PI
    if kind == "dft":
        return torch.arange(1, dim // 2, dtype=torch.float64) / dim  # k = 1..K
    raise ValueError(f"unknown encoding kind {kind!r}")


def _turns(kind: str, dim: int, base: float, device: torch.device) -> torch.Tensor:
    """The frequencies in turns, float64 [K], made once per device (shared: never modified)."""
    base = float(base)
    return device_constant(
        ("turns", kind, dim, base), lambda dev: _make_turns(kind, dim, base).to(dev), device
    )


def _angles(p: torch.Tensor, turns: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """2 pi frac(p * nu) for every position and frequency: [n] x [K] -> [n, K]."""
    t = p.to(torch.float64)[:, None] * turns
    if t.requires_grad:  # double backward differentiates this: no out= / in-place ops
        return reduced_angle(t, dtype)
    return reduced_angle_(t, dtype)


def _half_angle(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """2 pi frac(p / 2) = pi p reduced, [n]: the angle of the DFT's last column, cos(pi p)."""
    return reduced_angle(p.to(torch.float64) * 0.5, dtype)


def _fill(out: torch.Tensor, p: torch.Tensor, kind: str, dim: int, turns: torch.Tensor) -> None:
    """Write the encodings of positions p [n] into out [n, dim] (out's dtype >= float32)."""
    ang = _angles(p, turns, out.dtype)
    if kind == "sinusoidal":
        pairs = out.view(out.shape[0], dim // 2, 2)
        torch.sin(ang, out=pairs[:, :, 0])
        torch.cos(ang, out=pairs[:, :, 1])
        return
    K = dim // 2 - 1
    amp = math.sqrt(2.0 / dim)
    out[:, 0] = 1.0 / math.sqrt(dim)
    torch.cos(ang, out=out[:, 1 : K + 1]).mul_(amp)
    torch.sin(ang, out=out[:, K + 1 : 2 * K + 1]).mul_(amp)
    # cos(pi s) = cos(2 pi * frac(s / 2)): the last column, frequency 1/2 turn
    torch.cos(_half_angle(p, out.dtype), out=out[:, dim - 1]).mul_(1.0 / math.sqrt(dim))


def _block_term(kind: str, dim: int, base: float, block, dtype, device):
    """The encoding of position ``block`` [dim], made once per device (shared: never modified)."""
    if block is None:
        return None

    def make(dev: torch.device) -> torch.Tensor:
        row = torch.empty((1, dim), dtype=torch.float64)
        position = torch.tensor([float(block)], dtype=torch.float64)
        _fill(row, position, kind, dim, _turns(kind, dim, base, "cpu"))
        return row[0].to(device=dev, dtype=dtype)

    key = ("block", kind, dim, float(base), float(block), dtype)
    return device_constant(key, make, device)


def _bytes_per_row(dim: int) -> int:
    return 8 * dim + 4 * dim + 64


def encoding_forward(positions, dim: int, kind: str, base: float, block, out_dtype) -> torch.Tensor:
    """positions [...] -> [..., dim] in out_dtype."""
    p = positions.reshape(-1)
    fdt = feature_dtype(out_dtype)
    turns = _turns(kind, dim, base, positions.device)
    extra = _block_term(kind, dim, base, block, fdt, positions.device)
    out = torch.empty((p.shape[0], dim), dtype=out_dtype, device=positions.device)
    for sl in row_chunks(p.shape[0], _bytes_per_row(dim), p.device.type):
        # float32/float64 outputs are filled in place; half precision rounds once at the end
        dst = (
            out[sl]
            if out_dtype == fdt
            else torch.empty((sl.stop - sl.start, dim), dtype=fdt, device=p.device)
        )
        _fill(dst, p[sl], kind, dim, turns)
        if extra is not None:
            dst += extra
        if out_dtype != fdt:
            out[sl] = dst
    return out.reshape(*positions.shape, dim)


def _host_turns(kind: str, dim: int, base: float) -> list[float]:
    """_make_turns' values as Python floats, computed without torch: an exporter's trace
    would record torch's ops on them, in float64, and round their Python-float operands
    (1 / 2pi) to float32 (_torch_math.exact_scalar)."""
    if kind == "sinusoidal":
        return [base ** (-2.0 * i / dim) / TWO_PI for i in range(dim // 2)]
    return [k / dim for k in range(1, dim // 2)]


def _encoding_graph_float32(positions, dim: int, kind: str, base: float, block):
    """encoding_graph's float32 form (ops/_export_phases.py): no float64 tensor; integer
    positions and the block index enter as exact float32 pairs."""
    device = positions.device
    parts = _export_phases.position_parts(positions)
    cos, sin = _export_phases.positions_cos_sin(parts, _host_turns(kind, dim, base), device)
    if kind == "sinusoidal":
        out = torch.stack([sin, cos], dim=-1).flatten(-2)
    else:
        amp, edge = math.sqrt(2.0 / dim), 1.0 / math.sqrt(dim)
        half, _ = _export_phases.positions_cos_sin(parts, [0.5], device)  # cos(pi s)
        out = torch.cat([torch.full_like(half, edge), amp * cos, amp * sin, edge * half], -1)
    if block is not None:  # the block index as hi + lo, constants of the graph
        hi = float(np.float32(block))
        at = [torch.tensor(v, dtype=torch.float32, device=device) for v in (hi, block - hi)]
        bc, bs = _export_phases.positions_cos_sin(at, _host_turns(kind, dim, base), device)
        out = out + torch.stack([bs, bc], dim=-1).flatten(-2)
    return out


def encoding_graph(positions, dim: int, kind: str, base: float, block, out_dtype) -> torch.Tensor:
    """encoding_forward from differentiable, out-of-place ops on the whole input (no
    chunks, no out=, no kept table): the graph an ONNX export traces (ops/_custom_ops.py). Same
    math: float32 phases with the kernels' error-free reduction for a float32 graph
    (ops/_export_phases.py), else float64 phases reduced before the trig."""
    fdt = feature_dtype(out_dtype)
    if fdt == torch.float32 and _export_phases.float32_graph(positions):
        return _encoding_graph_float32(positions, dim, kind, base, block).to(out_dtype)
    p = positions.to(torch.float64).unsqueeze(-1)  # [..., 1]
    # a constant of the graph (made from Python floats: see _host_turns)
    turns = torch.tensor(_host_turns(kind, dim, base), dtype=torch.float64, device=p.device)
    ang = reduced_angle(p * turns, fdt)  # [..., K]
    if kind == "sinusoidal":
        out = torch.stack([torch.sin(ang), torch.cos(ang)], dim=-1).flatten(-2)
    else:
        amp, edge = math.sqrt(2.0 / dim), 1.0 / math.sqrt(dim)
        half = reduced_angle(p * 0.5, fdt)  # cos(pi s): the last column
        first = torch.full_like(half, edge)
        out = torch.cat(
            [first, amp * torch.cos(ang), amp * torch.sin(ang), edge * torch.cos(half)], -1
        )
    # built in the graph: a device_constant, kept for later calls, would hold a fake
    if block is not None:
        at = torch.full((), float(block), dtype=torch.float64, device=positions.device)
        out = out + encoding_graph(at, dim, kind, base, None, fdt)
    return out.to(out_dtype)


def encoding_add_graph(x, positions, kind: str, base: float, block) -> torch.Tensor:
    """encoding_add as encoding_graph does encoding_forward."""
    pe = encoding_graph(positions, x.shape[-1], kind, base, block, feature_dtype(x.dtype))
    return (x + pe).to(x.dtype)


def encoding_nd_add_graph(x, coords, kind: str, base: float) -> torch.Tensor:
    """The Sine-nD add (registry.per_axis) as encoding_graph does encoding_forward."""
    axes = coords.shape[-1]
    x_axes = x.unflatten(-1, (axes, x.shape[-1] // axes))
    return encoding_add_graph(x_axes, coords, kind, base, None).flatten(-2)


# Tables of the positions 0..L-1 (the modules' default): x + table is one add. Oldest out first.
_TABLES: OrderedDict = OrderedDict()
KEPT_TABLES_BYTES = 64 * 2**20


def _is_arange(positions: torch.Tensor) -> bool:
    """Whether positions is the integer sequence 0..L-1 (one small comparison)."""
    if positions.dim() != 1 or positions.is_floating_point() or positions.requires_grad:
        return False
    L = positions.shape[0]
    seq = device_constant(("arange", L), lambda dev: torch.arange(L, device=dev), positions.device)
    return torch.equal(positions, seq.to(positions.dtype))


def _table(positions, dim: int, kind: str, base: float, block, dtype) -> torch.Tensor:
    """encoding_forward(positions) in dtype, a kept table when positions is 0..L-1."""
    L = positions.numel()
    if L * dim * torch.finfo(dtype).bits // 8 > KEPT_TABLES_BYTES or not _is_arange(positions):
        return encoding_forward(positions, dim, kind, base, block, dtype)
    key = (kind, dim, float(base), block, L, dtype, positions.device)
    table = _TABLES.get(key)
    if table is None:
        with torch.inference_mode(False):  # usable by later differentiable calls
            table = encoding_forward(positions, dim, kind, base, block, dtype)
        _TABLES[key] = table
        while sum(t.numel() * t.element_size() for t in _TABLES.values()) > KEPT_TABLES_BYTES:
            _TABLES.popitem(last=False)
    return table


def encoding_add(x, positions, kind: str, base: float, block) -> torch.Tensor:
    """x + encoding(positions), positions broadcast against x.shape[:-1]; one rounding."""
    dim = x.shape[-1]
    pe = _table(positions, dim, kind, base, block, feature_dtype(x.dtype))
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    # Computed in float32 and rounded once to x's dtype, without a float32 copy of x.
    torch.add(x, pe, out=out)
    return out


def encoding_backward(grad, positions, dim: int, kind: str, base: float) -> torch.Tensor:
    """d(sum grad * encoding(positions)) / d positions; grad [*positions.shape, dim]."""
    p = positions.reshape(-1)
    g = grad.reshape(-1, dim)
    fdt = feature_dtype(positions.dtype)
    turns = _turns(kind, dim, base, positions.device)
    rate = (TWO_PI * turns).to(fdt)  # d phase / d position, per frequency
    out = torch.empty(p.shape, dtype=fdt, device=positions.device)
    for sl in row_chunks(p.shape[0], _bytes_per_row(dim), p.device.type):
        ang = _angles(p[sl], turns, fdt)
        gs = g[sl].to(fdt)
        if kind == "sinusoidal":
            g_sin, g_cos = gs[:, 0::2], gs[:, 1::2]
            amp_rate = rate
        else:
            K = dim // 2 - 1
            g_cos, g_sin = gs[:, 1 : K + 1], gs[:, K + 1 : 2 * K + 1]
            amp_rate = rate * math.sqrt(2.0 / dim)
        # d sin/dp = rate cos, d cos/dp = -rate sin
        per_freq = torch.mul(g_sin, torch.cos(ang)).addcmul_(g_cos, torch.sin(ang), value=-1.0)
        out[sl] = per_freq @ amp_rate
        if kind == "dft":  # the last column, cos(pi s) / sqrt(dim)
            half = _half_angle(p[sl], fdt)
            out[sl] -= gs[:, dim - 1] * torch.sin(half) * (math.pi / math.sqrt(dim))
    return out.to(positions.dtype).reshape(positions.shape)


def _lattice_basis(dim: int, device, dtype) -> torch.Tensor:
    """[l, t] = phi_l(t) on the lattice t = 0..dim-1, made once per device (shared: never
    modified)."""

    def make(dev: torch.device) -> torch.Tensor:
        lattice = torch.arange(dim, dtype=torch.float64)
        return reference.dft_basis(dim, lattice).T.contiguous().to(device=dev, dtype=dtype)

    return device_constant(("dft_basis", dim, dtype), make, device)


def lattice_inverse(encoding: torch.Tensor) -> torch.Tensor:
    """The inverse DFT over the lattice (Eq. 13): one matmul with the constant orthonormal
    basis, a plain (autograd-differentiable) matmul on every backend but the reference."""
    dim = encoding.shape[-1]
    if _export_phases.float32_graph(encoding):
        # the lattice's encodings [t, l] = phi_l(t), transposed, by the float32 graph (a
        # kept basis would be made by float64 ops, which the exporter would record)
        lattice = torch.arange(dim, device=encoding.device)
        basis = _encoding_graph_float32(lattice, dim, "dft", 1.0, None).T
        return encoding @ basis.to(encoding.dtype)
    return encoding @ _lattice_basis(dim, encoding.device, encoding.dtype)
