"""posenc_fast.integrations.timm against the real timm VisionTransformer (tiny models,
seconds on a CPU): token handling, dynamic image sizes, copies, compile, autocast."""

import copy
import io
import os
import subprocess
import sys

import pytest
import torch
from _timm import REASON, import_timm, timm_available

import posenc_fast as pf
from posenc_fast.cli import _inputs
from posenc_fast.integrations import timm as pf_timm


def test_importing_posenc_fast_does_not_import_timm_or_transformers():
    code = (
        "import sys, posenc_fast, posenc_fast.integrations.timm, "
        "posenc_fast.integrations.attention, posenc_fast.integrations.transformers, "
        "posenc_fast.convert; "
        "print('timm' in sys.modules, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False False"


@pytest.mark.skipif(os.environ.get("CI") != "true", reason="checks the CI environment only")
def test_ci_installs_timm():
    """CI must run the timm tests, not skip them: tools/setup_venv.sh installs timm."""
    assert timm_available(), REASON


def vit(**kwargs):
    """A tiny timm VisionTransformer: 32x32 images, 8x8 patches (a 4x4 grid), dim 32."""
    vt = import_timm().models.vision_transformer
    args = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)
    args.update(kwargs)
    torch.manual_seed(0)
    return vt.VisionTransformer(**args)


def images(h=32, w=32, seed=0):
    return _inputs.randn((2, 3, h, w), _inputs.generator(seed))


def grid_encoding(model, h, w):
    """What the encoding should add: the module's encoder on the (row, col) indices."""
    coords = pf.grid_positions(h, w, normalize=False, dtype=torch.float32)
    return model.pos_encoding.encode(coords)  # [h*w, C]


@pytest.mark.parametrize(
    "class_token,reg_tokens,no_embed_class",
    [(True, 0, False), (True, 2, True), (False, 0, False), (True, 3, False)],
    ids=["cls", "cls+reg-no_embed_class", "no-prefix", "cls+reg"],
)
def test_lff_encodes_patch_tokens_and_leaves_prefix_tokens(class_token, reg_tokens, no_embed_class):
    model = vit(
        class_token=class_token,
        reg_tokens=reg_tokens,
        no_embed_class=no_embed_class,
        global_pool="token" if class_token else "avg",
    )
    enc = pf_timm.use_lff(model, gamma=2.0)
    assert model.pos_embed is None and model.pos_encoding is enc
    x = images()
    patches = model.patch_embed(x)  # [B, 16, C]
    tokens = model._pos_embed(patches)
    prefix = model.num_prefix_tokens
    assert tokens.shape == (2, prefix + 16, 32)
    torch.testing.assert_close(tokens[:, prefix:], patches + grid_encoding(model, 4, 4))
    expected_prefix = [model.cls_token] * class_token + [model.reg_token] * bool(reg_tokens)
    if expected_prefix:
        torch.testing.assert_close(
            tokens[:, :prefix], torch.cat(expected_prefix, 1).expand(2, -1, -1)
        )
    assert model(x).shape == (2, 5)


def test_unseen_grid_sizes_with_dynamic_img_size():
    model = vit(dynamic_img_size=True, reg_tokens=1)
    pf_timm.use_lff(model, gamma=1.5)
    for h, w in [(32, 32), (48, 40), (16, 64)]:  # 4x4 (trained size), 6x5, 2x8
        patches = model.patch_embed(images(h, w))  # [B, H, W, C]
        tokens = model._pos_embed(patches)
        expected = (
            patches + grid_encoding(model, h // 8, w // 8).view(h // 8, w // 8, -1)
        ).flatten(1, 2)
        torch.testing.assert_close(tokens[:, 2:], expected)
        assert model(images(h, w)).shape == (2, 5)


def test_fixed_size_model_follows_set_input_size_and_explains_a_mismatch():
    model = vit()
    pf_timm.use_lff(model, gamma=2.0)
    model.set_input_size(img_size=(48, 40))  # the 4x4 grid becomes 6x5
    patches = model.patch_embed(images(48, 40))  # [B, 30, C]
    expected = patches + grid_encoding(model, 6, 5)
    torch.testing.assert_close(model._pos_embed(patches)[:, 1:], expected)
    with pytest.raises(ValueError, match="dynamic_img_size=True"):
        model.pos_encoding(torch.randn(2, 25, 32), (6, 5))


def test_sine2d_adds_the_sinusoidal_encoding_of_the_indices():
    model = vit(dynamic_img_size=True)
    pf_timm.use_sine2d(model, base=100.0)
    patches = model.patch_embed(images(40, 24))  # 5x3 grid
    coords = pf.grid_positions(5, 3, normalize=False)
    expected = patches + pf.sinusoidal_nd(coords, 16, base=100.0).view(5, 3, 32)
    torch.testing.assert_close(model._pos_embed(patches)[:, 1:], expected.flatten(1, 2))
    assert sum(p.numel() for p in model.pos_encoding.parameters()) == 0
    with pytest.raises(ValueError, match="divisible by 4"):
        pf_timm.use_sine2d(vit(embed_dim=30, num_heads=2))


def test_training_reaches_the_encoder_and_state_dict_round_trips():
    model = vit()
    pf_timm.use_lff(model, gamma=2.0, fourier_dim=32, hidden_dim=16)
    model(images()).sum().backward()
    lff = model.pos_encoding.lff
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in lff.parameters())
    state = model.state_dict()
    assert "pos_embed" not in state and "pos_encoding.lff.wr" in state
    other = vit()
    pf_timm.use_lff(other, gamma=2.0, fourier_dim=32, hidden_dim=16)
    other.load_state_dict(state)
    model.eval(), other.eval()
    torch.testing.assert_close(other(images()), model(images()))


def test_deepcopy_and_pickle_keep_working_and_stay_independent():
    model = vit(dynamic_img_size=True).eval()
    pf_timm.use_lff(model, gamma=2.0)
    x = images(40, 40)
    y = model(x)
    twin = copy.deepcopy(model)
    assert twin._pos_embed.model is twin  # the override follows the copy
    torch.testing.assert_close(twin(x), y)
    with torch.no_grad():
        # A change of the frequencies: a shift of b2 by a constant would vanish in the
        # blocks' LayerNorms (every patch token moves by the same vector in every channel).
        twin.pos_encoding.lff.wr.mul_(1.5)
    assert not torch.allclose(twin(x), y) and torch.equal(model(x), y)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    torch.testing.assert_close(loaded(x), y)


def test_compile_fullgraph_matches_eager_forward_and_backward():
    model = vit(dynamic_img_size=True, reg_tokens=1)
    pf_timm.use_lff(model, gamma=2.0, fourier_dim=32, hidden_dim=16)
    x = images()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    out.square().sum().backward()
    grad = model.pos_encoding.lff.wr.grad.clone()
    model.zero_grad()
    ref = model(x)
    ref.square().sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(grad, model.pos_encoding.lff.wr.grad)


def test_autocast_and_a_bfloat16_model():
    model = vit()
    pf_timm.use_lff(model, gamma=2.0)
    x = images()
    ref = model(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=0.1, rtol=0.1)
    model.to(torch.bfloat16)
    assert model.pos_encoding.lff.wr.dtype == torch.bfloat16
    out16 = model(x.bfloat16())
    assert out16.dtype == torch.bfloat16 and torch.isfinite(out16).all()
    sine = vit().to(torch.bfloat16)
    pf_timm.use_sine2d(sine)
    assert sine(x.bfloat16()).dtype == torch.bfloat16


def test_encoding_follows_the_device_and_dtype_of_the_table():
    model = vit().double()
    enc = pf_timm.use_lff(model)
    assert enc.lff.wr.dtype == torch.float64 and model(images().double()).dtype == torch.float64
    no_table = vit(pos_embed="none").double()
    assert pf_timm.use_lff(no_table).lff.wr.dtype == torch.float64


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="timm VisionTransformer"):
        pf_timm.use_lff(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="gamma"):
        pf_timm.use_lff(vit(), gamma=0.0)
    with pytest.raises(TypeError, match="out_dim is set by the model"):
        pf_timm.use_lff(vit(), out_dim=64)


def neighbour_similarity(model) -> float:
    """Mean cosine similarity of the Fourier features of horizontally neighbouring patches
    on the model's grid: near 1 means the encoder barely tells neighbours apart."""
    h, w = model.patch_embed.grid_size
    coords = pf.grid_positions(h, w, normalize=False, dtype=torch.float32)
    feats = pf.lff(coords[:, None, :], model.pos_encoding.lff.wr.detach().float())
    grid = feats.view(h, w, -1)
    return torch.nn.functional.cosine_similarity(grid[:, 1:], grid[:, :-1], dim=-1).mean().item()


def test_readme_integration_example_gives_distinct_neighbours():
    """The README's Integrations block, run as written: neighbouring patches of the 14x14
    grid get clearly different features (exp(-1/8) = 0.88 expected at gamma = 2), not the
    near-constant encodings of normalised positions (0.9975 measured with them)."""
    import_timm()
    import pathlib
    import re

    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## Integrations", 1)[1].split("\n## ", 1)[0]
    block = re.findall(r"```python\n(.*?)\n```", section, flags=re.S)[0]
    namespace: dict = {}
    exec(compile(block, "README.md Integrations block", "exec"), namespace)
    model = namespace["model"]
    assert model.patch_embed.grid_size == (14, 14)
    assert neighbour_similarity(model) < 0.92


def test_tokens_of_the_wrong_width_name_the_embed_dim():
    """Not a reshape error deep inside."""
    model = vit()
    pf_timm.use_sine2d(model)
    for tokens in (torch.zeros(2, 4, 4, 48), torch.zeros(2, 16, 48)):
        with pytest.raises(ValueError, match=r"embed_dim=32 channels.*got \["):
            model.pos_encoding(tokens, (4, 4))


def test_use_lff_with_an_integer_dtype_is_a_type_error():
    with pytest.raises(TypeError, match="dtype must be a floating torch.dtype.*torch.int64"):
        pf_timm.use_lff(vit(), dtype=torch.int64)
