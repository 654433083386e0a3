"""No leaks, no growth: 10,000 calls of each op of the cpp backend, forward and backward,
with shapes that change from call to call, leave the process's resident memory, its open
file descriptors and the memory the extension keeps (the spare block of the FLOATER tape,
csrc/cpu/spare.h; a Floater module's result cache) where they were after one round of the
shapes. A leak of 100 bytes per call would grow the process by 1 MB over the 10,000 calls:
the bound is 1.5 MiB per op.

Resident memory means nothing under AddressSanitizer (its quarantine holds freed memory):
there tools/check_sanitizers.sh runs the calls and only the other bounds are checked.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
from _cpu_kernels import EXT

import posenc_fast as pf
from posenc_fast.cli import _inputs
from posenc_fast.cli._inputs import FloaterCase, floater_inputs
from posenc_fast.ops.floater import tape as tape_mod

pytestmark = [pytest.mark.skipif(EXT is None, reason="the C++ extension is not built")]
CALLS = 10_000
GROWTH_BOUND = 1.5 * 2**20  # bytes of resident memory over CALLS calls
SANITIZED = EXT is not None and bool(EXT.build_info().get("sanitize"))
PAGE = os.sysconf("SC_PAGESIZE")


def _ops():
    return torch.ops.posenc_fast


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _stable(calls, n=CALLS):
    """Run calls[i % len(calls)]() n times after one round of them; the resident memory
    and open files before and after."""
    for c in calls:
        c()
    gc.collect()
    before = (_rss(), _fds())
    for i in range(n):
        calls[i % len(calls)]()
    gc.collect()
    after = (_rss(), _fds())
    if not SANITIZED:
        assert after[0] - before[0] < GROWTH_BOUND, (
            f"resident memory grew by {after[0] - before[0]} bytes"
        )
    assert after[1] == before[1], f"open files: {before[1]} -> {after[1]}"


def _one_thread():
    """One thread: a call's work is microseconds, a team's fork and join would dominate."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    return before


@pytest.fixture(autouse=True)
def single_thread():
    before = _one_thread()
    yield
    torch.set_num_threads(before)


def test_lff_calls_do_not_grow():
    calls = []
    for n, G, M, F, H, D in (
        (1, 1, 2, 8, 4, 6),
        (5, 2, 3, 10, 7, 9),
        (13, 1, 1, 6, 0, 0),
        (29, 2, 2, 16, 8, 17),
    ):
        x, wr, w1, b1, w2, b2 = _inputs.lff_inputs(
            _inputs.LffCase((n,), G, M, F, H, D), torch.float32, "cpu", n
        )
        rows = x.reshape(-1, M)
        act = "gelu"
        if H:
            y = _ops().lff_kernel(rows, wr, w1, b1, w2, b2, act, torch.float32)
        else:
            y = _ops().lff_kernel(rows, wr, None, None, None, None, act, torch.float32)
        grad = torch.randn_like(y)
        mlp = (w1, b1, w2, b2) if H else (None,) * 4
        needs = [True] * 6 if H else [True, True, False, False, False, False]

        def call(rows=rows, wr=wr, mlp=mlp, grad=grad, needs=needs, act=act):
            _ops().lff_kernel(rows, wr, *mlp, act, torch.float32)
            _ops().lff_kernel_backward(grad, rows, wr, *mlp, act, needs)

        calls.append(call)
    _stable(calls)


def test_encoding_calls_do_not_grow():
    calls = []
    g = _inputs.generator(1)
    for L, dim, B in ((1, 2, 1), (7, 10, 2), (17, 6, 3), (33, 16, 1)):
        p = _inputs.rand((L,), g, -30.0, 30.0)
        x = _inputs.randn((B, L, dim), g)
        grad = _inputs.randn((L, dim), g)
        for kind in ("sinusoidal", "dft"):

            def call(p=p, x=x, grad=grad, dim=dim, kind=kind):
                _ops().encoding_kernel(p, dim, kind, 10000.0, None, torch.float32)
                _ops().encoding_add_kernel(x, p, kind, 10000.0, None)
                _ops().encoding_kernel_backward(grad, p, dim, kind, 10000.0)

            calls.append(call)
    _stable(calls)


def test_rotary_calls_do_not_grow():
    calls = []
    for case in (
        _inputs.RotaryCase(1, 2, 1, 3, 8, 8, 2),
        _inputs.RotaryCase(2, 1, 1, 9, 6, 4, 1, "bnhd"),
        _inputs.RotaryCase(1, 2, 2, 17, 12, 12, 3, shared_x=True),
    ):
        q, k, x, wr = _inputs.rotary_inputs(case, torch.float32, "cpu", 2)
        table = _ops().rotary_table_kernel(x, wr, "interleaved", torch.float32)
        gt = torch.randn_like(table)
        gq, gk = torch.randn_like(q), torch.randn_like(k)

        def call(q=q, k=k, x=x, wr=wr, gt=gt, gq=gq, gk=gk, layout=case.layout):
            _ops().rotary_table_kernel(x, wr, "interleaved", torch.float32)
            _ops().rotary_table_kernel_backward(gt, x, wr, "interleaved", True, True)
            _ops().rotary_kernel(q, k, x, wr, "interleaved", layout, 0)
            _ops().rotary_kernel_backward(gq, gk, q, k, x, wr, "interleaved", layout, 0, [True] * 4)

        calls.append(call)
    _stable(calls)


def test_floater_calls_do_not_grow_and_keep_one_tape_block():
    """The forward, the backward, the taped forward and its backward: the spare block the
    tapes come from is kept (one block, the largest tape's), never more."""
    tape_mod.release_memory()  # an earlier test's (larger) tape
    calls, tape_bytes = [], []
    for S, d, H, L in ((1, 2, 3, 2), (3, 4, 5, 3), (5, 3, 2, 4)):
        args = floater_inputs(FloaterCase(S, d, H, L), torch.float32, "cpu", seed=S)
        out = _ops().floater_integrate(*args, 1, "rk4", "tanh")
        grad = torch.randn_like(out)
        needs = [True] * 5 + [False]
        tape_bytes.append(_ops().floater_integrate_taped(*args, 1, "rk4", "tanh", L)[1].nbytes)

        def call(args=args, out=out, grad=grad, needs=needs, L=L):
            _ops().floater_integrate(*args, 1, "rk4", "tanh")
            _ops().floater_integrate_backward(grad, out, *args, 1, "rk4", "tanh", [True] * 6)
            _, tape = _ops().floater_integrate_taped(*args, 1, "rk4", "tanh", L)
            _ops().floater_integrate_backward_taped(grad, out, *args, 1, "rk4", "tanh", needs, tape)

        calls.append(call)
    _stable(calls, CALLS // 2)  # four ops per call
    kept = tape_mod.release_memory()
    assert 0 < kept <= max(tape_bytes) + 64, (kept, tape_bytes)  # the largest block, once
    assert tape_mod.release_memory() == 0


def test_public_calls_and_module_caches_do_not_grow():
    """Through the dispatcher and autograd (every op, forward and backward), and a Floater
    module in eval mode called with changing lengths: its result cache holds one entry per
    call form whatever the lengths asked."""
    g = _inputs.generator(3)
    lff_mod = pf.LearnableFourierFeatures(2, 16, 8, 12, backend="cpp")
    floater_mod = pf.Floater(4, 6, backend="cpp").eval()
    wr = torch.randn(4, 2, requires_grad=True)
    calls = []
    for n in (1, 6, 11):
        pos = _inputs.randn((n, 1, 2), g).requires_grad_()
        x = _inputs.randn((2, n, 8), g).requires_grad_()
        q, k = _inputs.randn((1, 2, n, 8), g), _inputs.randn((1, 2, n, 8), g)

        def call(pos=pos, x=x, q=q, k=k, n=n):
            y = lff_mod(pos).sum() + pf.SinusoidalPE(8, backend="cpp")(x, pos[:, 0, 0]).sum()
            y = y + pf.dft(pos[:, 0, 0], 6, backend="cpp").sum()
            oq, ok = pf.apply_lff_rotary(q, k, pos[:, 0], wr, backend="cpp")
            (y + oq.sum() + ok.sum() + pf.lff_rotary(pos[:, 0], wr, backend="cpp").sum()).backward()
            with torch.no_grad():
                floater_mod(length=n)
                floater_mod(times=torch.linspace(0.1, 1.0, n))

        calls.append(call)
    _stable(calls, 1_000)  # ~1 ms a call
    info = floater_mod.cache_info()
    assert set(info.lengths) == {"length", "times"}, info
