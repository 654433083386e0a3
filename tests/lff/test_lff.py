"""Learnable Fourier features: every backend against the float64 reference.

The matrix (backend x dtype x case) covers odd sizes, N = 0 and 1, extra batch
dimensions, G in {1, 2, 4}, M in {1, 2, 4}, every activation, with and without MLP.
Backends come from conftest.backend_params, so kernels added later inherit every test.
"""

import math

import _helpers
import numpy as np
import pytest
import torch
from conftest import DEVICE, backend_dtype_params, backend_params
from torch.library import opcheck

import posenc_fast as pf
from posenc_fast.cli import _inputs
from posenc_fast.ops.lff import reference as ref
from posenc_fast.tolerances import PHASE_ATOL, assert_close

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
CASES = [pytest.param(c, id=c.id) for c in _inputs.LFF_CASES]
# Empty batches have no gradient to compare: test_empty_batch_backward covers them.
NONEMPTY_CASES = [pytest.param(c, id=c.id) for c in _inputs.LFF_CASES if math.prod(c.batch)]


def _kind(case):
    return "lff" if case.hidden_dim else "encoding"


@pytest.mark.parametrize("backend,dtype", backend_dtype_params("lff", DTYPES))
@pytest.mark.parametrize("case", CASES)
def test_forward_matches_reference(backend, dtype, case, device):
    x, wr, w1, b1, w2, b2 = _inputs.lff_inputs(case, dtype, device, seed=_helpers.seed_of(case.id))
    before = [t.clone() if t is not None else None for t in (x, wr, w1, b1, w2, b2)]
    y = pf.lff(x, wr, w1, b1, w2, b2, activation=case.activation, backend=backend)
    expected = ref.lff(x, wr, w1, b1, w2, b2, case.activation)
    width = case.group_out_dim if case.hidden_dim else case.fourier_dim
    assert y.shape == (*case.batch, case.groups * width)
    assert y.dtype == dtype
    assert_close(y, expected, dtype, _kind(case), what=f"{backend} {case.id}")
    for t, b in zip((x, wr, w1, b1, w2, b2), before):
        if t is not None:
            assert torch.equal(t, b), "inputs must not be modified"


@pytest.mark.parametrize("backend,dtype", backend_dtype_params("lff", DTYPES))
@pytest.mark.parametrize("case", NONEMPTY_CASES)
def test_backward_matches_reference(backend, dtype, case, device):
    inputs = _inputs.lff_inputs(case, dtype, device, seed=1 + _helpers.seed_of(case.id))
    _helpers.check_lff_backward(case, inputs, backend, grad_seed=7)


@pytest.mark.parametrize("backend", backend_params("lff", torch.float32))
def test_empty_batch_backward(backend, device):
    case = _inputs.LffCase((0,), 2, 2, 16, 8, 12)
    x, *w = _inputs.lff_inputs(case, torch.float32, device, 3)
    leaves = [x.requires_grad_(), *(t.requires_grad_() for t in w)]
    y = pf.lff(*leaves, backend=backend)
    assert y.shape == (0, 24)
    y.sum().backward()
    assert leaves[0].grad.shape == x.shape
    for t in leaves[1:]:
        assert torch.equal(t.grad, torch.zeros_like(t)), "no rows: zero weight gradients"


@pytest.mark.parametrize("backend", backend_params("lff", torch.float32))
def test_only_needed_gradients(backend, device):
    case = _inputs.LFF_CASES[0]
    x, wr, w1, b1, w2, b2 = _inputs.lff_inputs(case, torch.float32, device, 5)
    w2.requires_grad_()
    y = pf.lff(x, wr, w1, b1, w2, b2, backend=backend)
    y.square().sum().backward()
    assert w2.grad is not None
    assert x.grad is None and wr.grad is None and w1.grad is None


@pytest.mark.parametrize("backend", backend_params("lff", torch.float64))
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_gradcheck_float64(backend, activation, device):
    case = _inputs.LffCase((3,), 2, 2, 6, 4, 3, activation)
    inputs = [t.requires_grad_() for t in _inputs.lff_inputs(case, torch.float64, device, 11)]
    fn = lambda *a: pf.lff(*a, activation=activation, backend=backend)  # noqa: E731
    assert torch.autograd.gradcheck(fn, inputs)


@pytest.mark.parametrize("backend", backend_params("lff", torch.float64))
def test_gradcheck_features_only(backend, device):
    case = _inputs.LffCase((2, 3), 2, 3, 8, 0, 0)
    x, wr, *_ = _inputs.lff_inputs(case, torch.float64, device, 12)
    assert torch.autograd.gradcheck(
        lambda x, wr: pf.lff(x, wr, backend=backend), (x.requires_grad_(), wr.requires_grad_())
    )


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_gradgradcheck_torch_backend(activation, device):
    case = _inputs.LffCase((3,), 1, 2, 6, 4, 3, activation)
    inputs = [t.requires_grad_() for t in _inputs.lff_inputs(case, torch.float64, device, 13)]
    fn = lambda *a: pf.lff(*a, activation=activation, backend="torch")  # noqa: E731
    assert torch.autograd.gradgradcheck(fn, inputs)


def _direct_vs_op(backend, device, context):
    """pf.lff's output and gradients and its autograd node's name inside ``context``,
    and the same through the custom op called explicitly."""
    case = _inputs.LffCase((7,), 2, 2, 8, 4, 6)
    inputs = _inputs.lff_inputs(case, torch.float32, device, 23)
    runs = []
    for call in ("pf.lff", "op"):
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        with context():
            if call == "pf.lff":
                y = pf.lff(*leaves, backend=backend)
            else:
                y = torch.ops.posenc_fast.lff(*leaves, "gelu", torch.float32, backend)
            y.backward(torch.linspace(-1, 1, y.numel(), device=device).view_as(y))
        runs.append((type(y.grad_fn).__name__, y.detach(), [t.grad for t in leaves]))
    return runs


@pytest.mark.parametrize("backend", backend_params("lff", torch.float32))
def test_direct_eager_path_equals_the_op(backend, device):
    """Plain eager calls skip the custom op's dispatch (ops/_custom_ops.run) and
    give the op's bits, forward and backward; a function mode (here ``with
    torch.device``) or anything else that must see the op gets the op."""
    import contextlib

    plain = contextlib.nullcontext
    (direct_node, y1, g1), (op_node, y2, g2) = _direct_vs_op(backend, device, plain)
    assert direct_node == "LffFunctionBackward" and "posenc_fast_lff" in op_node
    assert torch.equal(y1, y2)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))
    (mode_node, y3, g3), _ = _direct_vs_op(backend, device, lambda: torch.device(device))
    assert "posenc_fast_lff" in mode_node
    assert torch.equal(y3, y1) and all(torch.equal(a, b) for a, b in zip(g3, g1))


def test_direct_eager_path_not_taken_when_compiling_or_for_subclasses():
    from posenc_fast.ops._custom_ops import direct_call_ok

    class Sub(torch.Tensor):
        pass

    t = torch.ones(2)
    assert direct_call_ok(t, None, torch.nn.Parameter(t))
    assert not direct_call_ok(t, t.as_subclass(Sub))
    seen = []

    @torch.compile(backend="eager", fullgraph=True)
    def f(a):
        seen.append(direct_call_ok(a))
        return a + 1

    f(t)
    assert seen == [False]  # dynamo traced the function: the op must be used


@pytest.mark.parametrize("backend", backend_params("lff", torch.float32))
@pytest.mark.parametrize("mlp", [True, False], ids=["mlp", "features"])
def test_opcheck(backend, mlp, device):
    case = _inputs.LffCase((5,), 2, 2, 8, 4, 6) if mlp else _inputs.LffCase((5,), 2, 2, 8, 0, 0)
    x, wr, w1, b1, w2, b2 = _inputs.lff_inputs(case, torch.float32, device, 17)
    args = [x.requires_grad_(), wr.requires_grad_()] + [
        t.requires_grad_() if t is not None else None for t in (w1, b1, w2, b2)
    ]
    opcheck(torch.ops.posenc_fast.lff.default, (*args, "gelu", torch.float32, backend))
    g = torch.randn(5, 2 * (6 if mlp else 8), device=device)
    plain = [t.detach() if t is not None else None for t in args]
    opcheck(
        torch.ops.posenc_fast.lff_backward.default,
        (g, *plain, "gelu", backend, [True] * 6),
    )


def test_compile_fullgraph_module(device):
    m = pf.LearnableFourierFeatures(2, 16, 8, 12, groups=2, device=device)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    x = torch.randn(9, 2, 2, device=device)
    y_eager = m(x)
    y = compiled(x)
    torch.testing.assert_close(y, y_eager)
    y.square().sum().backward()
    g = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    y_eager.square().sum().backward()
    for n, p in m.named_parameters():
        torch.testing.assert_close(g[n], p.grad, msg=n)


def test_export(device):
    m = pf.LearnableFourierFeatures(2, 8, 4, 6, device=device)
    x = torch.randn(5, 1, 2, device=device)
    ep = torch.export.export(m, (x,))
    torch.testing.assert_close(ep.module()(x), m(x))


# ---------------------------------------------------------------- accuracy


@pytest.mark.parametrize("backend", backend_params("lff", torch.float32))
@pytest.mark.parametrize("pos_dim", [1, 2, 4])
def test_large_phases_fp32(backend, pos_dim, device):
    """cos/sin features within 1e-6 of float64 math on the same fp32 inputs, |phase| <= 1e5."""
    g = _inputs.generator(21 + pos_dim)
    wr = _inputs.randn((32, pos_dim), g, torch.float32, device)
    x = _inputs.rand((257, 1, pos_dim), g, -1.0, 1.0, torch.float32, device)
    phase = (x.double().squeeze(1) @ wr.double().T).abs().max()
    x = (x * (1e5 / phase)).float()  # the largest |phase| is now ~1e5
    feats = pf.lff(x, wr, backend=backend) * math.sqrt(64)  # undo 1/sqrt(F): raw cos/sin
    expected = ref.lff(x, wr) * math.sqrt(64)
    assert (x.double().squeeze(1) @ wr.double().T).abs().max() > 9e4
    err = (feats.double() - expected).abs().max().item()
    assert err <= PHASE_ATOL, f"max error {err:.3g} at |phase| up to 1e5"


def test_float64_against_numpy():
    """One case computed independently with numpy, in float64."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 2, 3)) * 4
    wr, w1, b1 = rng.normal(size=(5, 3)), rng.normal(size=(10, 7)), rng.normal(size=7)
    w2, b2 = rng.normal(size=(7, 4)), rng.normal(size=4)
    phase = np.einsum("ngm,fm->ngf", x, wr)
    r = np.concatenate([np.cos(phase), np.sin(phase)], axis=-1) / np.sqrt(10)
    a = r @ w1 + b1
    from scipy.special import erf

    h = 0.5 * a * (1 + erf(a / np.sqrt(2)))
    expected = (h @ w2 + b2).reshape(6, 8)
    t = [torch.from_numpy(v) for v in (x, wr, w1, b1, w2, b2)]
    for backend in ["reference", *_inputs.backends_for("lff", "cpu", torch.float64)]:
        got = pf.lff(*t, backend=backend).numpy()
        np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12, err_msg=backend)


def test_random_features_approximate_gaussian_kernel():
    """Eq. 3-5 with the factors the paper drops: 2 (r_x . r_y) -> exp(-|x-y|^2 / (2 gamma^2))."""
    torch.manual_seed(0)
    gamma = 1.7
    m = pf.LearnableFourierFeatures(
        2, 2 * 20000, 1, 2 * 20000, mlp=False, gamma=gamma, dtype=torch.float64
    )
    x = torch.rand(40, 1, 2, dtype=torch.float64) * 4
    r = m(x)  # [40, F]
    gram = 2 * r @ r.T
    d2 = torch.cdist(x[:, 0], x[:, 0]) ** 2
    kernel = torch.exp(-d2 / (2 * gamma**2))
    err = (gram - kernel).abs().max().item()
    assert err < 0.03, f"random Fourier features deviate from the Gaussian kernel by {err}"
    # and the paper's literal Eq. 4 (exp(-|x-y|^2 / gamma^2), without the 2) is clearly different
    assert (gram - torch.exp(-d2 / gamma**2)).abs().max() > 0.1


def test_wr_initialised_with_std_one_over_gamma():
    torch.manual_seed(1)
    m = pf.LearnableFourierFeatures(4, 20000, 8, 8, gamma=4.0)
    std = m.wr.std().item()
    assert abs(std - 0.25) < 0.01, f"wr std {std}, expected 1/gamma = 0.25 (variance gamma^-2)"


# ---------------------------------------------------------------- edge cases


@pytest.mark.parametrize("backend", backend_params("lff", torch.float32, include_reference=True))
def test_nan_positions_stay_in_their_rows(backend, device):
    case = _inputs.LffCase((6,), 2, 2, 8, 4, 6)
    x, *w = _inputs.lff_inputs(case, torch.float32, device, 23)
    x[2, 1, 0] = float("nan")
    x[4, 0, 1] = float("inf")
    y = pf.lff(x, *w, backend=backend)
    bad_rows = {2, 4}
    for n in range(6):
        assert torch.isnan(y[n]).any() == (n in bad_rows), f"row {n}"
    # with the MLP every output of a group depends on its features; other groups stay finite
    assert torch.isfinite(y[2, :6]).all() and torch.isnan(y[2, 6:]).all()


@pytest.mark.parametrize("backend", backend_params("lff", torch.float32, include_reference=True))
def test_non_contiguous_inputs(backend, device):
    case = _inputs.LffCase((8,), 2, 2, 8, 4, 6)
    x, wr, w1, b1, w2, b2 = _inputs.lff_inputs(case, torch.float32, device, 29)
    x_nc = torch.stack([x, -x], dim=-1).flatten(-2)[..., ::2]  # strided view equal to x
    assert torch.equal(x_nc, x)
    w1_nc = w1.T.contiguous().T
    assert not x_nc.is_contiguous() and not w1_nc.is_contiguous()
    y = pf.lff(x_nc, wr, w1_nc, b1, w2, b2, backend=backend)
    assert_close(y, ref.lff(x, wr, w1, b1, w2, b2), torch.float32, "lff")
    # expanded (stride 0) positions
    xe = x[:1].expand(5, -1, -1)
    assert_close(pf.lff(xe, wr, backend=backend), ref.lff(xe, wr), torch.float32, "encoding")


@pytest.mark.parametrize("backend", backend_params("lff", torch.float32))
def test_integer_positions(backend, device):
    x = torch.randint(-300, 300, (7, 1, 2), device=device)
    wr = torch.randn(4, 2, device=device)
    assert_close(pf.lff(x, wr, backend=backend), ref.lff(x, wr), torch.float32, "encoding")


# ---------------------------------------------------------------- bad input


def _good(device="cpu"):
    case = _inputs.LffCase((4,), 2, 2, 8, 4, 6)
    return list(_inputs.lff_inputs(case, torch.float32, device, 31))


# Wrong shapes and a partial MLP: the same errors from pf.lff and from the C++ op's own
# checks (tests/lff/test_cpp_fourier.py), which name the argument the same way.
BAD_SHAPES = [
    pytest.param(lambda a: a.__setitem__(0, a[0][0, 0]), ValueError,
                 r"x must have shape \[\.\.\., G, M\]", id="x-rank"),
    pytest.param(lambda a: a.__setitem__(1, a[1][:, :1]), ValueError, "wr must have shape",
                 id="wr-shape"),
    pytest.param(lambda a: a.__setitem__(2, a[2][:-1]), ValueError, "w1 must have shape",
                 id="w1-shape"),
    pytest.param(lambda a: a.__setitem__(3, a[3][:-1]), ValueError, "b1 must have shape",
                 id="b1-shape"),
    pytest.param(lambda a: a.__setitem__(4, a[4][:-1]), ValueError, "w2 must have shape",
                 id="w2-shape"),
    pytest.param(lambda a: a.__setitem__(5, a[5][:-1]), ValueError, "b2 must have shape",
                 id="b2-shape"),
    pytest.param(lambda a: a.__setitem__(5, None), ValueError, "must be given together",
                 id="partial-mlp"),
]  # fmt: skip


@pytest.mark.parametrize(
    "mutate,exc,match",
    [
        pytest.param(lambda a: a.__setitem__(0, a[0].tolist()), TypeError,
                     "x must be a torch.Tensor", id="x-list"),
        pytest.param(lambda a: a.__setitem__(1, 3.0), TypeError, "wr must be a torch.Tensor",
                     id="wr-float"),
        *BAD_SHAPES,
        pytest.param(lambda a: a.__setitem__(2, a[2].double()), TypeError, "w1 has dtype",
                     id="dtype-mismatch"),
        pytest.param(lambda a: a.__setitem__(0, a[0].to(torch.complex64)), TypeError,
                     "x must be real", id="complex"),
        pytest.param(lambda a: a.__setitem__(1, a[1].long()), TypeError,
                     "wr must have a floating dtype", id="int-weights"),
        pytest.param(lambda a: a.__setitem__(2, a[2].to("meta")), ValueError, "w1 is on meta",
                     id="device-mismatch"),
    ],
)  # fmt: skip
def test_bad_input(mutate, exc, match):
    args = _good()
    mutate(args)
    with pytest.raises(exc, match=match):
        pf.lff(*args)


def test_bad_activation_and_backend():
    args = _good()
    with pytest.raises(ValueError, match="activation must be one of"):
        pf.lff(*args, activation="swish")
    with pytest.raises(ValueError, match="backend must be 'auto' or one of"):
        pf.lff(*args, backend="fast")
    with pytest.raises(TypeError, match="backend must be a str"):
        pf.lff(*args, backend=None)


def test_unavailable_backend_explains_every_backend():
    args = _good()
    with pytest.raises(pf.BackendError) as info:
        pf.lff(*args, backend="cuda")
    msg = str(info.value)
    for name in ("reference", "torch", "triton", "cuda", "cpp"):
        assert f"  {name}:" in msg


@pytest.mark.skipif(DEVICE != "cpu", reason="checks the CPU dispatch choice")
def test_auto_picks_cpp_then_torch_on_cpu():
    """The C++ kernels where the extension loads, else the torch backend; float64 always
    on the torch backend (the C++ kernels compute in float32)."""
    import _helpers

    from posenc_fast._dispatch import Problem

    def problem(dtype):
        sizes = {"fourier_dim": 16}
        return Problem("lff", "cpu", dtype, sizes, {"activation": "gelu"}, {"x": dtype})

    cpp = not _helpers.environment_reasons("cpp")
    assert _helpers.chosen(problem(torch.float32), "auto") == ("cpp" if cpp else "torch")
    assert _helpers.chosen(problem(torch.float64), "auto") == "torch"


def test_env_var_forces_backend(monkeypatch):
    args = _good()
    monkeypatch.setenv("POSENC_FAST_BACKEND", "reference")
    from posenc_fast.ops.lff.registry import LFF

    calls = []
    orig = LFF["reference"].forward
    monkeypatch.setattr(LFF["reference"], "forward", lambda *a: calls.append(1) or orig(*a))
    pf.lff(*args)
    assert calls, "POSENC_FAST_BACKEND=reference must route auto calls to the reference"
