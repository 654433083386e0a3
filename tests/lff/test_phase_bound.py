"""The torch backend's float32 phases (ops/_torch_math.py): taken only where the bound
B = max_k sum_m |wr_km| max_r |x_rm| proves every cos/sin within 1e-6 of float64 math.

Adversarial inputs: every |x| at its column's maximum and every row of wr with
sum_m |wr_km| = B, so phases reach B, and among millions of such phases the worst float32
roundings occur. At the boundary the features must stay within 1e-6; beyond it plain
float32 phases exceed 1e-6 (the bound is needed) and the backend, back on float64
phases, does not.
"""

import math

import _helpers
import pytest
import torch

import posenc_fast as pf
from posenc_fast.cli import _inputs
from posenc_fast.ops import _torch_math
from posenc_fast.ops.lff import reference as lff_ref
from posenc_fast.ops.lff import torch_impl as torch_lff
from posenc_fast.tolerances import PHASE_ATOL, assert_close

U = 2.0**-24


def _adversarial(M: int, bound: float, R: int = 1024, K: int = 1024, seed: int = 0):
    """rows [R, M] with |x| in [0.5, 1] and max |x| = 1 per column, wr [K, M] with every
    row's sum of |wr| equal to ``bound`` (so B = bound): phases up to B in magnitude."""
    g = _inputs.generator(seed)
    sign = torch.where(torch.rand((R, M), generator=g) < 0.5, -1.0, 1.0)
    rows = (0.5 + 0.5 * torch.rand((R, M), generator=g)) * sign
    rows[0] = 1.0  # the column maxima are exactly 1
    w = torch.rand((K, M), generator=g, dtype=torch.float64) + 0.05
    w *= torch.where(torch.rand((K, M), generator=g) < 0.5, -1.0, 1.0)
    w = w / w.abs().sum(1, keepdim=True) * bound
    wr = w.float()
    # rounding to float32 moved the row sums: rescale so the largest is exactly `bound`
    wr = wr * (bound / float(wr.double().abs().sum(1).max()))
    return rows.float(), wr


def _features(rows, wr):
    """The backend's unscaled cos and sin, and whether it took float32 phases."""
    p = torch_lff._prepare(rows, wr, None, None, None, None, torch.float32)
    ws = torch_lff._Workspace(p, rows.shape[0], rows.device)
    c, s = ws.cos_sin(ws.phase_rows(rows))
    return c, s, p.wr_t is not None


def _errors(rows, wr, c, s):
    phase = rows.double() @ wr.double().T  # exact products; float64 sums
    return max(float((c - phase.cos()).abs().max()), float((s - phase.sin()).abs().max()))


def _float32_phase_error(rows, wr) -> float:
    """Largest |float32 phase - exact phase|, the phase evaluated as the backend does."""
    p32 = rows[:, :1] * wr[:, 0]
    for m in range(1, rows.shape[1]):
        p32 = p32.addcmul(rows[:, m : m + 1], wr[:, m])
    return float((p32.double() - rows.double() @ wr.double().T).abs().max())


def test_limits_follow_the_error_analysis():
    for M in (1, 2, 3, 4):
        gamma = M * U / (1 - M * U)
        assert _torch_math.float32_phase_limit(M) == pytest.approx((PHASE_ATOL - 4 * U) / gamma)
    assert 12.7 < _torch_math.float32_phase_limit(1) < 12.8
    assert 6.3 < _torch_math.float32_phase_limit(2) < 6.4


@pytest.mark.parametrize("M", [1, 2, 3])
def test_decision_at_the_boundary(M):
    limit = _torch_math.float32_phase_limit(M)
    rows, wr = _adversarial(M, limit * (1 - 1e-6), R=64, K=64)
    assert _torch_math.phase_bound(rows, wr) <= limit
    assert _torch_math.float32_phases_suffice(rows, wr)
    assert not _torch_math.float32_phases_suffice(rows, wr * (1 + 1e-5))
    assert not _torch_math.float32_phases_suffice(rows * (1 + 1e-5), wr)
    assert not _torch_math.float32_phases_suffice(rows.double(), wr.double())  # float64 inputs
    for bad in (float("nan"), float("inf")):
        poisoned = rows.clone()
        poisoned[3, 0] = bad
        assert not _torch_math.float32_phases_suffice(poisoned, wr)


@pytest.mark.parametrize("M", [1, 2, 3])
def test_float32_phases_at_the_boundary_keep_1e_6(M):
    limit = _torch_math.float32_phase_limit(M)
    rows, wr = _adversarial(M, limit * (1 - 1e-6), seed=M)
    c, s, fast = _features(rows, wr)
    assert fast, "the bound holds: float32 phases must be taken"
    # the inputs are adversarial: float32 phase errors reach a good part of the bound
    assert _float32_phase_error(rows, wr) > 0.5 * M * U * limit
    err = _errors(rows, wr, c, s)
    assert err <= PHASE_ATOL, f"M={M}: {err:.3g} at B = {limit:.4g}"


@pytest.mark.parametrize("M", [1, 2])
def test_beyond_the_boundary_float64_phases_are_needed_and_taken(M):
    bound = 8 * _torch_math.float32_phase_limit(M)
    rows, wr = _adversarial(M, bound, seed=10 + M)
    # plain float32 phases would break the contract here ...
    assert _float32_phase_error(rows, wr) > 2 * PHASE_ATOL
    # ... so the backend takes float64 phases and keeps it
    c, s, fast = _features(rows, wr)
    assert not fast
    assert _errors(rows, wr, c, s) <= PHASE_ATOL


def _lff_case(scale: float):
    """LFF inputs with 2048 rows x 64 frequencies (enough to consider float32 phases),
    x in [-1, 1] and wr scaled so that B = scale * the float32 limit."""
    g = _inputs.generator(21)
    x = _inputs.rand((1024, 2, 2), g, -1.0, 1.0)
    wr = _inputs.randn((64, 2), g)
    wr *= scale * _torch_math.float32_phase_limit(2) / float(wr.abs().sum(1).max())
    w1 = _inputs.randn((128, 16), g, scale=0.3)
    b1, w2, b2 = (
        _inputs.randn((16,), g),
        _inputs.randn((16, 24), g, scale=0.25),
        _inputs.randn((24,), g),
    )
    return x, wr, w1, b1, w2, b2


@pytest.mark.parametrize("scale", [0.9, 1.1], ids=["float32-phases", "float64-phases"])
def test_lff_on_both_sides_of_the_bound(scale):
    """Forward and every gradient against the float64 reference, on either path, and the
    backward bitwise reproducible."""
    inputs = _lff_case(scale)
    rows = inputs[0].reshape(-1, 2)
    assert _torch_math.float32_phases_suffice(rows, inputs[1]) == (scale < 1)
    leaves = [t.clone().requires_grad_() for t in inputs]
    y = pf.lff(*leaves, backend="torch")
    leaves64 = [t.double().requires_grad_() for t in inputs]
    want = lff_ref.lff(*leaves64)
    assert_close(y, want, torch.float32, "lff", what="forward")
    g = _inputs.randn(y.shape, _inputs.generator(22))
    grads = torch.autograd.grad(y, leaves, g)
    grads64 = torch.autograd.grad(want, leaves64, g.double())
    for name, got, ref in zip(_helpers.LFF_NAMES, grads, grads64):
        assert_close(got, ref, torch.float32, "grad", what=f"d{name}")
    again = torch.autograd.grad(pf.lff(*leaves, backend="torch"), leaves, g)
    assert all(torch.equal(a, b) for a, b in zip(grads, again))
    # the features themselves (no MLP): the 1e-6 contract, scaled by 1/sqrt(F)
    feats = pf.lff(inputs[0], inputs[1], backend="torch")
    assert_close(feats, lff_ref.lff(inputs[0], inputs[1]), torch.float32, "encoding")
    assert math.isfinite(float(feats.abs().max()))
