"""Adding a backend for an op is one registry entry plus its kernels: a toy backend for
LFF, registered here (one entry in the backend table, one in LFF's registry), is run when
named, takes part in "auto" at its place in AUTO_ORDER, and its refusals (its SUPPORT
table, its environment) show in the dispatcher's errors like every other backend's."""

import pytest
import torch

import posenc_fast as pf
from posenc_fast import _dispatch
from posenc_fast._dispatch import Backend, Implementation, OpSupport
from posenc_fast.cli._inputs import LffCase, lff_inputs
from posenc_fast.ops.lff import torch_impl
from posenc_fast.ops.lff.registry import LFF

CASE = LffCase((9,), 2, 2, 8, 4, 6)


def _register(monkeypatch, calls, reasons=()):
    """The toy backend: the torch implementation's kernels, counted; float32 CPU tensors
    and hidden_dim <= 4 only."""

    def forward(*args):
        calls.append("forward")
        return torch_impl.lff_forward(*args)

    def backward(*args):
        calls.append("backward")
        return torch_impl.lff_backward(*args)

    backend = Backend("toy", "a test backend", lambda: list(reasons))
    support = OpSupport(devices=("cpu",), dtypes=(torch.float32,), max_sizes={"hidden_dim": 4})
    monkeypatch.setitem(_dispatch.BACKENDS, "toy", backend)
    monkeypatch.setitem(
        LFF, "toy", Implementation("toy", support, forward=forward, backward=backward)
    )


def _inputs(dtype=torch.float32, case=CASE):
    return [t.requires_grad_() for t in lff_inputs(case, dtype, "cpu", 31)]


def _run(inputs, backend):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    y = pf.lff(*leaves, backend=backend)
    y.backward(torch.linspace(-1, 1, y.numel()).view_as(y))
    return y.detach(), [t.grad for t in leaves]


def test_a_named_toy_backend_runs_its_kernels(monkeypatch):
    calls = []
    _register(monkeypatch, calls)
    inputs = _inputs()
    y, grads = _run(inputs, "toy")
    assert calls == ["forward", "backward"]
    want_y, want_grads = _run(inputs, "torch")
    assert torch.equal(y, want_y) and all(torch.equal(a, b) for a, b in zip(grads, want_grads))
    # through the custom op too (what torch.compile and export see): the name travels
    out = torch.ops.posenc_fast.lff(*[t.detach() for t in inputs], "gelu", torch.float32, "toy")
    assert torch.equal(out, want_y) and calls[-1] == "forward"
    m = pf.LearnableFourierFeatures(2, 8, 4, 12, groups=2, backend="toy")
    assert "backend='toy'" in repr(m)
    m(inputs[0].detach())
    assert calls[-1] == "forward"


def test_auto_takes_the_toy_backend_at_its_place_in_auto_order(monkeypatch):
    calls = []
    _register(monkeypatch, calls)
    monkeypatch.delenv(_dispatch.ENV_VAR, raising=False)
    inputs = [t.detach() for t in _inputs()]
    pf.lff(*inputs)
    assert calls == [], "not in AUTO_ORDER: never picked by auto"
    monkeypatch.setattr(_dispatch, "AUTO_ORDER", ["toy", *_dispatch.AUTO_ORDER])
    pf.lff(*inputs)
    assert calls == ["forward"]
    # beyond its SUPPORT table (hidden_dim 6 > 4, float64): auto goes on to the next one
    wide = LffCase((9,), 2, 2, 8, 6, 6)
    pf.lff(*[t.detach() for t in _inputs(case=wide)])
    pf.lff(*[t.detach() for t in _inputs(torch.float64)])
    assert calls == ["forward"]


def test_toy_refusals_are_reported_like_every_backend(monkeypatch):
    calls = []
    _register(monkeypatch, calls)
    x64 = [t.detach() for t in _inputs(torch.float64)]
    with pytest.raises(pf.BackendError) as info:
        pf.lff(*x64, backend="toy")
    msg = str(info.value)
    assert "backend 'toy' cannot run lff" in msg
    assert "toy: supports dtypes float32, got float64" in msg
    for name in ("reference", "torch", "triton", "cuda", "cpp"):
        assert f"  {name}:" in msg
    with pytest.raises(pf.BackendError, match="toy: does not implement encoding"):
        pf.sinusoidal(torch.arange(4.0), 8, backend="toy")
    assert calls == []


def test_an_unavailable_toy_backend_says_why(monkeypatch):
    calls = []
    _register(monkeypatch, calls, reasons=["toy is switched off"])
    monkeypatch.setattr(_dispatch, "AUTO_ORDER", ["toy", *_dispatch.AUTO_ORDER])
    monkeypatch.delenv(_dispatch.ENV_VAR, raising=False)
    inputs = [t.detach() for t in _inputs()]
    pf.lff(*inputs)  # auto: skipped, the next backend runs it
    assert calls == []
    assert pf.available_backends(verbose=True)["toy"] == ["toy is switched off"]
    with pytest.raises(pf.BackendError, match="toy: toy is switched off"):
        pf.lff(*inputs, backend="toy")
