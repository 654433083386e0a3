"""posenc_fast.integrations.attention: FLOATER Q/K/V biases in timm's Attention (the real
timm) and torch's nn.MultiheadAttention, checked against the literal formula (Eq. 12-13:
the biases are added to the projections), the unmodified layers (warm start), copies and
torch.compile."""

import copy

import _helpers
import pytest
import torch
from _timm import import_timm
from torch import nn

from posenc_fast.cli import _inputs
from posenc_fast.integrations.attention import (
    FloaterMultiheadAttention,
    FloaterQKV,
    add_floater_biases,
)


def vit(depth=3):
    vt = import_timm().models.vision_transformer
    torch.manual_seed(0)
    return vt.VisionTransformer(
        img_size=16, patch_size=4, embed_dim=32, depth=depth, num_heads=2, num_classes=3
    )


def randomize(biases, seed=1):
    """Non-trivial FLOATER biases (the initialisation is near zero)."""
    _inputs.randomize_parameters(biases, seed, scale=0.3)


def images(seed=0):
    return _inputs.randn((2, 3, 16, 16), _inputs.generator(seed))


def expected_qkv(qkv, biases, n, x):
    """Eq. 12-13: block n's projection plus its three biases, laid out [q | k | v]."""
    with torch.no_grad():
        b = biases(x.shape[-2])[n]  # [3, L, dim]
    return nn.functional.linear(x, qkv.weight, qkv.bias) + b.transpose(0, 1).flatten(1)


# -- timm ------------------------------------------------------------------------------------


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_timm_projections_get_their_blocks_biases(training):
    model = vit()
    biases = add_floater_biases(model)
    randomize(biases)
    model.train(training)
    x = _inputs.randn((2, 17, 32), _inputs.generator(2))
    for n, block in enumerate(model.blocks):
        assert isinstance(block.attn.qkv, FloaterQKV)
        torch.testing.assert_close(block.attn.qkv(x), expected_qkv(block.attn.qkv, biases, n, x))


def test_warm_start_and_checkpoints_of_the_unmodified_model():
    x = images()
    _helpers.check_floater_warm_start(vit().eval(), lambda model: model(x))


def test_deepcopy_after_a_training_forward_and_independence(calls):
    """The reported failure: per-block bias state left set broke deepcopy. Here nothing is
    stored per call: copying right after a forward (graph alive) works."""
    model = vit()
    biases = add_floater_biases(model)
    randomize(biases)
    out = model(images())
    twin = copy.deepcopy(model)
    assert twin.blocks[1].attn.qkv._block.module is twin.floater_bias
    torch.testing.assert_close(twin(images()), out)
    with torch.no_grad():
        twin.floater_bias.floater.p0.add_(1.0)
    assert not torch.allclose(twin(images()), out, atol=1e-3)
    torch.testing.assert_close(model(images()), out)
    out.sum().backward()
    assert biases.floater.p0.grad.abs().sum() > 0


def test_work_per_forward(calls):
    """Training: one integration of all blocks' states per forward (the
    per-block path, share_integration=False: one per block). Eval: one integration, then
    the cache serves every block."""
    model = vit(depth=3)
    add_floater_biases(model)
    model(images())
    assert calls == [17]  # 16 patches + the class token, once for all blocks
    calls.clear()
    per_block = vit(depth=3)
    add_floater_biases(per_block, share_integration=False)
    per_block(images())
    assert calls == [17] * 3
    calls.clear()
    model.eval()
    with torch.no_grad():
        model(images())
        model(images())
    assert calls == [17]


def test_compile_fullgraph_matches_eager():
    model = vit(depth=2)
    biases = add_floater_biases(model)
    randomize(biases)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(images())
    out.square().sum().backward()
    grad = biases.floater.w1.grad.clone()
    model.zero_grad()
    ref = model(images())
    ref.square().sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(grad, biases.floater.w1.grad)


def test_half_precision_model_keeps_a_float32_ode_state():
    model = vit(depth=2).to(torch.bfloat16)
    biases = add_floater_biases(model)
    assert biases.floater.p0.dtype == torch.float32
    assert model(images().bfloat16()).dtype == torch.bfloat16


# -- nn.MultiheadAttention ---------------------------------------------------------------


def _mha_inputs(batch_first, batched, L, S, E, kdim, vdim, seed):
    g = _inputs.generator(seed)

    def shape(n, d):
        if not batched:
            return (n, d)
        return (2, n, d) if batch_first else (n, 2, d)

    return (
        _inputs.randn(shape(L, E), g),
        _inputs.randn(shape(S, kdim), g),
        _inputs.randn(shape(S, vdim), g),
    )


MHA_CASES = {
    "self-batch_first": dict(batch_first=True),
    "self-seq_first": dict(batch_first=False),
    "cross-kdim-vdim": dict(batch_first=True, kdim=12, vdim=20, S=9),
    "unbatched": dict(batch_first=True, batched=False),
    "bool-mask-padding-weights": dict(batch_first=True, mask="bool", padding=True, weights=True),
    "float-3d-mask-per-head-weights": dict(mask="float3d", weights=True, average=False),
    "causal": dict(batch_first=True, mask="causal"),
    "no-bias": dict(batch_first=True, bias=False),
}


@pytest.mark.parametrize("case", list(MHA_CASES), ids=list(MHA_CASES))
def test_multihead_attention_with_zero_biases_is_torchs(case):
    c = dict(batch_first=False, batched=True, kdim=None, vdim=None, S=None, mask=None)
    c.update(padding=False, weights=False, average=True, bias=True)
    c.update(MHA_CASES[case])
    E, heads, L = 16, 4, 7
    S = c["S"] or L
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(
        E, heads, bias=c["bias"], kdim=c["kdim"], vdim=c["vdim"], batch_first=c["batch_first"]
    )
    wrapper = nn.Sequential(mha)
    q, k, v = _mha_inputs(
        c["batch_first"], c["batched"], L, S, E, c["kdim"] or E, c["vdim"] or E, 3
    )
    if c["kdim"] is None:
        k, v = q, q  # self-attention
    kwargs = {"need_weights": c["weights"], "average_attn_weights": c["average"]}
    g = _inputs.generator(4)
    if c["mask"] == "bool":
        kwargs["attn_mask"] = torch.rand(L, S, generator=g) < 0.3
        kwargs["attn_mask"][:, 0] = False  # every query keeps one key
    elif c["mask"] == "float3d":
        kwargs["attn_mask"] = _inputs.randn((2 * heads, L, S), g)
    elif c["mask"] == "causal":
        kwargs["attn_mask"] = nn.Transformer.generate_square_subsequent_mask(L)
        kwargs["is_causal"] = True
    if c["padding"]:
        kwargs["key_padding_mask"] = torch.zeros(2, S, dtype=torch.bool)
        kwargs["key_padding_mask"][1, -2:] = True
    ref_out, ref_w = mha(q, k, v, **kwargs)
    biases = add_floater_biases(wrapper)
    with torch.no_grad():
        for p in biases.parameters():
            p.zero_()
    ours = wrapper[0]
    assert isinstance(ours, FloaterMultiheadAttention) and ours.in_proj_bias is mha.in_proj_bias
    out, w = ours(q, k, v, **kwargs)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    if c["weights"]:
        torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=1e-5)
    else:
        assert w is None and ref_w is None


def test_multihead_attention_adds_the_biases_literally():
    """float64, self-attention, batch_first: softmax((xWq + bq + Bq)(xWk + bk + Bk)^T / sqrt(hd))
    (xWv + bv + Bv), per head, then out_proj."""
    E, heads, L = 12, 3, 6
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, heads, batch_first=True, dtype=torch.float64)
    holder = nn.Sequential(mha)
    biases = add_floater_biases(holder)
    assert biases.floater.p0.dtype == torch.float64
    randomize(biases)
    x = _inputs.randn((2, L, E), _inputs.generator(5), torch.float64)
    with torch.no_grad():
        B = biases(L)[0]  # [3, L, E]
        w, b = mha.in_proj_weight.chunk(3), mha.in_proj_bias.chunk(3)
        q, k, v = (
            (x @ w[j].T + b[j] + B[j]).view(2, L, heads, E // heads).transpose(1, 2)
            for j in range(3)
        )
        att = (q @ k.transpose(-1, -2) / (E // heads) ** 0.5).softmax(-1)
        ref = mha.out_proj((att @ v).transpose(1, 2).reshape(2, L, E))
        out, weights = holder[0](x, x, x)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(weights, att.mean(1))


def test_transformer_encoder_fast_paths_do_not_skip_the_biases():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2)  # nested-tensor path enabled
    x = _inputs.randn((2, 5, 16), _inputs.generator(6))
    padding = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    encoder.eval()
    with torch.no_grad():
        plain = encoder(x, src_key_padding_mask=padding)
    biases = add_floater_biases(encoder)
    randomize(biases)
    encoder.train()  # no fast path in training: the reference
    ref = encoder(x, src_key_padding_mask=padding).detach()
    encoder.eval()
    with torch.no_grad():
        for kwargs in ({"src_key_padding_mask": padding}, {}):
            out = encoder(x, **kwargs)
            expected = ref if kwargs else encoder.train()(x).detach()
            encoder.eval()
            keep = ~padding if kwargs else torch.ones_like(padding)
            torch.testing.assert_close(out[keep], expected[keep])
    assert not torch.allclose(ref[~padding], plain[~padding], atol=1e-3)


def test_multihead_attention_compiles_fullgraph():
    holder = nn.Sequential(nn.MultiheadAttention(16, 4, batch_first=True))
    biases = add_floater_biases(holder)
    randomize(biases)
    mha = holder[0]
    x = _inputs.randn((2, 6, 16), _inputs.generator(7))
    fn = torch.compile(
        lambda t: mha(t, t, t, need_weights=False)[0], fullgraph=True, backend="aot_eager"
    )
    out = fn(x)
    out.sum().backward()
    grad = biases.floater.p0.grad.clone()
    biases.zero_grad()
    ref = mha(x, x, x, need_weights=False)[0]
    ref.sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(grad, biases.floater.p0.grad)


def test_refusals_are_explained():
    with pytest.raises(ValueError, match="add_bias_kv"):
        add_floater_biases(nn.Sequential(nn.MultiheadAttention(8, 2, add_bias_kv=True)))
    with pytest.raises(ValueError, match="no attention layer"):
        add_floater_biases(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="refresh_every needs share_integration"):
        add_floater_biases(
            nn.Sequential(nn.MultiheadAttention(8, 2)), share_integration=False, refresh_every=4
        )
    with pytest.raises(ValueError, match="one width"):
        add_floater_biases(nn.Sequential(nn.MultiheadAttention(8, 2), nn.MultiheadAttention(4, 2)))
    model = nn.Sequential(nn.MultiheadAttention(8, 2))
    add_floater_biases(model)
    with pytest.raises(ValueError, match="already has FLOATER biases"):
        add_floater_biases(model)
    with pytest.raises(TypeError, match="nn.Module"):
        add_floater_biases("model")
