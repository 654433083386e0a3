"""The README's examples give useful encodings: its own ViT (LFF) and Sine-2D code, run
as written, gives neighbouring grid cells measurably different encodings (the bounds the
README's "Choosing gamma and base" states), where the earlier examples' normalised
positions gave 0.9975 (LFF, gamma = 1) and 0.99992 (Sine-2D, base 10000)."""

import pathlib
import re

import torch
from _helpers import neighbour_similarity

import posenc_fast as pf

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
LFF_BOUND = 0.93  # features: exp(-1/8) = 0.88 at gamma = 2 patches, +- ~0.02 (256 features)
SINE_BOUND = 0.9  # Sine-2D: 0.89 for 2 x cell index, base 64 (deterministic)


def _run_readme_block(marker: str) -> dict:
    """Execute the README's ```python block that contains ``marker``; its namespace."""
    blocks = re.findall(r"```python\n(.*?)\n```", README.read_text(), flags=re.S)
    (block,) = [b for b in blocks if marker in b]
    namespace = {"torch": torch, "pf": pf}
    exec(compile(block, f"README.md block with {marker!r}", "exec"), namespace)
    return namespace


def test_readme_vit_example_gives_distinct_neighbours():
    torch.manual_seed(0)
    ns = _run_readme_block("grid_positions(14, 14")
    pos, pe = ns["pos"], ns["pe"]
    assert pos.shape == (196, 2)
    features = pf.lff(pos[:, None, :], pe.wr)  # the Fourier features alone
    assert neighbour_similarity(features, 14, 14) < LFF_BOUND
    with torch.no_grad():
        out = pe(pos[:, None, :])  # the initial encoding the tokens receive
    assert neighbour_similarity(out, 14, 14) < LFF_BOUND
    # and the scale of a learned table at initialisation (timm: std 0.02)
    assert 0.013 < out.std(dim=0).square().mean().sqrt().item() < 0.027


def test_readme_sine2d_example_gives_distinct_neighbours():
    ns = _run_readme_block("sinusoidal_nd(")
    sine2d = ns["sine2d"]
    assert sine2d.shape == (1024, 256)
    assert neighbour_similarity(sine2d, 32, 32) < SINE_BOUND
    # the fused add in the same block adds exactly that table
    torch.testing.assert_close(ns["memory"], ns["feature_map"] + sine2d)


def test_the_earlier_examples_fail_these_bounds():
    """The measure can fail: the earlier README's settings exceed both bounds."""
    torch.manual_seed(0)
    pos01 = pf.grid_positions(14, 14)
    wr = pf.LearnableFourierFeatures(2, 256, 32, 768).wr  # gamma = 1
    assert neighbour_similarity(pf.lff(pos01[:, None, :], wr), 14, 14) > 0.99
    sine = pf.sinusoidal_nd(pf.grid_positions(32, 32), 128)  # base 10000
    assert neighbour_similarity(sine, 32, 32) > 0.999
