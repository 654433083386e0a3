"""FLOATER's part of ``python -m posenc_fast verify`` and ``bench`` (cli/floater_suite.py)."""

import pytest
import torch
from conftest import backend_params

from posenc_fast.cli import floater_suite


@pytest.mark.parametrize("backend", backend_params("floater"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_verify_check_passes(backend, dtype, device):
    res = floater_suite.check_floater(backend, dtype, device, seed=17)
    assert res.cases == len(floater_suite.verify_cases()) + 1
    assert not res.failures, res.failures[:3]
    assert 0 < res.fwd_err < 1e-4 and 0 < res.grad_err < 1e-4


def test_verify_check_catches_a_wrong_backend(monkeypatch, device):
    """The check must be able to fail: a backend integrating with one substep too few."""
    from posenc_fast.ops.floater.registry import FLOATER

    forward = FLOATER["torch"].forward

    def wrong(p0, w1, b1, w2, b2, times, options):
        fewer = options._replace(substeps=max(1, options.substeps - 1))
        return forward(p0, w1, b1, w2, b2, times, fewer)

    monkeypatch.setattr(FLOATER["torch"], "forward", wrong)
    res = floater_suite.check_floater("torch", torch.float64, device, seed=3)
    assert res.failures


def test_bench_case_implementations_agree(device):
    """Every implementation of a bench case (backends, torchdiffeq odeint and
    odeint_adjoint, the plain loop) integrates the same problem on the same steps."""
    pytest.importorskip("torchdiffeq")
    case = floater_suite.floater_case(8, 4, device)
    assert "torch" in case.backends
    assert {"torchdiffeq", "torchdiffeq-adjoint"} <= set(case.baselines)
    assert floater_suite.agreement(case) == ""
    adjoint = case.baselines["torchdiffeq-adjoint"]
    out = adjoint.fn()
    grads = torch.autograd.grad(out, adjoint.leaves, torch.ones_like(out))  # it runs backwards
    assert all(g is not None and g.abs().sum() > 0 for g in grads)


def test_bench_sizes():
    cases = floater_suite.bench_cases(quick=False, device="cpu")
    assert sorted((c.sizes["L"], c.sizes["d"]) for c in cases) == [
        (64, 16),
        (64, 128),
        (512, 16),
        (512, 128),
    ]
    assert all(c.op == "floater" and c.sizes["method"] == "rk38" for c in cases)
