"""Learnable Fourier rotary embeddings (LightGlue's layout): every backend against the
float64 reference, forward and backward, plus LightGlue's own formula restated.

The matrix (backend x dtype x case) covers both layouts, positions per batch row and
shared by the batch, fewer key heads than query heads, rotary_dim < head_dim (odd
head_dim too), N = 0 and 1, B = 0, strided q (a slice of a fused qkv tensor, as in
LightGlue), and sizes past one block of positions / frequencies of the kernels.
"""

from __future__ import annotations

import math

import _helpers
import pytest
import torch
from conftest import DEVICE, backend_dtype_params, backend_params
from torch import nn
from torch.library import opcheck

import posenc_fast as pf
from posenc_fast.cli import _inputs
from posenc_fast.cli._inputs import ROTARY_CASES, RotaryCase, rotary_inputs, rotary_table_inputs
from posenc_fast.ops.rotary import reference as ref
from posenc_fast.tolerances import PHASE_ATOL, assert_close

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


NONEMPTY = [pytest.param(c, id=c.id) for c in ROTARY_CASES if c.batch * c.n]
ALL_CASES = [pytest.param(c, id=c.id) for c in ROTARY_CASES]


def _scale(*refs) -> float:
    return max([float(r.detach().abs().max()) for r in refs if r.numel()] or [0.0])


def _check_apply(out, expected, dtype, what: str) -> None:
    s = _scale(*expected)
    for got, want, name in zip(out, expected, ("q", "k")):
        assert_close(got, want, dtype, "rotary", scale=s, what=f"{what} {name}'")


# ------------------------------------------------------------------ forward


@pytest.mark.parametrize("backend,dtype", backend_dtype_params("apply_lff_rotary", DTYPES))
@pytest.mark.parametrize("case", ALL_CASES)
def test_apply_matches_reference(backend, dtype, case, device):
    q, k, x, wr = rotary_inputs(case, dtype, device, _helpers.seed_of(case.id))
    assert not case.fused_qkv or q.stride(-1) == 3  # LightGlue's strided q
    before = [t.clone() for t in (q, k, x, wr)]
    oq, ok = pf.apply_lff_rotary(q, k, x, wr, case.layout, backend=backend)
    assert oq.shape == q.shape and ok.shape == k.shape
    assert oq.dtype == ok.dtype == dtype
    assert oq.is_contiguous() and ok.is_contiguous()
    expected = ref.apply_lff_rotary(q, k, x, wr, case.layout, out_dtype=torch.float64)
    _check_apply((oq, ok), expected, dtype, f"{backend} {case.id}")
    for t, b in zip((q, k, x, wr), before):
        assert torch.equal(t, b), "inputs must not be modified"
    # channels beyond rotary_dim pass through bitwise
    F = case.rotary_dim
    assert torch.equal(oq[..., F:], q[..., F:]) and torch.equal(ok[..., F:], k[..., F:])


TABLE_CASES = [
    pytest.param(s, id="x" + "x".join(map(str, s[:-1])) + f"-F{s[-1]}")
    for s in _inputs.ROTARY_TABLE_SHAPES
]


@pytest.mark.parametrize("backend,dtype", backend_dtype_params("lff_rotary", DTYPES))
@pytest.mark.parametrize("shape", TABLE_CASES)
def test_table_matches_reference(backend, dtype, shape, device):
    x, wr = rotary_table_inputs(shape, dtype, device, _helpers.seed_of(str(shape)))
    before = [x.clone(), wr.clone()]
    t = pf.lff_rotary(x, wr, backend=backend)
    assert t.shape == (2, *x.shape[:-2], 1, x.shape[-2], shape[-1])
    assert t.dtype == dtype
    assert_close(t, ref.lff_rotary_table(x, wr), dtype, "encoding", what=f"{backend} {shape}")
    assert torch.equal(x, before[0]) and torch.equal(wr, before[1])


# ------------------------------------------------------------------ backward


def _leaves(tensors, dtype=None):
    out = []
    for t in tensors:
        leaf = t.detach().clone() if dtype is None else t.detach().to(dtype)
        out.append(leaf.requires_grad_(True))
    return out


@pytest.mark.parametrize("backend,dtype", backend_dtype_params("apply_lff_rotary", DTYPES))
@pytest.mark.parametrize("case", NONEMPTY)
def test_apply_backward_matches_reference(backend, dtype, case, device):
    inputs = rotary_inputs(case, dtype, device, 1 + _helpers.seed_of(case.id))
    leaves = _leaves(inputs)
    oq, ok = pf.apply_lff_rotary(*leaves, case.layout, backend=backend)
    g = _inputs.generator(5)
    gq = _inputs.randn(oq.shape, g, dtype, device)
    gk = _inputs.randn(ok.shape, g, dtype, device)
    torch.autograd.backward((oq, ok), (gq, gk))
    leaves64 = _leaves(inputs, torch.float64)
    rq, rk = ref.apply_lff_rotary(*leaves64, case.layout)
    torch.autograd.backward((rq, rk), (gq.double(), gk.double()))
    _helpers.assert_grads_close(
        ("q", "k", "x", "wr"), leaves, leaves64, dtype, f"{backend} {case.id}"
    )


@pytest.mark.parametrize("backend,dtype", backend_dtype_params("lff_rotary", DTYPES))
@pytest.mark.parametrize("shape", TABLE_CASES)
def test_table_backward_matches_reference(backend, dtype, shape, device):
    x, wr = rotary_table_inputs(shape, dtype, device, 2 + _helpers.seed_of(str(shape)))
    leaves = _leaves((x, wr))
    t = pf.lff_rotary(*leaves, backend=backend)
    grad = _inputs.randn(t.shape, _inputs.generator(9), dtype, device)
    t.backward(grad)
    leaves64 = _leaves((x, wr), torch.float64)
    ref.lff_rotary_table(*leaves64).backward(grad.double())
    _helpers.assert_grads_close(("x", "wr"), leaves, leaves64, dtype, f"{backend} {shape}")


@pytest.mark.parametrize("backend", backend_params("apply_lff_rotary", torch.float32))
def test_only_needed_gradients(backend, device):
    case = ROTARY_CASES[1]
    q, k, x, wr = rotary_inputs(case, torch.float32, device, 3)
    wr.requires_grad_()
    oq, ok = pf.apply_lff_rotary(q, k, x, wr, case.layout, backend=backend)
    (oq.square().sum() + ok.sum()).backward()
    assert wr.grad is not None and wr.grad.abs().sum() > 0
    assert q.grad is None and k.grad is None and x.grad is None
    # only q's gradient, k's output unused: a rotation keeps norms, so d|q'|^2/dq = 2q
    q.requires_grad_()
    oq, ok = pf.apply_lff_rotary(q, k, x, wr.detach(), case.layout, backend=backend)
    oq.square().sum().backward()
    assert_close(q.grad, 2 * q.detach().double(), torch.float32, "grad")


# Small: gradcheck perturbs every input element once (numerical Jacobian).
GRADCHECK_CASES = [
    RotaryCase(1, 2, 1, 3, 6, 4, 2, "bnhd"),
    RotaryCase(2, 1, 1, 3, 5, 4, 1, shared_x=True),
]


@pytest.mark.parametrize("backend", backend_params("apply_lff_rotary", torch.float64))
@pytest.mark.parametrize("case", GRADCHECK_CASES, ids=lambda c: c.id)
def test_apply_gradcheck_float64(backend, case, device):
    inputs = _leaves(rotary_inputs(case, torch.float64, device, 11))
    fn = lambda *a: pf.apply_lff_rotary(*a, case.layout, backend=backend)  # noqa: E731
    assert torch.autograd.gradcheck(fn, inputs)


@pytest.mark.parametrize("backend", backend_params("lff_rotary", torch.float64))
def test_table_gradcheck_float64(backend, device):
    x, wr = _leaves(rotary_table_inputs((2, 5, 3, 6), torch.float64, device, 12))
    assert torch.autograd.gradcheck(lambda x, wr: pf.lff_rotary(x, wr, backend=backend), (x, wr))


def test_gradgradcheck_torch_backend(device):
    """A double backward differentiates the torch backend's recomputation."""
    case = GRADCHECK_CASES[1]
    inputs = _leaves(rotary_inputs(case, torch.float64, device, 13))
    fn = lambda *a: pf.apply_lff_rotary(*a, case.layout, backend="torch")  # noqa: E731
    assert torch.autograd.gradgradcheck(fn, inputs)
    x, wr = _leaves(rotary_table_inputs((3, 2, 4), torch.float64, device, 14))
    assert torch.autograd.gradgradcheck(
        lambda x, wr: pf.lff_rotary(x, wr, backend="torch"), (x, wr)
    )


@pytest.mark.parametrize("backend", backend_params("apply_lff_rotary", torch.float32))
def test_weight_gradient_is_deterministic(backend, device):
    """dwr is summed over positions in a fixed order: repeated runs agree bitwise."""
    case = RotaryCase(3, 2, 2, 70, 8, 8, 2)  # several tiles per batch row
    q, k, x, wr = rotary_inputs(case, torch.float32, device, 15)
    grads = []
    for _ in range(2):
        w = wr.clone().requires_grad_()
        oq, ok = pf.apply_lff_rotary(q, k, x, w, backend=backend)
        (oq * k).sum().add((ok * q).sum()).backward()
        grads.append(w.grad)
    assert torch.equal(grads[0], grads[1])


# ------------------------------------------------------------------ layouts and sharing


@pytest.mark.parametrize("backend", backend_params("apply_lff_rotary", torch.float32))
def test_layouts_and_shared_positions_agree(backend, device):
    """bnhd is bhnd transposed; positions [N, M] act as the same [B, N, M] for every b,
    and their gradient is the sum over the batch."""
    case = RotaryCase(3, 2, 2, 9, 8, 6, 2, shared_x=True)
    q, k, x, wr = rotary_inputs(case, torch.float32, device, 16)
    xs = x.clone().requires_grad_()
    xb = x.expand(3, -1, -1).clone().requires_grad_()
    a = pf.apply_lff_rotary(q, k, xs, wr, backend=backend)
    b = pf.apply_lff_rotary(q.transpose(1, 2), k.transpose(1, 2), xb, wr, "bnhd", backend=backend)
    for u, v in zip(a, b):
        assert_close(u, v.transpose(1, 2).double(), torch.float32, "rotary", scale=_scale(u))
    (a[0].sum() + a[1].square().sum()).backward()
    (b[0].sum() + b[1].square().sum()).backward()
    assert_close(xs.grad, xb.grad.sum(0).double(), torch.float32, "grad")


# ------------------------------------------------------------------ custom ops, compile


@pytest.mark.parametrize("backend", backend_params("apply_lff_rotary", torch.float32))
def test_opcheck(backend, device):
    case = RotaryCase(2, 2, 1, 5, 6, 4, 2, "bnhd")
    q, k, x, wr = (t.requires_grad_() for t in rotary_inputs(case, torch.float32, device, 17))
    # the LightGlue members run the general custom ops (interleaved pairs, no prefix)
    args = (q, k, x, wr, "interleaved", "bnhd", 0, backend)
    opcheck(torch.ops.posenc_fast.rotary.default, args)
    plain = [t.detach() for t in (q, k, x, wr)]
    gq, gk = torch.randn_like(plain[0]), torch.randn_like(plain[1])
    opcheck(
        torch.ops.posenc_fast.rotary_backward.default,
        (gq, gk, *plain, "interleaved", "bnhd", 0, backend, True, True, True, True),
    )
    xt, wt = rotary_table_inputs((2, 5, 2, 6), torch.float32, device, 18)
    xt, wt = xt.requires_grad_(), wt.requires_grad_()
    opcheck(
        torch.ops.posenc_fast.rotary_table.default,
        (xt, wt, "interleaved", torch.float32, backend),
    )
    g = torch.randn(2, 2, 5, 6, device=device)
    opcheck(
        torch.ops.posenc_fast.rotary_table_backward.default,
        (g, xt.detach(), wt.detach(), "interleaved", backend, True, False),
    )


def test_compile_fullgraph_module(device):
    m = pf.LearnableFourierRotary(2, head_dim=8, rotary_dim=6, device=device)

    def step(q, k, x):
        oq, ok = m.rotate(q, k, x)
        return oq @ ok.transpose(-1, -2) + m(x)[0, :, :, :, :1].sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    q, k = torch.randn(2, 3, 7, 8, device=device), torch.randn(2, 3, 7, 8, device=device)
    x = torch.randn(2, 7, 2, device=device)
    y = compiled(q, k, x)
    y_eager = step(q, k, x)
    torch.testing.assert_close(y, y_eager)
    y.square().sum().backward()
    g = m.wr.grad.clone()
    m.wr.grad = None
    y_eager.square().sum().backward()
    torch.testing.assert_close(g, m.wr.grad)


def test_export_with_a_dynamic_number_of_positions(device):
    """torch.export with N dynamic: one exported program serves every keypoint count."""
    from torch.export import Dim

    m = pf.LearnableFourierRotary(2, head_dim=8, device=device)

    class Rotate(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = m

        def forward(self, q, k, x):
            return self.m.rotate(q, k, x), self.m(x)

    def make(n):
        g = _inputs.generator(n)
        shapes = ((2, 3, n, 8), (2, 3, n, 8), (2, n, 2))
        return [_inputs.randn(s, g, torch.float32, device) for s in shapes]

    N = Dim("N", min=2, max=4096)
    dynamic = {"q": {2: N}, "k": {2: N}, "x": {1: N}}
    ep = torch.export.export(Rotate(), tuple(make(5)), dynamic_shapes=dynamic)
    inputs = make(11)
    (oq, ok), table = ep.module()(*inputs)
    (eq, ek), etable = Rotate()(*inputs)
    assert table.shape == (2, 2, 1, 11, 8)
    for u, v in ((oq, eq), (ok, ek), (table, etable)):
        torch.testing.assert_close(u, v)


# ------------------------------------------------------------------ accuracy


@pytest.mark.parametrize("backend", backend_params("apply_lff_rotary", torch.float32))
@pytest.mark.parametrize("pos_dim", [1, 2, 4])
def test_large_phases_fp32(backend, pos_dim, device):
    """cos / sin within 1e-6 of float64 math on the same fp32 inputs for |phase| up to
    1e5 (pixel coordinates times learned frequencies), in the table and in the rotation."""
    g = _inputs.generator(21 + pos_dim)
    wr = _inputs.randn((32, pos_dim), g, torch.float32, device)
    x = _inputs.rand((1, 130, pos_dim), g, -1.0, 1.0, torch.float32, device)
    phase = (x.double() @ wr.double().T).abs().max()
    x = (x * (1e5 / phase)).float()
    assert (x.double() @ wr.double().T).abs().max() > 9e4
    table = pf.lff_rotary(x, wr, backend=backend)
    err = (table.double() - ref.lff_rotary_table(x, wr)).abs().max().item()
    assert err <= PHASE_ATOL, f"table: max error {err:.3g} at |phase| up to 1e5"
    # unit pairs (1, 0) rotate to (cos, sin): the rotation's error is the cos / sin error
    q = torch.zeros(1, 2, 130, 64, device=device)
    q[..., 0::2] = 1.0
    oq, _ = pf.apply_lff_rotary(q, q, x, wr, backend=backend)
    err = (oq.double() - ref.apply_lff_rotary(q, q, x, wr, out_dtype=torch.float64)[0]).abs().max()
    assert err <= PHASE_ATOL, f"rotation: max error {err:.3g} at |phase| up to 1e5"


@pytest.mark.parametrize(
    "backend", backend_params("apply_lff_rotary", torch.float32, include_reference=True)
)
def test_nan_position_stays_in_its_row(backend, device):
    case = RotaryCase(2, 2, 2, 6, 4, 4, 2)
    q, k, x, wr = rotary_inputs(case, torch.float32, device, 23)
    x[1, 3, 0] = float("nan")
    oq, ok = pf.apply_lff_rotary(q, k, x, wr, backend=backend)
    bad = torch.zeros(2, 6, dtype=torch.bool)
    bad[1, 3] = True
    for out in (oq, ok):
        nan_rows = torch.isnan(out).any(-1).any(1).cpu()  # [B, N]
        assert torch.equal(nan_rows, bad)


@pytest.mark.parametrize("backend", backend_params("lff_rotary", torch.bfloat16))
def test_table_under_autocast(backend, device):
    """Under autocast the table comes in the autocast dtype (float32 wr), its phases
    still float32 or better; apply_lff_rotary follows q's dtype and ignores autocast."""
    x, wr = rotary_table_inputs((2, 9, 2, 8), torch.float32, device, 43)
    q = torch.randn(2, 1, 9, 8, device=device)
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        table = pf.lff_rotary(x, wr * 100.0, backend=backend)  # phases up to ~1e3
        oq, _ = pf.apply_lff_rotary(q, q, x, wr, backend=backend)
    assert table.dtype == torch.bfloat16 and oq.dtype == torch.float32
    assert_close(table, ref.lff_rotary_table(x, wr * 100.0), torch.bfloat16, "encoding")


@pytest.mark.parametrize("backend", backend_params("apply_lff_rotary", torch.float32))
def test_integer_positions(backend, device):
    x = torch.randint(-300, 300, (7, 2), device=device)
    wr = torch.randn(3, 2, device=device)
    q, k = torch.randn(1, 2, 7, 6, device=device), torch.randn(1, 1, 7, 6, device=device)
    out = pf.apply_lff_rotary(q, k, x, wr, backend=backend)
    expected = ref.apply_lff_rotary(q, k, x.double(), wr, out_dtype=torch.float64)
    _check_apply(out, expected, torch.float32, backend)
    table = pf.lff_rotary(x, wr, backend=backend)
    assert_close(table, ref.lff_rotary_table(x.double(), wr), torch.float32, "encoding")


# ------------------------------------------------------------------ LightGlue


class _LightGluePosEnc(nn.Module):
    """LightGlue's LearnableFourierPositionalEncoding, restated in our own words from
    github.com/cvg/LightGlue, lightglue/lightglue.py at commit 1fd587b (2025-07-05): an
    nn.Linear(M, F/2, bias=False) projection, cos and sin stacked on a new leading axis,
    a broadcast heads axis inserted before N, each frequency repeated on two channels."""

    def __init__(self, pos_dim: int, head_dim: int):
        super().__init__()
        self.Wr = nn.Linear(pos_dim, head_dim // 2, bias=False)

    def forward(self, x):
        angles = self.Wr(x)  # [B, N, F/2]
        stacked = torch.stack((angles.cos(), angles.sin()), dim=0)  # [2, B, N, F/2]
        return stacked.unsqueeze(-3).repeat_interleave(2, dim=-1)  # [2, B, 1, N, F]


def _lightglue_rotate(table, t):
    """LightGlue's apply_cached_rotary_emb with its rotate_half, restated: channel pairs
    (x1, x2) -> (-x2, x1), then t * cos + rotated * sin."""
    halves = t.unflatten(-1, (-1, 2))
    rotated = torch.stack((-halves[..., 1], halves[..., 0]), dim=-1).flatten(-2)
    return t * table[0] + rotated * table[1]


@pytest.mark.parametrize(
    "backend", backend_params("apply_lff_rotary", torch.float32, include_reference=True)
)
def test_matches_lightglue_self_attention(backend, device):
    """LightGlue's self-attention path: normalised keypoints [B, N, 2], q and k sliced from
    a fused qkv projection (channel stride 3), 4 heads of 16 channels."""
    torch.manual_seed(0)
    B, N, heads, head_dim = 2, 45, 4, 16
    theirs = _LightGluePosEnc(2, head_dim).to(device)
    ours = pf.LearnableFourierRotary(2, head_dim, backend=backend, device=device)
    ours.load_state_dict({"wr": theirs.Wr.weight.detach().clone()})
    kpts = torch.rand(B, N, 2, device=device) * 2 - 1
    qkv = nn.Linear(heads * head_dim, 3 * heads * head_dim).to(device)
    desc = torch.randn(B, N, heads * head_dim, device=device)
    qkv_out = qkv(desc).unflatten(-1, (heads, -1, 3)).transpose(1, 2)
    q, k = qkv_out[..., 0], qkv_out[..., 1]
    enc = theirs(kpts)
    table = ours(kpts)
    assert table.shape == enc.shape == (2, B, 1, N, head_dim)
    torch.testing.assert_close(table, enc, atol=2e-6, rtol=0)
    oq, ok = ours.rotate(q, k, kpts)
    torch.testing.assert_close(oq, _lightglue_rotate(enc, q), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ok, _lightglue_rotate(enc, k), atol=1e-5, rtol=1e-5)
    # training signal: the same gradients to the frequencies and the projection
    loss = lambda a, b: (a @ b.transpose(-1, -2)).softmax(-1).square().sum()  # noqa: E731
    loss(oq, ok).backward(retain_graph=True)  # the projection's graph is used again below
    g_ours = ours.wr.grad.clone()
    g_proj = qkv.weight.grad.clone()
    qkv.weight.grad = None
    loss(_lightglue_rotate(enc, q), _lightglue_rotate(enc, k)).backward()
    torch.testing.assert_close(g_ours, theirs.Wr.weight.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(g_proj, qkv.weight.grad, atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------ the module


def test_module_init_and_passthrough(device):
    torch.manual_seed(1)
    m = pf.LearnableFourierRotary(4, head_dim=10000, gamma=4.0, device=device)
    assert m.wr.shape == (5000, 4)
    assert abs(m.wr.std().item() - 0.25) < 0.01, "wr std must be 1/gamma (variance gamma^-2)"
    m = pf.LearnableFourierRotary(3, head_dim=9, rotary_dim=4, layout="bnhd", device=device)
    assert m.wr.shape == (2, 3)
    assert "rotary_dim=4" in repr(m) and "'bnhd'" in repr(m)
    q, k = torch.randn(2, 5, 3, 9, device=device), torch.randn(2, 5, 1, 9, device=device)
    oq, _ = m.rotate(q, k, torch.randn(5, 3, device=device))
    assert torch.equal(oq[..., 4:], q[..., 4:]) and not torch.allclose(oq[..., :4], q[..., :4])
    assert pf.LearnableFourierRotary(2, head_dim=7).rotary_dim == 6


def test_relative_positions_only(device):
    """The point of a rotary embedding: q'_n . k'_m depends on x_n - x_m only."""
    m = pf.LearnableFourierRotary(2, head_dim=8, device=device).double()
    q, k = (
        torch.randn(1, 1, 6, 8, dtype=torch.float64),
        torch.randn(1, 1, 6, 8, dtype=torch.float64),
    )
    x = torch.randn(1, 6, 2, dtype=torch.float64) * 5
    a = m.rotate(q, k, x)
    b = m.rotate(q, k, x + torch.tensor([3.0, -7.0], dtype=torch.float64))
    scores = [u @ v.transpose(-1, -2) for u, v in (a, b)]
    torch.testing.assert_close(scores[0], scores[1], atol=1e-10, rtol=1e-10)


# ------------------------------------------------------------------ bad input


def _good_apply():
    return list(rotary_inputs(RotaryCase(2, 2, 2, 4, 8, 6, 2), torch.float32, "cpu", 31))


@pytest.mark.parametrize(
    "mutate,exc,match",
    [
        (lambda a: a.__setitem__(0, a[0].tolist()), TypeError, "q must be a torch.Tensor"),
        (lambda a: a.__setitem__(0, a[0].long()), TypeError, "q must have a floating dtype"),
        (lambda a: a.__setitem__(0, a[0][0]), ValueError, r"q must have shape \[B, heads, N"),
        (lambda a: a.__setitem__(1, a[1][:, :, :3]), ValueError, "k must have the batch size"),
        (lambda a: a.__setitem__(1, a[1].double()), TypeError, "k has dtype"),
        (lambda a: a.__setitem__(2, a[2][:, :3]), ValueError, r"x must have shape \[B, N, M\] or"),
        (lambda a: a.__setitem__(2, a[2].to(torch.complex64)), TypeError, "x must be real"),
        (lambda a: a.__setitem__(3, a[3][:, :1]), ValueError, "wr must have shape"),
        (lambda a: a.__setitem__(3, a[3][:0]), ValueError, "F/2 >= 1"),
        (lambda a: a.__setitem__(3, torch.randn(5, 2)), ValueError, "more than head_dim"),
        (lambda a: a.__setitem__(3, a[3].long()), TypeError, "wr must have a floating dtype"),
        (lambda a: a.__setitem__(3, a[3].to("meta")), ValueError, "wr is on meta"),
    ],
    ids=[
        "q-list", "q-int", "q-rank", "k-shape", "k-dtype", "x-shape", "x-complex", "wr-shape",
        "wr-empty", "wr-too-wide", "wr-int", "device-mismatch",
    ],
)  # fmt: skip
def test_apply_bad_input(mutate, exc, match):
    args = _good_apply()
    mutate(args)
    with pytest.raises(exc, match=match):
        pf.apply_lff_rotary(*args)


def test_bad_layout_backend_and_table_input():
    q, k, x, wr = _good_apply()
    with pytest.raises(ValueError, match="layout must be one of"):
        pf.apply_lff_rotary(q, k, x, wr, layout="nhd")
    with pytest.raises(ValueError, match="backend must be 'auto' or one of"):
        pf.apply_lff_rotary(q, k, x, wr, backend="fast")
    with pytest.raises(ValueError, match=r"x must have shape \[\.\.\., N, M\]"):
        pf.lff_rotary(x[0, 0], wr)
    with pytest.raises(ValueError, match="wr must have shape"):
        pf.lff_rotary(x, wr.T)
    with pytest.raises(ValueError, match="rotary_dim .* must be <= head_dim"):
        pf.LearnableFourierRotary(2, head_dim=4, rotary_dim=6)
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        pf.LearnableFourierRotary(2, head_dim=4, rotary_dim=3)
    with pytest.raises(ValueError, match="q must have head_dim=8"):
        pf.LearnableFourierRotary(2, head_dim=8).rotate(q[..., :6], k[..., :6], x)


def test_unavailable_backend_explains_every_backend():
    """float64 q goes to the torch backend; asking cpp for it says why not, per backend."""
    q, k, x, wr = (t.double() for t in _good_apply())
    with pytest.raises(pf.BackendError) as info:
        pf.apply_lff_rotary(q, k, x, wr, backend="cpp")
    msg = str(info.value)
    assert "cpp: " in msg
    if not _helpers.environment_reasons("cpp"):
        assert "supports dtypes float32, bfloat16, float16, got float64" in msg
    for name in ("reference", "torch", "triton", "cuda", "cpp"):
        assert f"  {name}:" in msg


@pytest.mark.skipif(DEVICE != "cpu", reason="checks the CPU dispatch choice")
def test_auto_picks_cpp_then_torch_on_cpu(monkeypatch):
    """On the CPU, "auto" picks the C++ kernels when the extension is usable, else torch."""
    from posenc_fast.ops.rotary.registry import LIGHTGLUE_ROTARY as APPLY

    name = "torch" if _helpers.environment_reasons("cpp") else "cpp"
    calls = []
    orig = APPLY[name].forward
    monkeypatch.setattr(APPLY[name], "forward", lambda *a: calls.append(1) or orig(*a))
    pf.apply_lff_rotary(*_good_apply())
    assert calls == [1]


def test_float64_positions_are_refused_by_triton_with_a_reason():
    if "triton" not in backend_params_names():
        pytest.skip("the triton backend is not usable here (see the report header)")
    q, k, x, wr = _good_apply()
    with pytest.raises(pf.BackendError, match="x dtype must be one of"):
        pf.apply_lff_rotary(q, k, x.double(), wr, backend="triton")
    assert math.isfinite(pf.apply_lff_rotary(q, k, x.double(), wr)[0].sum().item())


def backend_params_names():
    # backends usable here: an unavailable one is a param with a skip mark (conftest.py)
    return [p.values[0] for p in backend_params("apply_lff_rotary") if not p.marks]


@pytest.mark.skipif(
    "triton" not in backend_params_names(),
    reason="the triton backend is not usable here (see the report header)",
)
def test_triton_gpu_block_sizes_in_the_interpreter(monkeypatch, device):
    """The GPU's block rule (16 positions x 32 frequencies), which the interpreter
    otherwise replaces by larger blocks, run through the interpreter: several tiles and
    frequency chunks, a partial last chunk, the pass-through tail, and the backward."""
    from posenc_fast.triton_kernels import rotary as kernels

    monkeypatch.setattr(
        kernels, "blocks", lambda n, f, half=False: (kernels.gpu_blocks(f, half), {})
    )
    case = RotaryCase(2, 2, 1, 37, 84, 80, 2)  # 40 frequencies: chunks of 32 and 8
    inputs = rotary_inputs(case, torch.float32, device, 41)
    leaves = _leaves(inputs)
    out = pf.apply_lff_rotary(*leaves, backend="triton")
    _check_apply(out, ref.apply_lff_rotary(*inputs, out_dtype=torch.float64), torch.float32, "gpu")
    torch.autograd.backward(out, [torch.ones_like(o) for o in out])
    leaves64 = _leaves(inputs, torch.float64)
    rq, rk = ref.apply_lff_rotary(*leaves64)
    torch.autograd.backward((rq, rk), [torch.ones_like(o) for o in (rq, rk)])
    _helpers.assert_grads_close(("q", "k", "x", "wr"), leaves, leaves64, torch.float32, "gpu")
    x, wr = rotary_table_inputs((1, 37, 2, 80), torch.float32, device, 42)
    assert_close(pf.lff_rotary(x, wr, backend="triton"), ref.lff_rotary_table(x, wr),
                 torch.float32, "encoding")  # fmt: skip


def test_verify_checks_rotary(monkeypatch, device):
    """``python -m posenc_fast verify`` checks both rotary ops and catches a wrong backend."""
    from posenc_fast.cli import verify
    from posenc_fast.ops.rotary.registry import LIGHTGLUE_ROTARY as APPLY

    table = verify.check_lff_rotary("torch", torch.float32, device, 3)
    assert table.cases == len(_inputs.ROTARY_TABLE_SHAPES) and not table.failures
    res = verify.check_apply_lff_rotary("torch", torch.float32, device, 3)
    assert res.cases == len(ROTARY_CASES) and not res.failures, res.failures
    orig = APPLY["torch"].forward

    def off_by_a_little(*args):
        oq, ok = orig(*args)
        return oq + 1e-4, ok

    monkeypatch.setattr(APPLY["torch"], "forward", off_by_a_little)
    res = verify.check_apply_lff_rotary("torch", torch.float32, device, 3)
    assert res.failures and all("q'" in f for f in res.failures), res.failures


# -- LightGlue users: one call ---------------------------------------------------------------


def lightglue_table(wr: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """LightGlue's LearnableFourierPositionalEncoding.forward restated (cvg/LightGlue):
    Wr(x) -> cos / sin stacked, a heads axis, each frequency on two channels."""
    projected = x @ wr.T
    emb = torch.stack([torch.cos(projected), torch.sin(projected)], 0).unsqueeze(-3)
    return emb.repeat_interleave(2, dim=-1)


@pytest.mark.parametrize("whole_checkpoint", [False, True], ids=["encoder", "lightglue-model"])
def test_from_state_dict_returns_lightglues_table(whole_checkpoint):
    gen = _inputs.generator(7)
    wr = _inputs.randn((32, 2), gen)  # LightGlue: head_dim 64 -> Wr [32, 2]
    sd = {"Wr.weight": wr}
    if whole_checkpoint:  # LightGlue's own model: posenc.* among its other layers
        sd = {"posenc.Wr.weight": wr, "self_attn.0.Wqkv.weight": torch.zeros(3, 3)}
    rope = pf.LearnableFourierRotary.from_state_dict(sd, "lightglue", gamma=0.5)
    assert (rope.pos_dim, rope.head_dim, rope.rotary_dim) == (2, 64, 64)
    assert rope.gamma == 0.25  # LightGlue's std gamma^-2: our gamma is its gamma squared
    kpts = _inputs.randn((2, 7, 2), gen)  # normalised keypoints [B, N, 2]
    want = lightglue_table(wr.double(), kpts.double())
    assert_close(rope(kpts), want, torch.float32, "encoding")
    assert rope(kpts).shape == (2, 2, 1, 7, 64)  # what apply_cached_rotary_emb consumes
    wr[0, 0] = 100.0  # the module holds a copy
    assert rope.wr[0, 0] != 100.0


def test_from_state_dict_names_what_is_missing():
    with pytest.raises(ValueError, match="missing keys 'posenc.Wr.weight'"):
        pf.LearnableFourierRotary.from_state_dict({"other": torch.zeros(1)}, "lightglue")
    with pytest.raises(ValueError, match="source must be one of"):
        pf.LearnableFourierRotary.from_state_dict({"Wr.weight": torch.zeros(2, 2)}, "guimont")
