"""The C++ rotary kernels (csrc/rotary/rotary_cpu.cpp) beyond the shared matrix of
tests/rotary/test_rotary.py, which already runs their "cpp" rows: every instruction set and every
thread count computes the same bits, the numbers are the Triton kernels' (bitwise for the
rotations and tables, float32 rounding apart for dx / dwr), phases up to 1e5 stay within
1e-6 on every instruction set, the gradients are the derivatives of the forward (gradcheck
at float32 precision), and the low-level ops check their arguments and pass opcheck.
"""

from __future__ import annotations

import pytest
import torch
from _cpu_kernels import (
    assert_every_isa_agrees,
    cpu_isa,
    isas_here,
    threads,
)

import posenc_fast as pf
from posenc_fast.cli import _inputs
from posenc_fast.cli._inputs import RotaryCase, rotary_inputs, rotary_table_inputs
from posenc_fast.ops.rotary import reference as ref
from posenc_fast.tolerances import PHASE_ATOL

# The C++ kernels' skip marks (extension built, CPU device) apply here too.
from _cpu_kernels import pytestmark  # noqa: F401  isort: skip

# Strided q (fused qkv), fewer key heads, rotary_dim < head_dim with vector tails (F/2 = 19),
# shared positions, and enough positions for several backward blocks of several items
# (items of 64 positions, at most 16 blocks: 2 * 10 items -> 10 blocks of 2).
CASES = [
    RotaryCase(2, 3, 3, 600, 42, 38, 2, fused_qkv=True),
    RotaryCase(3, 2, 1, 150, 40, 38, 3, "bnhd", shared_x=True),
]


def ops():
    return torch.ops.posenc_fast


def _apply_all(case, dtype, backend="cpp", seed=5):
    """Outputs and every gradient of one apply_lff_rotary call, and of one table, in a list."""
    inputs = rotary_inputs(case, dtype, "cpu", seed)
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    oq, ok = pf.apply_lff_rotary(*leaves, case.layout, backend=backend)
    g = _inputs.generator(seed + 1)
    torch.autograd.backward(
        (oq, ok), (_inputs.randn(oq.shape, g, dtype), _inputs.randn(ok.shape, g, dtype))
    )
    x, wr = (
        t.detach().requires_grad_() for t in rotary_table_inputs((321, 3, 38), dtype, "cpu", 7)
    )
    table = pf.lff_rotary(x, wr, backend=backend)
    table.backward(_inputs.randn(table.shape, g, dtype))
    return [oq.detach(), ok.detach(), *(t.grad for t in leaves), table.detach(), x.grad, wr.grad]


def _all_cases(dtype, backend="cpp"):
    return [t for case in CASES for t in _apply_all(case, dtype, backend)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_instruction_set_gives_the_same_bits(dtype):
    results = _all_cases(dtype)
    assert all(t.abs().sum() > 0 for t in results)  # no all-zero output hides a difference
    assert_every_isa_agrees(lambda: _all_cases(dtype))


def test_results_do_not_depend_on_the_thread_count():
    """Items and backward blocks are fixed by the shapes, dwr's partials summed in block
    order: 1, 2 and 3 threads give the same bits."""
    runs = {}
    for n in (1, 2, 3):
        with threads(n):
            runs[n] = _all_cases(torch.float32)
    for n in (2, 3):
        for i, (a, b) in enumerate(zip(runs[1], runs[n])):
            assert torch.equal(a, b), f"output {i} differs between 1 and {n} threads"


@pytest.mark.parametrize("pairs", ["interleaved", "half"])
def test_shared_positions_split_over_batch_rows_give_the_same_bits(pairs):
    """Positions shared by the batch on a small grid (196 tokens: 4 runs) are split over
    chunks of batch rows when several threads run (the rotation and, without dx / dW, the
    backward): q', k', dq, dk equal the per-sample path's (positions expanded over the
    batch: one item per run and row) and the one-thread run's, bit for bit."""
    g = _inputs.generator(11)
    q, k = _inputs.randn((8, 197, 4, 16), g), _inputs.randn((8, 197, 4, 16), g)
    x, w = _inputs.randn((196, 2), g, scale=3.0), _inputs.randn((8, 2), g)
    grads = [_inputs.randn(q.shape, g), _inputs.randn(k.shape, g)]

    def run(positions, n):
        leaves = [t.clone().requires_grad_() for t in (q, k)]
        with threads(n):
            out = pf.rotary(*leaves, positions, w, pairs, "bnhd", 1, backend="cpp")
            torch.autograd.backward(out, grads)
        return [*(o.detach() for o in out), *(t.grad for t in leaves)]

    want = run(x.expand(8, -1, -1), 1)
    for n in (1, 2, 3):
        for i, (a, b) in enumerate(zip(run(x, n), want)):
            assert torch.equal(a, b), f"tensor {i} differs with {n} threads"


def test_rotations_and_tables_equal_the_triton_kernels(triton_interpreter):
    """Same phases and the same products, rounded at the same places: q', k', dq, dk and
    the table are the Triton interpreter's bits; dx and dwr are sums in another order."""
    for case in [CASES[0], RotaryCase(2, 2, 1, 37, 84, 80, 2)]:
        a = _apply_all(case, torch.float32, "cpp")
        b = _apply_all(case, torch.float32, "triton")
        names = ["q'", "k'", "dq", "dk", "dx", "dwr", "table", "table dx", "table dwr"]
        for name, u, v in zip(names, a, b):
            if name in ("dx", "dwr", "table dx", "table dwr"):
                err = (u - v).abs().max().item()
                assert err <= 4e-6 * v.abs().max().item(), f"{case.id} {name}: {err:.3g}"
            else:
                assert torch.equal(u, v), f"{case.id} {name}"


@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512"])
def test_phases_up_to_1e5_on_every_instruction_set(isa):
    """The table and the rotation of unit pairs within 1e-6 of float64 math on the same
    float32 inputs, |phase| up to 1e5 rad, whichever code the CPU runs."""
    if isa not in isas_here():
        pytest.skip(f"CPU lacks {isa}")
    g = _inputs.generator(21)
    wr = _inputs.randn((40, 2), g)
    x = _inputs.rand((1, 257, 2), g, -1.0, 1.0)
    x = (x * (1e5 / (x.double() @ wr.double().T).abs().max())).float()
    assert (x.double() @ wr.double().T).abs().max() > 9e4
    q = torch.zeros(1, 2, 257, 80)
    q[..., 0::2] = 1.0
    with cpu_isa(isa):
        table = pf.lff_rotary(x, wr, backend="cpp")
        oq, _ = pf.apply_lff_rotary(q, q, x, wr, backend="cpp")
    assert (table.double() - ref.lff_rotary_table(x, wr)).abs().max() <= PHASE_ATOL
    want = ref.apply_lff_rotary(q, q, x, wr, out_dtype=torch.float64)[0]
    assert (oq.double() - want).abs().max() <= PHASE_ATOL


def test_gradcheck_at_float32_precision():
    """The backward is the derivative of the C++ forward itself: central differences of the
    float32 forward (step 1e-2: truncation ~1e-4, rounding ~1e-5 relative)."""
    for case in (
        RotaryCase(2, 2, 1, 3, 7, 6, 2, "bnhd"),
        RotaryCase(2, 1, 2, 4, 4, 4, 1, shared_x=True),
    ):
        inputs = [t.requires_grad_() for t in rotary_inputs(case, torch.float32, "cpu", 11)]

        def fn(*a, layout=case.layout):
            return pf.apply_lff_rotary(*a, layout, backend="cpp")

        with pytest.warns(UserWarning, match="double precision"):
            assert torch.autograd.gradcheck(fn, inputs, eps=1e-2, atol=2e-3, rtol=2e-2)
    x, wr = (
        t.requires_grad_() for t in rotary_table_inputs((2, 5, 3, 6), torch.float32, "cpu", 12)
    )
    with pytest.warns(UserWarning, match="double precision"):
        assert torch.autograd.gradcheck(
            lambda x, wr: pf.lff_rotary(x, wr, backend="cpp"),
            (x, wr),
            eps=1e-2,
            atol=2e-3,
            rtol=2e-2,
        )


# ---------------------------------------------------------------- the low-level ops


def _apply_args():
    return list(rotary_inputs(RotaryCase(2, 2, 1, 5, 8, 6, 2), torch.float32, "cpu", 31))


@pytest.mark.parametrize(
    "mutate,exc,match",
    [
        (lambda a: a.__setitem__(0, a[0].double()), TypeError, "q must be float32, bfloat16"),
        (lambda a: a.__setitem__(1, a[1].half()), TypeError, "k must have q's dtype"),
        (lambda a: a.__setitem__(0, a[0][0]), ValueError, r"q must have shape \[B, heads, N"),
        (lambda a: a.__setitem__(1, a[1][:, :, :4]), ValueError, "k must have the batch size"),
        (lambda a: a.__setitem__(2, a[2][:, :4]), ValueError, r"x must have shape \[B, N - prefix"),
        (lambda a: a.__setitem__(2, a[2].double()), TypeError, "x must be float32"),
        (lambda a: a.__setitem__(3, a[3][:, :1]), ValueError, r"freqs must have shape \[F/2, M\]"),
        (lambda a: a.__setitem__(3, torch.randn(5, 2)), ValueError, "more than head_dim = 8"),
    ],
    ids=["q-f64", "k-dtype", "q-rank", "k-shape", "x-shape", "x-f64", "wr-shape", "wr-wide"],
)  # fmt: skip
def test_apply_kernel_checks_name_the_argument(mutate, exc, match):
    args = _apply_args()
    mutate(args)
    with pytest.raises(exc, match=match):
        _apply(*args)


def _apply(*args, layout="bhnd"):
    """The general op's LightGlue case: interleaved pairs, no prefix."""
    return ops().rotary_kernel(*args, "interleaved", layout, 0)


def _apply_backward(*args, layout="bhnd", needs=(True,) * 4):
    return ops().rotary_kernel_backward(*args, "interleaved", layout, 0, list(needs))


def test_kernel_checks_options_and_gradients():
    args = _apply_args()
    with pytest.raises(ValueError, match="layout must be 'bhnd' or 'bnhd'"):
        _apply(*args, layout="nhd")
    oq, ok = _apply(*args)
    with pytest.raises(ValueError, match="needs must have 4 entries"):
        _apply_backward(oq, ok, *args, needs=[True])
    with pytest.raises(ValueError, match="gk must have k's shape"):
        _apply_backward(oq, oq, *args)
    with pytest.raises(TypeError, match="gq must have q's dtype"):
        _apply_backward(oq.half(), ok, *args)
    x, wr = args[2], args[3]
    with pytest.raises(TypeError, match="out_dtype must be float32"):
        ops().rotary_table_kernel(x, wr, "interleaved", torch.float64)
    t = ops().rotary_table_kernel(x, wr, "interleaved", torch.float32)
    with pytest.raises(ValueError, match="grad must have the table's shape"):
        ops().rotary_table_kernel_backward(t[:1], x, wr, "interleaved", True, True)


def test_apply_kernel_checks_devices():
    """k and the gradients must be on q's device. (A call that mixes CPU and Meta tensors
    dispatches to the Meta kernel, which checks its arguments like the CPU one.)"""
    q, k, x, wr = _apply_args()
    with pytest.raises(RuntimeError, match="k must be on q's device"):
        _apply(q, k.to("meta"), x, wr)
    oq, ok = _apply(q, k, x, wr)
    with pytest.raises(RuntimeError, match="k must be on q's device"):
        _apply_backward(oq, ok, q, k.to("meta"), x, wr)
    with pytest.raises(RuntimeError, match="gk must be on q's device"):
        _apply_backward(oq, ok.to("meta"), q, k, x, wr)


def test_opcheck_low_level_ops():
    q, k, x, wr = _apply_args()
    opcheck = torch.library.opcheck
    apply_op, backward_op = ops().rotary_kernel.default, ops().rotary_kernel_backward.default
    for layout in ("bhnd", "bnhd"):
        qq, kk = (q, k) if layout == "bhnd" else (q.transpose(1, 2), k.transpose(1, 2))
        opcheck(apply_op, (qq, kk, x, wr, "interleaved", layout, 0))
        opcheck(apply_op, (qq.bfloat16(), kk.bfloat16(), x[0], wr, "interleaved", layout, 0))
    oq, ok = _apply(q, k, x, wr)
    for needs in ([True] * 4, [False, True, False, True]):
        opcheck(backward_op, (oq, ok, q, k, x, wr, "interleaved", "bhnd", 0, needs))
    opcheck(ops().rotary_table_kernel.default, (x, wr, "interleaved", torch.float16))
    t = ops().rotary_table_kernel(x, wr, "interleaved", torch.float32)
    opcheck(
        ops().rotary_table_kernel_backward.default,
        (torch.randn_like(t), x, wr, "interleaved", True, False),
    )


def test_inputs_are_not_modified_and_strides_are_honoured():
    """q, k and their gradients with any strides (here: every one transposed in memory)
    give the same bits as contiguous ones; the inputs are left as they were."""
    q, k, x, wr = _apply_args()
    before = [t.clone() for t in (q, k, x, wr)]
    strided = [t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in (q, k)]
    assert strided[0].stride(-1) != 1
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    gs = [t.transpose(0, 2).contiguous().transpose(0, 2) for t in (gq, gk)]
    a = _apply_backward(gq, gk, q, k, x, wr)
    b = _apply_backward(*gs, *strided, x, wr)
    for u, v in zip(a, b):
        assert torch.equal(u, v)
    for u, v in zip(_apply(q, k, x, wr), _apply(*strided, x, wr)):
        assert torch.equal(u, v)
    for t, b in zip((q, k, x, wr), before):
        assert torch.equal(t, b)
