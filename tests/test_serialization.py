"""Modules survive checkpoints and copies: state_dict (also onto another backend),
torch.save/load with weights_only=True, deepcopy, pickle, meta-device construction."""

import copy
import io
import pickle

import pytest
import torch
from conftest import backend_params

import posenc_fast as pf
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
    from posenc_fast import backends

    dtypes = backends.get(backend).SUPPORT["lff"].dtypes
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
