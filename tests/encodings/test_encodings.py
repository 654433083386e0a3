"""Sinusoidal and DFT encodings (and their fused adds): every backend vs the reference."""

import math

import _helpers
import numpy as np
import pytest
import torch
from conftest import backend_dtype_params, backend_params
from torch.library import opcheck

import posenc_fast as pf
from posenc_fast.cli import _inputs
from posenc_fast.ops.encodings import reference as ref
from posenc_fast.tolerances import PHASE_ATOL, assert_close

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
CASES = [pytest.param(c, id=c.id) for c in _inputs.ENCODING_CASES]
FUNCS = {"sinusoidal": pf.sinusoidal, "dft": pf.dft}
MODULES = {"sinusoidal": pf.SinusoidalPE, "dft": pf.DFTPE}


def _reference(kind, positions, dim, **kw):
    return ref.dft(positions, dim) if kind == "dft" else ref.sinusoidal(positions, dim, **kw)


@pytest.mark.parametrize("backend,dtype", backend_dtype_params("encoding", DTYPES))
@pytest.mark.parametrize("case", CASES)
def test_forward_matches_reference(backend, dtype, case, device):
    p = _inputs.positions(case, dtype, device, seed=_helpers.seed_of(case.id))
    before = p.clone()
    out = FUNCS[case.kind](p, case.dim, backend=backend)
    expected_dtype = dtype if p.is_floating_point() else torch.get_default_dtype()
    assert out.shape == (*case.shape, case.dim) and out.dtype == expected_dtype
    assert_close(
        out,
        _reference(case.kind, p, case.dim),
        expected_dtype,
        "encoding",
        what=f"{backend} {case.id}",
    )
    assert torch.equal(p, before)


@pytest.mark.parametrize("backend,dtype", backend_dtype_params("encoding", DTYPES))
@pytest.mark.parametrize("kind", ["sinusoidal", "dft"])
def test_backward_matches_reference(backend, dtype, kind, device):
    g = _inputs.generator(3)
    p = _inputs.rand((4, 9), g, -40.0, 40.0, dtype, device).requires_grad_()
    out = FUNCS[kind](p, 12, backend=backend)
    grad = _inputs.randn(out.shape, g, dtype, device)
    out.backward(grad)
    p64 = p.detach().double().requires_grad_()
    _reference(kind, p64, 12).backward(grad.double())
    assert p.grad.dtype == dtype
    assert_close(p.grad, p64.grad, dtype, "grad", what=f"{kind} {backend}")


@pytest.mark.parametrize("backend,dtype", backend_dtype_params("encoding", DTYPES))
@pytest.mark.parametrize("kind", ["sinusoidal", "dft"])
@pytest.mark.parametrize("pos_shape", [(7,), (3, 7), (3, 1)], ids=["P-L", "P-BL", "P-B1"])
def test_fused_add_matches_reference(backend, dtype, kind, pos_shape, device):
    g = _inputs.generator(5)
    x = _inputs.randn((3, 7, 10), g, dtype, device).requires_grad_()
    p = _inputs.rand(pos_shape, g, -60.0, 60.0, dtype, device).requires_grad_()
    module = MODULES[kind](10, backend=backend)
    before = x.detach().clone()
    y = module(x, p)
    assert y.dtype == dtype and y.shape == x.shape
    expected = x.detach().double() + _reference(kind, p.detach(), 10)
    kind_tol = "encoding" if dtype in (torch.float32, torch.float64) else "lff"
    assert_close(y, expected, dtype, kind_tol, what=f"{kind} {backend}")
    assert torch.equal(x.detach(), before)
    grad = _inputs.randn(y.shape, g, dtype, device)
    y.backward(grad)
    assert torch.equal(x.grad, grad)
    p64 = p.detach().double().requires_grad_()
    (_reference(kind, p64, 10) * grad.double()).sum().backward()
    assert_close(p.grad, p64.grad, dtype, "grad")


@pytest.mark.parametrize(
    "backend", backend_params("encoding", torch.float32, include_reference=True)
)
@pytest.mark.parametrize("kind", ["sinusoidal", "dft"])
def test_default_positions_are_arange(backend, kind, device):
    x = torch.randn(2, 6, 8, device=device)
    y = MODULES[kind](8, backend=backend)(x)
    expected = x.double() + _reference(kind, torch.arange(6), 8)
    assert_close(y, expected, torch.float32, "encoding")


@pytest.mark.parametrize("backend", backend_params("encoding", torch.float64))
@pytest.mark.parametrize("kind", ["sinusoidal", "dft"])
def test_gradcheck_float64(backend, kind, device):
    p = (torch.rand(5, dtype=torch.float64, device=device) * 30).requires_grad_()
    assert torch.autograd.gradcheck(lambda p: FUNCS[kind](p, 8, backend=backend), (p,))
    x = torch.randn(2, 5, 8, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, p: MODULES[kind](8, backend=backend)(x, p), (x, p))


@pytest.mark.parametrize("kind", ["sinusoidal", "dft"])
def test_gradgradcheck_torch_backend(kind, device):
    p = (torch.rand(5, dtype=torch.float64, device=device) * 30).requires_grad_()
    assert torch.autograd.gradgradcheck(lambda p: FUNCS[kind](p, 8, backend="torch"), (p,))


@pytest.mark.parametrize("backend", backend_params("encoding", torch.float32))
@pytest.mark.parametrize("kind", ["sinusoidal", "dft"])
def test_opcheck(backend, kind, device):
    p = (torch.rand(3, 5, device=device) * 20).requires_grad_()
    x = torch.randn(2, 3, 5, 8, device=device, requires_grad=True)
    block = 3.0 if kind == "sinusoidal" else None
    opcheck(
        torch.ops.posenc_fast.encoding.default, (p, 8, kind, 10000.0, block, torch.float32, backend)
    )
    opcheck(torch.ops.posenc_fast.encoding_add.default, (x, p, kind, 10000.0, None, backend))
    opcheck(
        torch.ops.posenc_fast.encoding_backward.default,
        (torch.randn(3, 5, 8, device=device), p.detach(), 8, kind, 10000.0, backend),
    )


@pytest.mark.parametrize("kind", ["sinusoidal", "dft"])
def test_compile_fullgraph_module(kind, device):
    module = MODULES[kind](8)
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 6, 8, device=device, requires_grad=True)
    p = torch.rand(6, device=device, requires_grad=True) * 10
    torch.testing.assert_close(compiled(x, p), module(x, p))
    compiled(x, p).sum().backward()
    assert x.grad is not None


# ---------------------------------------------------------------- the papers' properties


@pytest.mark.parametrize("dim", [2, 8, 64, 100])
def test_dft_encodings_of_the_lattice_are_orthonormal(dim):
    e = pf.dft(torch.arange(dim, dtype=torch.float64), dim)  # row s = e(s)
    torch.testing.assert_close(e @ e.T, torch.eye(dim, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(e.T @ e, torch.eye(dim, dtype=torch.float64), atol=1e-12, rtol=0)


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("dim", [4, 16, 50])
def test_dft_inverse_gives_one_hots(backend, dim):
    s = torch.arange(dim, dtype=torch.float64)
    inv = pf.dft_inverse(pf.dft(s, dim, backend=backend), backend=backend)
    torch.testing.assert_close(inv, torch.eye(dim, dtype=torch.float64), atol=1e-12, rtol=0)
    inv32 = pf.dft_inverse(pf.dft(s.long(), dim, backend=backend), backend=backend)  # float32
    assert (inv32 - torch.eye(dim)).abs().max() < 1e-5


def test_dft_layout_matches_eq_21():
    dim, s = 10, 2.3
    K = dim // 2 - 1
    e = pf.dft(torch.tensor([s], dtype=torch.float64), dim)[0]
    w = [2 * math.pi * k / dim for k in range(K + 1)]
    expected = [1 / math.sqrt(dim)]
    expected += [math.sqrt(2 / dim) * math.cos(w[k] * s) for k in range(1, K + 1)]
    expected += [math.sqrt(2 / dim) * math.sin(w[k] * s) for k in range(1, K + 1)]
    expected += [math.cos(math.pi * s) / math.sqrt(dim)]
    np.testing.assert_allclose(e.numpy(), expected, rtol=0, atol=1e-14)


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_sinusoidal_float64_against_numpy(backend):
    p = np.array([0.0, 1.0, 17.5, -3.25, 1234.0])
    dim, base = 12, 10000.0
    i = np.arange(dim // 2)
    freq = 1.0 / base ** (2 * i / dim)
    expected = np.empty((5, dim))
    expected[:, 0::2] = np.sin(p[:, None] * freq)
    expected[:, 1::2] = np.cos(p[:, None] * freq)
    got = pf.sinusoidal(torch.from_numpy(p), dim, backend=backend).numpy()
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-13)
    # FLOATER Eq. 7: the per-block term adds the encoding of the block index n
    n = 3
    blk = np.empty(dim)
    blk[0::2], blk[1::2] = np.sin(n * freq), np.cos(n * freq)
    got = pf.sinusoidal(torch.from_numpy(p), dim, block=n, backend=backend).numpy()
    np.testing.assert_allclose(got, expected + blk, rtol=0, atol=1e-13)


@pytest.mark.parametrize("backend", backend_params("encoding", torch.float32))
@pytest.mark.parametrize("kind", ["sinusoidal", "dft"])
def test_large_positions_fp32(backend, kind, device):
    """Within 1e-6 of float64 math on the same fp32 positions, up to 1e5."""
    p = _inputs.rand((513,), _inputs.generator(9), -1e5, 1e5, torch.float32, device)
    out = FUNCS[kind](p, 64, backend=backend)
    scale = math.sqrt(64 / 2) if kind == "dft" else 1.0  # compare raw cos/sin
    err = ((out.double() - _reference(kind, p, 64)) * scale).abs().max().item()
    assert err <= PHASE_ATOL, f"max error {err:.3g} for positions up to 1e5"


def test_sinusoidal_nd_concatenates_axes_in_order():
    coords = torch.rand(4, 3, 2) * 10
    out = pf.sinusoidal_nd(coords, 6)
    assert out.shape == (4, 3, 12)
    torch.testing.assert_close(out[..., :6], pf.sinusoidal(coords[..., 0], 6))
    torch.testing.assert_close(out[..., 6:], pf.sinusoidal(coords[..., 1], 6))


@pytest.mark.parametrize("func", [pf.sinusoidal, pf.dft], ids=["sinusoidal", "dft"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_dtype_argument(func, dtype, device):
    """dtype= sets the result's dtype whatever the positions' (integer grid indices in a
    bfloat16 model), with the phases computed as accurately as always."""
    p = torch.arange(40, device=device).reshape(4, 10)
    out = func(p, 16, dtype=dtype)
    assert out.dtype == dtype
    kind = "sinusoidal" if func is pf.sinusoidal else "dft"
    assert_close(out, _reference(kind, p, 16), dtype, "encoding")
    rc = pf.grid_positions(3, 5, normalize=False, device=device)
    nd = pf.sinusoidal_nd(rc, 8, dtype=dtype)
    assert nd.dtype == dtype and nd.shape == (15, 16)
    assert_close(nd, ref.sinusoidal_nd(rc, 8), dtype, "encoding")
    with pytest.raises(TypeError, match="dtype must be a floating torch.dtype"):
        func(p, 16, dtype=torch.int32)


ND_SHAPES = [((7, 2), 8), ((3, 7, 2), 12), ((7, 3), 12), ((1, 1, 2), 4), ((3, 1, 2), 8)]


@pytest.mark.parametrize("backend,dtype", backend_dtype_params("encoding_nd", DTYPES))
@pytest.mark.parametrize(
    "coord_shape,dim", ND_SHAPES, ids=[f"C{'x'.join(map(str, c))}-d{d}" for c, d in ND_SHAPES]
)
def test_nd_fused_add_matches_reference(backend, dtype, coord_shape, dim, device):
    """SinusoidalNdPE: x + Sine-nD of coords in one op, forward and backward, coords
    broadcast against x [3, 7, dim] (grid shared by the batch, per-sample, size-1 dims)."""
    g = _inputs.generator(11 + dim)
    axes = coord_shape[-1]
    x = _inputs.randn((3, 7, dim), g, dtype, device).requires_grad_()
    c = _inputs.rand(coord_shape, g, -30.0, 30.0, dtype, device).requires_grad_()
    before = (x.detach().clone(), c.detach().clone())
    y = pf.SinusoidalNdPE(dim, axes, base=100.0, backend=backend)(x, c)
    assert y.dtype == dtype and y.shape == x.shape
    expected = x.detach().double() + ref.sinusoidal_nd(c.detach(), dim // axes, 100.0)
    kind_tol = "encoding" if dtype in (torch.float32, torch.float64) else "lff"
    assert_close(y, expected, dtype, kind_tol, what=f"{backend} {coord_shape}")
    grad = _inputs.randn(y.shape, g, dtype, device)
    y.backward(grad)
    assert torch.equal(x.grad, grad)
    c64 = c.detach().double().requires_grad_()
    (ref.sinusoidal_nd(c64, dim // axes, 100.0) * grad.double()).sum().backward()
    assert_close(c.grad, c64.grad, dtype, "grad")
    assert torch.equal(x.detach(), before[0]) and torch.equal(c.detach(), before[1])


@pytest.mark.parametrize("backend", backend_params("encoding_nd", torch.float32))
def test_nd_fused_add_integer_grid_in_bfloat16(backend, device):
    rc = pf.grid_positions(4, 6, normalize=False, device=device)  # int64 [24, 2]
    x = torch.randn(2, 24, 16, device=device).bfloat16()
    y = pf.SinusoidalNdPE(16, 2, backend=backend)(x, rc)
    assert y.dtype == torch.bfloat16
    assert_close(y, x.double() + ref.sinusoidal_nd(rc, 8), torch.bfloat16, "lff")


@pytest.mark.parametrize("backend", backend_params("encoding_nd", torch.float64))
def test_nd_fused_add_gradcheck_and_opcheck(backend, device):
    x = torch.randn(2, 5, 12, dtype=torch.float64, device=device, requires_grad=True)
    c = (torch.rand(5, 3, dtype=torch.float64, device=device) * 20).requires_grad_()
    module = pf.SinusoidalNdPE(12, 3, backend=backend)
    assert torch.autograd.gradcheck(module, (x, c))
    for dt in (torch.float32, torch.float64):
        if backend in _inputs.backends_for("encoding_nd", device, dt):
            args = (x.detach().to(dt).requires_grad_(), c.detach().to(dt).requires_grad_())
            opcheck(
                torch.ops.posenc_fast.encoding_nd_add.default, (*args, "sinusoidal", 1e4, backend)
            )


def test_nd_fused_add_compiles_and_backends_without_it_refuse(device, monkeypatch):
    module = pf.SinusoidalNdPE(8, 2)
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 6, 8, device=device, requires_grad=True)
    c = torch.rand(6, 2, device=device) * 10
    torch.testing.assert_close(compiled(x, c), module(x, c))

    import _helpers

    from posenc_fast import _dispatch
    from posenc_fast._dispatch import Backend, Problem
    from posenc_fast.ops.encodings.registry import ENCODING_ND

    # A backend that has the 1-D add but not the n-d one: no entry in the n-d registry.
    only = Backend("encodings-only", "test")
    monkeypatch.setitem(_dispatch.BACKENDS, "encodings-only", only)
    problem = Problem("encoding_nd", device, torch.float32, {"dim": 4, "axes": 2})
    reasons = _dispatch.reasons("encodings-only", ENCODING_ND, problem)
    assert reasons == ["does not implement encoding_nd"]
    assert not _dispatch.auto_eligible("encodings-only", ENCODING_ND, device)
    monkeypatch.delitem(_dispatch.BACKENDS, "encodings-only")
    assert _helpers.reasons("cpp", problem), "cpp declares no n-d add today"
    with pytest.raises(pf.BackendError, match="cpp"):
        pf.SinusoidalNdPE(8, 2, backend="cpp")(x, c)


# ---------------------------------------------------------------- edge cases and bad input


@pytest.mark.parametrize(
    "backend", backend_params("encoding", torch.float32, include_reference=True)
)
def test_non_contiguous_and_expanded(backend, device):
    p = (torch.rand(6, 4, device=device) * 20).T  # non-contiguous
    assert_close(
        pf.sinusoidal(p, 8, backend=backend), ref.sinusoidal(p, 8), torch.float32, "encoding"
    )
    x = torch.randn(8, 5, device=device).T  # non-contiguous x [5, 8]
    pe = torch.arange(5.0, device=device)[None].expand(3, 5)  # stride 0
    y = pf.DFTPE(8, backend=backend)(x.expand(3, 5, 8), pe)
    assert_close(y, x.double() + ref.dft(pe, 8), torch.float32, "encoding")


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda: pf.sinusoidal([1.0, 2.0], 8), TypeError, "positions must be a torch.Tensor"),
        (lambda: pf.sinusoidal(torch.ones(3), 7), ValueError, "dim must be even"),
        (lambda: pf.sinusoidal(torch.ones(3), 0), ValueError, "dim must be positive"),
        (
            lambda: pf.sinusoidal(torch.ones(3), 8, base=-1.0),
            ValueError,
            "base must be a finite positive",
        ),
        (
            lambda: pf.sinusoidal(torch.ones(3, dtype=torch.complex64), 8),
            TypeError,
            "positions must be real",
        ),
        (
            lambda: pf.sinusoidal(torch.ones(3, dtype=torch.bool), 8),
            TypeError,
            "floating or integer",
        ),
        (lambda: pf.dft(torch.ones(3), 9), ValueError, "dim must be even for the DFT"),
        (lambda: pf.dft_inverse(torch.ones(3, 7)), ValueError, "dim must be even for the DFT"),
        (
            lambda: pf.dft_inverse(torch.ones(3, 8, dtype=torch.long)),
            TypeError,
            "encoding must have a floating",
        ),
        (
            lambda: pf.SinusoidalPE(8)(torch.ones(3, 6)),
            ValueError,
            r"x must have shape \[\.\.\., L, dim=8\]",
        ),
        (
            lambda: pf.SinusoidalPE(8)(torch.ones(2, 3, 8), torch.ones(4)),
            ValueError,
            "positions must broadcast",
        ),
        (
            lambda: pf.DFTPE(8)(torch.ones(3, 8), torch.ones(2, 3)),
            ValueError,
            "positions must broadcast",
        ),
        (
            lambda: pf.DFTPE(8)(torch.ones(3, 8), torch.ones(3, device="meta")),
            ValueError,
            "positions is on meta",
        ),
        (lambda: pf.DFTPE(7), ValueError, "dim must be even for the DFT"),
        (
            lambda: pf.SinusoidalPE(8)(torch.ones(3, 8, dtype=torch.long)),
            TypeError,
            "x must have a floating",
        ),
        (lambda: pf.sinusoidal_nd(torch.ones(3, 2), 5), ValueError, "dim_per_axis must be even"),
        (lambda: pf.SinusoidalNdPE(10, 2), ValueError, "dim must be a multiple of 2 \\* axes = 4"),
        (
            lambda: pf.SinusoidalNdPE(8, 2)(torch.ones(3, 8), torch.ones(3, 3)),
            ValueError,
            r"coords must have shape \[\.\.\., axes=2\]",
        ),
        (
            lambda: pf.SinusoidalNdPE(8, 2)(torch.ones(3, 8), torch.ones(4, 2)),
            ValueError,
            "coords must have shape",
        ),
        (
            lambda: pf.SinusoidalNdPE(8, 2)(torch.ones(3, 6), torch.ones(3, 2)),
            ValueError,
            r"x must have shape \[\.\.\., dim=8\]",
        ),
        (
            lambda: pf.sinusoidal(torch.ones(3), 8, block=float("nan")),
            ValueError,
            "block must be finite",
        ),
    ],
)
def test_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize(
    "backend", backend_params("encoding", torch.float32, include_reference=True)
)
def test_empty_inputs(backend, device):
    assert pf.sinusoidal(torch.empty(0, 3, device=device), 4, backend=backend).shape == (0, 3, 4)
    x = torch.empty(2, 0, 8, device=device)
    assert pf.DFTPE(8, backend=backend)(x).shape == (2, 0, 8)


# ---------------------------------------------------------------- grid_positions


def test_grid_positions():
    g = pf.grid_positions(2, 3)
    assert g.shape == (6, 2) and g.dtype == torch.get_default_dtype()
    torch.testing.assert_close(g[:, 0], torch.tensor([0.25, 0.25, 0.25, 0.75, 0.75, 0.75]))
    torch.testing.assert_close(g[:, 1], torch.tensor([1, 3, 5, 1, 3, 5]) / 6.0)
    idx = pf.grid_positions(2, 3, normalize=False)
    assert idx.dtype == torch.int64
    assert idx.tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]
    assert pf.grid_positions(4, 5, 6, dtype=torch.float64).shape == (120, 3)
    with pytest.raises(ValueError, match=r"sizes\[1\] must be positive"):
        pf.grid_positions(3, 0)


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_dft_inverse_gradcheck_float64(backend):
    e = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda e: pf.dft_inverse(e, backend=backend), (e,))


def test_export_before_the_first_eager_call_caches_no_fake_tensor(monkeypatch):
    """dft_inverse's basis is a cached device constant; made first while torch.export
    traced (fake tensors), it was kept, and every later eager call returned a FakeTensor
    (seen with the ONNX exporter). Constants made under a tracer are not kept."""
    from posenc_fast.ops import _torch_math

    monkeypatch.setattr(_torch_math, "_DEVICE_CONSTANTS", {})

    class Inverse(torch.nn.Module):
        def forward(self, e):
            return pf.dft_inverse(e)

    e = torch.randn(3, 8)
    program = torch.export.export(Inverse(), (e,))
    out = pf.dft_inverse(e)
    assert type(out) is torch.Tensor
    torch.testing.assert_close(program.module()(e), out)
    assert_close(out, ref.dft_inverse(e.double()), torch.float32, "encoding")
