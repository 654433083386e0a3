"""torch.autocast: phases stay float32, outputs follow the autocast dtype (LFF, which has
matmuls), elementwise encodings keep their input's dtype (like torch.sin does), FLOATER
is not affected by autocast at all (its ODE state and output keep the parameters' dtype)."""

import contextlib
import math

import pytest
import torch
from conftest import DEVICE, backend_params

import posenc_fast as pf
from posenc_fast.cli import _inputs
from posenc_fast.ops.lff import reference as ref
from posenc_fast.tolerances import assert_close

AMP_DTYPES = [torch.bfloat16, torch.float16]


def _bf16_ulp(v: torch.Tensor, dtype) -> torch.Tensor:
    """One ulp of ``dtype`` at each value of v (float64)."""
    mant = {torch.bfloat16: 7, torch.float16: 10}[dtype]
    tiny = torch.finfo(dtype).tiny
    e = torch.floor(torch.log2(v.abs().clamp_min(tiny)))
    return torch.exp2(e - mant)


@pytest.mark.parametrize("backend", backend_params("lff", torch.float32))
@pytest.mark.parametrize("amp_dtype", AMP_DTYPES, ids=["bf16", "fp16"])
def test_phase_error_at_1e4_stays_at_fp32_level_under_autocast(backend, amp_dtype, device):
    g = torch.Generator().manual_seed(0)
    wr = torch.randn(32, 2, generator=g).to(device)
    x = (torch.rand(128, 1, 2, generator=g) * 2 - 1).to(device)
    x = x * (1e4 / (x[:, 0] @ wr.T).abs().max())  # |phase| up to 1e4
    with torch.autocast(device_type=DEVICE, dtype=amp_dtype):
        feats = pf.lff(x, wr, backend=backend)
    assert feats.dtype == amp_dtype, "outputs follow the autocast dtype"
    raw = feats.double() * math.sqrt(64)
    exact = ref.lff(x, wr) * math.sqrt(64)  # float64 math on the same fp32 inputs
    # Rounding the exact value to the autocast dtype is the only error allowed (+ fp32 level).
    err = (raw - exact).abs()
    allowed = _bf16_ulp(exact, amp_dtype) + 1e-6
    assert (err <= allowed).all(), f"max err {err.max():.3g} beyond one {amp_dtype} ulp"
    # A naive autocast computation (phase matmul in the autocast dtype) is off by radians,
    # which is what the float32 phase avoids.
    with torch.autocast(device_type=DEVICE, dtype=amp_dtype):
        naive = torch.cos(x[:, 0] @ wr.T)
    assert (naive.double() - torch.cos(x[:, 0].double() @ wr.double().T)).abs().max() > 0.1


@pytest.mark.parametrize("backend", backend_params("lff", torch.float32))
@pytest.mark.parametrize("amp_dtype", AMP_DTYPES, ids=["bf16", "fp16"])
def test_lff_module_under_autocast(backend, amp_dtype, device):
    torch.manual_seed(1)
    m = pf.LearnableFourierFeatures(2, 32, 16, 24, groups=2, backend=backend, device=device)
    x = torch.rand(40, 2, 2, device=device) * 100
    with torch.autocast(device_type=DEVICE, dtype=amp_dtype):
        y = m(x)
    assert y.dtype == amp_dtype
    assert_close(y, ref.lff(x, m.wr, m.w1, m.b1, m.w2, m.b2), amp_dtype, "lff")
    y.float().square().sum().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        assert torch.isfinite(p.grad).all(), name


def test_autocast_with_layer_norm_variant(device):
    m = pf.LearnableFourierFeatures(2, 16, 8, 12, layer_norm=True, device=device)
    with torch.autocast(device_type=DEVICE, dtype=torch.bfloat16):
        y = m(torch.rand(10, 1, 2, device=device))
    assert torch.isfinite(y.float()).all()


@pytest.mark.parametrize("backend", backend_params("encoding", torch.float32))
def test_encodings_keep_their_dtype_under_autocast(backend, device):
    p = torch.rand(33, device=device) * 1e4
    x = torch.randn(2, 33, 16, device=device)
    with torch.autocast(device_type=DEVICE, dtype=torch.bfloat16):
        pe = pf.sinusoidal(p, 16, backend=backend)
        y = pf.DFTPE(16, backend=backend)(x, p)
    assert pe.dtype == torch.float32 and y.dtype == torch.float32
    from posenc_fast.ops.encodings import reference as eref

    assert_close(pe, eref.sinusoidal(p, 16), torch.float32, "encoding")
    assert_close(y, x.double() + eref.dft(p, 16), torch.float32, "encoding")


# -- FLOATER: autocast does not apply ------------------------------------------------------
# The ODE state is integrated in the parameters' dtype (float32 or float64) under autocast
# too, and the output keeps that dtype: hundreds of solver steps would accumulate half
# precision's rounding (like the reductions and transcendental ops that autocast keeps in
# float32). A caller mixing the biases into bfloat16 activations casts them (or lets type
# promotion do it).


def _floater_module(backend, device):
    m = pf.FloaterAttentionBias(
        8, num_layers=2, hidden_dim=12, delta_t=0.05, substeps=3, activation="relu",
        backend=backend, device=device,
    )  # fmt: skip
    _inputs.randomize_parameters(m, 5, 0.5)
    return m


def _floater_all_paths(m, amp_dtype):
    """Training output and gradients, eval (cached) and a longer eval (cache extension)."""
    ctx = torch.autocast(DEVICE, dtype=amp_dtype) if amp_dtype else contextlib.nullcontext()
    m.zero_grad(set_to_none=True)
    m.floater.clear_cache()
    with ctx:
        train = m.train()(30)
        train.square().sum().backward()
        with torch.no_grad():
            cached = m.eval()(20)
            longer = m(30)
    return [train.detach(), cached, longer] + [p.grad for p in m.parameters()]


@pytest.mark.parametrize("backend", backend_params("floater", include_reference=True))
@pytest.mark.parametrize("amp_dtype", AMP_DTYPES, ids=["bf16", "fp16"])
def test_floater_ignores_autocast(backend, amp_dtype, device):
    m = _floater_module(backend, device)
    plain = _floater_all_paths(m, None)
    amp = _floater_all_paths(m, amp_dtype)
    for i, (a, b) in enumerate(zip(plain, amp)):
        assert b.dtype == torch.float32, f"output {i} is {b.dtype} under autocast"
        assert torch.equal(a, b), f"output {i} differs under autocast"
    p = [t.detach() for t in m.floater.parameters()]
    t = m.floater.length_times(30)
    with torch.autocast(DEVICE, dtype=amp_dtype):
        y = pf.floater(*p, t, 3, "rk4", "relu", backend=backend)
    assert y.dtype == torch.float32
    assert torch.equal(y, pf.floater(*p, t, 3, "rk4", "relu", backend=backend))


def test_floater_in_half_precision_would_drift():
    """Why the policy: the same integration with a bfloat16 state is off by far more than
    the float32 result (which meets the library's float32 tolerance)."""
    from posenc_fast.ops.floater import reference as fref

    case = _inputs.FloaterCase(4, 16, 16, 64, 5, "rk4", "tanh")
    p0, w1, b1, w2, b2, times = _inputs.floater_inputs(case, torch.float32, "cpu", 7)
    args = (p0, w1, b1, w2, b2, times, case.substeps, case.method, case.activation)
    exact = fref.floater(*args)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = pf.floater(*args)
    assert_close(got, exact, torch.float32, "floater")
    naive = fref.floater(*args, compute_dtype=torch.bfloat16)
    assert (naive.double() - exact).abs().max() > 100 * (got.double() - exact).abs().max()
