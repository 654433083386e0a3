"""FLOATER in ``python -m posenc_fast bench`` (its check in ``verify`` is
``verify.check_floater``).

- bench (:func:`bench_cases`): S = 12 states, H = d, times i * 0.01, five steps of the
  3/8 rule per interval ("rk38", i.e. torchdiffeq's "rk4"), ReLU: L in {64, 512}, d in
  {16, 128}. Besides the plain loop as users write it ("eager", working dtype; and
  torch.compile of its step: the loop itself stays eager, dynamo would otherwise unroll
  thousands of steps), the baselines are torchdiffeq's ``odeint`` (gradients by autograd
  through its steps) and ``odeint_adjoint`` (continuous adjoint, the same fixed grid
  backwards), both given exactly our step grid, so every implementation does the same
  number of steps.
"""

from __future__ import annotations

import torch

from .. import _testing
from ..ops.floater import floater
from ..ops.floater import reference as ref
from ..tolerances import mismatch
from ._cases import BenchCase, Impl, _available

BENCH_STATES = 12
BENCH_DELTA_T = 0.01
BENCH_SUBSTEPS = 5


# -- bench ---------------------------------------------------------------------------------


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
def plain_floater(p0, w1, b1, w2, b2, times, substeps: int = BENCH_SUBSTEPS):
    """The benchmark's eager baseline: the plain loop in the working dtype. Under
    torch.compile only ``_plain_step`` is compiled (recursive=False keeps this loop eager),
    which is the compiled baseline docs/performance.md asks for: a compiled step in a loop."""
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


def _grid(times: torch.Tensor, K: int) -> torch.Tensor:
    """Our step grid from times[0]: K equal steps per interval, the sample times on it."""
    prev = times[:-1]
    h = (times[1:] - prev) / K
    inner = prev[:, None] + torch.arange(1, K, dtype=times.dtype, device=times.device) * h[:, None]
    return torch.cat([times[:1], torch.cat([inner, times[1:, None]], 1).reshape(-1)])


class _TorchdiffeqDynamics(torch.nn.Module):
    """h(t, p) for torchdiffeq, reading the benchmark's own weight tensors."""

    def __init__(self, w1, b1, w2, b2):
        super().__init__()
        self.weights = (w1, b1, w2, b2)

    def forward(self, t, p):
        w1, b1, w2, b2 = self.weights
        d, H = p.shape[1], w1.shape[1]
        return torch.relu(p @ w1[:d] + t * w1[d] + b1) @ w2[:H] + t * w2[H] + b2


def _torchdiffeq_baselines(p0, w1, b1, w2, b2, times, K) -> dict:
    """torchdiffeq's odeint and odeint_adjoint on our step grid: name -> closure returning
    [L, S, d] (benchmarks/floater_gpu.py calls them too)."""
    try:
        from torchdiffeq import odeint, odeint_adjoint
    except ImportError:
        return {}
    func = _TorchdiffeqDynamics(w1, b1, w2, b2)
    grid = _grid(times, K)

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


def bench_inputs(S: int, d: int, L: int, dtype, device: str, seed: int):
    """(p0, w1, b1, w2, b2, times) of the FLOATER benchmarks (this module's ``bench`` and
    benchmarks/floater_gpu.py): H = d, ``_testing``'s random states and weights with w1
    scaled by 0.5 and w2 by 0.3, times i * BENCH_DELTA_T."""
    case = _testing.FloaterCase(S, d, d, L)
    p0, w1, b1, w2, b2, _ = _testing.floater_inputs(case, dtype, device, seed)
    # Weights of the default initialisation's scale for w1 and a moderate w2: the states
    # stay O(1) over the whole range (no overflow in float32 at L = 512).
    with torch.no_grad():
        w1.mul_(0.5)
        w2.mul_(0.3)
    times = (torch.arange(L, dtype=torch.float64, device=device) * BENCH_DELTA_T).to(dtype)
    return p0, w1, b1, w2, b2, times


def floater_case(
    L: int, d: int, device: str, dtype=torch.float32, S: int = BENCH_STATES
) -> BenchCase:
    K = BENCH_SUBSTEPS
    *weights, times = bench_inputs(S, d, L, dtype, device, seed=L + d)
    leaves = [t.requires_grad_(True) for t in weights]

    def eager(p0, w1, b1, w2, b2):
        return plain_floater(p0, w1, b1, w2, b2, times, K)

    def spec():
        w64 = [t.detach().double() for t in leaves]
        return ref.floater(*w64, times.double(), K, "rk38", "relu")

    impls = {
        name: Impl(
            lambda name=name: floater(*leaves, times, K, "rk38", "relu", backend=name), leaves
        )
        for name in _available("floater", device, dtype)
    }
    return BenchCase(
        "floater",
        f"S={S} L={L} d={d} H={d} K={K} rk38 {str(dtype)[6:]}",
        L,
        {"S": S, "L": L, "d": d, "H": d, "substeps": K, "method": "rk38", "dtype": str(dtype)[6:]},
        eager,
        tuple(leaves),
        leaves,
        spec,
        impls,
        baselines={  # [L, S, d]: layout gives the spec's [S, L, d]
            name: Impl(fn, leaves, lambda y: y.transpose(0, 1))
            for name, fn in _torchdiffeq_baselines(*leaves, times, K).items()
        },
        # latency-bound (a chain of L*K*4 dependent small layers): no byte or GEMM floor
        extra={"steps": L * K, "dependent_layers": L * K * 4 * 2},
    )


def bench_cases(quick: bool, device: str, sizes=None) -> list[BenchCase]:
    """The FLOATER cases of ``bench``; ``sizes``: (L, d) pairs replacing the default set
    (``bench --floater-sizes``, e.g. benchmarks/RESULTS.md's L = 512, d = H in {64, 512})."""
    if sizes is None:
        # quick: one small case. The many-op baselines (torchdiffeq, the plain loop) make
        # the bench's profiler-based peak-memory pass slow, tens of seconds per case on 2
        # cores.
        sizes = [(64, 16)] if quick else [(64, 16), (64, 128), (512, 16), (512, 128)]
        if device == "cuda" and not quick:
            sizes.append((1024, 512))  # docs/performance.md's FLOATER case
    return [floater_case(L, d, device) for L, d in sizes]


def agreement(case: BenchCase) -> str:
    """'' when every implementation of a bench case agrees with the eager loop, else why
    (a quick check that the baselines integrate the same problem)."""
    with torch.no_grad():
        want = case.eager(*case.args)
        for name, impl in {**case.backends, **case.baselines}.items():
            got = impl.fn()
            if impl.layout is not None:
                got = impl.layout(got)
            msg = mismatch(got, want, want.dtype, "floater")
            if msg:
                return f"{name}: {msg}"
    return ""
