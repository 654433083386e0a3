"""Hugging Face transformers models with posenc_fast, one call each (tiny models built
from configs: nothing is downloaded).

1. ``floater_roberta``: a RoBERTa classifier whose only position information is FLOATER's
   Q/K/V biases (its learned position table is zeroed and frozen) learns a task that needs
   the order of its tokens, with FLOATER's larger learning rate; then the biases are frozen,
   the model is saved with save_pretrained and rebuilt with
   posenc_fast.integrations.transformers.from_pretrained: the same logits.
2. ``lff_vit``: a ViT with learnable Fourier features of its patch grid, run on an image
   size it was not built for.
3. ``lightglue``: LightGlue's positional encoder replaced by the fused LFF rotary op: the
   same cos / sin tables and the same matches.

    pip install "posenc_fast[transformers]"
    python examples/transformers_models.py     # a few seconds on a CPU
"""

import tempfile

import torch
import transformers as tf

import posenc_fast.integrations.transformers as pf_hf
from posenc_fast.integrations.attention import add_floater_biases, floater_param_groups


def order_task(n=64, length=10, seed=0):
    """Label 1 when token 5 comes before token 6 (a bag of tokens cannot tell)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(7, 40, (n, length), generator=g)
    labels = torch.randint(0, 2, (n,), generator=g)
    for i in range(n):
        a, b = torch.randperm(length - 1, generator=g)[:2] + 1  # position 0: <s>
        first, second = (min(a, b), max(a, b)) if labels[i] else (max(a, b), min(a, b))
        ids[i, first], ids[i, second] = 5, 6
    ids[:, 0] = 0
    return ids, labels


def floater_roberta(steps=50, delta_t=0.3, init_scale=1.0):
    config = tf.RobertaConfig(
        vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=40, num_labels=2,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = tf.RobertaForSequenceClassification(config)
    table = model.roberta.embeddings.position_embeddings.weight
    with torch.no_grad():
        table.zero_()  # no learned positions: FLOATER's biases are the only ones
    table.requires_grad_(False)
    # delta_t: ODE time between neighbouring positions (the paper's 0.01 suits long
    # texts; ten tokens need more to differ); init_scale: w2's, the paper's default 0.01
    biases = add_floater_biases(model, delta_t=delta_t, init_scale=init_scale)
    opt = torch.optim.AdamW(floater_param_groups(model, lr=3e-3, flow_lr_scale=10.0))
    model.train()
    losses = []
    for step in range(steps):
        ids, labels = order_task(seed=1000 + step)  # fresh examples every step
        opt.zero_grad()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    test_ids, test_labels = order_task(n=256, seed=1)
    model.eval()
    biases.freeze(ids.shape[1])  # deployment: the biases stored, no ODE solved any more
    with torch.no_grad():
        logits = model(input_ids=test_ids).logits
    accuracy = (logits.argmax(-1) == test_labels).float().mean().item()
    with tempfile.TemporaryDirectory() as path:
        model.save_pretrained(path)  # FLOATER's parameters and frozen states, its options
        loaded = pf_hf.from_pretrained(tf.RobertaForSequenceClassification, path)
        with torch.no_grad():
            reloaded = loaded(input_ids=test_ids).logits
    return {"losses": losses, "accuracy": accuracy, "logits": logits, "reloaded": reloaded}


def lff_vit():
    config = tf.ViTConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=64, num_labels=3,
    )  # fmt: skip
    torch.manual_seed(0)
    model = tf.ViTForImageClassification(config).eval()
    pf_hf.use_lff(model, gamma=2.0, fourier_dim=32, hidden_dim=16)
    with torch.no_grad():
        # 48 x 64 pixels: a 6 x 8 grid of patches, never seen; nothing is interpolated
        return model(pixel_values=torch.rand(2, 3, 48, 64), interpolate_pos_encoding=True).logits


def lightglue():
    detector = tf.SuperPointConfig(
        encoder_hidden_sizes=[8, 8, 16, 16], decoder_hidden_size=32,
        keypoint_decoder_dim=65, descriptor_decoder_dim=32, max_keypoints=32,
    )  # fmt: skip
    config = tf.LightGlueConfig(
        keypoint_detector_config=detector, descriptor_dim=32, num_hidden_layers=2,
        num_attention_heads=2,
    )  # fmt: skip
    torch.manual_seed(0)
    original = tf.LightGlueForKeypointMatching(config).eval()
    fast = tf.LightGlueForKeypointMatching(config).eval()
    fast.load_state_dict(original.state_dict())
    pf_hf.use_fast_rotary(fast)  # the same state_dict keys: checkpoints load as before
    images = torch.rand(1, 2, 1, 64, 64)
    with torch.no_grad():
        return original(images), fast(images)


def main(steps=50):
    r = floater_roberta(steps)
    print(f"RoBERTa + FLOATER: loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}, "
          f"held-out accuracy {r['accuracy']:.2f} (chance 0.5); reloaded logits equal: "
          f"{torch.allclose(r['reloaded'], r['logits'], atol=1e-6)}")  # fmt: skip
    logits = lff_vit()
    print(f"ViT + LFF on an unseen 6x8 grid: logits {tuple(logits.shape)}")
    original, fast = lightglue()
    same = torch.equal(original.matches, fast.matches)
    diff = (original.matching_scores - fast.matching_scores).abs().max().item()
    print(f"LightGlue, fused rotary: same matches {same}, largest score difference {diff:.1e}")
    return r, logits, original, fast


if __name__ == "__main__":
    main()
