"""LearnableFourierFeatures: construction, parameters, variants (LayerNorm, dropout, KL)."""

import math

import pytest
import torch
from conftest import backend_params

import posenc_fast as pf
from posenc_fast.ops.lff import INIT_OUTPUT_STD, activation_moments
from posenc_fast.ops.lff import reference as ref
from posenc_fast.tolerances import assert_close


def test_parameters_follow_algorithm_1():
    m = pf.LearnableFourierFeatures(pos_dim=3, fourier_dim=10, hidden_dim=7, out_dim=12, groups=4)
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert shapes == {"wr": (5, 3), "w1": (10, 7), "b1": (7,), "w2": (7, 3), "b2": (3,)}
    assert not list(m.buffers())


def test_fixed_fourier_variant_registers_wr_as_buffer():
    m = pf.LearnableFourierFeatures(2, 8, 4, 6, learnable=False)
    assert "wr" not in dict(m.named_parameters())
    assert "wr" in dict(m.named_buffers())
    x = torch.randn(3, 1, 2)
    m(x).sum().backward()
    assert m.w1.grad is not None


def test_mlp_false_returns_features_without_mlp_parameters():
    m = pf.LearnableFourierFeatures(2, 8, 0, 16, groups=2, mlp=False)
    assert [n for n, _ in m.named_parameters()] == ["wr"]
    x = torch.randn(5, 2, 2)
    assert_close(m(x), ref.lff(x, m.wr), torch.float32, "encoding")


def test_mlp_false_needs_no_mlp_sizes():
    m = pf.LearnableFourierFeatures(2, 8, groups=2, mlp=False)
    assert m.out_dim == 16 and m.hidden_dim is None and "hidden_dim" not in repr(m)
    x = torch.randn(5, 2, 2)
    assert_close(m(x), ref.lff(x, m.wr), torch.float32, "encoding")
    assert pf.LearnableFourierFeatures(2, 8, out_dim=16, groups=2, mlp=False).out_dim == 16
    with pytest.raises(TypeError, match="^hidden_dim must be given with mlp=True"):
        pf.LearnableFourierFeatures(2, 8, out_dim=16)
    with pytest.raises(TypeError, match="^hidden_dim and out_dim must be given with mlp=True"):
        pf.LearnableFourierFeatures(2, 8)
    with pytest.raises(TypeError, match="^out_dim must be given with mlp=True"):
        pf.LearnableFourierFeatures(2, 8, 4)


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu"])
@pytest.mark.parametrize("layer_norm", [False, True], ids=["plain", "layer_norm"])
def test_initial_output_scale_is_a_learned_tables(activation, layer_norm):
    """At initialisation, over a 14 x 14 grid of patch indices with gamma = 2 patches, the
    output varies across positions with standard deviation ~0.02 per channel (timm's
    pos_embed initialisation) around a mean ~0; wr keeps the paper's N(0, gamma^-2).
    (nn.Linear's default initialisation gave ~0.007 around an offset of ~0.1.)"""
    torch.manual_seed(0)
    m = pf.LearnableFourierFeatures(
        2, 256, 32, 768, gamma=2.0, activation=activation, layer_norm=layer_norm
    )
    pos = pf.grid_positions(14, 14, normalize=False)
    y = m(pos[:, None, :]).detach().double()  # [196, 768]
    std = y.std(dim=0).square().mean().sqrt().item()
    offset = y.mean(dim=0).square().mean().sqrt().item()
    assert 0.7 * INIT_OUTPUT_STD < std < 1.3 * INIT_OUTPUT_STD, std
    assert offset < 0.5 * std, (offset, std)
    assert abs(m.wr.std().item() * 2.0 - 1.0) < 0.1 and abs(m.wr.mean().item()) < 0.1


def test_activation_moments():
    """The quadrature behind the initialisation, against closed forms for z ~ N(0, 1)."""
    mean, var = activation_moments("relu")
    assert mean == pytest.approx(1 / math.sqrt(2 * math.pi), abs=1e-6)
    assert var == pytest.approx(0.5 - 1 / (2 * math.pi), abs=1e-6)
    assert activation_moments("gelu")[0] == pytest.approx(1 / (2 * math.sqrt(math.pi)), abs=1e-6)
    assert activation_moments("gelu_tanh")[0] == pytest.approx(0.2821, abs=1e-3)


def test_no_unused_parameters_by_default():
    """Every registered parameter gets a gradient: DDP's default settings need this."""
    for kwargs in ({}, {"layer_norm": True}, {"kl": True}):
        m = pf.LearnableFourierFeatures(2, 8, 4, 6, **kwargs)
        loss = m(torch.randn(4, 1, 2)).square().sum()
        if kwargs.get("kl"):
            loss = loss + m.kl_regularizer()
        loss.backward()
        unused = [n for n, p in m.named_parameters() if p.grad is None]
        assert not unused, f"{kwargs}: unused parameters {unused}"
    assert "kl_log_target_var" not in dict(
        pf.LearnableFourierFeatures(2, 8, 4, 6).named_parameters()
    )


@pytest.mark.parametrize("backend", backend_params("lff", torch.float32, include_reference=True))
def test_forward_matches_reference_module(backend, device):
    torch.manual_seed(0)
    m = pf.LearnableFourierFeatures(
        2, 16, 8, 12, groups=2, gamma=0.5, activation="relu", backend=backend, device=device
    )
    x = torch.randn(2, 5, 2, 2, device=device)
    y = m(x)
    assert y.shape == (2, 5, 12)
    assert_close(y, ref.lff(x, m.wr, m.w1, m.b1, m.w2, m.b2, "relu"), torch.float32, "lff")


def test_layer_norm_variant_matches_reference():
    torch.manual_seed(1)
    m = pf.LearnableFourierFeatures(2, 16, 8, 12, groups=2, layer_norm=True, dtype=torch.float64)
    with torch.no_grad():  # make the LayerNorm affine parameters non-trivial
        for p in (m.norm1.weight, m.norm1.bias, m.norm2.weight, m.norm2.bias):
            p.normal_()
    x = torch.randn(7, 2, 2, dtype=torch.float64)
    r = ref.fourier_features(x, m.wr)
    r = torch.nn.functional.layer_norm(r, (16,), m.norm1.weight, m.norm1.bias)
    h = ref.activation("gelu", r @ m.w1 + m.b1)
    h = torch.nn.functional.layer_norm(h, (8,), m.norm2.weight, m.norm2.bias)
    expected = (h @ m.w2 + m.b2).flatten(-2)
    torch.testing.assert_close(m(x), expected)


def test_dropout_only_in_training():
    torch.manual_seed(2)
    m = pf.LearnableFourierFeatures(2, 16, 64, 12, dropout=0.5)
    x = torch.randn(50, 1, 2)
    m.eval()
    assert_close(m(x), ref.lff(x, m.wr, m.w1, m.b1, m.w2, m.b2), torch.float32, "lff")
    m.train()
    a, b = m(x), m(x)
    assert not torch.allclose(a, b), "dropout must make two training passes differ"
    with pytest.raises(ValueError, match="dropout"):
        pf.LearnableFourierFeatures(2, 16, 8, 12, dropout=1.0)


def test_kl_regularizer_matches_formula_and_is_learnable():
    torch.manual_seed(3)
    m = pf.LearnableFourierFeatures(2, 64, 8, 12, gamma=2.0, kl=True, dtype=torch.float64)
    assert torch.allclose(m.target_var, torch.tensor(0.25, dtype=torch.float64))
    kl = m.kl_regularizer()
    expected = ref.kl_regularizer(m.wr, m.target_var)
    torch.testing.assert_close(kl, expected)
    # KL(N(mu, s2) || N(0, t)) = log(sqrt(t/s2)) + (s2 + mu^2) / (2t) - 1/2
    w = m.wr.detach().flatten()
    mu, s2, t = w.mean(), w.var(unbiased=False), 0.25
    closed = 0.5 * math.log(t / s2) + (s2 + mu**2) / (2 * t) - 0.5
    assert abs(kl.item() - closed.item()) < 1e-12
    kl.backward()
    assert m.wr.grad is not None and m.kl_log_target_var.grad is not None
    assert torch.autograd.gradcheck(
        lambda w: ref.kl_regularizer(w, m.target_var.detach()), (m.wr.detach().requires_grad_(),)
    )


def test_kl_regularizer_without_kl_uses_fixed_target():
    m = pf.LearnableFourierFeatures(2, 64, 8, 12, gamma=2.0, dtype=torch.float64)
    torch.testing.assert_close(
        m.kl_regularizer(), ref.kl_regularizer(m.wr, torch.tensor(0.25, dtype=torch.float64))
    )


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"fourier_dim": 7}, "fourier_dim must be even"),
        ({"out_dim": 10, "groups": 3}, "out_dim .* must be divisible by groups"),
        ({"mlp": False, "out_dim": 12}, "out_dim must equal groups \\* fourier_dim"),
        ({"pos_dim": 0}, "pos_dim must be positive"),
        ({"hidden_dim": -1}, "hidden_dim must be positive"),
        ({"groups": 0}, "groups must be positive"),
        ({"gamma": 0.0}, "gamma must be a finite positive number"),
        ({"activation": "tanh"}, "activation must be one of"),
        ({"backend": "gpu"}, "backend must be 'auto' or one of"),
        ({"mlp": False, "out_dim": 16, "layer_norm": True}, "need mlp=True"),
    ],
)
def test_bad_construction(kwargs, match):
    args = {"pos_dim": 2, "fourier_dim": 8, "hidden_dim": 4, "out_dim": 12, "groups": 2}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        pf.LearnableFourierFeatures(**args)


def test_bad_input_shape_names_groups_and_pos_dim():
    m = pf.LearnableFourierFeatures(2, 8, 4, 12, groups=3)
    with pytest.raises(ValueError, match=r"groups=3, pos_dim=2"):
        m(torch.randn(5, 2, 2))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        m([[0.0, 1.0]])


def test_factory_kwargs_and_repr():
    m = pf.LearnableFourierFeatures(2, 8, 4, 12, groups=3, dtype=torch.float64, activation="relu")
    assert all(p.dtype == torch.float64 for p in m.parameters())
    assert "groups=3" in repr(m) and "activation='relu'" in repr(m)


def test_bf16_weights_fp32_positions():
    """The canonical mixed case: fp32 positions, bf16 module -> bf16 output."""
    torch.manual_seed(4)
    m = pf.LearnableFourierFeatures(2, 16, 8, 12, dtype=torch.bfloat16)
    x = torch.rand(20, 1, 2) * 100
    y = m(x)
    assert y.dtype == torch.bfloat16
    assert_close(y, ref.lff(x, m.wr, m.w1, m.b1, m.w2, m.b2), torch.bfloat16, "lff")


def test_reset_parameters_redraws():
    torch.manual_seed(5)
    m = pf.LearnableFourierFeatures(2, 8, 4, 6)
    before = m.wr.clone()
    m.reset_parameters()
    assert not torch.equal(before, m.wr)


def test_integer_dtype_is_a_type_error_naming_it():
    """README (Troubleshooting): the wrong kind of dtype is a TypeError naming it, not
    torch's "Only Tensors of floating point ... can require gradients"."""
    with pytest.raises(TypeError, match=r"dtype must be a floating torch.dtype.*torch.int64"):
        pf.LearnableFourierFeatures(2, 8, 4, 8, dtype=torch.int64)


def test_single_group_scalar_positions_layout():
    """Scalar positions p [...] (tpe's) are p[..., None, None] for groups = pos_dim = 1;
    a bare [...] is refused with that hint (a [1, 1] input would read both ways)."""
    torch.manual_seed(0)
    m = pf.LearnableFourierFeatures(1, 8, 6, 4)
    p = torch.rand(3, 5) * 365
    out = m(p[..., None, None])
    assert out.shape == (3, 5, 4)
    want = ref.lff(p[..., None, None], m.wr, m.w1, m.b1, m.w2, m.b2, "gelu")
    assert_close(out, want, torch.float32, "lff")
    with pytest.raises(
        ValueError, match=r"scalar positions p \[...\] go in as p\[..., None, None\]"
    ):
        m(p)
