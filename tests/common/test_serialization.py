"""Modules survive checkpoints and copies: state_dict (also onto another backend),
torch.save/load with weights_only=True, deepcopy, pickle, meta-device construction."""

import copy
import io
import pickle

import _helpers
import pytest
import torch
from conftest import backend_params

import posenc_fast as pf
from posenc_fast.cli import _inputs
from posenc_fast.tolerances import assert_close


def _lff(**kw):
    return pf.LearnableFourierFeatures(2, 16, 8, 12, groups=2, **kw)


MODULE_FACTORIES = {
    "lff": lambda **kw: _lff(**kw),
    "lff-fixed-ln-kl": lambda **kw: _lff(learnable=False, layer_norm=True, kl=True, **kw),
    "lff-features": lambda **kw: pf.LearnableFourierFeatures(
        3, 8, 0, 16, groups=2, mlp=False, **kw
    ),
}


def _input(name, device="cpu"):
    torch.manual_seed(0)
    return torch.rand(6, 2, 3 if name == "lff-features" else 2, device=device) * 10


@pytest.mark.parametrize("name", list(MODULE_FACTORIES))
def test_state_dict_round_trip_with_weights_only_load(name):
    a = MODULE_FACTORIES[name]().eval()
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    b = MODULE_FACTORIES[name]().eval()
    b.load_state_dict(state)
    x = _input(name)
    assert torch.equal(a(x), b(x))
    assert set(state) == set(a.state_dict())


@pytest.mark.parametrize("backend", backend_params("lff", torch.float32, include_reference=True))
def test_state_dict_loads_onto_another_backend_and_dtype(backend, device):

    dtypes = _helpers.support(backend, "lff").dtypes
    other = torch.float64 if dtypes is None or torch.float64 in dtypes else torch.float16
    a = _lff(backend="torch")
    b = _lff(backend=backend, device=device, dtype=other)
    b.load_state_dict(a.state_dict())  # load_state_dict copies across dtype and device
    x = _input("lff")
    assert_close(
        b(x.to(device)), a(x).double(), other if other != torch.float64 else torch.float32, "lff"
    )


@pytest.mark.parametrize("name", list(MODULE_FACTORIES))
def test_deepcopy_and_pickle(name):
    a = MODULE_FACTORIES[name]().eval()
    x = _input(name)
    for b in (copy.deepcopy(a), pickle.loads(pickle.dumps(a))):
        assert torch.equal(a(x), b(x))
        for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
            assert p.data_ptr() != q.data_ptr(), f"{n} must be a copy"


@pytest.mark.parametrize("name", list(MODULE_FACTORIES))
def test_meta_device_then_to_empty_and_reset(name, device):
    m = MODULE_FACTORIES[name](device="meta")
    assert all(p.is_meta for p in m.parameters())
    m.to_empty(device=device)
    m.reset_parameters()
    out = m.eval()(_input(name, device))
    assert torch.isfinite(out).all()
    assert m.wr.std() > 0


def test_encoding_modules_have_no_state_and_pickle():
    for m in (pf.SinusoidalPE(8, base=500.0), pf.DFTPE(8)):
        assert m.state_dict() == {}
        x = torch.randn(2, 5, 8)
        assert torch.equal(pickle.loads(pickle.dumps(m))(x), m(x))
        assert torch.equal(copy.deepcopy(m)(x), m(x))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_factory_dtype_and_device_honoured(dtype, device):
    m = _lff(device=device, dtype=dtype, layer_norm=True)
    assert all(p.dtype == dtype and p.device.type == device for p in m.parameters())
    assert m(_input("lff", device)).dtype == dtype


# -- FLOATER -------------------------------------------------------------------------------

FLOATER_FACTORIES = {
    "floater": lambda **kw: pf.Floater(
        6, 3, hidden_dim=5, delta_t=0.05, substeps=2, activation="tanh", **kw
    ),
    "floater-bias": lambda **kw: pf.FloaterAttentionBias(
        6, num_layers=2, hidden_dim=5, delta_t=0.05, substeps=2, activation="tanh", **kw
    ),
}
FLOATER_KEYS = {"p0", "w1", "b1", "w2", "b2"}


def _floater(name, seed=0, **kw):
    """A module with random parameters (the default initialisation starts near zero)."""
    m = FLOATER_FACTORIES[name](**kw)
    _inputs.randomize_parameters(m, seed, 0.5)
    return m


def _floater_module(m) -> pf.Floater:
    return m if isinstance(m, pf.Floater) else m.floater


@pytest.mark.parametrize("name", list(FLOATER_FACTORIES))
def test_floater_state_dict_round_trip_with_weights_only_load(name):
    a = _floater(name).eval()
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    prefix = "" if name == "floater" else "floater."
    assert set(state) == {prefix + k for k in FLOATER_KEYS}, "the cache is not state"
    b = _floater(name, seed=1).eval()
    stale = b(9)  # b's cache, computed with its own parameters
    b.load_state_dict(state)
    assert torch.equal(a(9), b(9))
    assert not torch.equal(stale, b(9))


@pytest.mark.parametrize("backend", backend_params("floater", include_reference=True))
def test_floater_state_dict_loads_onto_another_backend_and_dtype(backend, device):
    a = _floater("floater-bias", backend="torch").eval()
    b = _floater("floater-bias", seed=1, backend=backend, device=device, dtype=torch.float64)
    b.load_state_dict(a.state_dict())
    assert all(p.dtype == torch.float64 for p in b.parameters())
    assert_close(b.eval()(11), a(11).double(), torch.float32, "floater")


@pytest.mark.parametrize("name", list(FLOATER_FACTORIES))
def test_floater_deepcopy_and_pickle_leave_the_cache_behind(name):
    a = _floater(name).eval()
    uncached = len(pickle.dumps(a))
    out = a(400)  # a cache of 6 * 400 * 6 floats, ~7x the parameters and module
    assert len(pickle.dumps(a)) < uncached + 1000, "the cache was pickled"
    for b in (copy.deepcopy(a), pickle.loads(pickle.dumps(a))):
        fb = _floater_module(b)
        assert fb._cache.entries == {}, "a copy carried the cache"
        assert fb._cache.id != _floater_module(a)._cache.id, "a copy shares the cache's id"
        for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
            assert p.data_ptr() != q.data_ptr(), f"{n} must be a copy"
        assert torch.equal(b(400), out)
        with torch.no_grad():
            next(b.parameters()).add_(0.1)  # edits of the copy reach neither cache of a
        assert not torch.equal(b(400), out)
        assert torch.equal(a(400), out)


def test_floater_deepcopy_in_training_with_refresh_every():
    a = pf.Floater(4, 2, refresh_every=3)
    a(length=5).sum().backward()  # a refresh call: the stored result is now reused
    b = copy.deepcopy(a)
    assert b(length=5).requires_grad, "the copy starts with a refresh, not a stale value"
    assert not a(length=5).requires_grad


@pytest.mark.parametrize("name", list(FLOATER_FACTORIES))
def test_floater_meta_device_then_to_empty_and_reset(name, device):
    m = FLOATER_FACTORIES[name](device="meta")
    assert all(p.is_meta for p in m.parameters())
    m.to_empty(device=device)
    torch.manual_seed(5)
    m.reset_parameters()
    fl = _floater_module(m)
    assert torch.equal(fl.p0, torch.zeros_like(fl.p0)) and fl.w1.std() > 0
    torch.manual_seed(5)
    direct = FLOATER_FACTORIES[name](device=device)  # the same initialisation
    for (n, p), (_, q) in zip(m.named_parameters(), direct.named_parameters()):
        assert torch.equal(p, q), n
    out = m.eval()(20)
    assert torch.isfinite(out).all() and out.abs().max() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(FLOATER_FACTORIES))
def test_floater_factory_dtype_and_device_honoured(name, dtype, device):
    m = FLOATER_FACTORIES[name](device=device, dtype=dtype)
    assert all(p.dtype == dtype and p.device.type == device for p in m.parameters())
    out = m(7)
    assert out.dtype == dtype and out.device.type == device
