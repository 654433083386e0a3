"""The rotary families' eager baselines of ``bench`` (posenc_fast/cli/_baselines.py, restated
from timm 1.0.31 so that they exist without timm) are timm's own code: the same functions
bit for bit, and the bench cases' tables equal to those timm's rotary modules build for
the same models (vit_base_patch16_rope_224, ..._rope_mixed_224, vit_base_patch16_dinov3)."""

from __future__ import annotations

import pytest
import torch
from _timm import import_timm

from posenc_fast.cli import _baselines, _cases, _inputs, bench


@pytest.fixture(scope="module")
def ps():
    import_timm()
    from timm.layers import pos_embed_sincos

    return pos_embed_sincos


def _x(shape, seed=0):
    return _inputs.randn(shape, _inputs.generator(seed))


def _equal(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(a, b), f"{what}: max diff {float((a - b).abs().max()):.3g}"


def test_functions_are_timms(ps):
    x = _x((2, 3, 5, 16))
    _equal(_baselines.timm_rot(x), ps.rot(x), "rot")
    _equal(_baselines.timm_rope_rotate_half(x), ps.rope_rotate_half(x), "rope_rotate_half")
    for half in (False, True):
        _equal(_baselines.timm_rope_layout(x, half), ps._rope_layout(x, half), "_rope_layout")
        emb = _x((5, 32), 1)
        for t in (x, x.to(torch.bfloat16)):
            ours = _baselines.timm_apply_rot_embed_cat(t, emb, half)
            _equal(ours, ps.apply_rot_embed_cat(t, emb, half=half), f"apply half={half}")


@pytest.mark.parametrize("prefix,half", [(1, False), (5, True)])
def test_eva_rotation_is_the_attention_s(ps, prefix, half):
    """EvaAttention / AttentionRope.forward's two lines (timm/models/eva.py)."""
    q, k = _x((2, 3, prefix + 6, 8), 2), _x((2, 3, prefix + 6, 8), 3)
    rope = _x((6, 16), 4)
    want = [
        torch.cat([t[:, :, :prefix], ps.apply_rot_embed_cat(t[:, :, prefix:], rope, half=half)], 2)
        for t in (q, k)
    ]
    for ours, theirs in zip(_baselines.timm_eva_rotate(q, k, rope, prefix, half), want):
        _equal(ours, theirs, "rotation")


SMALL = (2, (4, 6))  # batch, grid


def test_axial_case_table_is_rotary_embedding_cat(ps):
    """vit_base_patch16_rope_224's RotaryEmbeddingCat: in_pixels=False, temperature 100,
    'xy' grid, cached table."""
    case = _cases.rotary_family_case("axial", "small", "cpu", sizes=SMALL)
    timm_rope = ps.RotaryEmbeddingCat(
        64, in_pixels=False, temperature=100.0, feat_shape=[4, 6], grid_indexing="xy"
    )
    _equal(case.eager.table, timm_rope.get_embed(), "axial table")


def test_mixed_case_is_rotary_embedding_mixed(ps):
    """vit_base_patch16_rope_mixed_224's RotaryEmbeddingMixed (temperature 10, 'xy' grid)
    holding the case's frequencies as its block 0: the same table, and the same gradient to
    its parameter through EvaAttention's rotation."""
    case = _cases.rotary_family_case("mixed", "small", "cpu", sizes=SMALL)
    timm_rope = ps.RotaryEmbeddingMixed(768, 1, 12, temperature=10.0, feat_shape=[4, 6])
    with torch.no_grad():
        timm_rope.freqs.copy_(case.eager.freqs[:, None])
    t_x, t_y = case.args[2:]
    table = timm_rope.get_embed()[0]
    _equal(_baselines.timm_mixed_table(case.eager.freqs, t_x, t_y), table, "mixed table")
    q, k = (t.detach() for t in case.args[:2])
    ours = case.eager(q, k, t_x, t_y)
    theirs = [
        torch.cat([t[:, :, :1], ps.apply_rot_embed_cat(t[:, :, 1:], table)], 2) for t in (q, k)
    ]
    for a, b in zip(ours, theirs):
        _equal(a, b, "mixed rotation")
    g = _x(ours[0].shape, 5)
    (mine,) = torch.autograd.grad((ours[0] * g).sum() + ours[1].sum(), [case.eager.freqs])
    (timms,) = torch.autograd.grad((theirs[0] * g).sum() + theirs[1].sum(), [timm_rope.freqs])
    _equal(mine, timms[:, 0], "gradient to freqs")


def test_dinov3_case_table_is_rotary_embedding_dinov3(ps):
    """vit_base_patch16_dinov3's RotaryEmbeddingDinoV3: temperature 100, rotate-half,
    centered grid."""
    case = _cases.rotary_family_case("dinov3", "small", "cpu", sizes=SMALL)
    timm_rope = ps.RotaryEmbeddingDinoV3(64, temperature=100.0, feat_shape=[4, 6])
    _equal(case.eager.table, timm_rope.get_embed(), "dinov3 table")
    assert case.sizes["prefix"] == 5 and case.sizes["pairs"] == "half"


@pytest.mark.parametrize(
    "family,grid", [(f, (4, 6)) for f in _cases.ROTARY_FAMILIES] + [("nd", (2, 3, 4))]
)
def test_family_cases_agree(family, grid):
    """Every family's baseline (eager) and ours against the float64 spec, forward; and the
    gradients of eager and ours agree (q, k and Mixed's frequencies)."""
    case = _cases.rotary_family_case(family, "small", "cpu", sizes=(2, grid))
    accuracy = bench._Accuracy(case)
    impls = bench._impls(case, ())
    assert {"eager", "torch"} <= set(impls)
    for name, impl in impls.items():
        assert accuracy.of(impl)["max_err_vs_spec"] < 2e-6, name
    grads = {}
    gq = _x(case.args[0].shape, 6)  # the same incoming gradients, whatever the output layout
    for name, impl in impls.items():
        q2, k2 = impl.fn()
        grads[name] = torch.autograd.grad((q2 * gq).sum() + k2.sum(), impl.leaves)
    assert len(grads["eager"]) == (3 if family == "mixed" else 2)
    for got in grads.values():
        for a, b in zip(got, grads["eager"]):
            assert a.shape == b.shape and float((a - b).abs().max()) < 1e-4 * (1 + b.abs().max())
