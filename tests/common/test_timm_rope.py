"""posenc_fast.integrations.timm.use_fast_rope against the real timm (1.0.31): every Eva
rotary family (EVA-02, RoPE-ViT axial and Mixed, DINOv3, MRoPE; grouped-query attention)
and NaFlexViT, built small with timm's own constructors (2 blocks, dim 32-64, 32 px
images: seconds on a CPU). The converted model gives timm's outputs (float32: within 1e-5
of the largest value) and gradients (as close to timm's model run in float64 as timm's own
float32 gradients), in training (augmented coordinates drawn as timm draws them) and
evaluation, at other and non-square sizes, with token dropping,
gradient checkpointing and forward_intermediates; checkpoints load both ways; compile,
torch.export and ONNX work; what does not fit is refused by name."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from _timm import import_timm

from posenc_fast.cli import _inputs
from posenc_fast.integrations import timm as pf_timm

SMALL = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)
AUGMENT = dict(rope_shift_coords=0.5, rope_jitter_coords=1.5, rope_rescale_coords=2.0)
# family -> (timm model name, its arguments beside SMALL)
FAMILIES = {
    "eva02": ("eva02_tiny_patch14_224", dict(ref_feat_shape=(3, 3))),
    "eva02-qkv-separate": ("eva02_tiny_patch14_224", dict(qkv_fused=False, num_reg_tokens=1)),
    "axial": ("vit_small_patch16_rope_224", {}),
    "axial-half-reg": ("vit_small_patch16_rope_224", dict(rope_rotate_half=True, num_reg_tokens=2)),
    "axial-augmented": ("vit_small_patch16_rope_224", AUGMENT),
    "mixed": ("vit_small_patch16_rope_mixed_224", {}),
    "mixed-augmented": ("vit_small_patch16_rope_mixed_224", dict(rope_shift_coords=1.0)),
    "dinov3": ("vit_small_patch16_dinov3", AUGMENT),
    "mrope": (
        "vit_small_patch16_rope_224",
        dict(rope_type="mrope", rope_grid_indexing="ij", embed_dim=48, dynamic_img_size=True),
    ),
    "gqa": (
        "vit_small_patch16_rope_224",
        dict(embed_dim=64, num_heads=4, num_kv_heads=2, qkv_fused=False),
    ),
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: more threads only add synchronisation on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def eva(family: str, **kwargs):
    """timm's model of the family, small, with attention weights large enough that the
    rotation changes the outputs markedly (timm's init leaves attention nearly uniform)."""
    name, args = FAMILIES[family]
    torch.manual_seed(0)
    model = import_timm().create_model(name, pretrained=False, **{**SMALL, **args, **kwargs})
    for i, blk in enumerate(model.blocks):
        _inputs.randomize_parameters(blk.attn, 10 + i, 1.0)
    return model


def converted(model, **kwargs):
    fast = copy.deepcopy(model)
    assert pf_timm.use_fast_rope(fast, **kwargs) is fast
    return fast


def images(b=2, h=32, w=32, seed=0):
    return _inputs.randn((b, 3, h, w), _inputs.generator(seed))


def close(got, want, what="", tol=1e-5):
    """Within ``tol`` of the largest magnitude of ``want`` (float32: 1e-5 for outputs)."""
    scale = want.detach().abs().max().item()
    torch.testing.assert_close(got, want, rtol=0, atol=tol * scale, msg=lambda m: f"{what}: {m}")


def loss_weights(t):
    """Fixed random weights of t's shape: the loss sum(w * t) (a sum of squares of
    LayerNorm outputs would be nearly constant, its gradients mostly rounding)."""
    return _inputs.randn(t.shape, _inputs.generator(7), t.dtype)


def run(model, x, seed=1, fn=None):
    """(output, {name: grad}) of one forward and backward from a fixed RNG state (token
    dropping and the coordinate augmentations draw from it)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = (model if fn is None else fn)(x)
    tokens = out if isinstance(out, torch.Tensor) else out[0]
    loss_weights(tokens).mul(tokens).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def assert_same(ref, fast, x, seed=1, fn=None):
    """The converted model's outputs are timm's within float32 rounding (1e-5 of the
    largest magnitude), and its gradients as accurate as timm's own, tensor by tensor:
    their largest distance to timm's model run in float64 (relative to the tensor's
    largest element) is at most three times that of timm's float32 gradients plus 2e-5.
    (A whole model's rounding, amplified by sharp attention, puts float32 gradients a few
    1e-5 from float64 ones, ours and timm's alike, the angles being computed otherwise;
    which of the two lands closer varies with the backend: a wrong gradient is off by
    far more.)"""
    ref64 = copy.deepcopy(ref).double()
    call = (lambda m: None) if fn is None else fn
    (a, ga), (b, gb) = run(ref, x, seed, call(ref)), run(fast, x, seed, call(fast))
    _, g64 = run(ref64, x.double(), seed, call(ref64))
    if isinstance(a, torch.Tensor):
        close(b, a, "output")
    else:
        for i, (u, v) in enumerate(zip(b[1], a[1])):
            close(u, v, f"intermediate {i}")
        close(b[0], a[0], "output")
    assert ga.keys() == gb.keys() == g64.keys()
    for name, want in g64.items():
        scale = want.abs().max()
        ours, timms = (((g[name] - want).abs().max() / scale).item() for g in (gb, ga))
        assert ours <= 3 * timms + 2e-5, (name, ours, timms)
    return gb


def rope_effect(model, x) -> float:
    """How much the rotation changes the features (relative): the tests mean something
    only where it does."""
    plain = copy.deepcopy(model).eval()
    for blk in plain.blocks:
        blk.attn.forward = lambda *a, _f=blk.attn.forward, **k: _f(*a, **{**k, "rope": None})
    with torch.no_grad():
        a, b = model.eval().forward_features(x), plain.forward_features(x)
    return ((a - b).abs().max() / a.abs().max()).item()


# -- outputs and gradients -------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_outputs_and_gradients_match_timm_in_training_and_evaluation(family):
    ref = eva(family)
    fast = converted(ref)
    x = images()
    assert rope_effect(ref, x) > 5e-3
    for train in (True, False):
        ref.train(train), fast.train(train)
        grads = assert_same(ref, fast, x)
        assert_same(ref, fast, x, fn=lambda m: m.forward_features)
        if "mixed" in family:
            assert grads["rope.freqs"].abs().sum() > 0  # reached through the block's view


def test_dropout_and_drop_path_draw_as_in_timm():
    """The attention's dropouts and the blocks' drop path in training: the converted
    attention draws from the RNG in timm's order (compared in float32 only: the draws
    depend on the dtype)."""
    ref = eva("axial", drop_path_rate=0.2, proj_drop_rate=0.2, attn_drop_rate=0.2)
    fast = converted(ref)
    ref.train(), fast.train()
    x = images()
    for fused in (True, False):  # SDPA's dropout, and timm's unfused path's nn.Dropout
        for m in (ref, fast):
            for blk in m.blocks:
                blk.attn.fused_attn = fused
        (a, ga), (b, gb) = run(ref, x), run(fast, x)
        close(b, a, f"fused_attn={fused}")
        for name in ga:
            close(gb[name], ga[name], name, 1e-4)


@pytest.mark.parametrize("family", ["axial-augmented", "dinov3", "mixed-augmented"])
def test_augmented_coordinates_are_drawn_as_timm_draws_them(family):
    """Training draws shift / jitter / rescale from the global RNG: the same seed gives
    timm's coordinates (and so its outputs); another seed other ones."""
    ref = eva(family)
    fast = converted(ref)
    ref.train(), fast.train()
    x = images()
    torch.manual_seed(5)
    a = ref(x)
    torch.manual_seed(5)
    b = fast(x)
    close(b, a)
    torch.manual_seed(6)
    assert not torch.allclose(fast(x), b)
    fast.eval(), ref.eval()
    close(fast(x), ref(x))  # no augmentation in evaluation


@pytest.mark.parametrize("family", ["eva02", "axial", "mixed", "dinov3", "mrope"])
def test_other_and_non_square_image_sizes(family):
    ref = eva(family, dynamic_img_size=True)
    fast = converted(ref)
    for h, w in [(32, 32), (24, 40), (48, 16)]:
        x = images(2, h, w, seed=h + w)
        for train in (True, False):
            ref.train(train), fast.train(train)
            assert_same(ref, fast, x)


@pytest.mark.parametrize("family", ["axial", "mixed", "dinov3"])
def test_set_input_size_of_a_fixed_size_model(family):
    args = {"dynamic_img_size": False} if family == "dinov3" else {}
    ref = eva(family, **args)
    fast = converted(ref)
    for m in (ref, fast):
        m.set_input_size(img_size=(40, 24))
    ref.eval(), fast.eval()
    assert_same(ref, fast, images(2, 40, 24))


@pytest.mark.parametrize("family", ["axial", "mixed", "dinov3", "eva02"])
def test_token_dropping_uses_per_sample_positions(family):
    """patch_drop_rate: timm keeps a random subset of patches per sample and gathers their
    embeddings with keep_indices; the converted model gathers their coordinates."""
    ref = eva(family, patch_drop_rate=0.5)
    fast = converted(ref)
    ref.train(), fast.train()
    x = images(3)
    assert_same(ref, fast, x, seed=3)
    ref.eval(), fast.eval()  # no dropping in evaluation
    assert_same(ref, fast, x)


@pytest.mark.parametrize("family", ["axial", "mixed"])
def test_forward_intermediates_head_and_grad_checkpointing(family):
    ref = eva(family)
    fast = converted(ref)
    x = images()

    def intermediates(m):
        return lambda x: m.forward_intermediates(x, indices=[0, 1], output_fmt="NLC")

    assert_same(ref, fast, x, fn=intermediates)
    feats = fast.forward_features(x)
    close(fast.forward_head(feats, pre_logits=True), ref.forward_head(feats, pre_logits=True))
    both = fast.forward_intermediates(x, indices=1, return_prefix_tokens=True)[1][0]
    close(both[0], ref.forward_intermediates(x, indices=1, return_prefix_tokens=True)[1][0][0])
    for m in (ref, fast):
        m.set_grad_checkpointing(True)
        m.train()
    assert_same(ref, fast, x)


def test_a_float64_model():
    ref = eva("mixed").double()
    fast = converted(ref)
    x = images().double()
    with torch.no_grad():
        a, b = ref.forward_features(x), fast.forward_features(x)
    # timm computes Mixed's angles in float32 even here; posenc_fast in float64
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert b.dtype == torch.float64


def test_autocast_bfloat16():
    ref = eva("axial")
    fast = converted(ref)
    x = images()
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        a, b = ref.forward_features(x), fast.forward_features(x)
    assert b.dtype == a.dtype
    torch.testing.assert_close(b.float(), a.float(), rtol=0.05, atol=0.05)


# -- NaFlexViT --------------------------------------------------------------------------------


def naflexvit(rope: str, **kwargs):
    """timm's NaFlexViT with the family's rotary embedding (rope_type), small."""
    extra = dict(rope_mrope_section=(2, 3, 3)) if rope == "mrope" else {}
    torch.manual_seed(0)
    model = import_timm().create_model(
        "naflexvit_base_patch16_gap", pretrained=False, rope_type=rope, pos_embed="none",
        **{**SMALL, **extra, **kwargs},
    )  # fmt: skip
    for i, blk in enumerate(model.blocks):
        _inputs.randomize_parameters(blk.attn, 10 + i, 1.0)
    return model


def naflex_batch(sizes, length, seed=0):
    """A NaFlex batch: per sample the 8x8 patches of a (rows, cols) grid in row-major
    order, padded to ``length`` (patch_valid False)."""
    g = _inputs.generator(seed)
    patches = _inputs.randn((len(sizes), length, 8 * 8 * 3), g)
    coord = torch.zeros(len(sizes), length, 2, dtype=torch.long)
    valid = torch.zeros(len(sizes), length, dtype=torch.bool)
    for b, (h, w) in enumerate(sizes):
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        coord[b, : h * w] = torch.stack([rows.flatten(), cols.flatten()], -1)
        valid[b, : h * w] = True
    return dict(patches=patches, patch_coord=coord, patch_valid=valid)


@pytest.mark.parametrize("rope", ["axial", "mixed", "dinov3", "mrope"])
def test_naflexvit_on_images(rope):
    ref = naflexvit(rope, **AUGMENT)
    fast = converted(ref)
    for train in (True, False):
        ref.train(train), fast.train(train)
        assert_same(ref, fast, images(2, 24, 40))


@pytest.mark.parametrize("rope", ["axial", "mixed", "dinov3", "mrope"])
def test_naflexvit_on_naflex_batches(rope):
    """Several grid sizes in one padded batch: the valid tokens, the pooled output and the
    gradients are timm's. (Padding tokens differ: timm's table is zero there, which zeroes
    their q and k; the op rotates them by position 0. They are masked out of attention and
    pooling.)"""
    ref = naflexvit(rope, **AUGMENT, patch_drop_rate=0.25)
    fast = converted(ref)
    batch = naflex_batch([(3, 5), (4, 4), (3, 5), (2, 3)], 16)
    valid = batch["patch_valid"]
    prefix = ref.num_prefix_tokens
    for train in (True, False):
        ref.train(train), fast.train(train)
        outs, grads = [], []
        for m in (ref, fast):
            m.zero_grad()
            torch.manual_seed(2)
            features = m.forward_features(**batch)
            logits = m.forward_head(**features)
            loss_weights(logits).mul(logits).sum().backward()
            outs.append((features, logits))
            grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
        (fa, la), (fb, lb) = outs
        close(lb, la, "pooled")
        if not train:  # (token dropping reorders the tokens in training)
            close(fb["patches"][:, prefix:][valid], fa["patches"][:, prefix:][valid], "tokens")
        for name in grads[0]:
            close(grads[1][name], grads[0][name], name, 1e-4)


# -- checkpoints, copies ---------------------------------------------------------------------


@pytest.mark.parametrize("family", ["axial", "mixed", "dinov3"])
def test_checkpoints_load_both_ways(family):
    ref = eva(family)
    fast = converted(ref)
    assert list(fast.state_dict()) == list(ref.state_dict())
    other = eva(family)
    with torch.no_grad():  # another model's weights, saved by timm, loaded into ours
        for p in other.parameters():
            p.add_(0.01)
    fast.load_state_dict(other.state_dict(), strict=True)
    fresh = import_timm().create_model(FAMILIES[family][0], pretrained=False, **{
        **SMALL, **FAMILIES[family][1]
    })  # fmt: skip
    fresh.load_state_dict(fast.state_dict(), strict=True)  # and ours into a fresh timm
    x = images()
    for m in (other, fast, fresh):
        m.eval()
    close(fast(x), other(x))
    close(fresh(x), other(x))


def test_deepcopy_and_pickle_follow_the_copy():
    fast = converted(eva("mixed")).eval()
    x = images()
    y = fast(x)
    twin = copy.deepcopy(fast)
    assert twin.blocks[0].attn.forward.rope is twin.rope
    assert twin.rope.get_embed.rope is twin.rope
    with torch.no_grad():
        twin.rope.freqs.mul_(2.0)
    assert not torch.allclose(twin(x), y) and torch.equal(fast(x), y)
    buf = io.BytesIO()
    torch.save(fast, buf)
    buf.seek(0)
    close(torch.load(buf, weights_only=False)(x), y)


def test_converting_twice_changes_nothing():
    ref = eva("dinov3").eval()
    fast = converted(converted(ref))
    x = images()
    close(fast(x), ref(x))


def test_get_embed_gives_the_coordinates():
    fast = converted(eva("axial"))
    coords = fast.rope.get_embed()
    assert coords.shape == (16, 2) and coords.dtype == torch.float32  # 'xy': (col, row)
    assert coords[:5].tolist() == [[0, 0], [1, 0], [2, 0], [3, 0], [0, 1]]
    mixed = converted(eva("mixed"))
    assert mixed.rope.get_embed().shape == (2, 1, 16, 2)  # per block, a view


# -- compile, export, ONNX -------------------------------------------------------------------


@pytest.mark.parametrize("family", ["mixed-augmented", "dinov3"])
def test_compile_fullgraph_matches_eager(family):
    """In training, with the coordinate augmentations and token dropping drawn inside the
    graph (aot_eager: the eager kernels and RNG, so the same draws)."""
    fast = converted(eva(family, dynamic_img_size=True, patch_drop_rate=0.3)).train()
    x = images(2, 24, 40)
    compiled = torch.compile(fast, fullgraph=True, backend="aot_eager")
    out, grads = run(fast, x, fn=compiled)
    ref, ref_grads = run(fast, x)
    close(out, ref)
    for name in ref_grads:
        close(grads[name], ref_grads[name], name)


@pytest.mark.parametrize("family", ["mixed", "dinov3"])
def test_torch_export_with_dynamic_sizes_matches_eager(family):
    fast = converted(eva(family, dynamic_img_size=True)).eval()
    rows, cols = torch.export.Dim("rows", min=2, max=8), torch.export.Dim("cols", min=2, max=8)
    shapes = ({0: torch.export.Dim("batch"), 2: 8 * rows, 3: 8 * cols},)
    program = torch.export.export(fast, (images(2, 32, 40),), dynamic_shapes=shapes)
    for b, h, w in [(2, 32, 40), (3, 24, 56)]:
        y = images(b, h, w, seed=9)
        with torch.no_grad():
            close(program.module()(y), fast(y), f"{b}x{h}x{w}")


class Families(torch.nn.Module):
    """Converted one-block Mixed, DINOv3 and EVA-02 models of dynamic image size, in one
    graph (each ONNX export costs seconds): images [B, 3, H, W] in, one output each."""

    def __init__(self):
        super().__init__()
        self.models = torch.nn.ModuleList(
            converted(eva(f, dynamic_img_size=True, depth=1)) for f in FAMILY_NAMES
        )

    def forward(self, x):
        return tuple(m(x) for m in self.models)


def test_onnx_dynamo_export_is_float32_only_and_matches_eager():
    """torch.onnx.export(dynamo=True) with dynamic batch and image sizes (timm's Eva does
    not export with the TorchScript-based exporter, converted or not: it traces is_causal
    as a tensor); onnxruntime runs the graph within the float32 tolerance of eager at
    other sizes."""
    onnx = pytest.importorskip("onnx", reason="onnx is in the test extra")
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is in the test extra")
    pytest.importorskip("onnxscript", reason="the dynamo exporter needs onnxscript")
    from _onnx_ops import float64_tensors

    model = Families().eval()
    x = images(2, 32, 40)
    rows, cols = torch.export.Dim("rows", min=2, max=8), torch.export.Dim("cols", min=2, max=8)
    shapes = ({0: torch.export.Dim("batch"), 2: 8 * rows, 3: 8 * cols},)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            model, (x,), dynamo=True, dynamic_shapes=shapes, input_names=["images"],
            opset_version=20, verbose=False,
        )  # fmt: skip
    proto = program.model_proto
    assert float64_tensors(proto) == []
    assert all(n.domain in ("", "ai.onnx") for n in proto.graph.node)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    for b, h, w in [(2, 32, 40), (3, 24, 16), (1, 48, 56)]:
        y = images(b, h, w, seed=b + h)
        with torch.no_grad():
            want = model(y)
        for got, ref, name in zip(session.run(None, {"images": y.numpy()}), want, FAMILY_NAMES):
            close(torch.from_numpy(got), ref, f"{name} {b}x{h}x{w}")
    del onnx


FAMILY_NAMES = ("mixed", "dinov3", "eva02")


# -- what does not fit -----------------------------------------------------------------------


def test_models_that_do_not_fit_are_refused_by_name():
    timm = import_timm()
    vit = timm.models.vision_transformer.VisionTransformer(**SMALL)
    with pytest.raises(TypeError, match="Eva-family models.*got VisionTransformer"):
        pf_timm.use_fast_rope(vit)
    with pytest.raises(TypeError, match="got Linear"):
        pf_timm.use_fast_rope(torch.nn.Linear(2, 2))
    no_rope = timm.models.eva.Eva(**SMALL)  # use_rot_pos_emb=False
    with pytest.raises(ValueError, match="no rotary embedding"):
        pf_timm.use_fast_rope(no_rope)
    base = eva("axial", rope_type="base")
    with pytest.raises(TypeError, match="RotaryEmbedding \\('base'\\) gives separate sin / cos"):
        pf_timm.use_fast_rope(base)
    with pytest.raises(ValueError, match="backend must be"):
        pf_timm.use_fast_rope(eva("axial"), backend="nope")


def test_attention_of_another_structure_is_refused_before_any_change():
    model = eva("axial")

    class MyAttention(type(model.blocks[1].attn)):
        pass

    model.blocks[1].attn.__class__ = MyAttention
    with pytest.raises(TypeError, match=r"blocks\[1\]\.attn is a MyAttention.*not subclasses"):
        pf_timm.use_fast_rope(model)
    assert "get_embed" not in vars(model.rope) and "forward" not in vars(model.blocks[0].attn)
    model = eva("axial")
    del model.blocks[0].attn.q_norm
    with pytest.raises(TypeError, match=r"lacks \['q_norm'\].*timm 1.0.31"):
        pf_timm.use_fast_rope(model)
    model = eva("axial")
    model.blocks[0].attn.rotate_half = True
    with pytest.raises(ValueError, match="mixes the two layouts"):
        pf_timm.use_fast_rope(model)


def test_a_table_passed_to_a_converted_attention_is_refused():
    ref = eva("axial")
    fast = converted(ref)
    table = ref.rope.get_embed()  # timm's [N, 2 * head_dim]
    tokens = torch.zeros(2, 17, 32)
    with pytest.raises(ValueError, match="coordinates.*not timm's table"):
        fast.blocks[0].attn(tokens, rope=table)


def test_step_benchmark_smoke(tmp_path):
    """benchmarks/timm_rope_step.py --quick on one tiny case (one measured step): its JSON
    and table. Timings are not checked."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "timm_rope_step.py"
    spec = importlib.util.spec_from_file_location("timm_rope_step", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "step.json"
    args = ["--quick", "--cases", "vit_s_mixed_448_b2", "--threads", "1", "--steps", "1"]
    assert bench.main([*args, "--warmup", "0", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["timm_s"] > 0 and row["fast_s"] > 0 and row["eval_logits_max_rel_diff"] < 1e-5
    assert bench.main(["--render", str(out)]) == 0
