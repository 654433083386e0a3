"""The benchmarks' eager baselines: every op as users write it in PyTorch. Not the
specification (the float64 reference is): their phases carry float32 rounding."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..ops.lff import activations


class EagerLFF(nn.Module):
    """x [..., G, M] -> [..., G * Dg] as the public LFF modules compute it: Wr as a bias-free
    nn.Linear, cat(cos, sin) / sqrt(F), then Linear, activation, Linear."""

    def __init__(self, M: int, F: int, H: int, Dg: int, activation: str = "gelu"):
        super().__init__()
        self.wr = nn.Linear(M, F // 2, bias=False)
        act = activations.get(activation).module()
        self.mlp = nn.Sequential(nn.Linear(F, H), act, nn.Linear(H, Dg))
        self.scale = 1.0 / math.sqrt(F)

    def forward(self, x: Tensor) -> Tensor:
        projected = self.wr(x)  # [..., G, F/2]
        feats = torch.cat([torch.cos(projected), torch.sin(projected)], dim=-1) * self.scale
        mlp_dtype = self.mlp[0].weight.dtype
        if self.wr.weight.dtype != mlp_dtype:  # float32 phases, a half-precision MLP
            feats = feats.to(mlp_dtype)
        return self.mlp(feats).flatten(-2)

    @classmethod
    def from_weights(cls, wr, w1, b1, w2, b2, activation: str = "gelu", phase_dtype=None):
        """The module holding copies of posenc_fast's weights (wr [F/2, M], w1 [F, H], b1,
        w2 [H, Dg], b2); Wr and the phases in ``phase_dtype`` (default the weights')."""
        m = cls(wr.shape[1], 2 * wr.shape[0], w1.shape[1], w2.shape[1], activation)
        m = m.to(device=wr.device, dtype=wr.dtype)
        if phase_dtype is not None:
            m.wr.to(phase_dtype)
        with torch.no_grad():
            m.wr.weight.copy_(wr)
            m.mlp[0].weight.copy_(w1.T)
            m.mlp[0].bias.copy_(b1)
            m.mlp[2].weight.copy_(w2.T)
            m.mlp[2].bias.copy_(b2)
        return m


class EagerSinusoidal(nn.Module):
    """positions [...] -> [..., dim]: the usual div_term table, interleaved sin / cos."""

    def __init__(self, dim: int, base: float = 10000.0, device=None):
        super().__init__()
        self.dim = dim
        div_term = torch.exp(
            torch.arange(0, dim, 2, dtype=torch.float32, device=device) * (-math.log(base) / dim)
        )
        self.register_buffer("div_term", div_term)

    def forward(self, positions: Tensor) -> Tensor:
        angle = positions.to(self.div_term.dtype).unsqueeze(-1) * self.div_term  # [..., dim/2]
        pe = torch.zeros(*positions.shape, self.dim, dtype=angle.dtype, device=angle.device)
        pe[..., 0::2] = torch.sin(angle)
        pe[..., 1::2] = torch.cos(angle)
        return pe


class EagerDFT(nn.Module):
    """positions [...] -> [..., dim]: Idé et al.'s Eq. 21 by a matmul and torch.cat."""

    def __init__(self, dim: int, device=None):
        super().__init__()
        self.dim = dim
        K = dim // 2 - 1
        w = 2.0 * math.pi / dim * torch.arange(1, K + 1, dtype=torch.float32, device=device)
        self.register_buffer("w", w[None, :])  # [1, K]: the basis frequencies as a row

    def forward(self, positions: Tensor) -> Tensor:
        s = positions.to(self.w.dtype).unsqueeze(-1)  # [..., 1]
        angle = s @ self.w  # [..., K]
        amp = math.sqrt(2.0 / self.dim)
        return torch.cat(
            [
                torch.full_like(s, 1.0 / math.sqrt(self.dim)),
                amp * torch.cos(angle),
                amp * torch.sin(angle),
                torch.cos(math.pi * s) / math.sqrt(self.dim),
            ],
            dim=-1,
        )


class EagerAdd(nn.Module):
    """x [..., L, dim] + table(0..L-1), the table computed in every call."""

    def __init__(self, table: nn.Module):
        super().__init__()
        self.table = table

    def forward(self, x: Tensor) -> Tensor:
        positions = torch.arange(x.shape[-2], device=x.device)
        return x + self.table(positions).to(x.dtype)


class EagerCachedAdd(nn.Module):
    """x [..., L, dim] + pe[:L], pe a buffer: the tutorial ``PositionalEncoding``."""

    def __init__(self, table: nn.Module, max_len: int, dtype, device=None):
        super().__init__()
        pe = table(torch.arange(max_len, device=device)).to(dtype)
        self.register_buffer("pe", pe)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.pe[: x.shape[-2]]


def table_module(kind: str, dim: int, device=None) -> nn.Module:
    return EagerDFT(dim, device) if kind == "dft" else EagerSinusoidal(dim, device=device)


def rotate_half(t: Tensor) -> Tensor:
    """(t0, t1, t2, t3, ...) -> (-t1, t0, -t3, t2, ...): LightGlue's channel pairs."""
    pairs = t.unflatten(-1, (-1, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


def apply_cached_rotary(table: Tensor, t: Tensor) -> Tensor:
    """t rotated by a table [2, ..., F] of cos / sin (LightGlue's per-layer rotation)."""
    return t * table[0] + rotate_half(t) * table[1]


class EagerRotary(nn.Module):
    """LightGlue's rotary encoding restated (tests/rotary/test_rotary.py names the commit):
    ``table(x)`` [2, B, 1, N, F] of cos / sin on channel pairs, from x [B, N, M]."""

    def __init__(self, M: int, F: int):
        super().__init__()
        self.wr = nn.Linear(M, F // 2, bias=False)

    def table(self, x: Tensor) -> Tensor:
        phases = self.wr(x)
        return torch.stack((phases.cos(), phases.sin())).unsqueeze(-3).repeat_interleave(2, -1)

    def forward(self, q: Tensor, k: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
        table = self.table(x)
        return apply_cached_rotary(table, q), apply_cached_rotary(table, k)

    @classmethod
    def from_weights(cls, wr: Tensor) -> EagerRotary:
        """The module holding a copy of posenc_fast's ``wr`` [F/2, M] (nn.Linear's [out, in])."""
        m = cls(wr.shape[1], 2 * wr.shape[0]).to(device=wr.device, dtype=wr.dtype)
        with torch.no_grad():
            m.wr.weight.copy_(wr)
        return m


# The rotary families as timm 1.0.31's Eva attention runs them (timm/layers/pos_embed_sincos.py,
# timm/models/eva.py), restated to run without timm; tests/rotary/test_rotary_baselines.py
# checks them against timm.


def timm_rot(x: Tensor) -> Tensor:
    """timm's ``rot``: (x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)."""
    return torch.stack([-x[..., 1::2], x[..., ::2]], -1).reshape(x.shape)


def timm_rope_rotate_half(x: Tensor) -> Tensor:
    """timm's ``rope_rotate_half``: (x1, x2) halves -> (-x2, x1)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def timm_apply_rot_embed_cat(x: Tensor, emb: Tensor, half: bool = False) -> Tensor:
    """timm's ``apply_rot_embed_cat``: emb = cat([sin, cos], -1), result in x's dtype."""
    sin_emb, cos_emb = emb.chunk(2, -1)
    rotated = timm_rope_rotate_half(x) if half else timm_rot(x)
    return (x * cos_emb + rotated * sin_emb).to(dtype=x.dtype)


def timm_rope_layout(x: Tensor, rotate_half: bool = False) -> Tensor:
    """timm's ``_rope_layout``: per-frequency values to the half or interleaved layout."""
    if rotate_half:
        return torch.cat([x, x], dim=-1)
    return x.repeat_interleave(2, -1)


def timm_eva_rotate(q: Tensor, k: Tensor, rope: Tensor, prefix: int, half: bool):
    """EvaAttention's rotation: tokens after ``prefix`` rotated, the prefix joined back."""
    q = torch.cat(
        [q[:, :, :prefix, :], timm_apply_rot_embed_cat(q[:, :, prefix:, :], rope, half)], 2
    )
    k = torch.cat(
        [k[:, :, :prefix, :], timm_apply_rot_embed_cat(k[:, :, prefix:, :], rope, half)], 2
    )
    return q, k


def timm_axial_table(coords: Tensor, bands: Tensor, rotate_half: bool = False) -> Tensor:
    """RotaryEmbeddingCat's table [N, 4 * nb] = cat([sin, cos]) of coordinates [N, ndim]
    (timm's ``_build_grid``, flattened) and bands [nb] (``build_rotary_pos_embed``)."""
    pos = coords.unsqueeze(-1) * bands  # [N, ndim, nb]
    sin_emb = timm_rope_layout(pos.sin().flatten(-2), rotate_half)
    cos_emb = timm_rope_layout(pos.cos().flatten(-2), rotate_half)
    return torch.cat([sin_emb, cos_emb], -1)


def timm_mixed_table(freqs: Tensor, t_x: Tensor, t_y: Tensor) -> Tensor:
    """RotaryEmbeddingMixed's ``get_mixed_freqs``: freqs [2, ..., F/2] (a block's slice of
    the parameter), t_x, t_y [N] -> [..., N, 2F] = cat([sin, cos]) in freqs' dtype."""
    dtype = freqs.dtype
    freqs, t_x, t_y = freqs.float(), t_x.float(), t_y.float()
    combined = t_x.unsqueeze(-1) * freqs[0].unsqueeze(-2) + t_y.unsqueeze(-1) * freqs[1].unsqueeze(
        -2
    )
    sin_emb = timm_rope_layout(combined.sin())
    cos_emb = timm_rope_layout(combined.cos())
    return torch.cat([sin_emb, cos_emb], dim=-1).to(dtype)


def timm_dinov3_table(coords: Tensor, periods: Tensor, rotate_half: bool = True) -> Tensor:
    """RotaryEmbeddingDinoV3's ``_create_embed``: coords [N, 2], periods [F/4] -> [N, 2F]."""
    angles = (2 * math.pi * coords[:, :, None].to(periods.dtype) / periods[None, None, :]).flatten(
        1
    )
    sin = timm_rope_layout(angles.sin(), rotate_half)
    cos = timm_rope_layout(angles.cos(), rotate_half)
    return torch.cat([sin, cos], dim=-1)


class EagerTableRotary(nn.Module):
    """Axial (EVA-02, RoPE-ViT) and DINOv3 in one Eva block: the table cat([sin, cos]) a
    prebuilt buffer (cached by timm, or built once per forward for all blocks)."""

    def __init__(self, table: Tensor, prefix: int, half: bool):
        super().__init__()
        self.register_buffer("table", table)
        self.prefix, self.half = prefix, half

    def forward(self, q: Tensor, k: Tensor):
        return timm_eva_rotate(q, k, self.table, self.prefix, self.half)


class EagerMixedRotary(nn.Module):
    """RoPE-Mixed in one Eva block: the table built each forward from freqs [2, heads, F/2]."""

    def __init__(self, freqs: Tensor, prefix: int):
        super().__init__()
        self.freqs = nn.Parameter(freqs.detach().clone())
        self.prefix = prefix

    def forward(self, q: Tensor, k: Tensor, t_x: Tensor, t_y: Tensor):
        table = timm_mixed_table(self.freqs, t_x, t_y)  # [heads, N, 2F]
        return timm_eva_rotate(q, k, table, self.prefix, False)


def flux_embed_nd(ids: Tensor, axes_dim, theta: float = 10000.0) -> Tensor:
    """FLUX's EmbedND (black-forest-labs/flux src/flux/math.py ``rope``): per axis, angles in
    float64 as 2x2 rotation matrices -> [..., 1, N, F/2, 2, 2] float32."""
    blocks = []
    for a, d in enumerate(axes_dim):
        omega = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=ids.device) / d)
        angle = ids[..., a].to(torch.float64)[..., None] * omega
        rot = torch.stack([angle.cos(), -angle.sin(), angle.sin(), angle.cos()], dim=-1)
        blocks.append(rot.unflatten(-1, (2, 2)).float())
    return torch.cat(blocks, dim=-3).unsqueeze(-5)


def flux_apply_rope(q: Tensor, k: Tensor, freqs_cis: Tensor):
    """FLUX's apply_rope (src/flux/math.py): pair rotations in float32, back in q's dtype."""
    q_ = q.float().reshape(*q.shape[:-1], -1, 1, 2)
    k_ = k.float().reshape(*k.shape[:-1], -1, 1, 2)
    q_out = freqs_cis[..., 0] * q_[..., 0] + freqs_cis[..., 1] * q_[..., 1]
    k_out = freqs_cis[..., 0] * k_[..., 0] + freqs_cis[..., 1] * k_[..., 1]
    return q_out.reshape(*q.shape).type_as(q), k_out.reshape(*k.shape).type_as(k)


class EagerFluxRotary(nn.Module):
    """FLUX's rotation in one block: ``pe`` (EmbedND, built once per forward) a buffer."""

    def __init__(self, pe: Tensor):
        super().__init__()
        self.register_buffer("pe", pe)

    def forward(self, q: Tensor, k: Tensor):
        return flux_apply_rope(q, k, self.pe)


def _plain_step(y, t, dt, w1, b1, w2, b2):
    """One 3/8-rule step of the ReLU dynamics, as a user would write it in PyTorch."""
    d, H = y.shape[1], w1.shape[1]

    def h(t, p):
        return torch.relu(p @ w1[:d] + t * w1[d] + b1) @ w2[:H] + t * w2[H] + b2

    k1 = h(t, y)
    k2 = h(t + dt / 3, y + dt * k1 / 3)
    k3 = h(t + 2 * dt / 3, y + dt * (k2 - k1 / 3))
    k4 = h(t + dt, y + dt * (k1 - k2 + k3))
    return y + dt * (k1 + 3 * (k2 + k3) + k4) / 8


@torch.compiler.disable(recursive=False)
def plain_floater(p0, w1, b1, w2, b2, times, substeps: int):
    """FLOATER's eager baseline, the plain loop. torch.compile compiles only ``_plain_step``
    (recursive=False: dynamo would unroll thousands of steps)."""
    y = p0
    states = []
    t_prev = torch.zeros((), dtype=p0.dtype, device=p0.device)
    for j in range(times.shape[0]):
        dt = (times[j] - t_prev) / substeps
        for k in range(substeps):
            y = _plain_step(y, t_prev + k * dt, dt, w1, b1, w2, b2)
        states.append(y)
        t_prev = times[j]
    return torch.stack(states, dim=1)


def step_grid(times: Tensor, K: int) -> Tensor:
    """Our step grid from times[0]: K equal steps per interval, the sample times on it."""
    prev = times[:-1]
    h = (times[1:] - prev) / K
    inner = prev[:, None] + torch.arange(1, K, dtype=times.dtype, device=times.device) * h[:, None]
    return torch.cat([times[:1], torch.cat([inner, times[1:, None]], 1).reshape(-1)])


class _TorchdiffeqDynamics(nn.Module):
    """h(t, p) for torchdiffeq, reading the benchmark's own weight tensors."""

    def __init__(self, w1, b1, w2, b2):
        super().__init__()
        self.weights = (w1, b1, w2, b2)

    def forward(self, t, p):
        w1, b1, w2, b2 = self.weights
        d, H = p.shape[1], w1.shape[1]
        return torch.relu(p @ w1[:d] + t * w1[d] + b1) @ w2[:H] + t * w2[H] + b2


def torchdiffeq_baselines(p0, w1, b1, w2, b2, times, K) -> dict:
    """torchdiffeq's odeint(_adjoint) on our step grid: name -> closure -> [L, S, d], or {}."""
    try:
        from torchdiffeq import odeint, odeint_adjoint
    except ImportError:
        return {}
    func = _TorchdiffeqDynamics(w1, b1, w2, b2)
    grid = step_grid(times, K)

    def forward_grid(f, y0, t):
        return grid

    def adjoint_grid(f, y0, t):  # the adjoint solves each interval [t1 -> t0] on its own
        g = t[0] + torch.arange(K + 1, dtype=t.dtype, device=t.device) * ((t[-1] - t[0]) / K)
        g[-1] = t[-1]
        return g

    opts = {"grid_constructor": forward_grid}
    return {
        "torchdiffeq": lambda: odeint(func, p0, times, method="rk4", options=opts),
        "torchdiffeq-adjoint": lambda: odeint_adjoint(
            func,
            p0,
            times,
            method="rk4",
            options=opts,
            adjoint_options={"grid_constructor": adjoint_grid},
            adjoint_params=(w1, b1, w2, b2),
        ),
    }
