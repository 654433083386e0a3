"""Figure 2 of the LFF paper: similarity of the centre position to every other position of
a 2-D grid, as the dot product of their encodings.

(a) Sine-2D, the concatenation of per-axis sinusoidal encodings: similarity decays along
    the axes and much faster along the diagonals.
(b) learnable Fourier features at initialisation (W_r ~ N(0, gamma^-2)): the dot product
    approximates a Gaussian kernel of the L2 distance, the same decay in every direction.

    python examples/similarity_heatmaps.py [out.png]      # needs matplotlib
"""

import sys

import torch

import posenc_fast as pf


def similarities(size=64, dim=128, gamma=8.0):
    coords = pf.grid_positions(size, size, normalize=False).double()  # [size^2, 2]
    centre = (size // 2) * size + size // 2
    sine = pf.sinusoidal_nd(coords, dim // 2, base=size * 10.0)  # [size^2, dim]
    sine_sim = sine @ sine[centre] / (sine[centre] @ sine[centre])
    torch.manual_seed(0)
    lff = pf.LearnableFourierFeatures(2, 4096, 1, 4096, mlp=False, gamma=gamma, dtype=torch.float64)
    with torch.no_grad():
        r = lff(coords[:, None, :])  # [size^2, F]; r_x . r_x = 1/2
        lff_sim = 2 * r @ r[centre]  # -> exp(-|x - c|^2 / (2 gamma^2))
    return sine_sim.reshape(size, size), lff_sim.reshape(size, size)


def main(path="similarity_heatmaps.png"):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sine_sim, lff_sim = similarities()
    fig, axes = plt.subplots(1, 2, figsize=(9, 4.2))
    for ax, img, title in zip(
        axes, (sine_sim, lff_sim), ("(a) Sine-2D (concatenation)", "(b) Learnable Fourier features")
    ):
        im = ax.imshow(img.numpy(), cmap="viridis")
        ax.set_title(title)
        ax.set_xticks([])
        ax.set_yticks([])
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.suptitle("similarity of the centre position to every other position")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"written {path}")
    return path


if __name__ == "__main__":
    main(*sys.argv[1:])
