"""A ViT-style encoder on a 2-D patch grid with learnable Fourier features.

The positional encoding is a function of the (row, col) coordinates of each patch, not a
table: the trained model runs unchanged on a larger grid it never saw (a learned
position-embedding table cannot: it has no rows for the new patches).

    python examples/vit_grid.py          # a few seconds on a CPU
"""

import torch
from torch import nn

import posenc_fast as pf


def patch_centres(h, w, patch, device=None):
    """[h*w, 2] pixel coordinates (row, col) of the centres of an h x w grid of patches."""
    coords = pf.grid_positions(h, w, normalize=False, device=device).float()
    return (coords + 0.5) * patch


class TinyViT(nn.Module):
    def __init__(self, patch=4, dim=64, classes=4):
        super().__init__()
        self.patch = patch
        self.embed = nn.Conv2d(1, dim, kernel_size=patch, stride=patch)
        # positions are pixel coordinates of the patch centres: G = 1 group of M = 2;
        # gamma = 2 patches of 4 pixels (docs/ops/lff.md, "Choosing gamma")
        self.pos = pf.LearnableFourierFeatures(
            pos_dim=2, fourier_dim=64, hidden_dim=32, out_dim=dim, gamma=8.0
        )
        self.block = nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=128, batch_first=True)
        self.head = nn.Linear(dim, classes)

    def forward(self, images):  # [B, 1, H, W]
        tokens = self.embed(images).flatten(2).transpose(1, 2)  # [B, h*w, dim]
        h, w = images.shape[-2] // self.patch, images.shape[-1] // self.patch
        coords = patch_centres(h, w, self.patch, images.device)
        tokens = tokens + self.pos(coords[:, None, :])  # [h*w, dim], broadcast over B
        return self.head(self.block(tokens).mean(dim=1))


def make_batch(n, size, generator):
    """Images with one bright square; the label is the quadrant it sits in."""
    images = torch.randn(n, 1, size, size, generator=generator) * 0.1
    labels = torch.randint(0, 4, (n,), generator=generator)
    half = size // 2
    for i, q in enumerate(labels.tolist()):
        r0, c0 = (q // 2) * half + half // 4, (q % 2) * half + half // 4
        images[i, 0, r0 : r0 + half // 2, c0 : c0 + half // 2] += 1.0
    return images, labels


def main(steps=60):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    model = TinyViT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _step in range(steps):
        images, labels = make_batch(32, 16, g)
        loss = nn.functional.cross_entropy(model(images), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        images, labels = make_batch(256, 16, g)
        acc = (model(images).argmax(1) == labels).float().mean().item()
        big, _big_labels = make_batch(8, 32, g)  # a 8x8 patch grid, never seen in training
        logits = model(big)
    print(f"loss {loss.item():.3f}, accuracy on 16x16 images {acc:.2f}")
    print(f"the same model on unseen 32x32 images (8x8 patches): logits {tuple(logits.shape)}")
    return loss.item(), acc, logits


if __name__ == "__main__":
    main()
