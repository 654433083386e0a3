"""The scripts in examples/ run (on the CPU, in seconds) and do what they say."""

import importlib.util
import pathlib

import pytest
import torch
from _helpers import neighbour_similarity

import posenc_fast as pf

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_vit_grid_trains_and_runs_on_an_unseen_grid():
    _loss, acc, logits = _load("vit_grid").main(steps=60)
    assert acc > 0.3, "better than chance (0.25) after a few steps"
    assert logits.shape == (8, 4) and torch.isfinite(logits).all()


def test_vit_grid_encodings_distinguish_neighbouring_patches():
    """Pixel coordinates with gamma = 2 patches: neighbouring patches' features have
    cosine similarity ~exp(-1/8) = 0.88 (32 frequencies scatter it), not ~1."""
    module = _load("vit_grid")
    torch.manual_seed(0)
    model = module.TinyViT()
    coords = module.patch_centres(8, 8, model.patch)  # a 32 x 32 image
    features = pf.lff(coords[:, None, :], model.pos.wr)
    assert neighbour_similarity(features, 8, 8) < 0.95


def test_detr_boxes_backpropagates_into_the_box_encoder():
    scores, grads = _load("detr_boxes").main()
    assert scores.shape == (2, 16) and all(grads.values())


def test_detr_boxes_sine2d_distinguishes_neighbouring_cells():
    module = _load("detr_boxes")
    model = module.BoxDecoder()
    coords = module.grid_coords(10, 12)
    table = model.map_pe(torch.zeros(120, model.dim), coords)  # the Sine-2D table itself
    torch.testing.assert_close(table, pf.sinusoidal_nd(coords, model.dim // 2, base=64.0))
    assert neighbour_similarity(table, 10, 12) < 0.9


def test_similarity_heatmaps(tmp_path):
    pytest.importorskip("matplotlib")
    module = _load("similarity_heatmaps")
    sine, lff = module.similarities(size=33)
    c = 16
    # LFF: isotropic (a diagonal step of length d ~ an axis step of length d)
    assert abs(lff[c, c + 6].item() - lff[c + 4, c + 4].item()) < 0.05  # |d| = 6 vs 5.66
    assert lff[c, c].item() == pytest.approx(1.0)
    # Sine-2D: the diagonal decays much faster than the axis
    assert sine[c + 4, c + 4] < sine[c, c + 6] - 0.1
    path = module.main(str(tmp_path / "fig2.png"))
    assert pathlib.Path(path).stat().st_size > 10_000


def test_floater_attention_caches_biases_at_inference(calls):
    """The script's claims, counted independently of its profiler: one integration per
    training step, one for every eval call together, and a longer sequence integrates
    only its new positions."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: threads only add synchronisation
    try:
        steps, length = 150, 16
        r = _load("floater_attention").main(steps=steps, length=length)
    finally:
        torch.set_num_threads(threads)
    assert calls == [length] * steps + [length] + [length], calls
    assert r["train_calls"] == [length] * 3
    assert r["eval_calls"] == [length], "five eval calls, one integration"
    assert r["extension_calls"] == [length], "only the new positions are integrated"
    assert r["losses"][-1] < 0.25 * r["losses"][0]
    assert min(r["accuracy"]) > 0.5, "previous-token task learnt (chance: 1/16)"
    assert len(set(r["accuracy"])) == 1


def test_transformers_models():
    """FLOATER is the RoBERTa's only position information and it learns the order task;
    the saved and reloaded model gives the same logits; the LFF ViT runs on an unseen
    grid; LightGlue on the fused rotary op finds the same matches."""
    pytest.importorskip("transformers", reason="transformers is in the test extra")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: threads only add synchronisation
    try:
        module = _load("transformers_models")
        r, logits, original, fast = module.main(steps=50)
    finally:
        torch.set_num_threads(threads)
    assert r["losses"][-1] < 0.6 * r["losses"][0]
    assert r["accuracy"] > 0.75, "order learnt from FLOATER's biases (chance: 0.5)"
    torch.testing.assert_close(r["reloaded"], r["logits"])
    assert logits.shape == (2, 3) and torch.isfinite(logits).all()
    assert torch.equal(original.matches, fast.matches)
    torch.testing.assert_close(original.matching_scores, fast.matching_scores)
