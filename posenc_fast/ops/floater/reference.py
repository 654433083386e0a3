"""FLOATER (Liu et al. 2020), literally: the ODE of its Eq. 8 integrated one solver step
after another in float64. This is the specification every FLOATER backend is tested
against; autograd through its loop is the exact discrete adjoint the backends write by hand.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

METHODS = ("rk4", "rk38", "midpoint", "euler")
ACTIVATIONS = ("relu", "tanh", "gelu", "identity")

# The tensors of every FLOATER call, in order (the custom ops' schemas are built from these
# and FloaterOptions' fields, op.py):
#   p0 [S, d]     the initial value of each of the S states (one per block / projection)
#   w1 [d+1, H], b1 [H], w2 [H+1, d], b2 [d]     the dynamics, shared by all states
#   times [L]     sample times, non-decreasing, >= 0
TENSORS = ("p0", "w1", "b1", "w2", "b2", "times")


class FloaterOptions(NamedTuple):
    """How the ODE is integrated: ``substeps`` steps of ``method`` per interval, the dynamics'
    ``activation`` (the ops' schemas take the three scalars, ``*options``)."""

    substeps: int = 5
    method: str = "rk4"
    activation: str = "relu"


# Each method is one explicit Runge-Kutta step y -> y + hstep * sum_i b_i k_i ("rk38" is
# the 3/8 rule, torchdiffeq's "rk4").
Dynamics = Callable[[Tensor, Tensor], Tensor]  # h(t, y): (0-d time, [S, d]) -> [S, d]


def activation(name: str, z: Tensor) -> Tensor:
    if name == "relu":
        return torch.clamp(z, min=0.0)
    if name == "tanh":
        return torch.tanh(z)
    if name == "gelu":  # erf form
        return 0.5 * z * (1.0 + torch.erf(z / math.sqrt(2.0)))
    if name == "identity":
        return z
    raise ValueError(f"activation must be one of {', '.join(map(repr, ACTIVATIONS))}; got {name!r}")


def euler_step(h: Dynamics, t: Tensor, y: Tensor, dt: Tensor) -> Tensor:
    return y + dt * h(t, y)


def midpoint_step(h: Dynamics, t: Tensor, y: Tensor, dt: Tensor) -> Tensor:
    k1 = h(t, y)
    k2 = h(t + dt / 2, y + dt / 2 * k1)
    return y + dt * k2


def rk4_step(h: Dynamics, t: Tensor, y: Tensor, dt: Tensor) -> Tensor:
    k1 = h(t, y)
    k2 = h(t + dt / 2, y + dt / 2 * k1)
    k3 = h(t + dt / 2, y + dt / 2 * k2)
    k4 = h(t + dt, y + dt * k3)
    return y + dt * (k1 + 2 * k2 + 2 * k3 + k4) / 6


def rk38_step(h: Dynamics, t: Tensor, y: Tensor, dt: Tensor) -> Tensor:
    k1 = h(t, y)
    k2 = h(t + dt / 3, y + dt * k1 / 3)
    k3 = h(t + 2 * dt / 3, y + dt * (-k1 / 3 + k2))
    k4 = h(t + dt, y + dt * (k1 - k2 + k3))
    return y + dt * (k1 + 3 * k2 + 3 * k3 + k4) / 8


STEPS: dict[str, Callable[[Dynamics, Tensor, Tensor, Tensor], Tensor]] = {
    "euler": euler_step,
    "midpoint": midpoint_step,
    "rk4": rk4_step,
    "rk38": rk38_step,
}


def dynamics(w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, activation_name: str) -> Dynamics:
    """h(t, p) = act(p w1[:d] + t w1[d] + b1) w2[:H] + t w2[H] + b2, for p [S, d]."""
    d, H = w2.shape[1], w1.shape[1]

    def h(t: Tensor, p: Tensor) -> Tensor:
        a = activation(activation_name, p @ w1[:d] + t * w1[d] + b1)
        return a @ w2[:H] + t * w2[H] + b2

    return h


def floater(
    p0, w1, b1, w2, b2, times, substeps=5, method="rk4", activation_name="relu",
    out_dtype: Optional[torch.dtype] = None, compute_dtype: torch.dtype = torch.float64,
) -> Tensor:  # fmt: skip
    """p(times) for every state, [S, L, d], integrated in ``compute_dtype`` (float64: the
    specification; another dtype gives the plain-PyTorch baseline of the benchmarks), cast
    to ``out_dtype`` (default: the compute dtype).

    Interval j runs from t_prev = (0 if j == 0 else times[j-1]) to times[j] in
    ``substeps`` equal steps; the state entering interval j > 0 is out[:, j-1], and
    out[:, j] is the state after it. With times i * delta_t (the paper's t_i), interval 0
    has length zero and out[:, 0] = p0."""
    c = compute_dtype
    h = dynamics(w1.to(c), b1.to(c), w2.to(c), b2.to(c), activation_name)
    step = STEPS[method]
    T = times.to(c)
    y = p0.to(c)
    states = []
    t_prev = torch.zeros((), dtype=c, device=p0.device)
    for j in range(T.shape[0]):
        dt = (T[j] - t_prev) / substeps
        for k in range(substeps):
            y = step(h, t_prev + k * dt, y, dt)
        states.append(y)
        t_prev = T[j]
    if states:
        out = torch.stack(states, dim=1)
    else:
        # L = 0: an empty result still depending on every input (zero gradients, as the
        # other backends give, not a tensor without a graph).
        anchor = sum(t.sum() for t in (w1, b1, w2, b2, T)) * 0.0
        out = y.new_empty((y.shape[0], 0, y.shape[1])) + y[:, None, :0].sum() + anchor
    return out if out_dtype is None else out.to(out_dtype)


def forward(p0, w1, b1, w2, b2, times, options: FloaterOptions) -> Tensor:
    """The registry's interface (registry.py): :func:`floater` in float64, returned in
    p0's dtype."""
    return floater(p0, w1, b1, w2, b2, times, *options, p0.dtype)
