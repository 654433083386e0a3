"""The activation table (ops/lff/activations.py): every form of an activation computes the
literal formula's values, and its ATen derivative is the formula's derivative."""

import pytest
import torch

from posenc_fast.cli import _inputs
from posenc_fast.ops.lff import activations


@pytest.mark.parametrize("name", activations.ACTIVATIONS)
def test_every_form_computes_the_formula(name):
    act = activations.get(name)
    a = _inputs.randn((4096,), _inputs.generator(3), torch.float64, "cpu", 3.0)
    a.requires_grad_(True)
    want = act.literal(a)
    for form in (act.folded(a), act.aten(a.detach()), act.module()(a.detach())):
        torch.testing.assert_close(form, want.detach(), rtol=1e-12, atol=1e-14)
    g = _inputs.randn((4096,), _inputs.generator(4), torch.float64, "cpu")
    (want_grad,) = torch.autograd.grad(want, a, g)
    torch.testing.assert_close(act.aten_backward(g, a.detach()), want_grad, rtol=1e-10, atol=1e-12)


def test_an_unknown_activation_is_named():
    with pytest.raises(ValueError, match="activation must be one of .*'tanh'"):
        activations.get("tanh")
