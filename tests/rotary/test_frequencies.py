"""The rotary families (posenc_fast.rope) against their own code: timm 1.0.31's
``_build_grid``, ``_apply_coord_augs``, ``RotaryEmbeddingCat`` / ``build_rotary_pos_embed``
(axial, EVA-02), ``init_random_2d_freqs`` / ``RotaryEmbeddingMixed`` (RoPE-Mixed, per block
and head, with the gradient to its frequencies) and ``RotaryEmbeddingDinoV3``; FLUX's
EmbedND from its formula (FLUX is not installable here). Positions and W come out bitwise
equal to timm's; tables and rotations within 1e-5 of timm's float32 numbers, plus what
timm's own float32 phase rounding adds (2^-24 |theta| per angle: 2.1e-5 at the pixel bands'
|theta| = 352; ours is within 1e-6 of float64), and within 1e-6 of timm's formulas
evaluated in float64.
"""

from __future__ import annotations

import math

import pytest
import torch
from _timm import import_timm

import posenc_fast as pf
from posenc_fast.cli import _inputs
from posenc_fast.tolerances import PHASE_ATOL

rope = pf.rope
U32 = 2.0**-24


@pytest.fixture(scope="module")
def ps():
    """timm.layers.pos_embed_sincos, where the rotary families live."""
    import_timm()
    from timm.layers import pos_embed_sincos

    return pos_embed_sincos


def _timm_cat(table: torch.Tensor) -> torch.Tensor:
    """Our [2, ..., F] table (cos, sin) as timm's concatenated [..., 2F] = [sin | cos]."""
    return torch.cat([table[1], table[0]], dim=-1)


def assert_table_close(ours, theirs, theta_max: float, what: str) -> None:
    """Within 1e-5 plus timm's own float32 rounding of the angles (2^-24 |theta|)."""
    assert ours.shape == theirs.shape, (what, ours.shape, theirs.shape)
    tol = 1e-5 + 2 * U32 * theta_max
    err = float((ours.double() - theirs.double()).abs().max())
    assert err <= tol, f"{what}: max |ours - timm| = {err:.3g} > {tol:.3g}"


def assert_rotation_close(ours, theirs, q, theta_max: float, what: str) -> None:
    """A rotation's error is the table's times the pair's size, plus the output's rounding."""
    assert ours.shape == theirs.shape, (what, ours.shape, theirs.shape)
    tol = (1e-5 + 2 * U32 * theta_max) * 2 * float(q.abs().max())
    err = float((ours.double() - theirs.double()).abs().max())
    assert err <= tol, f"{what}: max |ours - timm| = {err:.3g} > {tol:.3g}"


def _qk(shape, seed):
    g = _inputs.generator(seed)
    return _inputs.randn(shape, g), _inputs.randn(shape, g)


# ------------------------------------------------------------------ positions


GRIDS = [
    dict(feat_shape=(5, 7)),
    dict(feat_shape=(5, 7), kind="pixel"),
    dict(feat_shape=(6, 4), kind="centered"),
    dict(feat_shape=(6, 4), kind="centered", normalize="max", offset=0.25),
    dict(feat_shape=(6, 4), kind="centered", normalize="min", indexing="xy"),
    dict(feat_shape=(3, 5), indexing="xy", offset=1.5),
    dict(feat_shape=(7, 9), ref_feat_shape=(14, 14)),
    dict(feat_shape=(7, 9), kind="pixel", ref_feat_shape=(16, 12), indexing="xy"),
    dict(feat_shape=(2, 3, 4)),
    dict(feat_shape=(11,), kind="centered"),
]


def _id(args: dict) -> str:
    return "-".join(f"{k}={v}".replace(" ", "") for k, v in args.items())


@pytest.mark.parametrize("args", GRIDS, ids=_id)
def test_grid_is_timms_build_grid(ps, args):
    timm_args = dict(
        grid_type=args.get("kind", "index"),
        ref_feat_shape=args.get("ref_feat_shape"),
        grid_offset=args.get("offset", 0.0),
        grid_indexing=args.get("indexing", "ij"),
        normalize_coords=args.get("normalize", "separate"),
    )
    shape = list(args["feat_shape"])
    ref = timm_args["ref_feat_shape"]
    timm_args["ref_feat_shape"] = None if ref is None else list(ref)
    theirs = ps._build_grid(shape, **timm_args).reshape(-1, len(shape))
    ours = rope.grid(**args)
    assert ours.dtype == theirs.dtype == torch.float32
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize(
    "shift,jitter,rescale",
    [(0.5, None, None), (None, 1.5, None), (None, None, 2.0), (1.0, 1.3, 1.7)],
)
def test_augment_is_timms_apply_coord_augs(ps, shift, jitter, rescale):
    coords = rope.grid((4, 6), "centered")
    torch.manual_seed(11)
    theirs = ps._apply_coord_augs(coords, shift, jitter, rescale)
    torch.manual_seed(11)
    assert torch.equal(rope.augment(coords, shift, jitter, rescale), theirs)
    # a generator in the same state draws the same numbers
    ours = rope.augment(coords, shift, jitter, rescale, generator=torch.Generator().manual_seed(11))
    assert torch.equal(ours, theirs)
    assert torch.equal(coords, rope.grid((4, 6), "centered")), "coords must not be modified"


# ------------------------------------------------------------------ axial (EVA-02)


AXIAL = [
    dict(in_pixels=True),
    dict(in_pixels=True, linear_bands=True, max_res=160),
    dict(in_pixels=False, temperature=100.0),
    dict(in_pixels=False, ref_feat_shape=[16, 16], grid_offset=0.5),
    dict(in_pixels=False, grid_indexing="xy", rotate_half=True),
    dict(in_pixels=True, rotate_half=True),
]


@pytest.mark.parametrize("cfg", AXIAL, ids=_id)
def test_axial_is_timms_rotary_embedding_cat(ps, cfg):
    """RotaryEmbeddingCat(dim=head_dim).get_embed(shape) (EVA-02's): our table, and q, k
    rotated as its apply_rot_embed_cat does."""
    head_dim, shape = 32, [7, 10]
    m = ps.RotaryEmbeddingCat(dim=head_dim, **cfg)
    emb = m.get_embed(shape)  # [N, 2 * head_dim] = [sin | cos]
    bands = {k: cfg[k] for k in ("in_pixels", "max_res", "temperature", "linear_bands") if k in cfg}
    w = rope.axial(head_dim, **bands)
    nb = head_dim // 4
    assert torch.equal(w[:nb, 0], m.bands) and torch.equal(w[nb:, 1], m.bands)
    assert w.shape == (head_dim // 2, 2) and not w[:nb, 1].any() and not w[nb:, 0].any()
    x = rope.grid(
        shape,
        "pixel" if cfg["in_pixels"] else "index",
        ref_feat_shape=cfg.get("ref_feat_shape"),
        offset=cfg.get("grid_offset", 0.0),
        indexing=cfg.get("grid_indexing", "ij"),
    )
    pairs = "half" if cfg.get("rotate_half") else "interleaved"
    theta = float((x.double() @ w.double().T).abs().max())
    table = pf.rotary_table(x, w, pairs)
    assert_table_close(_timm_cat(table), emb, theta, "table")
    # timm's formula in float64 (its float64 bands and grid): ours within 1e-6 of it
    sin64, cos64 = ps.build_rotary_pos_embed(
        shape,
        bands=m.bands.double(),
        in_pixels=cfg["in_pixels"],
        ref_feat_shape=cfg.get("ref_feat_shape"),
        grid_offset=cfg.get("grid_offset", 0.0),
        grid_indexing=cfg.get("grid_indexing", "ij"),
        rotate_half=cfg.get("rotate_half", False),
        dtype=torch.float64,
    )
    err64 = float((table.double() - torch.stack([cos64, sin64])).abs().max())
    assert err64 <= PHASE_ATOL, err64
    q, k = _qk((2, 3, x.shape[0], head_dim), 1)
    half = cfg.get("rotate_half", False)
    oq, ok = pf.rotary(q, k, x, w, pairs)
    assert_rotation_close(oq, ps.apply_rot_embed_cat(q, emb, half=half), q, theta, "q'")
    assert_rotation_close(ok, ps.apply_rot_embed_cat(k, emb, half=half), k, theta, "k'")


def test_axial_in_other_dimensions():
    """ndim axes, head_dim // (2 ndim) bands each, block-diagonal; a 3-D grid rotates like
    three 1-D rotations of their own channels."""
    w = rope.axial(24, ndim=3, in_pixels=False)
    assert w.shape == (12, 3)
    assert torch.equal(w[:4, 0], w[4:8, 1]) and torch.equal(w[4:8, 1], w[8:, 2])
    assert int((w != 0).sum()) == 12
    with pytest.raises(ValueError, match="head_dim"):
        rope.axial(4, ndim=3)


# ------------------------------------------------------------------ RoPE-Mixed


def test_mixed_is_timms_init_random_2d_freqs(ps):
    torch.manual_seed(3)
    theirs = ps.init_random_2d_freqs(16, depth=3, num_heads=2, temperature=10.0)
    torch.manual_seed(3)
    ours = rope.mixed(16, depth=3, heads=2)
    assert ours.shape == (3, 2, 8, 2)
    assert torch.equal(rope.mixed_to_timm(ours), theirs)
    assert torch.equal(rope.mixed_from_timm(theirs), ours)
    assert rope.mixed_from_timm(theirs).data_ptr() == theirs.data_ptr(), "a view, no copy"
    again = rope.mixed(16, depth=3, heads=2, generator=torch.Generator().manual_seed(3))
    assert torch.equal(again, ours)
    unrotated = ps.init_random_2d_freqs(16, 3, 2, rotate=False)
    assert torch.equal(rope.mixed(16, 3, 2, rotate=False), rope.mixed_from_timm(unrotated))


def test_mixed_is_timms_rotary_embedding_mixed_per_block_with_gradients(ps):
    """RotaryEmbeddingMixed: each block's table and rotation from a slice of timm's own
    parameter (a permuted view), and the same gradient to that parameter."""
    depth, heads, head_dim, shape = 3, 2, 16, [5, 6]
    torch.manual_seed(4)
    m = ps.RotaryEmbeddingMixed(dim=heads * head_dim, depth=depth, num_heads=heads)
    emb = m.get_embed(shape)  # [depth, heads, N, 2 * head_dim]
    x = rope.grid(shape, indexing="xy")  # timm's (t_x, t_y)
    w = rope.mixed_from_timm(m.freqs)  # [depth, heads, head_dim / 2, 2], a view
    theta = float((x.double() @ w.detach().double().reshape(-1, 2).T).abs().max())
    qs = [_qk((2, heads, x.shape[0], head_dim), 10 + d) for d in range(depth)]
    ours_loss = theirs_loss = 0.0
    for d in range(depth):
        table = pf.rotary_table(x, w[d])  # [2, heads, N, head_dim]
        assert table.shape == (2, heads, x.shape[0], head_dim)
        assert_table_close(_timm_cat(table.detach()), emb[d].detach(), theta, f"block {d}")
        q, k = qs[d]
        oq, ok = pf.rotary(q, k, x, w[d])
        tq, tk = ps.apply_rot_embed_cat(q, emb[d]), ps.apply_rot_embed_cat(k, emb[d])
        assert_rotation_close(oq.detach(), tq.detach(), q, theta, f"block {d} q'")
        assert_rotation_close(ok.detach(), tk.detach(), k, theta, f"block {d} k'")
        ours_loss = ours_loss + (oq @ ok.transpose(-1, -2)).tanh().sum()
        theirs_loss = theirs_loss + (tq @ tk.transpose(-1, -2)).tanh().sum()
    (g_ours,) = torch.autograd.grad(ours_loss, m.freqs)
    (g_theirs,) = torch.autograd.grad(theirs_loss, m.freqs)
    scale = float(g_theirs.abs().max())
    err = float((g_ours - g_theirs).abs().max())
    assert err <= 1e-5 * scale, f"gradient to freqs: {err:.3g} (scale {scale:.3g})"


# ------------------------------------------------------------------ DINOv3


DINOV3 = [
    dict(),
    dict(normalize_coords="max", grid_offset=0.5),
    dict(normalize_coords="min", grid_indexing="xy"),
    dict(temperature=None, min_period=0.5, max_period=40.0),
]


@pytest.mark.parametrize("cfg", DINOV3, ids=_id)
def test_dinov3_is_timms_rotary_embedding_dinov3(ps, cfg):
    head_dim, shape = 32, [6, 9]
    m = ps.RotaryEmbeddingDinoV3(dim=head_dim, **cfg).eval()
    emb = m.get_embed(shape)
    periods = {k: cfg[k] for k in ("temperature", "min_period", "max_period") if k in cfg}
    w = rope.dinov3(head_dim, **periods)
    d = head_dim // 4
    torch.testing.assert_close(w[:d, 0].double(), 2 * math.pi / m.periods.double())
    x = rope.grid(
        shape,
        "centered",
        offset=cfg.get("grid_offset", 0.0),
        indexing=cfg.get("grid_indexing", "ij"),
        normalize=cfg.get("normalize_coords", "separate"),
    )
    theta = float((x.double() @ w.double().T).abs().max())
    assert_table_close(_timm_cat(pf.rotary_table(x, w, "half")), emb, theta, "table")
    q, k = _qk((2, 2, x.shape[0], head_dim), 5)
    oq, ok = pf.rotary(q, k, x, w, "half")
    assert_rotation_close(oq, ps.apply_rot_embed_cat(q, emb, half=True), q, theta, "q'")
    assert_rotation_close(ok, ps.apply_rot_embed_cat(k, emb, half=True), k, theta, "k'")


def test_dinov3_training_augmentation_is_timms(ps):
    """In training, timm draws one shift / jitter / rescale per call: augment() with the
    same generator state gives the same positions, so the same table."""
    aug = dict(shift_coords=0.5, jitter_coords=1.4, rescale_coords=2.0)
    m = ps.RotaryEmbeddingDinoV3(dim=32, **aug).train()
    torch.manual_seed(8)
    emb = m.get_embed([5, 5])
    torch.manual_seed(8)
    x = rope.augment(rope.grid((5, 5), "centered"), 0.5, 1.4, 2.0)
    w = rope.dinov3(32)
    theta = float((x.double() @ w.double().T).abs().max())
    assert_table_close(_timm_cat(pf.rotary_table(x, w, "half")), emb, theta, "augmented")


# ------------------------------------------------------------------ FLUX (N-D)


def flux_embed_nd(ids: torch.Tensor, axes_dim, theta: float) -> torch.Tensor:
    """FLUX's EmbedND (black-forest-labs/flux, src/flux/modules/layers.py) and its ``rope``
    (src/flux/math.py), written out: per axis a of dimension d, the angles pos_a * omega_j
    with omega_j = 1 / theta^(2j / d) (j < d / 2; float64), as 2x2 rotation matrices
    [[cos, -sin], [sin, cos]]; the axes' blocks concatenated along the frequencies, a heads
    axis inserted: [B, 1, N, sum(axes_dim) / 2, 2, 2] in float32."""
    blocks = []
    for a, d in enumerate(axes_dim):
        omega = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        angle = ids[..., a].to(torch.float64)[..., None] * omega  # [B, N, d / 2]
        rot = torch.stack([angle.cos(), -angle.sin(), angle.sin(), angle.cos()], dim=-1)
        blocks.append(rot.unflatten(-1, (2, 2)).float())
    return torch.cat(blocks, dim=-3).unsqueeze(1)


def flux_apply_rope(t: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """FLUX's apply_rope (src/flux/math.py): channel pairs (2i, 2i+1) as column vectors,
    multiplied by their rotation matrix, in float32."""
    pairs = t.float().reshape(*t.shape[:-1], -1, 1, 2)
    out = freqs_cis[..., 0] * pairs[..., 0] + freqs_cis[..., 1] * pairs[..., 1]
    return out.reshape(*t.shape).type_as(t)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["W64", "W32"])
def test_nd_is_flux_embed_nd(dtype):
    """FLUX.1's axes (16, 56, 56), theta 10000: text tokens at id 0, then an image grid
    (0, row, col). W in float64 keeps FLUX's float64 angles (ours within 1e-6); in float32
    the rounding of omega adds 2^-24 |theta| more."""
    axes_dim, B, H = (16, 56, 56), 2, 3
    w = rope.nd(axes_dim, 10000.0, dtype=dtype)
    assert w.shape == (64, 3) and w.dtype == dtype
    image = torch.cat([torch.zeros(48, 1), rope.grid((6, 8))], dim=1)
    ids = torch.cat([torch.zeros(5, 3), image]).expand(B, -1, -1)  # [B, N, 3]
    q, k = _qk((B, H, ids.shape[1], 128), 7)  # 128 channels, 64 pairs rotated
    freqs_cis = flux_embed_nd(ids, axes_dim, 10000.0)
    oq, ok = pf.rotary(q, k, ids, w, "interleaved", "bhnd")
    theta = float((ids.double() @ w.double().T).abs().max())
    rounding = 0.0 if dtype == torch.float64 else 2 * U32 * theta
    tol = (PHASE_ATOL + rounding) * 2 * float(q.abs().max()) + 1e-6
    for ours, t in ((oq, q), (ok, k)):
        theirs = flux_apply_rope(t, freqs_cis)
        err = float((ours - theirs).abs().max())
        assert err <= tol, f"{err:.3g} > {tol:.3g}"


def test_builders_refuse_bad_arguments():
    with pytest.raises(ValueError, match="kind must be one of"):
        rope.grid((3, 3), "cells")
    with pytest.raises(ValueError, match=r"feat_shape\[1\] must be positive"):
        rope.grid((3, 0))
    with pytest.raises(ValueError, match="ref_feat_shape"):
        rope.grid((3, 3), ref_feat_shape=(4,))
    with pytest.raises(ValueError, match="jitter must be >= 1"):
        rope.augment(rope.grid((2, 2)), jitter=0.5)
    with pytest.raises(ValueError, match="shift must be >= 0"):
        rope.augment(rope.grid((2, 2)), shift=-1.0)
    with pytest.raises(ValueError, match="head_dim must be divisible by 4"):
        rope.mixed(18, 2, 2)
    with pytest.raises(ValueError, match="give temperature"):
        rope.dinov3(32, temperature=None)
    with pytest.raises(ValueError, match=r"axes_dim\[1\] must be even"):
        rope.nd((16, 7))
    with pytest.raises(ValueError, match=r"freqs must have shape \[2, \*, \*, \*\]"):
        rope.mixed_from_timm(torch.zeros(3, 2, 2, 4))
