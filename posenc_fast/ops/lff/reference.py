"""Learnable Fourier features, literally (Li et al. 2021, Eq. 2-6 and Algorithm 1).

This is the specification every backend is tested against: float64 throughout, unfused,
differentiable by autograd, written to be read next to the paper.

    x  [..., G, M]   positions: G groups of M coordinates
    wr [F/2, M]      Fourier frequencies (Algorithm 1 line 1: W_r)
    w1 [F, H], b1 [H], w2 [H, D/G], b2 [D/G]   the MLP shared by all groups

    r   = [cos(x wr^T) || sin(x wr^T)] / sqrt(F)        Eq. 2 (cos block first)
    y_g = act(r w1 + b1) w2 + b2                        Algorithm 1 line 2
    PE  = concat over groups, group-major: PE[..., g*D/G + j] = y_g[..., j]   line 3

Eq. 2 of the paper writes 1/sqrt(D) for the normalisation; Algorithm 1 uses 1/sqrt(|F|),
the number of features, which we follow: then r_x . r_x = 1/2 for every x, and with many
features 2 (r_x . r_y) -> exp(-|x - y|^2 / (2 gamma^2))."""

from __future__ import annotations

import math
from typing import Optional

import torch

from . import activations


def activation(name: str, a: torch.Tensor) -> torch.Tensor:
    """act(a), the formula as written (activations.py: gelu in its erf form, gelu_tanh, relu)."""
    return activations.get(name).literal(a)


def fourier_features(
    x: torch.Tensor, wr: torch.Tensor, compute_dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """r = [cos(x wr^T) || sin(x wr^T)] / sqrt(F): [..., G, M] -> [..., G, F]."""
    x = x.to(compute_dtype)
    wr = wr.to(compute_dtype)
    num_features = 2 * wr.shape[0]
    phase = x @ wr.T  # [..., G, F/2]
    return torch.cat([torch.cos(phase), torch.sin(phase)], dim=-1) / math.sqrt(num_features)


def lff(
    x: torch.Tensor,
    wr: torch.Tensor,
    w1: Optional[torch.Tensor] = None,
    b1: Optional[torch.Tensor] = None,
    w2: Optional[torch.Tensor] = None,
    b2: Optional[torch.Tensor] = None,
    activation_name: str = "gelu",
    out_dtype: Optional[torch.dtype] = None,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Algorithm 1 in float64; the result is cast to ``out_dtype`` (default float64).

    Without the MLP (w1 is None) the features of every group are returned, concatenated
    group-major: [..., G * F]. ``compute_dtype`` other than float64 evaluates the same
    literal equations in that dtype: the plain eager-PyTorch baseline of the benchmarks,
    not a specification."""
    r = fourier_features(x, wr, compute_dtype)  # [..., G, F]
    if w1 is None:
        y = r
    else:
        c = compute_dtype
        hidden = activation(activation_name, r @ w1.to(c) + b1.to(c))  # [..., G, H]
        y = hidden @ w2.to(c) + b2.to(c)  # [..., G, D/G]
    y = y.flatten(-2)  # [..., G * width], group-major
    return y if out_dtype is None else y.to(out_dtype)


def kl_regularizer(wr: torch.Tensor, target_var: torch.Tensor) -> torch.Tensor:
    """Appendix Eq. 9: KL(N(mu, sigma^2) || N(0, target_var)) of the entries of wr.

    L = -1/2 (1 - log target_var + log sigma^2 - (sigma^2 + mu^2) / target_var),
    with mu and sigma^2 the empirical (population) mean and variance of wr."""
    w = wr.to(torch.float64).flatten()
    mu = w.mean()
    var = ((w - mu) ** 2).mean()
    t = target_var.to(torch.float64)
    return -0.5 * (1.0 - torch.log(t) + torch.log(var) - (var + mu**2) / t)
