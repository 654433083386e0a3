"""The taped forward of the cpp backend (posenc_fast/ops/floater/tape.py): its backward reads
the forward's stage values instead of integrating the taped intervals again, and must give
bitwise the gradients of the backward that recomputes them; the Python path takes it for
training calls only; its size follows POSENC_FAST_FLOATER_TAPE_MB; bad tapes are refused."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from torch.library import opcheck

import posenc_fast as pf
from posenc_fast import _extension
from posenc_fast.cli._inputs import FloaterCase, floater_inputs
from posenc_fast.ops.floater import FloaterOptions
from posenc_fast.ops.floater import reference as ref
from posenc_fast.ops.floater import tape as tape_mod
from posenc_fast.tolerances import assert_close

EXT = _extension.load()
pytestmark = [
    pytest.mark.skipif(EXT is None, reason="the C++ extension is not built"),
    pytest.mark.skipif(DEVICE != "cpu", reason="the tape is the cpp backend's (CPU)"),
]
NEEDS_NO_TIMES = [True, True, True, True, True, False]


def ops():
    return torch.ops.posenc_fast


@pytest.fixture
def teams(cpu_teams):
    """Teams of two really run, even on a busy machine (csrc/cpu/parallel.h)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


# (S, d, H, L, substeps): chunks of states with an odd remainder (padding rows), one state,
# and dynamics above the L2 threshold (one chunk, regions split over columns by a team).
SHAPES = [(7, 16, 24, 5, 3), (13, 33, 20, 4, 2), (1, 5, 3, 3, 2), (9, 300, 270, 3, 1)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize(
    "method,act", [("rk4", "relu"), ("rk38", "tanh"), ("midpoint", "gelu"), ("euler", "identity")]
)
def test_taped_backward_is_bitwise_the_recomputing_one(teams, shape, dtype, method, act):
    S, d, H, L, n = shape
    args = floater_inputs(FloaterCase(S, d, H, L), dtype, "cpu", seed=S + d)
    out = ops().floater_integrate(*args, n, method, act)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
    plain = ops().floater_integrate_backward(grad, out, *args, n, method, act, NEEDS_NO_TIMES)
    for intervals in (0, 1, L):  # none, some (the rest recomputed), every interval
        taped_out, tape = ops().floater_integrate_taped(*args, n, method, act, intervals)
        assert torch.equal(taped_out, out)
        opts = FloaterOptions(n, method, act)
        assert tape.numel() == tape_mod.numel(S, d, H, intervals, opts) and tape.dtype == dtype
        got = ops().floater_integrate_backward_taped(
            grad, out, *args, n, method, act, NEEDS_NO_TIMES, tape
        )
        for name, a, b in zip(("p0", "w1", "b1", "w2", "b2"), plain, got):
            assert torch.equal(a, b), f"d{name} with {intervals} taped intervals"


def test_taped_backward_with_times_gradient_recomputes(teams):
    """The times' gradient needs the slopes, which the tape does not hold: that backward
    ignores the tape and gives the plain backward's gradients."""
    args = floater_inputs(FloaterCase(5, 8, 6, 4), torch.float64, "cpu", seed=3)
    out, tape = ops().floater_integrate_taped(*args, 2, "rk4", "gelu", 4)
    grad = torch.randn_like(out)
    plain = ops().floater_integrate_backward(grad, out, *args, 2, "rk4", "gelu", [True] * 6)
    got = ops().floater_integrate_backward_taped(
        grad, out, *args, 2, "rk4", "gelu", [True] * 6, tape
    )
    for a, b in zip(plain, got):
        assert torch.equal(a, b)


def _training_call(monkeypatch, budget_mb, dtype=torch.float32, times_grad=False):
    monkeypatch.setenv(tape_mod.TAPE_ENV, str(budget_mb))
    args = floater_inputs(FloaterCase(6, 12, 10, 5, substeps=2), dtype, "cpu", seed=9)
    leaves = [a.clone().requires_grad_(i < 5 or times_grad) for i, a in enumerate(args)]
    out = pf.floater(*leaves, 2, "rk4", "tanh", backend="cpp")
    out.backward(torch.ones_like(out))
    return out, [leaf.grad for leaf in leaves], args


def test_training_call_tapes_and_matches_reference(calls, monkeypatch):
    # calls is set up before monkeypatch, so torn down after it: monkeypatch puts back the
    # counting wrapper it found, then calls removes it (the other order left the counting
    # wrapper on FLOATER["cpp"] for the process's later tests)
    seen = []
    forward_taped = pf.ops.floater.registry.FLOATER["cpp"].forward_taped

    def spy(*args):
        out, tape = forward_taped(*args)
        seen.append(args[-1])  # intervals
        return out, tape

    monkeypatch.setattr(pf.ops.floater.registry.FLOATER["cpp"], "forward_taped", spy)
    out, grads, args = _training_call(monkeypatch, 1024, torch.float64)
    assert seen == [5]  # every interval fits
    leaves = [a.detach().requires_grad_(i < 5) for i, a in enumerate(args)]
    want = ref.floater(*leaves, 2, "rk4", "tanh")
    want.backward(torch.ones_like(want))
    assert_close(out, want, torch.float64, "floater")
    for g, leaf in zip(grads[:5], leaves):
        assert_close(g, leaf.grad, torch.float64, "grad")
    assert grads[5] is None
    # the budget in MiB: one interval of this problem takes 2 x 4 x 6 x 22 x 8 bytes
    per = tape_mod.numel(6, 12, 10, 1, FloaterOptions(2, "rk4", "tanh")) * 8
    seen.clear()
    _training_call(monkeypatch, 2.5 * per / 2**20, torch.float64)
    assert seen == [2]


@pytest.mark.parametrize("budget", [0, 1024])
def test_tape_budget_changes_no_bit(monkeypatch, budget):
    out0, grads0, _ = _training_call(monkeypatch, 0)
    out1, grads1, _ = _training_call(monkeypatch, budget)
    assert torch.equal(out0, out1)
    for a, b in zip(grads0, grads1):
        assert (a is None and b is None) or torch.equal(a, b)


def test_no_tape_without_a_training_backward(monkeypatch):
    made = []
    impl = pf.ops.floater.registry.FLOATER["cpp"]
    forward_taped = impl.forward_taped
    monkeypatch.setattr(impl, "forward_taped", lambda *a: made.append(1) or forward_taped(*a))
    _training_call(monkeypatch, 1024, times_grad=True)  # the times need a gradient
    args = floater_inputs(FloaterCase(3, 4, 5, 3), torch.float32, "cpu", seed=1)
    pf.floater(*args, backend="cpp")  # nothing needs a gradient
    with torch.no_grad():
        pf.floater(*[a.requires_grad_() for a in args], backend="cpp")
    assert made == []


def test_memory_is_kept_for_the_next_tape_and_released(monkeypatch):
    _training_call(monkeypatch, 1024)
    assert tape_mod.release_memory() > 0  # the last tape's block
    assert tape_mod.release_memory() == 0


@pytest.mark.parametrize("raw", ["-1", "lots", "nan"])
def test_bad_budget_is_refused(monkeypatch, raw):
    monkeypatch.setenv(tape_mod.TAPE_ENV, raw)
    with pytest.raises(ValueError, match=tape_mod.TAPE_ENV):
        _training_call(monkeypatch, raw)


def test_bad_tapes_are_refused():
    args = floater_inputs(FloaterCase(4, 6, 5, 3), torch.float32, "cpu", seed=2)
    out, tape = ops().floater_integrate_taped(*args, 2, "rk4", "relu", 2)
    grad = torch.ones_like(out)

    def backward(t):
        return ops().floater_integrate_backward_taped(
            grad, out, *args, 2, "rk4", "relu", NEEDS_NO_TIMES, t
        )

    for bad in (tape[:-1], tape.double(), tape.view(2, -1), torch.cat([tape, tape, tape, tape])):
        with pytest.raises(ValueError, match="tape"):
            backward(bad)
    for intervals in (-1, 4):
        with pytest.raises(ValueError, match="intervals"):
            ops().floater_integrate_taped(*args, 2, "rk4", "relu", intervals)


def test_opcheck_taped_ops():
    args = floater_inputs(FloaterCase(4, 6, 5, 3), torch.float64, "cpu", seed=5)
    leaves = [a.clone().requires_grad_(i < 5) for i, a in enumerate(args)]
    opcheck(ops().floater_taped.default, (*leaves, 2, "rk38", "gelu", "cpp", 2))
    opcheck(ops().floater_integrate_taped.default, (*args, 2, "rk38", "gelu", 3))
    out, tape = ops().floater_integrate_taped(*args, 2, "rk38", "gelu", 3)
    opcheck(
        ops().floater_integrate_backward_taped.default,
        (torch.randn_like(out), out, *args, 2, "rk38", "gelu", NEEDS_NO_TIMES, tape),
    )


@pytest.mark.parametrize("backend", ["cpp", "auto"])
def test_compiled_training_call_tapes(monkeypatch, backend):
    """Under torch.compile a training call tapes too (decided while dynamo traces): the
    backward gets the tape, and outputs and gradients are bitwise the eager call's; with
    dynamic sizes the intervals follow each call's length."""
    taped, backward_tapes = [], []
    impl = pf.ops.floater.registry.FLOATER["cpp"]
    forward_taped, backward = impl.forward_taped, impl.backward
    monkeypatch.setattr(impl, "forward_taped", lambda *a: taped.append(a[-1]) or forward_taped(*a))

    def spy_backward(*args):
        backward_tapes.append(args[-1] is not None)
        return backward(*args)

    monkeypatch.setattr(impl, "backward", spy_backward)
    monkeypatch.setenv(tape_mod.TAPE_ENV, "1024")
    args = floater_inputs(FloaterCase(6, 12, 10, 5, substeps=2), torch.float32, "cpu", seed=9)
    expect = impl is pf.ops.floater.registry.implementation(
        backend, args[0], args[1], args[5], FloaterOptions(2, "rk4", "tanh")
    )

    def call(fn, length):
        leaves = [a.clone().requires_grad_(i < 5) for i, a in enumerate(args)]
        leaves[5] = leaves[5][:length]
        out = fn(*leaves)
        out.backward(torch.ones_like(out))
        return out, [leaf.grad for leaf in leaves[:5]]

    def eager(*t):
        return pf.floater(*t, 2, "rk4", "tanh", backend=backend)

    for dynamic in (False, True):
        run = torch.compile(eager, backend="aot_eager", fullgraph=True, dynamic=dynamic)
        for length in (5, 3) if dynamic else (5,):
            want, want_grads = call(eager, length)
            taped.clear()
            backward_tapes.clear()
            got, grads = call(run, length)
            assert torch.equal(got, want)
            for g, w in zip(grads, want_grads):
                assert torch.equal(g, w)
            assert taped == ([length] if expect else []) and backward_tapes == (
                [True] if expect else []
            )
        torch._dynamo.reset()


@pytest.mark.skipif(
    not hasattr(torch.compiler, "_is_exporting_flag"),
    reason="torch 2.5 has no export flag: an export cannot be told from a compile",
)
def test_export_of_a_training_module_keeps_the_plain_op():
    """torch.export of a module in training mode records the plain op, not the taped one
    (an exported program is for deployment; ONNX knows only the plain op)."""
    fl = pf.Floater(8, 3, hidden_dim=6, backend="cpp").train()
    ep = torch.export.export(fl, (), {"length": 4}, strict=False)
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert any("posenc_fast.floater.default" in t for t in targets), targets
    assert not any("floater_taped" in t for t in targets), targets
