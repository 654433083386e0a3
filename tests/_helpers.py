"""Helpers of the test suite: seeds from test ids, gradient checks against the float64
reference, the dispatcher's answers, FLOATER's integration counter and warm-start check.
The inputs and case matrices the tests share with ``python -m posenc_fast verify`` live in
posenc_fast/cli/_inputs.py."""

from __future__ import annotations

import zlib
from typing import Optional

import torch

from posenc_fast import _dispatch
from posenc_fast.cli import _inputs
from posenc_fast.ops.floater.registry import FLOATER
from posenc_fast.ops.lff import lff
from posenc_fast.ops.lff import reference as lff_reference
from posenc_fast.tolerances import assert_close, tol


def seed_of(text: str) -> int:
    """A stable seed derived from a test id (``hash`` is randomised per process)."""
    return zlib.crc32(text.encode()) % 2**31


def neighbour_similarity(encodings: torch.Tensor, h: int, w: int) -> float:
    """Mean cosine similarity of the encodings [h*w, D] of horizontally and vertically
    adjacent cells of an h x w grid (rows first, as grid_positions orders them): near 1
    for encodings that barely change between neighbours."""
    e = encodings.detach().reshape(h, w, -1).double()
    cos = torch.nn.functional.cosine_similarity
    pairs = [cos(e[:, 1:], e[:, :-1], dim=-1).flatten(), cos(e[1:], e[:-1], dim=-1).flatten()]
    return torch.cat(pairs).mean().item()


LFF_NAMES = ("x", "wr", "w1", "b1", "w2", "b2")


def assert_grads_close(names, leaves, leaves64, dtype, what: str = "") -> None:
    """Every leaf that requires grad got a gradient of its own shape and dtype, within the
    "grad" tolerance of the float64 reference leaf's gradient. The tolerance is the
    looser of ``dtype`` (the op's: float32 positions of a bfloat16 MLP carry the MLP's
    rounding in their gradient) and the gradient's own dtype (float16 positions of a
    float64 op get a float16 gradient)."""
    for name, got, want in zip(names, leaves, leaves64):
        if got is None or not got.requires_grad:
            continue
        g = got.grad
        assert g is not None and g.shape == got.shape and g.dtype == got.dtype, f"{what} d{name}"
        d = max((dtype, g.dtype), key=lambda t: tol(t, "grad").rtol)
        assert_close(g, want.grad, d, "grad", what=f"{what} d{name}")


def check_lff_backward(case: _inputs.LffCase, inputs, backend: str, grad_seed: int, what: str = ""):
    """pf.lff's backward on ``inputs`` (as from :func:`lff_inputs`, in the dtype of the
    weights) for a random grad_output drawn from ``grad_seed``, against float64 autograd
    through the reference (:func:`assert_grads_close`)."""
    dtype = inputs[1].dtype
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in inputs]
    y = lff(*leaves, activation=case.activation, backend=backend)
    g = _inputs.randn(y.shape, _inputs.generator(grad_seed), dtype, y.device)
    y.backward(g)
    leaves64 = [t.detach().double().requires_grad_(True) if t is not None else None for t in inputs]
    lff_reference.lff(*leaves64, case.activation).backward(g.double())
    assert_grads_close(LFF_NAMES, leaves, leaves64, dtype, f"{what} {backend} {case.id}")


def unavailable_backends(
    op: str, device: str, dtype: Optional[torch.dtype] = None
) -> dict[str, list[str]]:
    """{name: reasons} of the backends that implement ``op`` on ``device`` (and ``dtype``)
    but cannot run in this environment (e.g. triton under a Triton interpreter too old)."""
    out = {}
    for name, b in _inputs.implementing(op, device, dtype, include_reference=False):
        reasons = b.environment_reasons()
        if reasons:
            out[name] = reasons
    return out


# -- FLOATER -------------------------------------------------------------------------------


def count_floater_integrations():
    """Count FLOATER integrations: returns ``(seen, restore)``.

    Until ``restore()`` is called, every call that reaches any backend's integrator appends
    its number of sample times to ``seen`` (cache hits append nothing)."""
    seen: list = []
    patched = []
    for impl in FLOATER.values():
        if impl.differentiable:  # the reference integrates without the op: not counted
            continue
        for name in ("forward", "forward_taped"):  # the taped forward integrates too
            forward = getattr(impl, name, None)
            if forward is None:
                continue

            def counting(*args, _forward=forward, **kwargs):
                seen.append(args[5].shape[0])  # times [L]
                return _forward(*args, **kwargs)

            setattr(impl, name, counting)
            patched.append((impl, name, forward))

    def restore():
        for impl, name, forward in patched:
            setattr(impl, name, forward)

    return seen, restore


def check_floater_warm_start(model, run) -> None:
    """add_floater_biases' warm start on ``model`` (in eval mode; ``run(model)`` is its
    output): only new parameters named ``floater_bias.*``; with the biases zeroed the output
    is the unmodified model's, with random ones it is not; the unmodified model's state_dict
    still loads (strict=False, with only FLOATER's keys missing)."""
    from posenc_fast.integrations.attention import add_floater_biases

    before = run(model)
    pretrained = model.state_dict()
    biases = add_floater_biases(model)
    new_keys = set(model.state_dict()) - set(pretrained)
    assert new_keys and all(k.startswith("floater_bias.") for k in new_keys)
    with torch.no_grad():
        for p in biases.parameters():
            p.zero_()  # FLOATER switched off: exactly the unmodified model
    torch.testing.assert_close(run(model), before)
    _inputs.randomize_parameters(biases, 1, scale=0.3)
    assert not torch.allclose(run(model), before, atol=1e-3)
    result = model.load_state_dict(pretrained, strict=False)
    assert set(result.missing_keys) == new_keys and not result.unexpected_keys


# -- the dispatcher, as the tests ask it ---------------------------------------------------


def chosen(problem, requested: str = "auto") -> str:
    """Name of the backend the dispatcher picks for ``problem`` (its op's registry)."""
    return _dispatch.choose(_dispatch.REGISTRIES[problem.op], problem, requested).name


def support(backend: str, op: str):
    """``backend``'s SUPPORT table for ``op`` (KeyError where it does not implement it)."""
    return _dispatch.REGISTRIES[op][backend].support


def environment_reasons(backend: str) -> list[str]:
    return _dispatch.BACKENDS[backend].environment_reasons()


def reasons(backend: str, problem) -> list[str]:
    """Why ``backend`` refuses ``problem`` ([] if it can run it)."""
    return _dispatch.reasons(backend, _dispatch.REGISTRIES[problem.op], problem)
