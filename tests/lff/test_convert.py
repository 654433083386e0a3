"""posenc_fast.convert: checkpoints of the public LFF modules load into
LearnableFourierFeatures and compute the same outputs, and export back.

Each public module's forward is restated below in our own words, with the parameter names
and layouts of its published state_dict (the comment names the repository and commit it
follows). Every test builds the same network both ways and compares outputs in float64.
"""

import math

import pytest
import torch
from torch import nn

import posenc_fast as pf
from posenc_fast import convert
from posenc_fast.cli import _inputs

DT = torch.float64
TOL = {"atol": 1e-10, "rtol": 1e-10}


class Guimont(nn.Module):
    """willGuimont/learnable_fourier_positional_encoding @ 1fe87e28b416,
    LearnableFourierPositionalEncoding: x [N, G, M] -> [N, D]."""

    def __init__(self, G, M, F_dim, H_dim, D, gamma):
        super().__init__()
        self.G, self.D, self.F_dim = G, D, F_dim
        self.Wr = nn.Linear(M, F_dim // 2, bias=False)
        self.mlp = nn.Sequential(nn.Linear(F_dim, H_dim), nn.GELU(), nn.Linear(H_dim, D // G))
        nn.init.normal_(self.Wr.weight, mean=0.0, std=gamma**-2)

    def forward(self, x):
        phase = self.Wr(x)
        feats = torch.cat([phase.cos(), phase.sin()], -1) / math.sqrt(self.F_dim)
        return self.mlp(feats).reshape(x.shape[0], self.D)


class JHLew(nn.Module):
    """JHLew/Learnable-Fourier-Features @ f5377bbfc68b, LearnableFourierFeatures:
    pos [B, L, G, M] -> [B, L, G * D/G]; Wr is a bare parameter drawn with std gamma^2."""

    def __init__(self, pos_dim, f_dim, h_dim, d_dim, g_dim=1, gamma=1.0):
        super().__init__()
        self.Wr = nn.Parameter(torch.randn(f_dim // 2, pos_dim) * gamma**2)
        self.mlp = nn.Sequential(
            nn.Linear(f_dim, h_dim), nn.GELU(), nn.Linear(h_dim, d_dim // g_dim)
        )
        self.div = math.sqrt(f_dim)

    def forward(self, pos):
        phase = pos @ self.Wr.T
        y = self.mlp(torch.cat([phase.cos(), phase.sin()], -1) / self.div)
        return y.flatten(-2)


class LightGlueEncoding(nn.Module):
    """cvg/LightGlue @ 1fd587b6f5a7, LearnableFourierPositionalEncoding: x [B, N, M] ->
    [2, B, 1, N, F]: unscaled cos (index 0) and sin (1), each frequency repeated on two
    neighbouring channels (the rotary layout)."""

    def __init__(self, M, dim, F_dim=None, gamma=1.0):
        super().__init__()
        F_dim = F_dim if F_dim is not None else dim
        self.Wr = nn.Linear(M, F_dim // 2, bias=False)
        nn.init.normal_(self.Wr.weight, mean=0.0, std=gamma**-2)

    def forward(self, x):
        phase = self.Wr(x)
        emb = torch.stack([phase.cos(), phase.sin()], 0).unsqueeze(-3)
        return emb.repeat_interleave(2, dim=-1)


class TPE(nn.Module):
    """jnyborg/tpe @ be258107d063, models/ltae.py LearnableFourierPositionalEncoding:
    integer positions [B, T] -> [B, T, n_head * d]; positions divided by max_pos."""

    def __init__(self, m=1, f=384, h=32, d=768, max_pos=10000, n_head=16):
        super().__init__()
        self.wr = nn.Linear(m, f // 2, bias=False)
        self.mlp = nn.Sequential(nn.Linear(f, h), nn.GELU(), nn.Linear(h, d))
        self.max_pos, self.n_head, self.scale = max_pos, n_head, f**-0.5

    def forward(self, x):
        phase = self.wr(x.unsqueeze(2).to(self.wr.weight.dtype) / self.max_pos)
        y = self.mlp(self.scale * torch.cat([phase.cos(), phase.sin()], -1))
        return torch.cat([y] * self.n_head, dim=2)


def _randomize(module, seed):
    """Fresh random weights (never the initialisation), std 1/sqrt(fan_in) for matrices
    stored [out, in] like nn.Linear's."""
    g = _inputs.generator(seed)
    with torch.no_grad():
        for p in module.parameters():
            std = 1.0 / math.sqrt(p.shape[-1]) if p.dim() == 2 else 0.5
            p.copy_(_inputs.randn(p.shape, g, p.dtype, p.device, std))
    return module


def _positions(shape, seed, scale=3.0):
    return _inputs.randn(shape, _inputs.generator(seed), DT, "cpu", scale)


# -- loading: their checkpoint -> our module ---------------------------------------------


@pytest.mark.parametrize("F,H", [(64, 32), (32, 32)], ids=["F64-H32", "F==H"])
def test_guimont_checkpoint_gives_the_same_outputs(F, H):
    theirs = _randomize(Guimont(G=3, M=2, F_dim=F, H_dim=H, D=48, gamma=4.0).to(DT), 1)
    ours = convert.from_state_dict(theirs.state_dict(), "guimont", gamma=4.0, groups=3)
    assert (ours.pos_dim, ours.fourier_dim, ours.hidden_dim, ours.out_dim) == (2, F, H, 48)
    assert ours.gamma == 16.0  # std 4^-2 = 1/16
    x = _positions((37, 3, 2), 2)
    torch.testing.assert_close(ours(x), theirs(x), **TOL)


def test_jhlew_checkpoint_gives_the_same_outputs():
    theirs = _randomize(JHLew(pos_dim=3, f_dim=40, h_dim=24, d_dim=32, g_dim=2, gamma=2.0), 3)
    theirs = theirs.to(DT)
    ours = pf.LearnableFourierFeatures.from_state_dict(
        theirs.state_dict(), "jhlew", gamma=2.0, groups=2
    )
    assert ours.gamma == 0.25 and ours.out_dim == 32  # std 2^2 = 1/0.25
    x = _positions((2, 11, 2, 3), 4)
    torch.testing.assert_close(ours(x), theirs(x), **TOL)


def test_lightglue_frequencies_load_from_a_whole_model_checkpoint():
    enc = _randomize(LightGlueEncoding(M=2, dim=64), 5).to(DT)
    whole = {"posenc." + k: v for k, v in enc.state_dict().items()}
    whole["transformers.0.self_attn.Wqkv.weight"] = torch.randn(3, 3)  # the rest of LightGlue
    ours = convert.from_state_dict(whole, "lightglue", prefix="posenc.")
    assert not ours.mlp and ours.fourier_dim == 64
    kpts = _positions((2, 9, 2), 6, scale=1.0)  # LightGlue's normalised keypoints
    feats = ours(kpts[..., None, :]) * math.sqrt(64)  # [cos || sin], unscaled
    cos, sin = feats.chunk(2, dim=-1)
    rotary = torch.stack([cos, sin], 0).unsqueeze(-3).repeat_interleave(2, dim=-1)
    torch.testing.assert_close(rotary, enc(kpts), **TOL)


def test_tpe_checkpoint_takes_raw_positions():
    theirs = _randomize(TPE(f=16, h=8, d=12, max_pos=365, n_head=3), 7).to(DT)
    ours = convert.from_state_dict(theirs.state_dict(), "tpe", max_pos=365)
    days = torch.randint(0, 365, (2, 20), generator=_inputs.generator(8))
    pe = ours(days[..., None, None])  # [B, T, d]: G = 1 group of M = 1 coordinate
    torch.testing.assert_close(pe.repeat(1, 1, 3), theirs(days), **TOL)


# -- exporting: our module -> their checkpoint ---------------------------------------------


def test_export_loads_strictly_into_each_public_module():
    x = _positions((13, 2, 2), 9)
    ours = _randomize(pf.LearnableFourierFeatures(2, 32, 16, 24, groups=2, dtype=DT), 10)
    g = Guimont(G=2, M=2, F_dim=32, H_dim=16, D=24, gamma=1.0).to(DT)
    g.load_state_dict(convert.to_state_dict(ours, "guimont"), strict=True)
    torch.testing.assert_close(g(x), ours(x), **TOL)
    j = JHLew(2, 32, 16, 24, g_dim=2).to(DT)
    j.load_state_dict(convert.to_state_dict(ours, "jhlew"), strict=True)
    torch.testing.assert_close(j(x[None]), ours(x[None]), **TOL)

    feats = _randomize(pf.LearnableFourierFeatures(2, 32, 0, 32, mlp=False, dtype=DT), 11)
    lg = LightGlueEncoding(2, 32).to(DT)
    sd = convert.to_state_dict(feats, "lightglue", prefix="posenc.")
    lg.load_state_dict({k.removeprefix("posenc."): v for k, v in sd.items()}, strict=True)
    cos = (feats(x[:, :1]) * math.sqrt(32))[..., :16]
    torch.testing.assert_close(lg(x[:, 0])[0, 0], cos.repeat_interleave(2, -1), **TOL)

    scalar = _randomize(pf.LearnableFourierFeatures(1, 16, 8, 12, dtype=DT), 12)
    t = TPE(f=16, h=8, d=12, max_pos=100, n_head=2).to(DT)
    t.load_state_dict(convert.to_state_dict(scalar, "tpe", max_pos=100), strict=True)
    days = torch.arange(0, 100, 7)[None]
    torch.testing.assert_close(t(days), scalar(days[..., None, None]).repeat(1, 1, 2), **TOL)


def test_round_trip_preserves_every_tensor_and_leaves_the_input_alone():
    theirs = _randomize(Guimont(1, 2, 32, 32, 32, gamma=3.0), 13).state_dict()
    before = {k: v.clone() for k, v in theirs.items()}
    back = convert.to_state_dict(convert.from_state_dict(theirs, "guimont", gamma=3.0), "guimont")
    assert back.keys() == theirs.keys()
    for k in theirs:
        assert torch.equal(back[k], theirs[k]), k
        assert torch.equal(theirs[k], before[k]), f"{k} modified"


# -- gamma conventions: checked against each module's own initialisation ------------------


@pytest.mark.parametrize(
    "source,make,gamma",
    [
        ("guimont", lambda g: Guimont(1, 2, 8192, 4, 4, gamma=g), 3.0),
        ("jhlew", lambda g: JHLew(2, 8192, 4, 4, gamma=g), 0.5),
        ("lightglue", lambda g: LightGlueEncoding(2, 8192, gamma=g), 2.0),
    ],
)
def test_translated_gamma_matches_the_initial_spread(source, make, gamma):
    """Our gamma is 1 / std of Wr: a freshly initialised public module (8192 samples)
    must have that spread when its own gamma is translated."""
    torch.manual_seed(0)
    sd = make(gamma).state_dict()
    ours = convert.from_state_dict(sd, source, gamma=gamma)
    assert ours.wr.std().item() == pytest.approx(1.0 / ours.gamma, rel=0.05)
    assert convert.gamma_to(source, ours.gamma) == pytest.approx(gamma)


def test_tpe_gamma_follows_from_max_pos():
    torch.manual_seed(0)
    ours = convert.from_state_dict(
        TPE(f=8192, h=4, d=4, max_pos=50).state_dict(), "tpe", max_pos=50
    )
    assert ours.wr.std().item() == pytest.approx(1.0 / ours.gamma, rel=0.05)


# -- errors --------------------------------------------------------------------------------


def _guimont_sd(F=16, H=8, D=4):
    return _randomize(Guimont(1, 2, F, H, D, gamma=1.0), 14).state_dict()


def test_missing_and_unexpected_keys_are_named():
    sd = _guimont_sd()
    del sd["mlp.2.bias"]
    sd["extra"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"missing keys 'mlp.2.bias'; unexpected keys 'extra'"):
        convert.from_state_dict(sd, "guimont")


def test_wrong_source_names_the_format_it_looks_like():
    msg = r"missing keys 'Wr'; unexpected keys 'Wr.weight'.*those of a 'guimont' checkpoint"
    with pytest.raises(ValueError, match=msg):
        convert.from_state_dict(_guimont_sd(), "jhlew")
    with pytest.raises(ValueError, match="prefix="):
        convert.from_state_dict({"posenc.Wr.weight": torch.randn(4, 2)}, "lightglue")


def test_transposed_weights_are_detected_when_the_shape_tells():
    sd = _guimont_sd(F=16, H=8, D=4)
    sd["mlp.0.weight"] = sd["mlp.0.weight"].T  # [F, H]: posenc_fast's layout
    with pytest.raises(ValueError, match=r"mlp.0.weight.*got \[16, 8\]: it looks transposed"):
        convert.from_state_dict(sd, "guimont")
    sd = _guimont_sd(F=16, H=8, D=4)
    sd["mlp.2.weight"] = sd["mlp.2.weight"].T
    with pytest.raises(ValueError, match=r"mlp.2.weight.*looks transposed"):
        convert.from_state_dict(sd, "guimont")
    sd = _guimont_sd()
    sd["mlp.0.bias"] = torch.zeros(5)
    with pytest.raises(ValueError, match=r"mlp.0.bias.*\[8\]"):
        convert.from_state_dict(sd, "guimont")


def test_a_transposed_square_weight_cannot_be_detected():
    """The documented limit: with F == H the wrong layout has the right shape. It loads,
    and only an output comparison shows it (which is why the converter transposes)."""
    theirs = _randomize(Guimont(1, 2, 16, 16, 8, gamma=1.0), 15).to(DT)
    sd = dict(theirs.state_dict())
    sd["mlp.0.weight"] = sd["mlp.0.weight"].T.contiguous()
    wrong = convert.from_state_dict(sd, "guimont")
    x = _positions((5, 1, 2), 16)
    assert not torch.allclose(wrong(x), theirs(x), atol=1e-3)


def test_argument_errors():
    with pytest.raises(ValueError, match="source"):
        convert.from_state_dict(_guimont_sd(), "timm")
    with pytest.raises(ValueError, match="max_pos is required"):
        convert.from_state_dict(TPE(f=8, h=4, d=4).state_dict(), "tpe")
    with pytest.raises(ValueError, match="max_pos applies"):
        convert.from_state_dict(_guimont_sd(), "guimont", max_pos=10)
    with pytest.raises(TypeError, match="state_dict must be a mapping"):
        convert.from_state_dict([1, 2], "guimont")
    with pytest.raises(ValueError, match="has no MLP"):
        convert.to_state_dict(pf.LearnableFourierFeatures(2, 8, 4, 4), "lightglue")
    with pytest.raises(ValueError, match="layer_norm"):
        convert.to_state_dict(pf.LearnableFourierFeatures(2, 8, 4, 4, layer_norm=True), "guimont")
    with pytest.raises(ValueError, match="GELU"):
        convert.to_state_dict(pf.LearnableFourierFeatures(2, 8, 4, 4, activation="relu"), "jhlew")
    with pytest.raises(ValueError, match="pos_dim=1"):
        convert.to_state_dict(pf.LearnableFourierFeatures(2, 8, 4, 4), "tpe", max_pos=3)
    with pytest.raises(TypeError, match="LearnableFourierFeatures"):
        convert.to_state_dict(nn.Linear(2, 2), "guimont")
