"""posenc_fast.integrations.transformers against the real Hugging Face transformers (tiny
models built from configs here, nothing from a hub): FLOATER Q/K/V biases in BERT-family
encoders and ViT/DeiT (the literal Eq. 12-13 on every projection, masks, position_ids,
training, the eval cache, torch.compile, checkpoints, ONNX), LFF position encodings of a
ViT's patch grid, and LightGlue's positional encoder on the fused rotary op."""

from __future__ import annotations

import copy
import importlib.util
import io
import logging
import os
import warnings

import _helpers
import pytest
import torch
import torch.nn.functional as F

import posenc_fast as pf
from posenc_fast.cli import _inputs
from posenc_fast.integrations import transformers as pf_hf
from posenc_fast.integrations.attention import add_floater_biases, floater_param_groups
from posenc_fast.tolerances import assert_close

REASON = (
    "transformers is not installed (it is in the test extra: pip install -e '.[test]'; "
    "CI runs these tests)"
)


@pytest.mark.skipif(os.environ.get("CI") != "true", reason="checks the CI environment only")
def test_ci_installs_transformers():
    """CI must run these tests, not skip them: the test extra installs transformers."""
    assert importlib.util.find_spec("transformers") is not None, REASON


if importlib.util.find_spec("transformers") is None:
    pytest.skip(REASON, allow_module_level=True)

import transformers as tf  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: more threads only add synchronisation (several times slower on a
    busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# The tiny encoder every BERT-style and ViT family is built with (without dropout).
ENCODER = dict(
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=32,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)
DISTILBERT_NAMES = dict(  # the same encoder in DistilBertConfig's names
    hidden_size="dim",
    num_hidden_layers="n_layers",
    num_attention_heads="n_heads",
    intermediate_size="hidden_dim",
    hidden_dropout_prob="dropout",
    attention_probs_dropout_prob="attention_dropout",
)
TEXT = {**ENCODER, "vocab_size": 40, "max_position_embeddings": 40}
VISION = {**ENCODER, "image_size": 16, "patch_size": 4}
FAMILIES = {
    "bert": (tf.BertConfig, tf.BertModel, TEXT),
    "roberta": (tf.RobertaConfig, tf.RobertaModel, TEXT),
    "xlm-roberta": (tf.XLMRobertaConfig, tf.XLMRobertaModel, TEXT),
    "camembert": (tf.CamembertConfig, tf.CamembertModel, TEXT),
    "electra": (tf.ElectraConfig, tf.ElectraModel, {**TEXT, "embedding_size": 16}),
    "distilbert": (
        tf.DistilBertConfig,
        tf.DistilBertModel,
        {"vocab_size": 40, **{DISTILBERT_NAMES[k]: v for k, v in ENCODER.items()}},
    ),
    "vit": (tf.ViTConfig, tf.ViTModel, VISION),
    "deit": (tf.DeiTConfig, tf.DeiTModel, VISION),
}


def build(family="bert", attn="eager", seed=0, model_class=None, **overrides):
    config_class, default_class, args = FAMILIES[family]
    config = config_class(**{**args, **overrides}, attn_implementation=attn)
    torch.manual_seed(seed)
    return (model_class or default_class)(config)


def inputs(family, batch=2, length=7, seed=0):
    """input_ids (never RoBERTa's padding id 1) or 16x16 images."""
    g = _inputs.generator(seed)
    if family in ("vit", "deit"):
        return {"pixel_values": _inputs.randn((batch, 3, 16, 16), g)}
    return {"input_ids": torch.randint(3, 40, (batch, length), generator=g)}


def randomize(biases, seed=1):
    """Non-trivial FLOATER biases (the initialisation is near zero)."""
    _inputs.randomize_parameters(biases, seed, scale=0.3)


def projections(model):
    return [m for m in model.modules() if isinstance(m, pf_hf.FloaterProjection)]


def record_projections(model):
    """(projection, input, output) of every FloaterProjection call, via forward hooks."""
    seen = []
    handles = [
        p.register_forward_hook(lambda m, a, out: seen.append((m, a[0], out)))
        for p in projections(model)
    ]
    return seen, handles


def hidden(model, **kwargs):
    out = model(**kwargs)
    return out.last_hidden_state


# -- FLOATER biases: the formula, every family ---------------------------------------------


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_projection_adds_its_blocks_bias(family, training):
    """Eq. 12-13 on the real layers: projection j of block n returns x W^T + b + bias[n, j]
    at the token positions, for all three projections of every layer."""
    model = build(family)
    biases = add_floater_biases(model)
    randomize(biases)
    model.train(training)
    seen, handles = record_projections(model)
    model(**inputs(family))
    for h in handles:
        h.remove()
    layers = model.config.num_hidden_layers if family != "distilbert" else model.config.n_layers
    assert biases.num_layers == layers and len(seen) == 3 * layers
    with torch.no_grad():
        table = biases(seen[0][1].shape[-2])  # [N, 3, L, dim]
    for proj, x, out in seen:
        n, j = proj._block.layer, proj.index
        want = F.linear(x, proj.weight, proj.bias) + table[n, j]
        torch.testing.assert_close(out, want)
    assert {(p._block.layer, p.index) for p, _, _ in seen} == {
        (n, j) for n in range(layers) for j in range(3)
    }


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_zero_biases_are_the_original_model_and_checkpoints_still_load(attn):
    """The warm start: with FLOATER off the model is the pretrained one; its projections
    keep their parameter names (a pretrained state_dict loads, strict=False for FLOATER's)."""
    x = inputs("roberta")
    mask = torch.ones_like(x["input_ids"])
    mask[1, -3:] = 0
    _helpers.check_floater_warm_start(
        build("roberta", attn).eval(), lambda model: hidden(model, **x, attention_mask=mask)
    )


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_padding_masks_are_respected(attn):
    """Right padding changes nothing for the real tokens: their outputs equal the
    unpadded sequence's (eager and sdpa attention)."""
    model = build("roberta", attn).eval()
    randomize(add_floater_biases(model))
    ids = inputs("roberta", batch=1, length=5)["input_ids"]
    padded = torch.cat([ids, torch.ones(1, 3, dtype=ids.dtype)], dim=1)  # pad id 1
    mask = torch.tensor([[1] * 5 + [0] * 3])
    with torch.no_grad():
        alone = hidden(model, input_ids=ids)
        batch = hidden(model, input_ids=padded, attention_mask=mask)
    torch.testing.assert_close(batch[:, :5], alone)


def test_position_ids_choose_the_biases():
    """BERT passes position_ids to its attention layers: the biases are gathered at them,
    per sequence (here shifted by 3 and 9); without them, positions are 0..L-1."""
    model = build("bert").eval()
    biases = add_floater_biases(model)
    randomize(biases)
    x = inputs("bert", length=6)
    pos = torch.stack([torch.arange(6) + 3, torch.arange(6) + 9])
    seen, handles = record_projections(model)
    with torch.no_grad():
        shifted = hidden(model, **x, position_ids=pos)
        table = biases(15)  # positions 0..14
    for proj, xin, out in seen:
        want = F.linear(xin, proj.weight, proj.bias) + table[proj._block.layer, proj.index][pos]
        torch.testing.assert_close(out, want)
    for h in handles:
        h.remove()
    with torch.no_grad():
        default = hidden(model, **x)
        explicit = hidden(model, **x, position_ids=torch.arange(6)[None])
    torch.testing.assert_close(explicit, default)
    assert not torch.allclose(shifted, default, atol=1e-4)


# -- training ---------------------------------------------------------------------------------


def classifier(seed=0, attn="eager", **kwargs):
    model = build("roberta", attn, seed, tf.RobertaForSequenceClassification, num_labels=2)
    biases = add_floater_biases(model, **kwargs)
    randomize(biases, seed + 1)
    return model, biases


def batch(seed=0):
    """A learnable toy task: the label is whether token 5 comes before token 6."""
    g = _inputs.generator(seed)
    ids = torch.randint(7, 40, (8, 9), generator=g)
    labels = torch.arange(8) % 2
    for i in range(8):
        a, b = (2, 6) if labels[i] else (6, 2)
        ids[i, a], ids[i, b] = 5, 6
    return ids, labels


def test_fine_tuning_shares_one_integration_per_step_and_every_parameter_learns(calls):
    model, biases = classifier()
    model.train()
    opt = torch.optim.AdamW(floater_param_groups(model, lr=3e-3, flow_lr_scale=10.0))
    ids, labels = batch()
    losses = []
    for step in range(6):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        if step == 0:
            for name, p in biases.named_parameters():
                assert p.grad is not None and p.grad.abs().sum() > 0, name
        opt.step()
        losses.append(loss.item())
    assert calls == [9] * 6, "one integration per step, shared by both layers"
    assert losses[-1] < losses[0]


def test_refresh_every_and_the_eval_cache(calls):
    model, biases = classifier(refresh_every=3)
    ids, labels = batch()
    grads = []
    for _ in range(4):
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=labels).loss.backward()
        grads.append(biases.floater.w1.grad is not None)
    assert grads == [True, False, False, True] and calls == [9, 9]
    calls.clear()
    model.eval()
    biases.floater.clear_cache()  # (the refresh steps' result would serve)
    with torch.no_grad():
        first = model(input_ids=ids).logits
        again = model(input_ids=ids).logits
    assert calls == [9], "one integration, then the cache serves every block"
    torch.testing.assert_close(again, first)


def test_compile_fullgraph_matches_eager(calls):
    """One traced graph (DistilBERT): layer 0's shared integration is read by layer 1
    inside it; outputs and gradients equal the eager step's. (backend="eager": dynamo's
    tracing is what is tested; the bias modules under AOT autograd are tested with timm.)"""
    model = build("distilbert", "sdpa").train()
    biases = add_floater_biases(model)
    randomize(biases)
    x = inputs("distilbert", length=9)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    out = hidden(compiled, **x)
    out.square().sum().backward()
    assert calls == [9], "one integration for both layers, in the graph"
    grad = biases.floater.w1.grad.clone()
    model.zero_grad()
    ref = hidden(model, **x)
    ref.square().sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(grad, biases.floater.w1.grad)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_gradient_checkpointing_gives_the_same_step(reentrant):
    """transformers' gradient checkpointing of every layer: the same outputs and FLOATER
    gradients as without (non-reentrant recomputes from the shared integration, reentrant
    integrates per block in the backward)."""
    model, biases = classifier()
    ids, labels = batch()
    ref = model(input_ids=ids, labels=labels)
    ref.loss.backward()
    want = [p.grad.clone() for p in biases.parameters()]
    model.zero_grad()
    model.activation_checkpointing_enable({"use_reentrant": reentrant})
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    torch.testing.assert_close(out.logits, ref.logits)
    for p, g in zip(biases.parameters(), want):
        torch.testing.assert_close(p.grad, g)


def test_deepcopy_after_a_training_forward():
    model, _ = classifier()
    ids, labels = batch()
    out = model(input_ids=ids, labels=labels)
    twin = copy.deepcopy(model)
    torch.testing.assert_close(twin(input_ids=ids, labels=labels).logits, out.logits)
    out.loss.backward()  # the original's graph is intact


# -- checkpoints ------------------------------------------------------------------------------


@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen"])
def test_save_pretrained_and_reload(tmp_path, frozen):
    """save_pretrained keeps the FLOATER parameters (and frozen states) and the options
    (config.json); pf_hf.from_pretrained rebuilds the model from the directory or from
    config + state_dict; building + add_floater_biases + load_state_dict works too."""
    from safetensors.torch import load_file

    model, biases = classifier(delta_t=0.02, substeps=3)
    if frozen:
        biases.freeze(12)
    model.eval()
    ids, _ = batch()
    with torch.no_grad():
        want = model(input_ids=ids).logits
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    floater_keys = {k for k in saved if k.startswith("floater_bias.")}
    assert {"floater_bias.floater.p0", "floater_bias.floater.w2"} <= floater_keys
    assert ("floater_bias.floater.frozen_states" in floater_keys) == frozen
    options = model.config.posenc_fast["floater_biases"]
    assert options["delta_t"] == 0.02 and options["substeps"] == 3

    cls = tf.RobertaForSequenceClassification
    for loaded in (
        pf_hf.from_pretrained(cls, tmp_path),
        pf_hf.from_pretrained(cls, config=model.config, state_dict=dict(saved)),
    ):
        assert loaded.floater_bias.frozen == frozen
        assert loaded.floater_bias.floater.delta_t == 0.02
        with torch.no_grad():
            torch.testing.assert_close(loaded.eval()(input_ids=ids).logits, want)

    fresh = build("roberta", model_class=cls, num_labels=2)
    add_floater_biases(fresh, delta_t=0.02, substeps=3)
    fresh.load_state_dict(saved, strict=False)  # tied / non-persistent entries aside
    with torch.no_grad():
        torch.testing.assert_close(fresh.eval()(input_ids=ids).logits, want)


def test_fine_tune_freeze_and_export_to_onnx():
    """The README's deployment route: fine-tune, freeze the biases, export with dynamic
    batch and length, run in onnxruntime. (The TorchScript-based exporter: ~1 s here
    against 10-20 s for dynamo=True on this model, which exports the same graph ops.)"""
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is in the test extra")
    onnx = pytest.importorskip("onnx", reason="onnx is in the test extra")
    from _onnx_ops import float64_tensors

    model, biases = classifier(substeps=2)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids, labels = batch()
    for _ in range(3):
        opt.zero_grad()
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
    biases.freeze(16)
    model.eval()

    class Logits(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask):
            return self.m(input_ids=input_ids, attention_mask=attention_mask).logits

    wrapped = Logits(model).eval()
    axes = {0: "batch", 1: "length"}
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            wrapped,
            (ids, torch.ones_like(ids)),
            f,
            dynamo=False,
            input_names=["input_ids", "attention_mask"],
            dynamic_axes={"input_ids": axes, "attention_mask": axes},
            opset_version=17,
        )
    float64 = float64_tensors(onnx.load_from_string(f.getvalue()))
    assert float64 == [], float64[:10]  # float32 runtimes (TensorRT) run it
    session = ort.InferenceSession(f.getvalue(), providers=["CPUExecutionProvider"])
    for b, length in [(3, 5), (2, 16)]:
        x = torch.randint(3, 40, (b, length), generator=_inputs.generator(b))
        m = torch.ones_like(x)
        m[-1, length // 2 :] = 0
        got = session.run(None, {"input_ids": x.numpy(), "attention_mask": m.numpy()})[0]
        with torch.no_grad():
            want = wrapped(x, m)
        torch.testing.assert_close(torch.from_numpy(got), want, rtol=1e-4, atol=1e-5)


# -- refusals ---------------------------------------------------------------------------------


def test_refusals_name_what_is_supported():
    gpt2 = tf.GPT2Model(tf.GPT2Config(vocab_size=40, n_embd=16, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match="BertSelfAttention, RobertaSelfAttention"):
        add_floater_biases(gpt2)
    decoder = build("bert", is_decoder=True)
    add_floater_biases(decoder)
    with pytest.raises(ValueError, match="use_cache=False"):
        decoder(**inputs("bert"))
    decoder(**inputs("bert"), use_cache=False)  # causal self-attention without a cache
    model = build("bert")
    add_floater_biases(model)
    with pytest.raises(ValueError, match="already has FLOATER biases"):
        add_floater_biases(model)
    attention = model.encoder.layer[0].attention.self
    with pytest.raises(ValueError, match="position_ids must be >= 0"):
        attention(torch.zeros(1, 3, 16), position_ids=torch.tensor([[0, -1, 2]]))
    with pytest.raises(ValueError, match="cross-attention"):
        attention(torch.zeros(1, 3, 16), encoder_hidden_states=torch.zeros(1, 4, 16))
    with pytest.raises(TypeError, match="ViT embeddings"):
        pf_hf.use_lff(build("bert"))
    with pytest.raises(TypeError, match="LightGlueForKeypointMatching"):
        pf_hf.use_fast_rotary(build("bert"))


# -- LFF position encodings of a ViT's patch grid ----------------------------------------------


@pytest.mark.parametrize("family", ["vit", "deit"])
def test_lff_encodes_the_patch_grid_of_any_size(family):
    model = build(family).eval()
    enc = pf_hf.use_lff(model, gamma=2.0, fourier_dim=16, hidden_dim=8)
    emb = model.embeddings
    assert emb.position_embeddings is None and emb.pos_encoding is enc
    assert not any("position_embeddings" in k for k in model.state_dict())
    prefix = 2 if family == "deit" else 1
    for h, w in [(16, 16), (8, 20)]:
        x = _inputs.randn((2, 3, h, w), _inputs.generator(h + w))
        with torch.no_grad():
            got = emb(x, interpolate_pos_encoding=True)
            patches = emb.patch_embeddings(x)
            coords = pf.grid_positions(h // 4, w // 4, normalize=False, dtype=torch.float32)
            want = patches + enc.encode(coords)
        assert got.shape == (2, prefix + (h // 4) * (w // 4), 16)
        torch.testing.assert_close(got[:, prefix:], want)
        torch.testing.assert_close(got[:, 0], emb.cls_token[:, 0].expand(2, -1))
    with pytest.raises(ValueError, match="interpolate_pos_encoding=True"):
        model(pixel_values=torch.zeros(1, 3, 8, 20))
    out = model(pixel_values=torch.zeros(1, 3, 8, 20), interpolate_pos_encoding=True)
    assert out.last_hidden_state.shape == (1, prefix + 10, 16)


def test_lff_vit_trains_saves_and_reloads(tmp_path, caplog):
    cls = tf.ViTForImageClassification
    model = build("vit", model_class=cls, num_labels=3)
    enc = pf_hf.use_lff(model, gamma=3.0, fourier_dim=16, hidden_dim=8)
    add_floater_biases(model)  # both at once: the LFF table and FLOATER biases
    x = inputs("vit")["pixel_values"]
    loss = model(pixel_values=x, labels=torch.tensor([0, 2])).loss
    loss.backward()
    assert all(p.grad is not None for p in enc.parameters())
    model.eval()
    with torch.no_grad():
        want = model(pixel_values=x).logits
    model.save_pretrained(tmp_path)
    assert model.config.posenc_fast["lff"]["gamma"] == 3.0
    with caplog.at_level(logging.WARNING, logger="transformers"):
        loaded = pf_hf.from_pretrained(cls, tmp_path).eval()
    assert "MISSING" not in caplog.text, "the replaced table is not reported as missing"
    assert loaded.vit.embeddings.pos_encoding.lff.fourier_dim == 16
    with torch.no_grad():
        torch.testing.assert_close(loaded(pixel_values=x).logits, want)


# -- LightGlue: the positional encoder on the fused rotary op ---------------------------------


def lightglue():
    sp = tf.SuperPointConfig(
        encoder_hidden_sizes=[8, 8, 16, 16],
        decoder_hidden_size=32,
        keypoint_decoder_dim=65,
        descriptor_decoder_dim=32,
        max_keypoints=32,
    )
    config = tf.LightGlueConfig(
        keypoint_detector_config=sp, descriptor_dim=32, num_hidden_layers=2, num_attention_heads=2
    )
    torch.manual_seed(0)
    return tf.LightGlueForKeypointMatching(config).eval()


def test_lightglue_fast_rotary_equals_the_original():
    model = lightglue()
    with torch.no_grad():
        model.positional_encoder.projector.weight.normal_(0.0, 2.0)  # phases of several turns
    original = copy.deepcopy(model.positional_encoder)
    keys = set(model.state_dict())
    new = pf_hf.use_fast_rotary(model)
    assert set(model.state_dict()) == keys  # checkpoints load unchanged
    kp = torch.rand(4, 32, 2, generator=_inputs.generator(3)) * 2 - 1  # normalised keypoints
    with torch.no_grad():
        (cos, sin), proj = new(kp, output_hidden_states=True)
        (cos0, sin0), proj0 = original(kp, output_hidden_states=True)
    torch.testing.assert_close(cos, cos0)
    torch.testing.assert_close(sin, sin0)
    torch.testing.assert_close(proj, proj0)
    ((cos1, sin1),) = new(kp)
    assert cos1.shape == sin1.shape == (4, 32, 16)  # head_dim 32 / 2

    images = torch.rand(1, 2, 1, 64, 64, generator=_inputs.generator(4))
    reference = lightglue()
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        got, want = model(images), reference(images)
    torch.testing.assert_close(got.matching_scores, want.matching_scores, rtol=1e-4, atol=1e-5)
    assert torch.equal(got.matches, want.matches)


def test_lff_vit_and_lightglue_encoder_export_float32_graphs():
    """use_lff's ViT (dynamic image size: the dynamo exporter; the TorchScript-based one
    traces the grid size as a tensor, which grid_positions refuses) and use_fast_rotary's
    LightGlue encoder (any keypoint count; TorchScript-based exporter, ~1 s) export to
    graphs without float64 tensors, which onnxruntime runs within the float32 tolerances
    of eager."""
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is in the test extra")
    onnx = pytest.importorskip("onnx", reason="onnx is in the test extra")
    pytest.importorskip("onnxscript", reason="the dynamo exporter needs onnxscript")
    from _onnx_ops import float64_tensors

    class Hidden(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x):  # images [B, 3, H, W]
            return self.m(pixel_values=x, interpolate_pos_encoding=True)[0]

    class Table(torch.nn.Module):
        def __init__(self, encoder):
            super().__init__()
            self.encoder = encoder

        def forward(self, x):  # keypoints [B, N, 2]
            return self.encoder(x)[0]

    vit = build("vit").eval()
    pf_hf.use_lff(vit, gamma=2.0, fourier_dim=16, hidden_dim=8)
    glue = lightglue()
    with torch.no_grad():
        glue.positional_encoder.projector.weight.normal_(0.0, 2.0)
    rows, cols = torch.export.Dim("rows", min=2, max=6), torch.export.Dim("cols", min=2, max=6)
    cases = [
        (Hidden(vit), {0: torch.export.Dim("batch"), 2: 4 * rows, 3: 4 * cols}, "dynamo"),
        (Table(pf_hf.use_fast_rotary(glue)), {0: "batch", 1: "n"}, "torchscript"),
    ]
    sizes = {"Hidden": [(2, 3, 16, 16), (1, 3, 8, 20)], "Table": [(2, 32, 2), (3, 9, 2)]}
    for model, axes, exporter in cases:
        name = type(model).__name__
        x = torch.rand(sizes[name][0], generator=_inputs.generator(1)) * 2 - 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if exporter == "dynamo":
                program = torch.onnx.export(
                    model.eval(), (x,), dynamo=True, dynamic_shapes=(axes,), verbose=False
                )
                data = program.model_proto.SerializeToString()
            else:
                f = io.BytesIO()
                torch.onnx.export(
                    model.eval(), (x,), f, dynamo=False, input_names=["x"], dynamic_axes={"x": axes}
                )
                data = f.getvalue()
        float64 = float64_tensors(onnx.load_from_string(data))
        assert float64 == [], (name, float64[:10])
        session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
        feed = session.get_inputs()[0].name
        for k, shape in enumerate(sizes[name]):
            x = torch.rand(shape, generator=_inputs.generator(10 + k)) * 2 - 1
            got = [torch.from_numpy(o) for o in session.run(None, {feed: x.numpy()})]
            with torch.no_grad():
                want = model(x)
            want = list(want) if isinstance(want, (tuple, list)) else [want]
            for g, w in zip(got, want):
                assert_close(g, w, torch.float32, "lff", what=f"{name} {list(shape)}")


# -- DINOv3 ViT: attention on the fused rotary op ---------------------------------------------


def dinov3(seed=0, attn="sdpa", **overrides):
    """A tiny DINOv3 ViT (32 px, 8 px patches, 2 registers, training augmentations of the
    coordinates), with q and k projections large enough that the rotation matters."""
    config = tf.DINOv3ViTConfig(
        **{
            **dict(
                hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                image_size=32, patch_size=8, num_register_tokens=2, pos_embed_shift=0.3,
                pos_embed_jitter=1.5, pos_embed_rescale=2.0, layerscale_value=0.5,
            ),
            **overrides,
        }
    )  # fmt: skip
    config._attn_implementation = attn
    torch.manual_seed(seed)
    model = tf.DINOv3ViTModel(config)
    for i, layer in enumerate(model.model.layer):
        _inputs.randomize_parameters(layer.attention, 10 + i, 0.5)
    return model


def dinov3_step(model, x, seed=1):
    """(last hidden state, pooled output, {name: grad}) of one forward and backward from a
    fixed RNG state (the coordinate augmentations draw from it in training)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(pixel_values=x)
    hidden = out.last_hidden_state  # weighted: a sum of squares of LayerNorm outputs is ~constant
    weights = _inputs.randn(hidden.shape, _inputs.generator(7), hidden.dtype)
    ((weights * hidden).sum() + out.pooler_output.sum()).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return out.last_hidden_state, out.pooler_output, grads


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_dinov3_fast_rope_equals_the_original(attn):
    """Outputs within float32 rounding (1e-5 of the largest magnitude), gradients tensor by
    tensor within three times the original's own float32 distance to float64 plus 2e-5
    (test_timm_rope's bar: which float32 model lands closer varies; a wrong gradient is
    off by far more), in training (augmented coordinates, the same draws) and evaluation,
    at other and non-square sizes."""
    ref = dinov3(attn=attn)
    keys = list(ref.state_dict())
    fast = pf_hf.use_fast_rope(copy.deepcopy(ref))
    assert list(fast.state_dict()) == keys
    ref64 = copy.deepcopy(ref).double()
    for h, w in [(32, 32), (24, 40)]:
        x = _inputs.randn((2, 3, h, w), _inputs.generator(h + w))
        for train in (True, False):
            for m in (ref, fast, ref64):
                m.train(train)
            (ha, pa, ga), (hb, pb, gb) = dinov3_step(ref, x), dinov3_step(fast, x)
            _, _, g64 = dinov3_step(ref64, x.double())
            for got, want in ((hb, ha), (pb, pa)):
                scale = want.abs().max().item()
                torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * scale)
            assert gb.keys() == ga.keys() == g64.keys()
            for n, want in g64.items():
                scale = want.abs().max()
                ours, theirs = (((g[n] - want).abs().max() / scale).item() for g in (gb, ga))
                assert ours <= 3 * theirs + 2e-5, (n, ours, theirs)
    plain = copy.deepcopy(ref).eval()
    with torch.no_grad():  # the rotation matters here: without it the outputs differ
        plain.rope_embeddings.inv_freq.zero_()
        x = _inputs.randn((2, 3, 32, 32), _inputs.generator(0))
        assert (plain(x).last_hidden_state - ref.eval()(x).last_hidden_state).abs().max() > 1e-2


def test_dinov3_fast_rope_saves_reloads_compiles_and_exports(tmp_path):
    model = pf_hf.use_fast_rope(dinov3(num_hidden_layers=1)).eval()
    x = _inputs.randn((2, 3, 24, 40), _inputs.generator(5))
    with torch.no_grad():
        want = model(pixel_values=x).last_hidden_state
    model.save_pretrained(tmp_path)
    ours = pf_hf.from_pretrained(tf.DINOv3ViTModel, str(tmp_path)).eval()
    assert "forward" in vars(ours.model.layer[0].attention)  # use_fast_rope applied again
    plain = tf.DINOv3ViTModel.from_pretrained(str(tmp_path)).eval()  # transformers' own
    with torch.no_grad():
        torch.testing.assert_close(ours(pixel_values=x).last_hidden_state, want)
        torch.testing.assert_close(
            plain(pixel_values=x).last_hidden_state, want, rtol=1e-5, atol=1e-5
        )

    def hidden(m):
        return lambda images: m(pixel_values=images).last_hidden_state

    compiled = torch.compile(hidden(model), fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), want)
    program = torch.export.export(HiddenState(model), (x,))
    with torch.no_grad():
        torch.testing.assert_close(program.module()(x), want)


class HiddenState(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, images):
        return self.model(pixel_values=images).last_hidden_state


def test_dinov3_fast_rope_exports_a_float32_onnx_graph():
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is in the test extra")
    onnx = pytest.importorskip("onnx", reason="onnx is in the test extra")
    pytest.importorskip("onnxscript", reason="the dynamo exporter needs onnxscript")
    from _onnx_ops import float64_tensors

    model = HiddenState(pf_hf.use_fast_rope(dinov3(num_hidden_layers=1))).eval()
    x = _inputs.randn((2, 3, 32, 40), _inputs.generator(1))
    rows, cols = torch.export.Dim("rows", min=2, max=8), torch.export.Dim("cols", min=2, max=8)
    shapes = ({0: torch.export.Dim("batch"), 2: 8 * rows, 3: 8 * cols},)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(model, (x,), dynamo=True, dynamic_shapes=shapes, verbose=False)
    proto = program.model_proto
    assert float64_tensors(proto) == []
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    for shape in [(2, 3, 32, 40), (1, 3, 24, 16)]:
        y = _inputs.randn(shape, _inputs.generator(sum(shape)))
        got = torch.from_numpy(session.run(None, {session.get_inputs()[0].name: y.numpy()})[0])
        with torch.no_grad():
            want = model(y)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())
    del onnx


def test_dinov3_fast_rope_refusals():
    with pytest.raises(TypeError, match="exactly one DINOv3 ViT rotary position embedding"):
        pf_hf.use_fast_rope(build("vit"))
    model = dinov3()
    del model.model.layer[1].attention.q_proj
    with pytest.raises(TypeError, match=r"lacks \['q_proj'\].*transformers 5.24"):
        pf_hf.use_fast_rope(model)
    fast = pf_hf.use_fast_rope(dinov3())
    table = (torch.ones(16, 16), torch.zeros(16, 16))
    with pytest.raises(ValueError, match="patch coordinates.*not a cos / sin table"):
        fast.model.layer[0].attention(torch.zeros(1, 19, 32), position_embeddings=table)
