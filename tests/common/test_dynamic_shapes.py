"""Dynamic sizes: a grid from a dynamic image size and a FLOATER length from a dynamic
sequence length, under torch.export (Dim) and torch.compile(dynamic=True). Sizes arrive
as SymInts there; a bad size still fails with an error naming the argument."""

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch.export import Dim

import posenc_fast as pf
from posenc_fast.cli import _inputs


class PatchGridLFF(nn.Module):
    """A ViT's patch embedding plus LFF of the patch grid (the pattern whose export failed:
    grid_positions got SymInt sizes)."""

    def __init__(self, patch=4, dim=16):
        super().__init__()
        self.patch = patch
        self.embed = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)
        self.pos = pf.LearnableFourierFeatures(2, 16, 8, dim)

    def forward(self, images):  # [B, 3, H, W]
        tokens = self.embed(images).flatten(2).transpose(1, 2)  # [B, h*w, dim]
        h, w = images.shape[-2] // self.patch, images.shape[-1] // self.patch
        rc = pf.grid_positions(h, w, normalize=False)  # [h*w, 2]
        return tokens + self.pos(rc[:, None, :])


def _images(h, w, patch=4):
    return _inputs.randn((2, 3, h * patch, w * patch), _inputs.generator(h * 100 + w))


def test_export_grid_positions_with_dynamic_image_size():
    model = PatchGridLFF().eval()
    hp, wp = Dim("hp", min=1, max=64), Dim("wp", min=1, max=64)
    shapes = {"images": {2: 4 * hp, 3: 4 * wp}}
    ep = torch.export.export(model, (_images(3, 5),), dynamic_shapes=shapes)
    for h, w in ((3, 5), (6, 2), (7, 7)):  # sizes other than the traced one
        images = _images(h, w)
        torch.testing.assert_close(ep.module()(images), model(images))


@pytest.mark.parametrize("normalize", [True, False])
def test_compile_grid_positions_dynamic(normalize):
    torch._dynamo.reset()

    def grid(x):
        return pf.grid_positions(x.shape[0], x.shape[1], normalize=normalize)

    compiled = torch.compile(grid, fullgraph=True, dynamic=True, backend="aot_eager")
    for h, w in ((3, 4), (5, 2)):
        x = torch.empty(h, w)
        assert torch.equal(compiled(x), grid(x))


def test_grid_positions_bad_sizes_still_fail_clearly():
    with pytest.raises(ValueError, match=r"sizes\[1\] must be positive"):
        pf.grid_positions(3, 0)
    with pytest.raises(TypeError, match=r"sizes\[0\] must be an int, got float"):
        pf.grid_positions(2.0, 3)


def test_compiled_bad_dynamic_size_fails_clearly():
    """A symbolic size is checked without being read while tracing (a recorded bound); a
    call whose size breaks it fails like the eager call, naming the argument."""
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda x: pf.grid_positions(x.shape[0] - 5, 2), dynamic=True, backend="aot_eager"
    )
    assert compiled(torch.empty(8)).shape == (6, 2)
    assert compiled(torch.empty(9)).shape == (8, 2)  # the same graph, a new size
    with pytest.raises(ValueError, match=r"sizes\[0\] must be positive, got -1"):
        compiled(torch.empty(4))


class SeqFloater(nn.Module):
    """Tokens + FLOATER encodings of their positions, FloaterAttentionBias alongside."""

    def __init__(self, dim=6):
        super().__init__()
        self.pe = pf.Floater(dim, num_states=1, hidden_dim=5, substeps=2)
        self.bias = pf.FloaterAttentionBias(dim, num_layers=2, hidden_dim=4, substeps=1)
        for i, m in enumerate((self.pe, self.bias)):
            _inputs.randomize_parameters(m, 30 + i, fan_in=True)

    def forward(self, x):  # x [B, L, dim]
        L = x.shape[1]
        return x + self.pe(length=L)[0], self.bias(L)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_export_floater_with_dynamic_length(training):
    model = SeqFloater().train(training)
    x = torch.randn(2, 7, 6)
    ep = torch.export.export(model, (x,), dynamic_shapes={"x": {1: Dim("L", min=1, max=512)}})
    model.eval()  # eager comparison; exported programs are pure functions of their inputs
    for L in (7, 3, 20):
        x = torch.randn(2, L, 6)
        got, want = ep.module()(x), model(x)
        assert got[1].shape == (2, 3, L, 6)
        torch.testing.assert_close(got, want)


def test_compile_floater_dynamic_length():
    torch._dynamo.reset()
    model = SeqFloater().train()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=counter)
    for L in (5, 9, 13):
        x = torch.randn(2, L, 6, requires_grad=True)
        got = compiled(x)
        want = model(x)
        torch.testing.assert_close(got, want)
        sum(t.sum() for t in got).backward()
    assert counter.frame_count == 1, "one graph for every length"


def test_floater_length_bad_values_still_fail_clearly():
    fl = pf.Floater(4, 2)
    with pytest.raises(ValueError, match="length must be >= 0, got -1"):
        fl(length=-1)
    with pytest.raises(TypeError, match="length must be an int, got float"):
        fl(length=3.0)
