"""FLOATER for inference: freeze() stores the integrated states as a buffer that
forward serves (no integration: counted by the ``calls`` fixture), state_dict carries it,
exported and traced models hold no integration op; cache_info() reports hits, misses,
the lengths held and the frozen length."""

import pytest
import torch
from torch import nn

import posenc_fast as pf
from posenc_fast.cli import _inputs
from posenc_fast.integrations.attention import add_floater_biases
from posenc_fast.ops.floater import reference as ref
from posenc_fast.tolerances import assert_close


def _module(device, seed=0, **kw):
    kw = {"hidden_dim": 6, "delta_t": 0.05, "substeps": 3, "activation": "tanh", **kw}
    fl = pf.Floater(5, 3, device=device, dtype=torch.float64, **kw)
    _inputs.randomize_parameters(fl, seed, fan_in=True)
    return fl


def _fresh(fl, length):
    """The float64 reference on the module's times (no module, no cache)."""
    t = fl.length_times(length)
    return ref.floater(fl.p0, fl.w1, fl.b1, fl.w2, fl.b2, t, fl.substeps, fl.method, fl.activation)


def _posenc_ops(graph) -> list[str]:
    """The posenc_fast:: ops called in an FX graph."""
    return [str(n.target) for n in graph.nodes if "posenc_fast" in str(n.target)]


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_frozen_module_serves_stored_states_without_integrating(device, calls, training):
    fl = _module(device)
    assert fl.freeze(10) is fl and fl.frozen and fl.frozen_length == 10
    assert calls == [10]  # freeze integrates once
    fl.train(training)
    for length in (10, 4, 0):
        out = fl(length=length)
        assert out.shape == (3, length, 5)
        assert_close(out, _fresh(fl, length), torch.float64, "floater")
    assert calls == [10]
    assert not fl(length=4).requires_grad  # frozen: the dynamics get no gradient


def test_frozen_module_names_the_lengths_and_refuses_times(device):
    fl = _module(device).freeze(6)
    with pytest.raises(ValueError, match=r"length 7 exceeds the 6 positions .*freeze\(7\)"):
        fl(length=7)
    with pytest.raises(ValueError, match="frozen.*unfreeze"):
        fl(times=torch.tensor([0.0, 0.1], dtype=torch.float64, device=device))
    with pytest.raises(ValueError, match="length must be positive"):
        fl.freeze(0)


def test_unfreeze_integrates_again(device, calls):
    fl = _module(device).freeze(5).eval()
    fl.unfreeze()
    assert not fl.frozen and "frozen_states" not in fl.state_dict()
    out = fl(length=8)  # longer than frozen: integrated
    assert calls == [5, 3]  # onwards from the 5 states freeze() left in the result cache
    assert_close(out, _fresh(fl, 8), torch.float64, "floater")


def test_state_dict_carries_the_states_and_freezes_a_fresh_module(device, calls):
    fl = _module(device).freeze(7)
    sd = fl.state_dict()
    assert sd["frozen_states"].shape == (3, 7, 5)
    fresh = _module(device, seed=5)  # other parameters, never frozen
    fresh.load_state_dict(sd)  # strict: the buffer is created for the checkpoint's key
    assert fresh.frozen and fresh.frozen_length == 7
    n = len(calls)
    torch.testing.assert_close(fresh(length=7), fl(length=7), rtol=0, atol=0)
    assert len(calls) == n
    # and back: a frozen module loads another frozen length
    other = _module(device).freeze(3)
    other.load_state_dict(sd)
    assert other.frozen_length == 7
    # a module that was never frozen keeps its state_dict keys (old checkpoints load)
    assert "frozen_states" not in _module(device).state_dict()


def test_attention_bias_freeze_and_exported_program_has_no_integration(device, calls):
    bias = pf.FloaterAttentionBias(4, num_layers=2, substeps=2, device=device)
    _inputs.randomize_parameters(bias, 3, scale=0.3)
    want = bias.eval()(6)
    bias.freeze(9)
    torch.testing.assert_close(bias(6), want)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.bias = bias

        def forward(self, x):  # x [B, L, 4]
            return x + self.bias(x.shape[1])[1, 2]

    x = torch.randn(2, 6, 4, device=device)
    L = torch.export.Dim("L", max=9)
    ep = torch.export.export(Model(), (x,), dynamic_shapes=({0: torch.export.Dim("B"), 1: L},))
    assert _posenc_ops(ep.graph) == []
    n = len(calls)
    y = torch.randn(3, 9, 4, device=device)
    torch.testing.assert_close(ep.module()(y), y + bias(9)[1, 2])
    assert len(calls) == n


def test_transformer_with_frozen_biases_traces_and_exports_without_integration(device, calls):
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).to(device)
    biases = add_floater_biases(model, substeps=2)
    _inputs.randomize_parameters(biases, 4, scale=0.3)
    x = torch.randn(2, 5, 8, device=device)
    model.eval()
    with torch.no_grad():
        want = model(x)
    biases.freeze(8)
    for training in (False, True):  # frozen biases are served in training too
        model.train(training)
        n = len(calls)
        got = model(x)
        assert len(calls) == n
        if not training:  # (dropout in training)
            torch.testing.assert_close(got, want)
    model.eval()
    traced = torch.jit.trace(model, (x,), check_trace=False)
    assert "posenc_fast::" not in str(traced.inlined_graph)  # no op call
    ep = torch.export.export(model, (x,))
    assert _posenc_ops(ep.graph) == []
    torch.testing.assert_close(ep.module()(x), want)


def test_cache_info_counts_hits_and_misses(device):
    fl = _module(device).eval()
    info = fl.cache_info()
    assert (info.hits, info.misses, info.lengths, info.frozen) == (0, 0, {}, 0)
    fl(length=8)
    fl(length=8)
    fl(length=3)  # a prefix: served
    assert fl.cache_info() == (2, 1, {"length": 8}, 0)
    fl(length=12)  # extends the stored states: integrates
    fl(times=torch.tensor([0.0, 0.3], dtype=torch.float64, device=device))
    assert fl.cache_info() == (2, 3, {"length": 12, "times": 2}, 0)
    fl.clear_cache()
    assert fl.cache_info() == (0, 0, {}, 0)
    fl.freeze(4)
    fl(length=2)
    info = fl.cache_info()
    assert info.frozen == 4 and info.hits == 1
    bias = pf.FloaterAttentionBias(4, num_layers=1)
    assert bias.cache_info() == bias.floater.cache_info()
