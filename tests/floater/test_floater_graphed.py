"""The torch backend's CUDA-graph path (posenc_fast/ops/floater/graphed.py) and what "auto"
picks on CUDA while the CUDA integrator is gated. No GPU here: the graphed path's code runs
eagerly on CPU tensors (static buffers, copies in, clones out) against float64, and on
"meta" tensors, where reading any value on the host (which a capture forbids) raises; the
CUDA device is mocked for the dispatch decisions."""

from __future__ import annotations

import _helpers
import pytest
import torch

from posenc_fast import _dispatch, _extension
from posenc_fast.cli import _inputs
from posenc_fast.cli._inputs import FloaterCase, floater_inputs
from posenc_fast.ops.floater import graphed
from posenc_fast.ops.floater import reference as ref
from posenc_fast.ops.floater.reference import FloaterOptions
from posenc_fast.ops.floater.registry import FLOATER, problem_of
from posenc_fast.tolerances import assert_close

CASE = FloaterCase(3, 5, 7, 6, 2, "rk38", "gelu", repeat_time=True)
OPTIONS = FloaterOptions(CASE.substeps, CASE.method, CASE.activation)
NEEDS = (True, True, True, True, True, True)


@pytest.fixture(autouse=True)
def _fresh_entries():
    graphed.clear()
    yield
    graphed.clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_graphed_path_matches_float64(dtype):
    """Forward and backward through the static buffers; a second call with other values
    reuses the entry (its inputs are copied in) and leaves the first call's results alone
    (the outputs are clones)."""
    results = []
    for seed in (1, 2):
        args = floater_inputs(CASE, dtype, "cpu", seed)
        out = graphed.forward(*args, OPTIONS, capture=False)
        grad = _inputs.randn(out.shape, _inputs.generator(seed + 9), dtype, "cpu")
        grads = graphed.backward(grad, out, *args, OPTIONS, NEEDS, capture=False)
        leaves = [a.double().requires_grad_(True) for a in args]
        want = ref.floater(*leaves, *OPTIONS)
        assert_close(out, want, dtype, "floater", what="forward")
        for name, g, w in zip(
            ["p0", "w1", "b1", "w2", "b2", "times"],
            grads,
            torch.autograd.grad(want, leaves, grad.double()),
        ):
            assert_close(g, w, dtype, "grad", what=f"d{name}")
        results.append((out.clone(), out, [g.clone() for g in grads], grads))
    assert graphed.entries() == 2  # one forward and one backward entry, both reused
    first_copy, first, grads_copy, grads = results[0]
    assert torch.equal(first, first_copy) and all(
        torch.equal(a, b) for a, b in zip(grads, grads_copy)
    )


def test_graphed_path_reads_no_value_on_the_host():
    """On meta tensors every op runs on shapes alone: a host read (.item(), a bool of a
    tensor) would raise here, and would break a capture (or sync the GPU) there."""
    args = [t.to("meta") for t in floater_inputs(CASE, torch.float32, "cpu", 0)]
    out = graphed.forward(*args, OPTIONS, capture=False)
    assert out.device.type == "meta" and out.shape == (3, 6, 5)
    grads = graphed.backward(torch.empty_like(out), out, *args, OPTIONS, NEEDS, capture=False)
    assert [g.shape for g in grads] == [a.shape for a in args]


def test_graphed_path_is_cuda_only(monkeypatch):
    args = floater_inputs(CASE, torch.float32, "cpu", 0)
    assert not graphed.capturable(args[0])
    out = FLOATER["torch"].forward(*args, OPTIONS)  # the registry's function: the plain loop here
    assert graphed.entries() == 0 and out.shape == (3, 6, 5)
    monkeypatch.setenv(graphed.GRAPHS_ENV, "0")
    assert not graphed.capturable(torch.empty(1, device="meta"))


@pytest.fixture
def mocked_gpu(monkeypatch):
    """A CUDA device of compute capability 9.0 and an extension with its CUDA part, as far
    as the dispatcher can tell."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(_extension, "reasons", lambda part="cpu": [])
    monkeypatch.setattr(_dispatch, "_warned", set(_dispatch.BACKENDS))  # no warnings
    monkeypatch.delenv(_dispatch.CUDA_GATE_ENV, raising=False)
    monkeypatch.delenv(_dispatch.ENV_VAR, raising=False)


def test_auto_on_cuda_uses_the_graphed_torch_backend_until_validated(mocked_gpu, monkeypatch):
    problem = problem_of(
        "cuda", torch.float32, (36, 384, 384, 197), FloaterOptions(5, "rk4", "relu")
    )
    assert _helpers.chosen(problem) == "torch"
    assert (
        FLOATER["torch"].forward is graphed.forward
        and FLOATER["torch"].backward is graphed.backward
    )
    reasons = _helpers.reasons("cuda", problem)
    assert any(_dispatch.CUDA_GATE_ENV in r for r in reasons), reasons
    monkeypatch.setenv(_dispatch.CUDA_GATE_ENV, "1")  # what a validating GPU run sets
    assert _helpers.chosen(problem) == "cuda"
    # beyond the CUDA kernels' sizes: the graphed loop again
    big = problem_of("cuda", torch.float32, (4, 8192, 64, 10), FloaterOptions(5, "rk4", "relu"))
    assert _helpers.chosen(big) == "torch"


def test_the_cuda_backend_tapes():
    """The cuda backend has a taped forward: eager training calls on CUDA keep the stage
    values within POSENC_FAST_FLOATER_TAPE_MB (tape.wanted asks for it)."""
    assert callable(getattr(FLOATER["cuda"], "forward_taped", None))
