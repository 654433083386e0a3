"""64-bit indexing on the GPU: outputs, inputs and gradients with more
than 2^31 elements, checked against the float64 reference on the rows at both ends and on
the rows around element 2^31 (where a 32-bit offset would wrap).

test_triton.py::test_more_than_2_31_output_elements already covers the triton sinusoidal
forward and the LFF forward with its dx; this file adds the DFT forward, the fused adds
(positions broadcast and per row), the encodings' backward, the LFF weight gradients and
the torch backend (the fallback on CUDA for float64 and oversized problems).

The GPU tests need a CUDA device with ~40 GB free and are skipped otherwise, with that
reason. The same helpers run at a small size on the CPU (``test_helpers_at_small_size``),
so the GPU-only code stays exercised in CI.
"""

from __future__ import annotations

import _helpers
import pytest
import torch
from conftest import DEVICE, backend_params

import posenc_fast as pf
from posenc_fast.cli import _inputs
from posenc_fast.ops.encodings import reference as ref_enc
from posenc_fast.ops.lff import reference as ref_lff
from posenc_fast.tolerances import assert_close

BIG = 2**31


def _gpu_reason():
    if not torch.cuda.is_available():
        return "needs a CUDA device: 64-bit indexing is checked with > 2^31-element tensors"
    free, _ = torch.cuda.mem_get_info()
    if free < 40e9:
        return f"needs ~40 GB of free GPU memory, {free / 1e9:.0f} GB free"
    reasons = _helpers.environment_reasons("triton")
    if reasons:
        return f"the triton backend is unavailable: {'; '.join(reasons)}"
    return ""


@pytest.fixture
def big_gpu():
    """Skip, saying why, unless a CUDA device with room for > 2^31-element tensors is here
    (asked when a test runs: no CUDA context is created while collecting)."""
    reason = _gpu_reason()
    if reason:
        pytest.skip(reason)
    yield
    torch.cuda.empty_cache()


def _rows(n: int, width: int) -> list[int]:
    """Rows to check: the first, the last, and those holding elements 2^31 - 1 and 2^31."""
    edge = [(BIG - 1) // width, BIG // width, BIG // width + 1]
    return sorted({r for r in [0, 1, *edge, n - 2, n - 1] if 0 <= r < n})


# ---------------------------------------------------------------- helpers (any size)


def check_dft_forward(n, dim, device, backend):
    p = torch.arange(n, device=device, dtype=torch.float32) * 0.37 - 1000.0
    out = pf.dft(p, dim, backend=backend)
    assert out.shape == (n, dim)
    rows = _rows(n, dim)
    assert_close(out[rows], ref_enc.dft(p[rows], dim), torch.float32, "encoding")


def check_sinusoidal_forward(n, dim, device, backend):
    p = torch.arange(n, device=device, dtype=torch.float32) * 1.37
    out = pf.sinusoidal(p, dim, backend=backend)
    rows = _rows(n, dim)
    assert_close(out[rows], ref_enc.sinusoidal(p[rows], dim), torch.float32, "encoding")


def check_fused_add(batch, length, dim, device, backend, kind, per_row):
    """x [batch, length, dim] bf16 + encoding of positions [length] (broadcast: the kernel
    wraps row indices) or [batch, length]."""
    g = _inputs.generator(1)
    x = torch.empty(batch, length, dim, dtype=torch.bfloat16, device=device).uniform_(-1, 1)
    shape = (batch, length) if per_row else (length,)
    p = _inputs.rand(shape, g, 0.0, 5e4, torch.float32, device)
    module = (pf.SinusoidalPE if kind == "sinusoidal" else pf.DFTPE)(dim, backend=backend)
    y = module(x, p)
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    flat_y, flat_x = y.view(-1, dim), x.view(-1, dim)
    flat_p = p.expand(batch, length).reshape(-1)
    rows = _rows(batch * length, dim)
    ref = ref_enc.sinusoidal if kind == "sinusoidal" else ref_enc.dft
    expected = flat_x[rows].double() + ref(flat_p[rows], dim)
    assert_close(flat_y[rows], expected, torch.bfloat16, "lff", what=f"{kind} per_row={per_row}")


def check_encoding_backward(n, dim, device, backend, kind):
    """d positions through an output of n * dim elements; the incoming gradient is zero
    except on the checked rows, so the reference needs only those rows."""
    p = (torch.arange(n, device=device, dtype=torch.float32) * 0.73).requires_grad_()
    fn = pf.sinusoidal if kind == "sinusoidal" else pf.dft
    out = fn(p, dim, backend=backend)
    rows = _rows(n, dim)
    g = torch.zeros_like(out)
    g_rows = _inputs.randn((len(rows), dim), _inputs.generator(2), torch.float32, device)
    g[rows] = g_rows
    out.backward(g)
    del out, g
    p64 = p.detach()[rows].double().requires_grad_()
    ref = ref_enc.sinusoidal if kind == "sinusoidal" else ref_enc.dft
    (ref(p64, dim) * g_rows.double()).sum().backward()
    assert_close(p.grad[rows], p64.grad, torch.float32, "grad", what=kind)
    others = torch.ones(n, dtype=torch.bool, device=device)
    others[rows] = False
    assert not p.grad[others].any(), "a gradient appeared on a row without incoming gradient"


def check_lff_weight_gradients(n, Dg, device, backend, dtype):
    """All six gradients of an LFF whose output has n * Dg elements; the incoming gradient
    is zero except on the checked rows (so the weight gradients equal the reference's on
    those rows alone, and the zero rows add nothing, exactly)."""
    case = _inputs.LffCase((n,), 1, 2, 64, 16, Dg)
    inputs = _inputs.lff_inputs(case, dtype, device, seed=4)
    leaves = [t.detach().requires_grad_() for t in inputs]
    y = pf.lff(*leaves, backend=backend)
    assert y.shape == (n, Dg)
    rows = _rows(n, Dg)
    g = torch.zeros_like(y)
    g[rows] = _inputs.randn((len(rows), Dg), _inputs.generator(5), dtype, device)
    y.backward(g)
    gr = g[rows].double()
    del y, g
    ref_in = [t.detach()[rows] if i == 0 else t.detach() for i, t in enumerate(inputs)]
    ref_leaves = [t.double().requires_grad_() for t in ref_in]
    ref_lff.lff(*ref_leaves).backward(gr)
    names = ("x", "wr", "w1", "b1", "w2", "b2")
    for i, (name, got, want) in enumerate(zip(names, leaves, ref_leaves)):
        grad = got.grad[rows] if i == 0 else got.grad
        assert_close(grad, want.grad, dtype, "grad", what=f"d{name}")


# ---------------------------------------------------------------- on the GPU


@pytest.mark.slow
def test_triton_dft_forward_beyond_2_31(big_gpu):
    n, dim = 2**22 + 3, 520  # 2.18e9 float32 elements
    assert n * dim > BIG
    check_dft_forward(n, dim, "cuda", "triton")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sinusoidal", "dft"])
@pytest.mark.parametrize("per_row", [False, True], ids=["broadcast", "per-row"])
def test_triton_fused_add_beyond_2_31(kind, per_row, big_gpu):
    batch, length, dim = 2, 2**21 + 1, 520  # 2.18e9 bf16 elements in x and in the sum
    assert batch * length * dim > BIG
    check_fused_add(batch, length, dim, "cuda", "triton", kind, per_row)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sinusoidal", "dft"])
def test_triton_encoding_backward_beyond_2_31(kind, big_gpu):
    n, dim = 2**22 + 3, 520
    check_encoding_backward(n, dim, "cuda", "triton", kind)


@pytest.mark.slow
def test_triton_lff_weight_gradients_beyond_2_31(big_gpu):
    n, Dg = 2**21 + 5, 1024  # 2.15e9 bf16 output elements
    assert n * Dg > BIG
    check_lff_weight_gradients(n, Dg, "cuda", "triton", torch.bfloat16)


@pytest.mark.slow
def test_torch_backend_beyond_2_31(big_gpu):
    """The CUDA fallback (float64, oversized problems): chunked PyTorch, same indexing."""
    check_sinusoidal_forward(2**22 + 3, 520, "cuda", "torch")
    check_lff_weight_gradients(2**21 + 5, 1024, "cuda", "torch", torch.bfloat16)


# ---------------------------------------------------------------- the helpers, small


@pytest.mark.parametrize("backend", backend_params("lff"))
def test_helpers_at_small_size(backend):
    """The GPU tests' checks on a few rows, on the test device (CPU: the interpreter)."""
    check_dft_forward(37, 8, DEVICE, backend)
    check_sinusoidal_forward(37, 8, DEVICE, backend)
    for kind in ("sinusoidal", "dft"):
        check_encoding_backward(29, 6, DEVICE, backend, kind)
        check_fused_add(2, 9, 6, DEVICE, backend, kind, per_row=True)
        check_fused_add(2, 9, 6, DEVICE, backend, kind, per_row=False)
    check_lff_weight_gradients(19, 6, DEVICE, backend, torch.bfloat16)
    check_lff_weight_gradients(19, 6, DEVICE, backend, torch.float32)
