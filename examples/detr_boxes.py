"""DETR-style encoding: a 2-D feature map with Sine-2D positions (added in one pass by
SinusoidalNdPE), and boxes encoded as G = 2 groups of (x, y) corners by learnable Fourier
features (the LFF paper's Sec. 4.3 / UI experiments use the same grouping: one MLP shared
by the two corners).

    python examples/detr_boxes.py        # a second on a CPU
"""

import torch
from torch import nn

import posenc_fast as pf


def grid_coords(h, w, device=None):
    """Sine-2D positions of an h x w feature map: 2 x (row, col) cell index, so that the
    highest frequency (1 radian per unit) turns 2 radians between neighbouring cells
    (docs/ops/encodings.md, "Choosing base")."""
    return 2.0 * pf.grid_positions(h, w, normalize=False, device=device)  # [h*w, 2]


class BoxDecoder(nn.Module):
    def __init__(self, dim=64):
        super().__init__()
        self.dim = dim
        # base = the extent of the positions: maps up to 32 cells a side (2 x 32 units)
        self.map_pe = pf.SinusoidalNdPE(dim, axes=2, base=64.0)
        # boxes: G = 2 groups (top-left, bottom-right) of M = 2 coordinates in (0, 1)
        self.box_pe = pf.LearnableFourierFeatures(
            pos_dim=2, fourier_dim=64, hidden_dim=32, out_dim=dim, groups=2, gamma=0.1
        )
        self.layer = nn.TransformerDecoderLayer(dim, nhead=4, dim_feedforward=128, batch_first=True)
        self.score = nn.Linear(dim, 1)

    def forward(self, feature_map, boxes):
        # feature_map [B, dim, h, w]; boxes [B, Q, 2, 2] as ((x0, y0), (x1, y1))
        _B, _C, h, w = feature_map.shape
        memory = feature_map.flatten(2).transpose(1, 2)  # [B, h*w, C]
        memory = self.map_pe(memory, grid_coords(h, w, feature_map.device))  # + Sine-2D
        queries = self.box_pe(boxes)  # [B, Q, C]: group 0 -> [:C/2], group 1 -> [C/2:]
        return self.score(self.layer(queries, memory)).squeeze(-1)  # [B, Q]


def main():
    torch.manual_seed(0)
    model = BoxDecoder()
    feature_map = torch.randn(2, 64, 10, 12)
    corners = torch.rand(2, 16, 2, 2).sort(dim=2).values  # x0 <= x1, y0 <= y1
    scores = model(feature_map, corners)
    scores.sum().backward()
    grads = {n: p.grad is not None for n, p in model.box_pe.named_parameters()}
    print(f"scores {tuple(scores.shape)}, box encoder gradients: {grads}")
    return scores, grads


if __name__ == "__main__":
    main()
