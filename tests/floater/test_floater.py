"""FLOATER: every backend against the float64 reference, against independent ODE solvers
(scipy DOP853, torchdiffeq), and against the properties the paper states.

Backends come from conftest.backend_params("floater"), so the compiled integrators inherit
every test. The module's cache has its own file, test_floater_cache.py.
"""

import math

import _helpers
import numpy as np
import pytest
import torch
from conftest import backend_dtype_params, backend_params
from torch.library import opcheck

import posenc_fast as pf
from posenc_fast.cli import _baselines, _inputs
from posenc_fast.ops.floater import reference as ref
from posenc_fast.tolerances import assert_close

DTYPES = [torch.float32, torch.float64]
METHODS = ["euler", "midpoint", "rk4", "rk38"]
ACTIVATIONS = ["relu", "tanh", "gelu", "identity"]
SMOOTH = ["tanh", "gelu", "identity"]  # gradcheck needs differentiable dynamics
CASES = [pytest.param(c, id=c.id) for c in _inputs.FLOATER_CASES]
NAMES = ("p0", "w1", "b1", "w2", "b2", "times")


def _reference_grads(inputs, grad, case):
    """Autograd through the literal float64 loop: the exact discrete adjoint."""
    leaves = [t.detach().double().requires_grad_(True) for t in inputs]
    out = ref.floater(*leaves, case.substeps, case.method, case.activation)
    out.backward(grad.double())
    return out, [t.grad for t in leaves]


def _check_case(backend, dtype, case, device, seed):
    inputs = _inputs.floater_inputs(case, dtype, device, seed)
    before = [t.clone() for t in inputs]
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = pf.floater(*leaves, case.substeps, case.method, case.activation, backend=backend)
    S, L, d = case.num_states, case.length, case.dim
    assert out.shape == (S, L, d) and out.dtype == dtype and out.device.type == device
    if out.numel() == 0:
        return  # nothing to compare; gradients of empty outputs: test_empty_shapes_backward
    grad = _inputs.randn(out.shape, _inputs.generator(seed + 1), dtype, device)
    out.backward(grad)
    expected, ref_grads = _reference_grads(inputs, grad, case)
    what = f"{backend} {case.id} {dtype}"
    assert_close(out, expected, dtype, "floater", what=what)
    for name, leaf, want in zip(NAMES, leaves, ref_grads):
        assert leaf.grad is not None and leaf.grad.dtype == dtype, name
        assert_close(leaf.grad, want, dtype, "grad", what=f"{what} d{name}")
    for t, b in zip(inputs, before):
        assert torch.equal(t, b), "inputs must not be modified"


@pytest.mark.parametrize("backend,dtype", backend_dtype_params("floater", DTYPES))
@pytest.mark.parametrize("case", CASES)
def test_matches_reference(backend, dtype, case, device):
    """Forward and every gradient (p0, weights, times) on the shared case list."""
    _check_case(backend, dtype, case, device, seed=_helpers.seed_of(case.id))


@pytest.mark.parametrize("backend,dtype", backend_dtype_params("floater", DTYPES))
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_every_method_and_activation(backend, dtype, method, activation, device):
    case = _inputs.FloaterCase(3, 5, 6, 5, 2, method, activation)
    _check_case(
        backend,
        dtype,
        case,
        device,
        seed=METHODS.index(method) * 10 + ACTIVATIONS.index(activation),
    )


@pytest.mark.parametrize("backend", backend_params("floater", include_reference=True))
def test_length_form_starts_at_p0(backend, device):
    """fl(length=L) samples t_i = i * delta_t: out[:, 0] is p0 exactly, and the rest equals
    the functional form on those times."""
    fl = pf.Floater(
        6,
        3,
        hidden_dim=5,
        delta_t=0.1,
        substeps=3,
        activation="tanh",
        backend=backend,
        device=device,
        dtype=torch.float64,
    )
    _inputs.randomize_parameters(fl, 4, fan_in=True)
    out = fl(length=9)
    assert torch.equal(out[:, 0], fl.p0.detach())
    times = torch.arange(9, dtype=torch.float64, device=device) * 0.1
    expected = ref.floater(fl.p0, fl.w1, fl.b1, fl.w2, fl.b2, times, 3, "rk4", "tanh")
    assert_close(out, expected, torch.float64, "floater")


# -- independent solvers ---------------------------------------------------------------------


def _dop853(p0, w1, b1, w2, b2, times, activation, tol):
    """scipy's DOP853 solution at ``times`` with rtol = atol = ``tol``: [S, L, d], float64,
    on the CPU."""
    solve_ivp = pytest.importorskip("scipy.integrate").solve_ivp
    S, d = p0.shape
    h = ref.dynamics(
        w1.double().cpu(), b1.double().cpu(), w2.double().cpu(), b2.double().cpu(), activation
    )

    def f(t, y):
        p = torch.from_numpy(y).reshape(S, d)
        return h(torch.tensor(t, dtype=torch.float64), p).reshape(-1).numpy()

    t_eval = times.double().cpu().numpy()
    sol = solve_ivp(
        f,
        (0.0, t_eval[-1]),
        p0.double().cpu().numpy().reshape(-1),
        method="DOP853",
        t_eval=t_eval,
        rtol=tol,
        atol=tol,
    )
    assert sol.success, sol.message
    return torch.from_numpy(sol.y.T.reshape(len(t_eval), S, d)).transpose(0, 1)


@pytest.mark.parametrize("backend", backend_params("floater", torch.float64))
@pytest.mark.parametrize("method", ["rk4", "rk38"])
def test_matches_high_accuracy_solution(backend, method, device):
    """Fine steps converge to scipy's DOP853 at rtol = atol = 1e-12 (float64)."""
    case = _inputs.FloaterCase(3, 4, 6, 5, activation="tanh")
    p0, w1, b1, w2, b2, times = _inputs.floater_inputs(case, torch.float64, device, seed=11)
    out = pf.floater(p0, w1, b1, w2, b2, times, 64, method, "tanh", backend=backend)
    exact = _dop853(p0, w1, b1, w2, b2, times, "tanh", 1e-12)
    assert_close(out, exact, torch.float64, "floater", what=f"{backend} {method} vs DOP853")


@pytest.mark.parametrize("backend,dtype", backend_dtype_params("floater", DTYPES))
def test_rk38_matches_torchdiffeq_rk4_step_for_step(backend, dtype, device):
    """torchdiffeq's "rk4" is the 3/8 rule. On the same grid (its grid_constructor given
    our substep grid, the sample times on it, so no interpolation happens) the two agree
    to rounding; the classic rk4 would differ by ~1e-6 here (caught in float64)."""
    odeint = pytest.importorskip("torchdiffeq").odeint
    K = 2
    case = _inputs.FloaterCase(3, 5, 7, 6, K, "rk38", "gelu")
    p0, w1, b1, w2, b2, times = _inputs.floater_inputs(case, dtype, device, seed=5)
    out = pf.floater(p0, w1, b1, w2, b2, times, K, "rk38", "gelu", backend=backend)
    h = ref.dynamics(w1, b1, w2, b2, "gelu")
    t = torch.cat([times.new_zeros(1), times])
    grid = _baselines.step_grid(t, K)  # 0, then K equal steps per interval
    sol = odeint(
        lambda t, y: h(t, y),
        p0,
        t,
        method="rk4",
        options={"grid_constructor": lambda f, y0, t: grid},
    )
    assert_close(out, sol[1:].transpose(0, 1), dtype, "floater", what=f"{backend} vs torchdiffeq")


@pytest.mark.parametrize("backend", backend_params("floater", torch.float64))
@pytest.mark.parametrize(
    "method,order,substeps", [("euler", 1, 64), ("midpoint", 2, 16), ("rk4", 4, 4), ("rk38", 4, 4)]
)
def test_convergence_order(backend, method, order, substeps, device):
    """Doubling the substeps divides the error by about 2^order (2, 4, 16, 16)."""
    case = _inputs.FloaterCase(2, 4, 5, 4, activation="tanh")
    p0, w1, b1, w2, b2, times = _inputs.floater_inputs(case, torch.float64, device, seed=3)
    exact = _dop853(p0, w1, b1, w2, b2, times, "tanh", 1e-13)

    def error(k):
        out = pf.floater(p0, w1, b1, w2, b2, times, k, method, "tanh", backend=backend)
        return (out.cpu() - exact).abs().max().item()

    coarse, fine = error(substeps), error(2 * substeps)
    ratio = coarse / fine
    assert 0.8 * 2**order < ratio < 1.25 * 2**order, (method, coarse, fine, ratio)


@pytest.mark.parametrize(
    "backend", backend_params("floater", torch.float64, include_reference=True)
)
def test_eq9_rotation_reproduces_sinusoidal(backend, device):
    """Eq. 9: with identity activation, h(t, p) = p M with M the rotation generator
    (dp[2i]/dt = f_i p[2i+1], dp[2i+1]/dt = -f_i p[2i]) and p0 = PE(s), the solution at
    t_i = i * delta_t is the sinusoidal encoding PE(s + t_i)."""
    dim, L, delta_t = 8, 16, 0.25
    starts = torch.tensor([0.0, 5.0, 11.3], dtype=torch.float64)
    freq = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    fl = pf.Floater(
        dim,
        3,
        delta_t=delta_t,
        substeps=32,
        activation="identity",
        backend=backend,
        device=device,
        dtype=torch.float64,
    )
    with torch.no_grad():
        for p in fl.parameters():
            p.zero_()
        M = torch.zeros(dim, dim, dtype=torch.float64)
        i = torch.arange(dim // 2)
        M[2 * i + 1, 2 * i] = freq
        M[2 * i, 2 * i + 1] = -freq
        fl.w1[:dim] = M.to(device)  # the time row and every bias stay zero
        fl.w2[:dim] = torch.eye(dim, dtype=torch.float64, device=device)
        fl.p0.copy_(pf.sinusoidal(starts.to(device), dim))
    out = fl(length=L)
    positions = starts[:, None] + torch.arange(L, dtype=torch.float64) * delta_t
    assert_close(
        out, pf.sinusoidal(positions, dim).to(device), torch.float64, "floater", what=backend
    )


# -- initialisation --------------------------------------------------------------------------


@pytest.mark.parametrize("backend", backend_params("floater", include_reference=True))
@pytest.mark.parametrize("method", METHODS)
def test_zero_parameters_give_exact_zero(backend, method, device):
    for activation in ACTIVATIONS:
        fl = pf.Floater(
            5,
            4,
            hidden_dim=3,
            substeps=2,
            method=method,
            activation=activation,
            backend=backend,
            device=device,
        )
        with torch.no_grad():
            for p in fl.parameters():
                p.zero_()
        out = fl(length=12)
        assert out.shape == (4, 12, 5)
        assert torch.equal(out, torch.zeros_like(out)), activation


def test_default_init_is_near_zero_and_trainable(device):
    """p0 = 0 and a small output layer: the output starts near zero (the paper's warm
    start), far below what a standard-scale output layer gives, and every parameter still
    receives a gradient."""
    torch.manual_seed(0)
    fl = pf.Floater(16, 6, device=device)
    assert torch.equal(fl.p0, torch.zeros_like(fl.p0))
    out = fl(length=200)  # t up to 1.99
    assert torch.equal(out[:, 0], torch.zeros_like(out[:, 0]))
    small = out.abs().max().item()
    assert 0 < small < 2e-2
    (out * torch.randn_like(out)).sum().backward()
    for name, p in fl.named_parameters():
        assert p.grad is not None and p.grad.abs().max() > 0, name
    with torch.no_grad():
        bound = 1.0 / math.sqrt(17)
        fl.w2.uniform_(-bound, bound)  # nn.Linear's scale instead
    assert fl(length=200).abs().max().item() > 20 * small


# -- gradients, custom ops, compile --------------------------------------------------------


def _gradcheck_inputs(device, method, activation, dtype=torch.float64):
    case = _inputs.FloaterCase(2, 3, 4, 3, 2, method, activation)
    inputs = _inputs.floater_inputs(case, dtype, device, seed=21)
    return [t.detach().clone().requires_grad_(True) for t in inputs]


@pytest.mark.parametrize(
    "backend", backend_params("floater", torch.float64, include_reference=True)
)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("activation", SMOOTH)
def test_gradcheck_float64(backend, method, activation, device):
    """Every input including the times (they are strictly increasing here, so the finite
    differences stay valid)."""
    inputs = _gradcheck_inputs(device, method, activation)

    def fn(*args):
        return pf.floater(*args, 2, method, activation, backend=backend)

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7, rtol=1e-6)


def test_gradgradcheck_torch_backend(device):
    inputs = _gradcheck_inputs(device, "rk4", "tanh")

    def fn(*args):
        return pf.floater(*args, 2, "rk4", "tanh", backend="torch")

    assert torch.autograd.gradgradcheck(fn, inputs, eps=1e-6, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", backend_params("floater"))
@pytest.mark.parametrize(
    "needs", [(True,) * 6, (False, True, False, True, False, False)], ids=["all", "weights"]
)
def test_opcheck(backend, needs, device):
    inputs = [t.detach() for t in _gradcheck_inputs(device, "rk38", "gelu")]
    args = [t.clone().requires_grad_(n) for t, n in zip(inputs, needs)]
    opcheck(torch.ops.posenc_fast.floater.default, (*args, 2, "rk38", "gelu", backend))
    out = torch.ops.posenc_fast.floater(*inputs, 2, "rk38", "gelu", backend)
    grad = torch.randn_like(out)
    opcheck(
        torch.ops.posenc_fast.floater_backward.default,
        (grad, out, *inputs, 2, "rk38", "gelu", backend, list(needs), None),
    )


@pytest.mark.parametrize("backend", backend_params("floater"))
def test_only_needed_gradients(backend, device):
    p0, w1, b1, w2, b2, times = _gradcheck_inputs(device, "rk4", "relu")
    for t in (p0, b1, b2, times):
        t.requires_grad_(False)
    pf.floater(p0, w1, b1, w2, b2, times, 2, "rk4", "relu", backend=backend).sum().backward()
    assert p0.grad is None and b1.grad is None and times.grad is None
    assert w1.grad is not None and w2.grad is not None


def test_compile_fullgraph_module(device):
    torch._dynamo.reset()
    fl = pf.Floater(6, 4, hidden_dim=5, activation="gelu", device=device)
    _inputs.randomize_parameters(fl, 2, fan_in=True)
    compiled = torch.compile(fl, fullgraph=True, backend="aot_eager")
    got = compiled(length=9)
    expected = fl(length=9)
    torch.testing.assert_close(got, expected)
    got.sum().backward()
    g_compiled = [p.grad.clone() for p in fl.parameters()]
    fl.zero_grad()
    expected.sum().backward()
    for a, b in zip(g_compiled, (p.grad for p in fl.parameters())):
        torch.testing.assert_close(a, b)


# -- robustness ------------------------------------------------------------------------------


@pytest.mark.parametrize("backend,dtype", backend_dtype_params("floater", DTYPES))
def test_nan_state_does_not_poison_other_states(backend, dtype, device):
    case = _inputs.FloaterCase(4, 5, 6, 6, 2, "rk4", "relu")
    p0, w1, b1, w2, b2, times = _inputs.floater_inputs(case, dtype, device, seed=9)
    p0 = p0.clone()
    p0[1, 2] = float("nan")
    out = pf.floater(p0, w1, b1, w2, b2, times, 2, "rk4", "relu", backend=backend)
    assert torch.isnan(out[1]).all()
    keep = [0, 2, 3]
    alone = pf.floater(p0[keep], w1, b1, w2, b2, times, 2, "rk4", "relu", backend=backend)
    assert torch.isfinite(out[keep]).all()
    assert_close(out[keep], alone, dtype, "floater")


@pytest.mark.parametrize("backend", backend_params("floater"))
def test_non_contiguous_inputs(backend, device):
    case = _inputs.FloaterCase(3, 4, 5, 5, 2, "rk38", "tanh")
    inputs = _inputs.floater_inputs(case, torch.float64, device, seed=12)
    # Same values, other layouts: transposed storage, strided slices.
    p0, w1, b1, w2, b2, times = inputs
    strided = [
        p0.T.contiguous().T,
        w1.T.contiguous().T,
        torch.stack([b1, b1], 1)[:, 0],
        w2.T.contiguous().T,
        torch.stack([b2, b2], 1)[:, 1],
        torch.stack([times, times], 1)[:, 0],
    ]
    assert not any(t.is_contiguous() for t in strided[:2])
    out = pf.floater(*strided, 2, "rk38", "tanh", backend=backend)
    assert_close(out, ref.floater(*inputs, 2, "rk38", "tanh"), torch.float64, "floater")


@pytest.mark.parametrize("backend", backend_params("floater"))
def test_empty_shapes_backward(backend, device):
    for S, L in ((0, 4), (3, 0)):
        case = _inputs.FloaterCase(S, 4, 3, L)
        leaves = [
            t.requires_grad_(True) for t in _inputs.floater_inputs(case, torch.float64, device, 1)
        ]
        out = pf.floater(*leaves, 2, "rk4", "tanh", backend=backend)
        assert out.shape == (S, L, 4)
        out.sum().backward()
        for name, t in zip(NAMES, leaves):
            assert t.grad is not None and torch.equal(t.grad, torch.zeros_like(t)), name


def test_integer_times_are_converted(device):
    case = _inputs.FloaterCase(2, 3, 4, 4, 2, "rk4", "tanh")
    p0, w1, b1, w2, b2, _ = _inputs.floater_inputs(case, torch.float64, device, seed=1)
    t_int = torch.tensor([0, 1, 1, 3], device=device)
    out = pf.floater(p0, w1, b1, w2, b2, t_int, 2, "rk4", "tanh")
    expected = ref.floater(p0, w1, b1, w2, b2, t_int.double(), 2, "rk4", "tanh")
    assert out.dtype == torch.float64
    assert_close(out, expected, torch.float64, "floater")


def test_module_times_form_and_attention_bias(device):
    fl = pf.Floater(4, 6, hidden_dim=3, activation="gelu", device=device, dtype=torch.float64)
    _inputs.randomize_parameters(fl, 6, fan_in=True)
    times = torch.tensor([0.2, 0.5, 0.5, 1.25], dtype=torch.float64, device=device)
    expected = ref.floater(fl.p0, fl.w1, fl.b1, fl.w2, fl.b2, times, 5, "rk4", "gelu")
    assert_close(fl(times=times), expected, torch.float64, "floater")

    bias = pf.FloaterAttentionBias(
        4,
        num_layers=2,
        num_projections=3,
        hidden_dim=3,
        activation="gelu",
        device=device,
        dtype=torch.float64,
    )
    bias.floater.load_state_dict(fl.state_dict())
    out = bias(7)
    assert out.shape == (2, 3, 7, 4)
    assert torch.equal(out.reshape(6, 7, 4), fl(length=7))


def test_attention_block_example(device):
    """The README example: biases added to the Q/K/V projections of every block; the
    gradient reaches the FLOATER parameters."""
    F = torch.nn.functional

    class Block(torch.nn.Module):
        def __init__(self, dim, heads):
            super().__init__()
            self.heads = heads
            self.qkv = torch.nn.Linear(dim, 3 * dim)
            self.proj = torch.nn.Linear(dim, dim)

        def forward(self, x, bias):  # x [B, L, dim], bias [3, L, dim]
            q, k, v = (self.qkv(x).unflatten(-1, (3, -1)) + bias.transpose(0, 1)).unbind(-2)
            q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v)
            return x + self.proj(y.transpose(1, 2).flatten(2))

    torch.manual_seed(0)
    pos = pf.FloaterAttentionBias(dim=32, num_layers=2, device=device)
    blocks = torch.nn.ModuleList(Block(32, heads=4) for _ in range(2)).to(device)
    x = torch.randn(2, 10, 32, device=device)
    bias = pos(x.shape[1])
    for n, block in enumerate(blocks):
        x = block(x, bias[n])
    x.square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in pos.parameters())
    assert pos.floater.w2.grad.abs().max() > 0


# -- bad input -------------------------------------------------------------------------------


def _good(device="cpu"):
    case = _inputs.FloaterCase(2, 3, 4, 3)
    return list(_inputs.floater_inputs(case, torch.float32, device, seed=0))


def _with(i, value):
    args = _good()
    args[i] = value
    return args


BAD_FUNCTIONAL = [
    ("times", _with(5, torch.tensor([0.1, 0.3, 0.2]))),  # decreasing
    ("times", _with(5, torch.tensor([-0.1, 0.3, 0.4]))),  # negative
    ("times", _with(5, torch.tensor([0.1, float("nan"), 0.4]))),
    ("times", _with(5, torch.tensor([[0.1, 0.2]]))),
    ("p0", _with(0, torch.randn(3))),
    ("w1", _with(1, torch.randn(3, 4))),  # needs d+1 = 4 rows
    ("b1", _with(2, torch.randn(5))),
    ("w2", _with(3, torch.randn(4, 3))),  # needs H+1 = 5 rows
    ("b2", _with(4, torch.randn(2))),
]


@pytest.mark.parametrize(
    "arg,args", BAD_FUNCTIONAL, ids=[f"{a}-{i}" for i, (a, _) in enumerate(BAD_FUNCTIONAL)]
)
def test_bad_functional_arguments(arg, args):
    with pytest.raises(ValueError, match=rf"^{arg}\b"):
        pf.floater(*args)


@pytest.mark.parametrize(
    "arg,kwargs",
    [
        ("method", {"method": "rk5"}),
        ("activation", {"activation": "swish"}),
        ("substeps", {"substeps": 0}),
    ],
)
def test_bad_functional_options(arg, kwargs):
    with pytest.raises(ValueError, match=rf"^{arg}\b"):
        pf.floater(*_good(), **kwargs)


@pytest.mark.parametrize(
    "arg,kwargs",
    [
        ("method", {"method": "dopri5"}),
        ("activation", {"activation": "sigmoid"}),
        ("dim", {"dim": 0}),
        ("num_states", {"num_states": -1}),
        ("delta_t", {"delta_t": 0.0}),
        ("substeps", {"substeps": -2}),
        ("refresh_every", {"refresh_every": 0}),
    ],
)
def test_bad_module_arguments(arg, kwargs):
    args = {"dim": 4, "num_states": 2, **kwargs}
    with pytest.raises(ValueError, match=rf"^{arg}\b"):
        pf.Floater(**args)


def test_bad_module_calls():
    fl = pf.Floater(4, 2)
    with pytest.raises(ValueError, match=r"^length\b"):
        fl(length=-1)
    with pytest.raises(ValueError, match="exactly one of length or times"):
        fl()
    with pytest.raises(ValueError, match="exactly one of length or times"):
        fl(3, times=torch.tensor([0.1]))
    with pytest.raises(ValueError, match=r"^times\b"):
        fl(times=torch.tensor([0.3, 0.1]))
    with pytest.raises(ValueError, match=r"^times\b"):
        fl(times=torch.tensor([-1.0]))
    with pytest.raises(TypeError, match="length"):
        fl(length=2.5)


@pytest.mark.parametrize(
    "arg,attr,value",
    [
        ("substeps", "substeps", 0),
        ("method", "method", "dopri5"),
        ("activation", "activation", "swish"),
        ("w1", "w1", torch.nn.Parameter(torch.zeros(3, 4))),  # needs d+1 = 5 rows
        ("b2", "b2", torch.nn.Parameter(torch.zeros(3))),
        ("w1", "w1", torch.nn.Parameter(torch.zeros(5, 4, device="meta"))),
    ],
)
def test_module_attributes_replaced_after_construction(arg, attr, value):
    """A call checks the module's parameters and options once, before integrating: on
    every path that integrates (forward in both call forms, a block's own integration)."""
    fl = pf.Floater(4, 2, substeps=1)
    setattr(fl, attr, value)
    calls = (lambda: fl(length=3), lambda: fl(times=torch.tensor([0.1])))
    calls += (lambda: fl.integrate_states(3, slice(0, 1)),)
    for call in calls:
        with pytest.raises((ValueError, TypeError), match=rf"^{arg}\b"):
            call()


def test_mixed_dtypes_rejected():
    args = _good()
    args[1] = args[1].double()
    with pytest.raises(TypeError, match="w1"):
        pf.floater(*args)


# -- half-precision parameters (model.to(torch.bfloat16)) ---------------------------------
# Integrated in float32, returned in the parameters' dtype: within one ulp of that dtype of
# the float64 solution on the same (rounded) parameters. A half-precision state would drift
# by far more (test_amp.py::test_floater_in_half_precision_would_drift).
HALF = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]
ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}  # relative, at worst


def _within_one_ulp(out, expected, dtype, what=""):
    assert out.dtype == dtype, what
    err = (out.double() - expected.detach()).abs()
    bound = ULP[dtype] * expected.detach().abs() + 1e-6
    assert (err <= bound).all(), f"{what}: max err {err.max():.3g}, {(err > bound).sum()} bad"


def _half_module(dtype, device, **kw):
    fl = pf.Floater(6, 3, hidden_dim=5, activation="gelu", substeps=3, device=device, **kw)
    _inputs.randomize_parameters(fl, 5, fan_in=True)
    return fl.to(dtype)


@pytest.mark.parametrize("dtype", HALF)
def test_half_precision_module_integrates_in_float32(dtype, device):
    fl = _half_module(dtype, device)
    p64 = [p.detach().double().requires_grad_() for p in fl.parameters()]
    t = fl.length_times(12)
    assert t.dtype == torch.float32
    expected = ref.floater(*p64, t.double(), 3, "rk4", "gelu")
    out = fl(length=12)  # training mode
    _within_one_ulp(out, expected, dtype, "training output")
    grad = _inputs.randn(out.shape, _inputs.generator(6), dtype, device)
    out.backward(grad)
    expected.backward(grad.double())
    for (name, p), want in zip(fl.named_parameters(), p64):
        assert p.grad is not None and p.grad.dtype == dtype, name
        assert_close(p.grad, want.grad, dtype, "grad", what=name)
    fl.eval()
    with torch.no_grad():
        cached, longer = fl(length=12), fl(length=20)  # the cache, then its extension
    _within_one_ulp(cached, expected, dtype, "cached")
    full = ref.floater(*p64, fl.length_times(20).double(), 3, "rk4", "gelu")
    _within_one_ulp(longer, full, dtype, "extended")
    times = torch.tensor([0.05, 0.3, 0.31], device=device)
    _within_one_ulp(
        fl(times=times), ref.floater(*p64, times.double(), 3, "rk4", "gelu"), dtype, "times"
    )


@pytest.mark.parametrize("dtype", HALF)
def test_half_precision_functional_and_attention_bias(dtype, device):
    case = _inputs.FloaterCase(3, 5, 7, 6, 3, "rk4", "relu")
    inputs = [t.to(dtype) for t in _inputs.floater_inputs(case, torch.float32, device, 8)]
    out = pf.floater(*inputs, 3, "rk4", "relu")
    expected = ref.floater(*(t.double() for t in inputs), 3, "rk4", "relu")
    _within_one_ulp(out, expected, dtype, "functional")
    bias = pf.FloaterAttentionBias(8, num_layers=2, device=device).to(dtype)
    y = bias(5)
    assert y.shape == (2, 3, 5, 8) and y.dtype == dtype and torch.isfinite(y).all()
    y.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == dtype for p in bias.parameters())


@pytest.mark.parametrize("dtype", HALF)
def test_half_precision_compiled_module(dtype, device):
    torch._dynamo.reset()
    fl = _half_module(dtype, device)
    compiled = torch.compile(fl, fullgraph=True, backend="aot_eager")
    got = compiled(length=7)
    assert got.dtype == dtype and torch.equal(got, fl(length=7))


def test_reference_of_identity_is_affine():
    """A cross-check of the reference itself (numpy, independent of torch's matmul):
    with identity activation and Euler, one step is p + h (p W1 W2 + ...)."""
    case = _inputs.FloaterCase(2, 3, 4, 1, 1, "euler", "identity")
    p0, w1, b1, w2, b2, times = (
        t.numpy() for t in _inputs.floater_inputs(case, torch.float64, "cpu", 2)
    )
    t1 = times[0]
    h = ((p0 @ w1[:3] + 0.0 * w1[3] + b1) @ w2[:4]) + 0.0 * w2[4] + b2
    expected = p0 + t1 * h
    got = ref.floater(
        *(torch.from_numpy(x) for x in (p0, w1, b1, w2, b2, times)), 1, "euler", "identity"
    )
    np.testing.assert_allclose(got[:, 0].numpy(), expected, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize(
    "backend", backend_params("floater", torch.float64, include_reference=True)
)
@pytest.mark.parametrize("length", [0, 3])
def test_double_backward_against_reference(backend, length, device):
    """Gradients with create_graph=True, and gradients of those, equal the reference's
    (regression: at L = 0 the torch backend's double-backward path returned an output
    without a graph, so autograd.grad raised "element 0 of tensors does not require grad")."""
    case = _inputs.FloaterCase(2, 3, 4, length, 2, "rk4", "tanh")
    inputs = _inputs.floater_inputs(case, torch.float64, device, seed=5)
    results = []
    for name in (backend, "reference"):
        leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
        out = pf.floater(*leaves, 2, "rk4", "tanh", backend=name)
        g = _inputs.randn(out.shape, _inputs.generator(6), torch.float64, device)
        first = torch.autograd.grad(out, leaves, g, create_graph=True)
        loss = sum((x * x).sum() for x in first)
        # L = 0: the first gradients are constant zeros, so there is nothing to go through.
        second = (
            torch.autograd.grad(loss, leaves, allow_unused=True)
            if loss.requires_grad
            else (None,) * 6
        )
        results.append((first, second))
    (first, second), (want_first, want_second) = results
    for name, got, want in zip(NAMES, first, want_first):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=f"d{name}")
        assert length or not got.any(), f"d{name}"
    for name, got, want in zip(NAMES, second, want_second):
        if want is None:
            assert got is None or not got.any(), f"dd{name}"
        else:
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=f"dd{name}")


@pytest.mark.parametrize("backend", ["auto", "cpp", "torch"])
def test_an_eager_call_chooses_its_implementation_once(backend, monkeypatch):
    """The dispatcher runs once per eager call (the ops look the chosen name up), and not
    at all on a cache hit or in the backward."""
    if backend == "cpp" and pf.available_backends(verbose=True)["cpp"]:
        pytest.skip("cpp unavailable here")
    from posenc_fast import _dispatch

    chosen = []
    choose = _dispatch.choose

    def counting(registry, problem, requested="auto"):
        chosen.append(problem.op)
        return choose(registry, problem, requested)

    monkeypatch.setattr(_dispatch, "choose", counting)
    fl = pf.Floater(5, 3, hidden_dim=4, backend=backend)
    bias = pf.FloaterAttentionBias(5, num_layers=2, hidden_dim=4, backend=backend)
    _inputs.randomize_parameters(fl, 1, scale=0.3)
    args = [p.detach().requires_grad_() for p in fl.parameters()] + [torch.arange(4.0)]

    def calls(fn, expected):
        chosen.clear()
        out = fn()
        outs = out if isinstance(out, tuple) else (out,)
        sum(o.square().sum() for o in outs).backward()
        assert chosen == ["floater"] * expected, (fn, chosen)

    calls(lambda: pf.floater(*args, backend=backend), 1)
    calls(lambda: fl(length=6), 1)  # training
    calls(lambda: tuple(bias.block_biases(n, 6) for n in range(2)), 1)  # shared by both
    fl.eval()
    calls(lambda: fl(length=6), 1)  # a cache miss (gradients attached to the states)
    calls(lambda: fl(length=4), 0)  # a hit
    calls(lambda: fl(length=9), 0)  # an extension: the stored states' implementation
    with torch.no_grad():
        chosen.clear()
        pf.floater(*args, backend=backend)
        assert chosen == ["floater"]
