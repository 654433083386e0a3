"""The torch backend's kept tables for x + encoding(0..L-1) (ops/encodings/torch_impl.py)."""

import pytest
import torch

import posenc_fast as pf
from posenc_fast.cli import _inputs
from posenc_fast.ops.encodings import reference as enc_ref
from posenc_fast.ops.encodings import torch_impl as torch_enc
from posenc_fast.tolerances import assert_close


@pytest.fixture
def no_tables(monkeypatch):
    monkeypatch.setattr(torch_enc, "_TABLES", type(torch_enc._TABLES)())
    return torch_enc._TABLES


@pytest.mark.parametrize("kind", ["sinusoidal", "dft"])
def test_default_positions_reuse_one_table(kind, no_tables):
    module = (pf.DFTPE if kind == "dft" else pf.SinusoidalPE)(24, backend="torch")
    ref = enc_ref.dft if kind == "dft" else enc_ref.sinusoidal
    for seed in range(3):
        x = _inputs.randn((2, 40, 24), _inputs.generator(seed))
        want = x.double() + ref(torch.arange(40), 24)
        assert_close(module(x), want, torch.float32, "encoding", what=f"call {seed}")
    assert len(no_tables) == 1
    (table,) = no_tables.values()
    assert table.shape == (40, 24) and table.dtype == torch.float32
    # a different length is a different table; explicit 0..L-1 positions hit the same one
    module(_inputs.randn((1, 7, 24), _inputs.generator(5)))
    module(x, torch.arange(40, dtype=torch.int32))
    assert len(no_tables) == 2


def test_other_positions_are_not_kept(no_tables):
    module = pf.SinusoidalPE(16, backend="torch")
    x = _inputs.randn((3, 10, 16), _inputs.generator(1))
    p = torch.arange(10).flip(0)
    want = x.double() + enc_ref.sinusoidal(p, 16)
    assert_close(module(x, p), want, torch.float32, "encoding")
    module(x, torch.arange(10.0))  # floating positions: computed, not kept
    module(x, torch.arange(10).expand(3, 10))  # [B, L] positions
    assert not no_tables


def test_kept_tables_are_bounded_and_outlives_inference_mode(no_tables, monkeypatch):
    monkeypatch.setattr(torch_enc, "KEPT_TABLES_BYTES", 3 * 32 * 16 * 4)
    module = pf.SinusoidalPE(16, backend="torch")
    with torch.inference_mode():
        module(torch.randn(1, 32, 16))
    x = torch.randn(2, 32, 16, requires_grad=True)
    y = module(x)  # the table made in inference mode serves a differentiable call
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    for L in (30, 31, 29):
        module(torch.randn(1, L, 16))
    assert [k[4] for k in no_tables] == [30, 31, 29]  # 32 went first
    module(torch.randn(1, 100, 16))  # larger than the whole budget: never kept
    assert 100 not in [k[4] for k in no_tables]
