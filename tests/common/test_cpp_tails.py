"""Every op of the cpp backend on shapes at and just past each size class of its kernels,
forward and backward, on every instruction set this CPU has and at 1 and 2 threads, against
the float64 reference, with the same bits at either thread count.

The size classes (csrc/): vectors of 4, 8 or 16 floats (baseline, AVX2, AVX-512) and their
partial tails; LFF's tiles of 48 rows, register tiles of 12/8/6/4/2/1 rows and column blocks
of 4 vectors, backward blocks of >= 96 rows; the encodings' runs of 16 positions; rotary's
runs of 64 positions and channel tails; FLOATER's chunks of up to 8 states (padded to an
even count), row tiles of 6/4/2, and its team layout (weights over 384 KiB) with panels of
64 columns; the FLOATER tape. The shapes are small (a few seconds in all): this is also the
sweep tools/check_sanitizers.sh runs under AddressSanitizer, where a read or write past a
tail is reported whatever the numbers it gives.
"""

from __future__ import annotations

import _helpers
import pytest
import torch
from _cpu_kernels import EXT, cpu_isa, isas_here, threads

import posenc_fast as pf
from posenc_fast.cli import _inputs
from posenc_fast.cli._inputs import FloaterCase, LffCase, floater_inputs
from posenc_fast.ops.encodings import reference as ref_enc
from posenc_fast.ops.floater import reference as ref_floater
from posenc_fast.ops.lff import reference as ref_lff
from posenc_fast.ops.rotary import reference as ref_rot
from posenc_fast.tolerances import assert_close

pytestmark = [pytest.mark.skipif(EXT is None, reason="the C++ extension is not built")]


def _ops():
    return torch.ops.posenc_fast


def _every_setting(run, check):
    """run() (a list of tensors) on every instruction set here, at 1 and 2 threads: each
    result passes check(result, label), and 2 threads give the 1-thread bits."""
    for isa in isas_here():
        with cpu_isa(isa):
            got = {}
            for n in (1, 2):
                with threads(n):
                    got[n] = run()
                check(got[n], f"{isa}, {n} thread(s)")
            for i, (a, b) in enumerate(zip(got[1], got[2])):
                assert torch.equal(a, b), f"{isa}: output {i} differs between 1 and 2 threads"


# ---------------------------------------------------------------- LFF
# rows R = N * G around the register tiles and the 48-row tile; F/2, H and D around 4, 8,
# 16 and 4 vectors (32 on AVX2); features only; bfloat16 / float16 storage; and enough rows
# for several tiles and backward blocks on two threads.
LFF_TAILS = [
    (LffCase((1,), 1, 1, 2, 1, 1, "relu"), torch.float32),
    (LffCase((13,), 1, 3, 10, 9, 33, "gelu"), torch.float32),
    (LffCase((49,), 1, 2, 34, 17, 40, "gelu_tanh"), torch.float32),
    (LffCase((97,), 2, 5, 18, 8, 17, "gelu"), torch.bfloat16),
    (LffCase((7,), 3, 2, 30, 0, 0), torch.float32),
    (LffCase((50,), 1, 1, 34, 0, 0), torch.float16),
    (LffCase((301,), 1, 2, 66, 19, 45, "gelu_tanh"), torch.float32),
    (LffCase((150,), 2, 3, 16, 12, 24, "relu"), torch.float16),
]


@pytest.mark.parametrize(
    "case,dtype", LFF_TAILS, ids=[f"{c.id}-{str(t)[6:]}" for c, t in LFF_TAILS]
)
def test_lff_tails(case, dtype):
    inputs = _inputs.lff_inputs(case, dtype, "cpu", seed=_helpers.seed_of(case.id))
    grad = _inputs.randn((*case.batch, case.groups * (case.group_out_dim or case.fourier_dim)),
                          _inputs.generator(1), dtype)  # fmt: skip
    present = [t for t in inputs if t is not None]

    def run():
        leaves = [t.detach().clone().requires_grad_() for t in present]
        y = pf.lff(*leaves, *[None] * (6 - len(leaves)), activation=case.activation, backend="cpp")
        y.backward(grad)
        return [y.detach(), *(t.grad for t in leaves)]

    leaves64 = [t.detach().double().requires_grad_() for t in present]
    want = ref_lff.lff(*leaves64, *[None] * (6 - len(leaves64)), case.activation)
    want.backward(grad.double())
    kind = "lff" if case.hidden_dim else "encoding"

    def check(got, label):
        assert_close(got[0], want, dtype, kind, what=f"{case.id} {label}")
        for g, leaf, name in zip(got[1:], leaves64, _helpers.LFF_NAMES):
            assert_close(g, leaf.grad, dtype, "grad", what=f"{case.id} {label} d{name}")

    _every_setting(run, check)


# ---------------------------------------------------------------- encodings
# positions around the runs of 16, dim around the vector widths, broadcast over a batch of x
ENC_TAILS = [(1, 2, 1), (15, 6, 3), (17, 10, 2), (33, 34, 1), (100, 66, 2), (16, 18, 5)]


@pytest.mark.parametrize("kind", ["sinusoidal", "dft"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_encoding_tails(kind, dtype):
    fn, module = (pf.sinusoidal, pf.SinusoidalPE) if kind == "sinusoidal" else (pf.dft, pf.DFTPE)
    g = _inputs.generator(3)
    cases = []
    for L, dim, B in ENC_TAILS:
        p = _inputs.rand((L,), g, -60.0, 60.0, dtype)
        x = _inputs.randn((B, L, dim), g, dtype)
        gy = _inputs.randn((B, L, dim), g, dtype)
        cases.append((p, x, gy, dim))

    def run():
        out = []
        for p, x, gy, dim in cases:
            pl, xl = p.clone().requires_grad_(), x.clone().requires_grad_()
            table = fn(pl, dim, backend="cpp")
            y = module(dim, backend="cpp")(xl, pl)
            ((table * gy[0]).sum() + (y * gy).sum()).backward()
            out += [table.detach(), y.detach(), pl.grad, xl.grad]
        return out

    def check(got, label):
        for i, (p, x, gy, dim) in enumerate(cases):
            table, y, dp, dx = got[4 * i : 4 * i + 4]
            p64 = p.double().requires_grad_()
            e = ref_enc.dft(p64, dim) if kind == "dft" else ref_enc.sinusoidal(p64, dim)
            ((e * gy[0].double()).sum() + (e * gy.double()).sum()).backward()
            what = f"{kind} L{p.shape[0]} dim{dim} {label}"
            kind_tol = "encoding" if dtype == torch.float32 else "lff"
            assert_close(table, e, dtype, "encoding", what=what)
            assert_close(y, x.double() + e, dtype, kind_tol, what=what)
            assert torch.equal(dx, gy)
            assert_close(dp, p64.grad, dtype, "grad", what=what)

    _every_setting(run, check)


# ---------------------------------------------------------------- rotary
# (B, heads_q, heads_k, N, head_dim, rotary_dim, M, layout, shared_x, fused_qkv): positions
# around the runs of 64, rotary dims around the vector widths, pass-through channels,
# strided q (LightGlue's fused qkv), both layouts.
ROT_TAILS = [
    _inputs.RotaryCase(1, 1, 1, 1, 2, 2, 1),
    _inputs.RotaryCase(2, 2, 1, 63, 7, 4, 3, "bnhd"),
    _inputs.RotaryCase(1, 3, 3, 65, 18, 16, 2, fused_qkv=True),
    _inputs.RotaryCase(2, 2, 2, 130, 40, 34, 2, shared_x=True),
    _inputs.RotaryCase(1, 2, 1, 64, 66, 66, 1, "bnhd", shared_x=True),
]


@pytest.mark.parametrize("case", ROT_TAILS, ids=[c.id for c in ROT_TAILS])
def test_rotary_tails(case):
    q, k, x, wr = _inputs.rotary_inputs(case, torch.float32, "cpu", _helpers.seed_of(case.id))
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, x, wr)]
    wq, wk = ref_rot.apply_lff_rotary(*leaves64, case.layout)
    wt = ref_rot.lff_rotary_table(leaves64[2], leaves64[3])
    g = _inputs.generator(2)
    gq, gk, gt = (_inputs.randn(t.shape, g) for t in (wq, wk, wt))
    ((wq * gq.double()).sum() + (wk * gk.double()).sum() + (wt * gt.double()).sum()).backward()
    scale = max(float(wq.detach().abs().max()), float(wk.detach().abs().max()))

    def run():
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, x, wr)]
        oq, ok = pf.apply_lff_rotary(*leaves, case.layout, backend="cpp")
        table = pf.lff_rotary(leaves[2], leaves[3], backend="cpp")
        ((oq * gq).sum() + (ok * gk).sum() + (table * gt).sum()).backward()
        return [oq.detach(), ok.detach(), table.detach(), *(t.grad for t in leaves)]

    def check(got, label):
        what = f"{case.id} {label}"
        assert_close(got[0], wq, torch.float32, "rotary", scale=scale, what=what)
        assert_close(got[1], wk, torch.float32, "rotary", scale=scale, what=what)
        assert_close(got[2], wt, torch.float32, "encoding", what=what)
        for gr, leaf, name in zip(got[3:], leaves64, ("q", "k", "x", "wr")):
            assert_close(gr, leaf.grad, torch.float32, "grad", what=f"{what} d{name}")

    _every_setting(run, check)


# ---------------------------------------------------------------- FLOATER
# (S, d, H, L, substeps, method, activation, dtype): chunks with odd remainders (padding
# rows) and tails of the row tiles; d and H around the vector widths; a team layout (the
# weights over 384 KiB: one chunk, columns split over the team in panels of 64) in float32
# and float64.
FLOATER_TAILS = [
    (1, 1, 1, 3, 2, "rk4", "tanh", torch.float64),
    (5, 3, 9, 4, 2, "rk38", "gelu", torch.float32),
    (7, 9, 5, 3, 1, "midpoint", "relu", torch.float64),
    (13, 17, 8, 3, 2, "euler", "identity", torch.float32),
    (17, 8, 17, 2, 1, "rk4", "gelu", torch.float64),
    (3, 230, 231, 2, 1, "rk4", "tanh", torch.float32),
    (5, 161, 163, 2, 1, "rk38", "relu", torch.float64),
]


@pytest.mark.parametrize(
    "shape", FLOATER_TAILS, ids=lambda s: "-".join(map(str, s[:7])) + str(s[7])[-2:]
)
def test_floater_tails_and_tape(shape):
    S, d, H, L, n, method, act, dtype = shape
    args = floater_inputs(FloaterCase(S, d, H, L), dtype, "cpu", seed=S + d + H)
    grad = torch.randn((S, L, d), generator=torch.Generator().manual_seed(4), dtype=dtype)
    needs = [True] * 6
    needs_taped = [True] * 5 + [False]

    def run():
        out = _ops().floater_integrate(*args, n, method, act)
        res = [out, *_ops().floater_integrate_backward(grad, out, *args, n, method, act, needs)]
        for intervals in (1, L):  # some intervals taped (the rest recomputed), every one
            taped, tape = _ops().floater_integrate_taped(*args, n, method, act, intervals)
            assert torch.equal(taped, out)
            got = _ops().floater_integrate_backward_taped(
                grad, out, *args, n, method, act, needs_taped, tape
            )
            for a, b in zip(res[1:6], got):
                assert torch.equal(a, b), f"taped backward ({intervals} intervals)"
        return res

    leaves = [a.detach().double().requires_grad_() for a in args]
    want = ref_floater.floater(*leaves, n, method, act)
    want.backward(grad.double())

    def check(got, label):
        what = f"S{S} d{d} H{H} {label}"
        assert_close(got[0], want, dtype, "floater", what=what)
        for g, leaf, name in zip(got[1:], leaves, ("p0", "w1", "b1", "w2", "b2", "times")):
            assert_close(g, leaf.grad, dtype, "grad", what=f"{what} d{name}")

    _every_setting(run, check)
