"""The general rotary op (``pf.rotary``, ``pf.rotary_table``, ``pf.Rotary``): every backend
that implements it (``backends_for("rotary")``: the compiled kernels join this matrix when
they are registered) against the float64 reference, forward and backward, on fresh random
inputs; gradcheck / gradgradcheck; accuracy at |phase| 1e5; bad input; the module.

The matrix covers shared and per-head frequencies, positions per sample and shared by the
batch, interleaved and half pairs, partial rotation (odd head_dim too), prefix tokens, both
layouts, fewer key heads than query heads (shared frequencies), strided q and k (slices of
a fused qkv tensor) with frequencies as a permuted view (timm's RoPE-Mixed layout), N = 0,
N = prefix, B = 0, and sizes past one block of positions / frequencies of the kernels.
"""

from __future__ import annotations

import _helpers
import pytest
import torch
from _rotary_cases import Case, case_inputs, output_scale
from conftest import backend_dtype_params, backend_params

import posenc_fast as pf
from posenc_fast.cli import _inputs
from posenc_fast.ops.rotary import reference as ref
from posenc_fast.tolerances import PHASE_ATOL, assert_close

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


CASES = [
    Case(2, 4, 4, 37, 16, 16, 2, strided=True),  # LightGlue-like
    Case(2, 3, 1, 19, 12, 8, 3, "bnhd", "half", prefix=1),  # GQA, a class token
    Case(2, 2, 2, 17, 10, 6, 2, "bhnd", "half", per_head=True, prefix=5),  # cls + 4 registers
    Case(1, 3, 3, 5, 7, 4, 1, "bnhd", per_head=True, shared_x=True),  # odd head_dim
    Case(3, 2, 1, 1, 2, 2, 4, "bnhd", shared_x=True, prefix=1),  # no positioned token
    Case(2, 2, 2, 9, 8, 8, 2, "bnhd", "half", per_head=True, strided=True),  # timm's Mixed view
    Case(1, 2, 2, 70, 164, 160, 2, "bhnd", "half", per_head=True),  # several blocks
    Case(2, 2, 2, 0, 8, 8, 2),
    Case(0, 2, 2, 4, 8, 8, 2, "bnhd", per_head=True),
]
NONEMPTY = [pytest.param(c, id=c.id) for c in CASES if c.batch * (c.n - c.prefix)]
ALL_CASES = [pytest.param(c, id=c.id) for c in CASES]


def inputs(case: Case, dtype, device, seed: int):
    return case_inputs(case, dtype, device, seed)


def _call(case: Case, *args, backend="auto"):
    return pf.rotary(*args, case.pairs, case.layout, case.prefix, backend=backend)


def _reference(case: Case, *args, out_dtype=None):
    return ref.rotary(*args, case.pairs, case.layout, case.prefix, out_dtype)


def _leaves(tensors, dtype=None):
    out = []
    for t in tensors:
        leaf = t.detach().clone() if dtype is None else t.detach().to(dtype)
        out.append(leaf.requires_grad_(True))
    return out


# ------------------------------------------------------------------ forward


@pytest.mark.parametrize("backend,dtype", backend_dtype_params("rotary", DTYPES))
@pytest.mark.parametrize("case", ALL_CASES)
def test_matches_reference(backend, dtype, case, device):
    args = inputs(case, dtype, device, _helpers.seed_of(case.id))
    before = [t.clone() for t in args]
    oq, ok = _call(case, *args, backend=backend)
    q, k = args[:2]
    assert oq.shape == q.shape and ok.shape == k.shape and oq.dtype == ok.dtype == dtype
    assert oq.is_contiguous() and ok.is_contiguous()
    want = _reference(case, *args, out_dtype=torch.float64)
    s = output_scale(*want)
    for got, w, name in zip((oq, ok), want, "qk"):
        assert_close(got, w, dtype, "rotary", scale=s, what=f"{backend} {case.id} {name}'")
    for t, b in zip(args, before):
        assert torch.equal(t, b), "inputs must not be modified"
    # what passes through does so bitwise: channels >= F, the prefix tokens
    F, P = case.rotary_dim, case.prefix
    tokens = (slice(None),) * (2 if case.layout == "bhnd" else 1) + (slice(0, P),)
    for out, t in ((oq, q), (ok, k)):
        assert torch.equal(out[..., F:], t[..., F:]) and torch.equal(out[tokens], t[tokens])


TABLES = [  # (x shape, freqs shape, pairs)
    ((17, 2), (8, 2), "half"),
    ((2, 9, 3), (4, 3, 3), "interleaved"),  # per head: [2, 2, 4, 9, 6]
    ((5, 4), (2, 2, 4), "half"),
    ((2, 3, 9, 2), (4, 2), "interleaved"),
    ((0, 3), (3, 3), "interleaved"),
    ((1, 70, 2), (2, 80, 2), "half"),
]
TABLE_CASES = [
    pytest.param(xs, fs, p, id=f"x{'x'.join(map(str, xs))}-W{'x'.join(map(str, fs))}-{p}")
    for xs, fs, p in TABLES
]


def table_inputs(x_shape, f_shape, dtype, device, seed):
    g = _inputs.generator(seed)
    pdt = torch.float64 if dtype == torch.float64 else torch.float32
    return _inputs.randn(x_shape, g, pdt, device, 3.0), _inputs.randn(f_shape, g, dtype, device)


@pytest.mark.parametrize("backend,dtype", backend_dtype_params("rotary_table", DTYPES))
@pytest.mark.parametrize("x_shape,f_shape,pairs", TABLE_CASES)
def test_table_matches_reference(backend, dtype, x_shape, f_shape, pairs, device):
    x, w = table_inputs(x_shape, f_shape, dtype, device, _helpers.seed_of(str(f_shape)))
    before = [x.clone(), w.clone()]
    t = pf.rotary_table(x, w, pairs, backend=backend)
    F = 2 * f_shape[-2]
    if len(f_shape) == 2:
        assert t.shape == (2, *x_shape[:-1], F)
    else:
        assert t.shape == (2, *x_shape[:-2], f_shape[0], x_shape[-2], F)
    assert t.dtype == dtype
    assert_close(t, ref.rotary_table(x, w, pairs), dtype, "encoding", what=f"{backend}")
    assert torch.equal(x, before[0]) and torch.equal(w, before[1])


# ------------------------------------------------------------------ backward


@pytest.mark.parametrize("backend,dtype", backend_dtype_params("rotary", DTYPES))
@pytest.mark.parametrize("case", NONEMPTY)
def test_backward_matches_reference(backend, dtype, case, device):
    args = inputs(case, dtype, device, 1 + _helpers.seed_of(case.id))
    leaves = _leaves(args)
    oq, ok = _call(case, *leaves, backend=backend)
    g = _inputs.generator(5)
    gq, gk = _inputs.randn(oq.shape, g, dtype, device), _inputs.randn(ok.shape, g, dtype, device)
    before = [gq.clone(), gk.clone()]
    torch.autograd.backward((oq, ok), (gq, gk))
    assert torch.equal(gq, before[0]) and torch.equal(gk, before[1])
    leaves64 = _leaves(args, torch.float64)
    torch.autograd.backward(_reference(case, *leaves64), (gq.double(), gk.double()))
    names = ("q", "k", "x", "freqs")
    _helpers.assert_grads_close(names, leaves, leaves64, dtype, f"{backend} {case.id}")


@pytest.mark.parametrize("backend,dtype", backend_dtype_params("rotary_table", DTYPES))
@pytest.mark.parametrize("x_shape,f_shape,pairs", TABLE_CASES)
def test_table_backward_matches_reference(backend, dtype, x_shape, f_shape, pairs, device):
    x, w = table_inputs(x_shape, f_shape, dtype, device, 2 + _helpers.seed_of(str(f_shape)))
    leaves = _leaves((x, w))
    t = pf.rotary_table(*leaves, pairs, backend=backend)
    grad = _inputs.randn(t.shape, _inputs.generator(9), dtype, device)
    t.backward(grad)
    leaves64 = _leaves((x, w), torch.float64)
    ref.rotary_table(*leaves64, pairs).backward(grad.double())
    _helpers.assert_grads_close(("x", "freqs"), leaves, leaves64, dtype, f"{backend}")


# Small: gradcheck perturbs every input element once (numerical Jacobian).
SMALL = [
    Case(1, 2, 2, 4, 6, 4, 2, "bnhd", "half", per_head=True, prefix=1),
    Case(2, 2, 1, 3, 5, 4, 1, "bhnd", shared_x=True),
    Case(2, 2, 2, 3, 4, 4, 2, "bhnd", "interleaved", per_head=True, strided=True),
]


@pytest.mark.parametrize("backend", backend_params("rotary", torch.float64))
@pytest.mark.parametrize("case", SMALL, ids=lambda c: c.id)
def test_gradcheck_float64(backend, case, device):
    args = _leaves(inputs(case, torch.float64, device, 11))
    assert torch.autograd.gradcheck(lambda *a: _call(case, *a, backend=backend), args)


@pytest.mark.parametrize("backend", backend_params("rotary_table", torch.float64))
@pytest.mark.parametrize("f_shape,pairs", [((3, 2), "half"), ((2, 2, 2), "interleaved")])
def test_table_gradcheck_float64(backend, f_shape, pairs, device):
    x, w = _leaves(table_inputs((2, 4, 2), f_shape, torch.float64, device, 12))
    fn = lambda x, w: pf.rotary_table(x, w, pairs, backend=backend)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, w))


@pytest.mark.parametrize("case", SMALL[:2], ids=lambda c: c.id)
def test_gradgradcheck(case, device):
    """A double backward differentiates the torch backend's recomputation."""
    args = _leaves(inputs(case, torch.float64, device, 13))
    assert torch.autograd.gradgradcheck(lambda *a: _call(case, *a), args)
    x, w = _leaves(table_inputs((3, 2), (2, 2, 2), torch.float64, device, 14))
    assert torch.autograd.gradgradcheck(lambda x, w: pf.rotary_table(x, w, "half"), (x, w))


@pytest.mark.parametrize("backend", backend_params("rotary", torch.float32))
def test_frequency_gradient_is_deterministic(backend, device):
    """dfreqs is summed over positions in a fixed order: repeated runs agree bitwise."""
    case = Case(3, 2, 2, 70, 8, 8, 2, "bhnd", "half", per_head=True, prefix=2)
    q, k, x, w = inputs(case, torch.float32, device, 15)
    grads = []
    for _ in range(2):
        leaf = w.clone().requires_grad_()
        oq, ok = _call(case, q, k, x, leaf, backend=backend)
        (oq * k).sum().add((ok * q).sum()).backward()
        grads.append(leaf.grad)
    assert torch.equal(grads[0], grads[1])


# ------------------------------------------------------------------ semantics


def test_lightglue_members_are_the_general_op(device):
    """apply_lff_rotary = rotary(.., "interleaved", layout, 0), lff_rotary =
    rotary_table(..).unsqueeze(-3): bitwise, on the same backend."""
    case = Case(2, 3, 1, 11, 10, 8, 2, "bnhd")
    q, k, x, w = inputs(case, torch.float32, device, 16)
    for a, b in zip(pf.apply_lff_rotary(q, k, x, w, "bnhd", backend="torch"),
                    pf.rotary(q, k, x, w, "interleaved", "bnhd", 0, backend="torch")):  # fmt: skip
        assert torch.equal(a, b)
    t = pf.rotary_table(x, w, backend="torch")
    assert torch.equal(pf.lff_rotary(x, w, backend="torch"), t.unsqueeze(-3))


@pytest.mark.parametrize("pairs", ["interleaved", "half"])
def test_shared_positions_and_frequencies_are_the_broadcast_ones(pairs, device):
    """Positions [N, M] act as the same [B, N, M] for every b (their gradient: the sum
    over the batch); freqs [F/2, M] as the same [H, F/2, M] for every head."""
    case = Case(3, 2, 2, 9, 8, 6, 2, "bhnd", pairs, shared_x=True, prefix=1)
    q, k, x, w = inputs(case, torch.float32, device, 17)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    xb = x.expand(3, -1, -1).clone().requires_grad_()
    wh = w.expand(2, -1, -1).clone().requires_grad_()
    a = pf.rotary(q, k, xs, ws, pairs, "bhnd", 1)
    b = pf.rotary(q, k, xb, wh, pairs, "bhnd", 1)
    for u, v in zip(a, b):
        assert_close(u, v.double(), torch.float32, "rotary", scale=output_scale(v))
    (a[0].sum() + a[1].square().sum()).backward()
    (b[0].sum() + b[1].square().sum()).backward()
    assert_close(xs.grad, xb.grad.sum(0).double(), torch.float32, "grad")
    assert_close(ws.grad, wh.grad.sum(0).double(), torch.float32, "grad")


@pytest.mark.parametrize("pairs", ["interleaved", "half"])
def test_relative_positions_only(pairs, device):
    """q'_n . k'_m depends on x_n - x_m only, per head with per-head frequencies."""
    g = _inputs.generator(18)
    q, k = (_inputs.randn((1, 3, 6, 8), g, torch.float64, device) for _ in range(2))
    w = _inputs.randn((3, 4, 2), g, torch.float64, device)
    x = _inputs.randn((6, 2), g, torch.float64, device, 5.0)
    shift = torch.tensor([3.0, -7.0], dtype=torch.float64, device=device)
    a, b = pf.rotary(q, k, x, w, pairs), pf.rotary(q, k, x + shift, w, pairs)
    s = [u @ v.transpose(-1, -2) for u, v in (a, b)]
    torch.testing.assert_close(s[0], s[1], atol=1e-10, rtol=1e-10)


def test_pairs_are_what_the_spec_says(device):
    """pair i = channels (2i, 2i+1) or (i, i + F/2): a unit vector on a pair's first
    channel rotates to (cos, sin) on that pair."""
    x = torch.tensor([[0.3]], dtype=torch.float64, device=device)
    w = torch.tensor([[1.0], [2.0]], dtype=torch.float64, device=device)  # F = 4
    for pairs, (a0, b0, a1, b1) in (("interleaved", (0, 1, 2, 3)), ("half", (0, 2, 1, 3))):
        q = torch.zeros(1, 1, 1, 5, dtype=torch.float64, device=device)
        q[..., a0] = q[..., a1] = 1.0
        q[..., 4] = 7.0  # passes through
        oq, _ = pf.rotary(q, q, x, w, pairs)
        want = {a0: 0.3, b0: 0.3, a1: 0.6, b1: 0.6}
        for ch, angle in want.items():
            fn = torch.cos if ch in (a0, a1) else torch.sin
            torch.testing.assert_close(
                oq[0, 0, 0, ch], fn(torch.tensor(angle, dtype=torch.float64))
            )
        assert oq[0, 0, 0, 4] == 7.0


@pytest.mark.parametrize("backend", backend_params("rotary", torch.float32))
def test_integer_positions(backend, device):
    x = torch.randint(-300, 300, (2, 7, 2), device=device)
    w = torch.randn(2, 3, 2, device=device)
    q, k = torch.randn(2, 2, 7, 6, device=device), torch.randn(2, 2, 7, 6, device=device)
    out = pf.rotary(q, k, x, w, "half", backend=backend)
    want = ref.rotary(q, k, x.double(), w, "half", out_dtype=torch.float64)
    for got, w64 in zip(out, want):
        assert_close(got, w64, torch.float32, "rotary", scale=output_scale(*want))


@pytest.mark.parametrize("backend", backend_params("rotary_table", torch.bfloat16))
def test_table_under_autocast(backend, device):
    """Under autocast the table comes in the autocast dtype (float32 freqs); rotary follows
    q's dtype and ignores autocast."""
    x, w = table_inputs((9, 2), (2, 4, 2), torch.float32, device, 43)
    q = torch.randn(1, 2, 9, 8, device=device)
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        table = pf.rotary_table(x, w * 100.0, "half", backend=backend)
        oq, _ = pf.rotary(q, q, x, w, "half")
    assert table.dtype == torch.bfloat16 and oq.dtype == torch.float32
    assert_close(table, ref.rotary_table(x, w * 100.0, "half"), torch.bfloat16, "encoding")


# ------------------------------------------------------------------ accuracy


@pytest.mark.parametrize("backend", backend_params("rotary", torch.float32))
@pytest.mark.parametrize("pairs", ["interleaved", "half"])
@pytest.mark.parametrize("pos_dim", [1, 2, 3])
def test_phases_up_to_1e5_stay_within_1e6(backend, pairs, pos_dim, device):
    """cos / sin within 1e-6 of float64 math on the same fp32 inputs for |phase| up to
    1e5 (pixel coordinates times large frequencies), per-head frequencies, in the table
    and in the rotation (unit pairs (1, 0) rotate to (cos, sin))."""
    g = _inputs.generator(21 + pos_dim)
    w = _inputs.randn((2, 32, pos_dim), g, torch.float32, device)
    x = _inputs.rand((130, pos_dim), g, -1.0, 1.0, torch.float32, device)
    phase = (x.double() @ w.double().reshape(-1, pos_dim).T).abs().max()
    x = (x * (1e5 / phase)).float()
    assert (x.double() @ w.double().reshape(-1, pos_dim).T).abs().max() > 9e4
    table = pf.rotary_table(x, w, pairs, backend=backend)
    err = float((table.double() - ref.rotary_table(x, w, pairs)).abs().max())
    assert err <= PHASE_ATOL, f"table: max error {err:.3g} at |phase| up to 1e5"
    q = torch.zeros(1, 2, 131, 64, device=device)
    first = slice(0, 64, 2) if pairs == "interleaved" else slice(0, 32)
    q[..., first] = 1.0
    oq, _ = pf.rotary(q, q, x, w, pairs, prefix=1, backend=backend)
    want = ref.rotary(q, q, x, w, pairs, prefix=1, out_dtype=torch.float64)[0]
    err = float((oq.double() - want).abs().max())
    assert err <= PHASE_ATOL, f"rotation: max error {err:.3g} at |phase| up to 1e5"


# ------------------------------------------------------------------ bad input


def _good():
    case = Case(2, 2, 2, 5, 8, 6, 2, per_head=True, prefix=1)
    return list(inputs(case, torch.float32, "cpu", 31))


def _set(i, make):
    return lambda a: a.__setitem__(i, make(a[i]))


@pytest.mark.parametrize(
    "mutate,kwargs,exc,match",
    [
        (_set(0, lambda t: t.tolist()), {}, TypeError, "q must be a torch.Tensor"),
        (_set(0, lambda t: t.long()), {}, TypeError, "q must have a floating dtype"),
        (_set(0, lambda t: t[0]), {}, ValueError, r"q must have shape \[B, heads, N"),
        (_set(1, lambda t: t[:, :, :3]), {}, ValueError, "k must have the batch size"),
        (_set(1, lambda t: t.double()), {}, TypeError, "k has dtype"),
        (_set(1, lambda t: t[:, :1]), {}, ValueError, "k must have the 2 heads of q"),
        (_set(2, lambda t: t[:, :3]), {}, ValueError, r"x must have shape \[B, N - prefix, M\]"),
        (_set(2, lambda t: t.to(torch.complex64)), {}, TypeError, "x must be real"),
        (_set(2, lambda t: t.bool()), {}, TypeError, "x must be a floating or integer"),
        (_set(3, lambda t: t[:1]), {}, ValueError, r"freqs must have shape \[2, \*, 2\]"),
        (_set(3, lambda t: t[0, :, :1]), {}, ValueError, r"freqs must have shape \[\*, 2\]"),
        (_set(3, lambda t: t[None]), {}, ValueError, r"freqs must have shape \[F/2, M\] .* or"),
        (_set(3, lambda t: t[:, :0]), {}, ValueError, "F/2 >= 1"),
        (_set(3, lambda t: torch.randn(5, 2)), {}, ValueError, "more than head_dim = 8"),
        (_set(3, lambda t: t.long()), {}, TypeError, "freqs must have a floating dtype"),
        (_set(3, lambda t: t.to("meta")), {}, ValueError, "freqs is on meta"),
        (lambda a: None, {"pairs": "rotate_half"}, ValueError, "pairs must be one of"),
        (lambda a: None, {"layout": "nhd"}, ValueError, "layout must be one of"),
        (lambda a: None, {"prefix": -1}, ValueError, "prefix must be an int in"),
        (lambda a: None, {"prefix": 6}, ValueError, r"prefix must be an int in \[0, N\]"),
        (lambda a: None, {"prefix": True}, ValueError, "prefix must be an int"),
        (lambda a: None, {"backend": "fast"}, ValueError, "backend must be 'auto' or one of"),
    ],
    ids=[
        "q-list", "q-int", "q-rank", "k-shape", "k-dtype", "k-fewer-heads-per-head-freqs",
        "x-shape", "x-complex", "x-bool", "freqs-heads", "freqs-M", "freqs-rank", "freqs-empty",
        "freqs-too-wide", "freqs-int", "device-mismatch", "pairs", "layout", "prefix-negative",
        "prefix-past-N", "prefix-bool", "backend",
    ],
)  # fmt: skip
def test_bad_input_names_the_argument(mutate, kwargs, exc, match):
    args = _good()
    mutate(args)
    kwargs = {"prefix": 1, **kwargs}
    with pytest.raises(exc, match=match):
        pf.rotary(*args, **kwargs)


def test_bad_table_input_names_the_argument():
    x, w = table_inputs((5, 2), (2, 3, 2), torch.float32, "cpu", 32)
    with pytest.raises(ValueError, match=r"x must have shape \[\.\.\., N, M\]"):
        pf.rotary_table(x[0], w)
    with pytest.raises(ValueError, match=r"freqs must have shape \[F/2, M\] or \[H, F/2, M\]"):
        pf.rotary_table(x, w[None])
    with pytest.raises(ValueError, match=r"freqs must have shape \[2, \*, 2\]"):
        pf.rotary_table(x, w[..., :1])
    with pytest.raises(ValueError, match="pairs must be one of"):
        pf.rotary_table(x, w, "halves")
    with pytest.raises(TypeError, match="x must be real"):
        pf.rotary_table(x.to(torch.complex64), w)


def test_unavailable_backend_explains_every_backend():
    """A backend that cannot run a call says why, for every backend."""
    args = [t.double() for t in _good()]
    with pytest.raises(pf.BackendError) as info:
        pf.rotary(*args, prefix=1, backend="triton")
    for name in ("reference", "torch", "triton", "cuda", "cpp"):
        assert f"  {name}:" in str(info.value)


# ------------------------------------------------------------------ the module


def test_module_defaults_and_frequencies(device):
    m = pf.Rotary(2, head_dim=64, device=device)
    torch.testing.assert_close(m.freqs, pf.rope.axial(64, 2, in_pixels=False).to(device))
    assert isinstance(m.freqs, torch.nn.Parameter) and m.rotary_dim == 64
    m = pf.Rotary(3, head_dim=20, heads=4, pairs="half", layout="bnhd", prefix=1, device=device)
    assert m.freqs.shape == (4, 9, 3) and m.rotary_dim == 18  # 3 axes x 3 bands
    assert "heads=4" in repr(m) and "'half'" in repr(m) and "prefix=1" in repr(m)
    w = pf.rope.dinov3(32)
    m = pf.Rotary.from_frequencies(w, head_dim=40, pairs="half", learnable=False)
    assert "freqs" in dict(m.named_buffers()) and not list(m.parameters())
    assert "freqs" in m.state_dict() and torch.equal(m.freqs, w) and m.freqs is not w
    assert (m.pos_dim, m.head_dim, m.rotary_dim, m.heads) == (2, 40, 32, None)
    mixed = pf.rope.mixed(16, depth=2, heads=3)
    m = pf.Rotary.from_frequencies(mixed[1])
    assert m.heads == 3 and m.head_dim == 16 and torch.equal(m.freqs, mixed[1])


def test_module_rotates_and_tables_like_the_functions(device):
    m = pf.Rotary(2, head_dim=10, rotary_dim=8, heads=2, pairs="half", prefix=2, device=device)
    _inputs.randomize_parameters(m, 3)
    g = _inputs.generator(33)
    q, k = _inputs.randn((2, 2, 7, 10), g), _inputs.randn((2, 2, 7, 10), g)
    x = pf.rope.grid((5,))[:, :1].expand(5, 2).contiguous()
    oq, ok = m(q, k, x)
    want = pf.rotary(q, k, x, m.freqs, "half", "bhnd", 2)
    assert torch.equal(oq, want[0]) and torch.equal(ok, want[1])
    assert torch.equal(m.table(x), pf.rotary_table(x, m.freqs, "half"))
    (oq.sum() + ok.square().sum()).backward()
    assert m.freqs.grad is not None and m.freqs.grad.abs().sum() > 0


def test_module_bad_arguments():
    with pytest.raises(ValueError, match=r"rotary_dim \(6\) must be <= head_dim \(4\)"):
        pf.Rotary(2, head_dim=4, frequencies=torch.randn(3, 2))
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        pf.Rotary(2, head_dim=8, rotary_dim=5)
    with pytest.raises(ValueError, match=r"must be >= 2 \* pos_dim"):
        pf.Rotary(3, head_dim=4)
    with pytest.raises(ValueError, match=r"frequencies must have shape \[\*, 2\]"):
        pf.Rotary(2, head_dim=8, frequencies=torch.randn(3, 3))
    with pytest.raises(ValueError, match=r"frequencies must have shape \[4, \*, 2\]"):
        pf.Rotary(2, head_dim=8, heads=4, frequencies=torch.randn(3, 2, 2))
    with pytest.raises(ValueError, match="pairs must be one of"):
        pf.Rotary(2, head_dim=8, pairs="rot")
    with pytest.raises(ValueError, match="prefix must be >= 0"):
        pf.Rotary(2, head_dim=8, prefix=-1)
    m = pf.Rotary(2, head_dim=8)
    with pytest.raises(ValueError, match="q must have head_dim=8"):
        m(torch.randn(1, 1, 3, 6), torch.randn(1, 1, 3, 6), torch.randn(3, 2))
