"""Property-based fuzzing: random problems for every op on every backend
usable here, against the float64 reference, forward and backward.

Drawn: shapes (batch dimensions of size 0 and 1 included), dtypes (and position dtypes:
half precision, integers), groups, activations, with and without the MLP, scales of the
parameters and of the positions (up to 1e4, phases capped at docs/precision.md's 1e5).

Budget and reproducibility: a fixed number of examples per test (``FUZZ_EXAMPLES``,
``POSENC_FAST_FUZZ_EXAMPLES=<n>`` to fuzz longer locally) drawn deterministically
(``derandomize``: every run tries the same examples, so CI time is bounded and a failure
repeats). The tensors come from the drawn ``seed``; on failure hypothesis prints the
falsifying example (seed included) and the note with the case, e.g.
``lff[torch] N[3, 0]-G2-M1-F6-H4-Dg5-gelu float32 x=float32 seed=12345``.
"""

from __future__ import annotations

import os

import _helpers
import pytest
import torch
from conftest import DEVICE, backend_params

import posenc_fast as pf
from posenc_fast.cli import _inputs
from posenc_fast.ops.encodings import reference as ref_enc
from posenc_fast.ops.floater import reference as ref_fl
from posenc_fast.ops.lff import reference as ref_lff
from posenc_fast.tolerances import assert_close

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, note, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

FUZZ_EXAMPLES = int(os.environ.get("POSENC_FAST_FUZZ_EXAMPLES", "0"))


def fuzz(examples: int):
    return settings(
        max_examples=FUZZ_EXAMPLES or examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        print_blob=True,
    )


FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
SCALES = (1e-3, 0.3, 3.0, 50.0, 1e3, 1e4)
MAX_PHASE = 1e5


def _dtypes(backend: str, op: str):
    declared = _helpers.support(backend, op).dtypes
    return [d for d in FLOATS if declared is None or d in declared]


# ---------------------------------------------------------------- lff


@st.composite
def lff_problems(draw, dtypes):
    batch = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
    G, M = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    F = 2 * draw(st.integers(1, 12))
    mlp = draw(st.booleans())
    H = draw(st.integers(1, 16)) if mlp else 0
    Dg = draw(st.integers(1, 12)) if mlp else 0
    activation = draw(st.sampled_from(("gelu", "gelu_tanh", "relu")))
    dtype = draw(st.sampled_from(dtypes))
    x_kind = draw(st.sampled_from(("default", "float16", "bfloat16", "int64")))
    pos_scale = draw(st.sampled_from(SCALES))
    wr_scale = draw(st.sampled_from((0.1, 1.0, 10.0)))
    seed = draw(st.integers(0, 2**31 - 1))
    case = _inputs.LffCase(batch, G, M, F, H, Dg, activation, pos_scale)
    return case, dtype, x_kind, wr_scale, seed


def _lff_inputs(case, dtype, x_kind, wr_scale, seed):
    x, wr, *mlp = _inputs.lff_inputs(case, dtype, DEVICE, seed)
    wr = (wr.double() * wr_scale).to(dtype)
    # Cap the largest phase at docs/precision.md's range (scale x down, keep it finite).
    phase = (x.double() @ wr.double().T).abs().max().item() if x.numel() else 0.0
    if phase > MAX_PHASE:
        x = (x.double() * (MAX_PHASE / phase)).to(x.dtype)
    if x_kind == "int64":
        x = x.round().to(torch.int64)
    elif x_kind != "default":
        x = x.to(getattr(torch, x_kind))
    return [x, wr, *mlp]


@pytest.mark.parametrize("backend", backend_params("lff"))
def test_lff_matches_reference(backend):
    @fuzz(40)
    @given(lff_problems(_dtypes(backend, "lff")))
    def check(problem):
        case, dtype, x_kind, wr_scale, seed = problem
        what = f"lff[{backend}] {case.id} {str(dtype)[6:]} x={x_kind} wr*{wr_scale} seed={seed}"
        note(what)
        inputs = _lff_inputs(case, dtype, x_kind, wr_scale, seed)
        sup = _helpers.support(backend, "lff").input_dtypes.get("x")
        x_dtype = inputs[0].dtype if inputs[0].is_floating_point() else torch.float32
        if sup is not None and x_dtype not in sup:
            with pytest.raises(pf.BackendError, match="x dtype must be one of"):
                pf.lff(*inputs, activation=case.activation, backend=backend)
            return
        leaves = [
            t.detach().clone().requires_grad_(t.is_floating_point()) if t is not None else None
            for t in inputs
        ]
        y = pf.lff(*leaves, activation=case.activation, backend=backend)
        leaves64 = [
            t.detach().double().requires_grad_(t.is_floating_point()) if t is not None else None
            for t in inputs
        ]
        expected = ref_lff.lff(*leaves64, case.activation)
        width = case.group_out_dim if case.hidden_dim else case.fourier_dim
        assert y.shape == (*case.batch, case.groups * width) and y.dtype == dtype, what
        assert_close(y, expected, dtype, "lff" if case.hidden_dim else "encoding", what=what)
        if y.numel():
            g = _inputs.randn(y.shape, _inputs.generator(seed + 1), dtype, DEVICE)
            y.backward(g)
            expected.backward(g.double())
            _helpers.assert_grads_close(_helpers.LFF_NAMES, leaves, leaves64, dtype, what)

    check()


# ---------------------------------------------------------------- encodings


ENCODING_KINDS = ("sinusoidal", "dft", "sinusoidal_nd", "dft_inverse", "SinusoidalPE", "DFTPE")


@st.composite
def encoding_problems(draw, dtypes, op):
    kind, add_kind = op, None
    if op in ("SinusoidalPE", "DFTPE"):
        kind, add_kind = "add", "sinusoidal" if op == "SinusoidalPE" else "dft"
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
    dim = 2 * draw(st.integers(1, 20))
    base = draw(st.sampled_from((10000.0, 100.0, 2.5, 1e6)))
    block = draw(st.sampled_from((None, None, 3.0, -17.5, 1e4)))
    dtype = draw(st.sampled_from(dtypes))
    integer = draw(st.booleans())
    scale = draw(st.sampled_from(SCALES))
    broadcast = draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    return kind, add_kind, shape, dim, base, block, dtype, integer, scale, broadcast, seed


def _positions(shape, dtype, integer, scale, g):
    if integer:
        hi = max(2, int(scale))
        return torch.randint(-hi, hi, shape, generator=g).to(DEVICE)
    return _inputs.rand(shape, g, -scale, scale, torch.float64, DEVICE).to(dtype)


@pytest.mark.parametrize("op", ENCODING_KINDS)
@pytest.mark.parametrize("backend", backend_params("encoding"))
def test_encodings_match_reference(backend, op):
    """sinusoidal (with base and block), dft, sinusoidal_nd, dft_inverse, and the fused
    adds of SinusoidalPE / DFTPE (positions [L] broadcast, or one per row)."""
    sup = _helpers.support(backend, "encoding")

    @fuzz(25)
    @given(encoding_problems(_dtypes(backend, "encoding"), op))
    def check(problem):
        kind, add_kind, shape, dim, base, block, dtype, integer, scale, broadcast, seed = problem
        what = (
            f"{op}[{backend}] P{list(shape)} dim={dim} base={base} block={block} "
            f"{str(dtype)[6:]} int={integer} scale={scale} bcast={broadcast} seed={seed}"
        )
        note(what)
        g = _inputs.generator(seed)
        p = _positions(shape, dtype, integer, scale, g)
        if kind == "dft_inverse":
            e = _inputs.randn((*shape, dim), g, dtype, DEVICE).requires_grad_()
            out = pf.dft_inverse(e, backend=backend)
            e64 = e.detach().double().requires_grad_()
            expected = ref_enc.dft_inverse(e64)
            leaves, leaves64, tol = [e], [e64], "lff"
        elif kind == "add":
            L = shape[-1] if shape else 3
            x = _inputs.randn((*shape[:-1], L, dim), g, dtype, DEVICE).requires_grad_()
            if broadcast or not shape:
                p = _positions((L,), dtype, integer, scale, g)
            module = (pf.SinusoidalPE if add_kind == "sinusoidal" else pf.DFTPE)(
                dim, backend=backend, **({"base": base} if add_kind == "sinusoidal" else {})
            )
            pin = p.detach().requires_grad_(p.is_floating_point())
            allowed = sup.input_dtypes.get("positions")
            if allowed is not None and p.dtype not in allowed:
                return  # refusals: test_validation.py::test_positions_in_another_float_dtype
            out = module(x, pin)
            x64 = x.detach().double().requires_grad_()
            p64 = p.detach().double().requires_grad_(p.is_floating_point())
            pe = (
                ref_enc.sinusoidal(p64, dim, base)
                if add_kind == "sinusoidal"
                else ref_enc.dft(p64, dim)
            )
            expected = x64 + pe
            leaves, leaves64 = [x, pin], [x64, p64]
            tol = "encoding" if dtype in (torch.float32, torch.float64) else "lff"
        else:
            pin = p.detach().requires_grad_(p.is_floating_point())
            p64 = p.detach().double().requires_grad_(p.is_floating_point())
            if kind == "sinusoidal":
                out = pf.sinusoidal(pin, dim, base, block, backend=backend)
                expected = ref_enc.sinusoidal(p64, dim, base, block)
            elif kind == "dft":
                out = pf.dft(pin, dim, backend=backend)
                expected = ref_enc.dft(p64, dim)
            else:
                if not shape:
                    return  # coords need a last dimension
                out = pf.sinusoidal_nd(pin, dim, base, backend=backend)
                expected = ref_enc.sinusoidal(p64, dim, base).flatten(-2)
            leaves, leaves64, tol = [pin], [p64], "encoding"
        out_dtype = dtype if (kind in ("add", "dft_inverse") or not integer) else torch.float32
        assert out.shape == expected.shape and out.dtype == out_dtype, what
        assert_close(out, expected, out_dtype, tol, what=what)
        if out.numel() and out.requires_grad:
            grad = _inputs.randn(out.shape, _inputs.generator(seed + 1), out_dtype, DEVICE)
            out.backward(grad)
            expected.backward(grad.double())
            names = ("input", "positions")
            _helpers.assert_grads_close(names, leaves, leaves64, out_dtype, what)

    check()


# ---------------------------------------------------------------- floater


@st.composite
def floater_problems(draw, dtypes):
    case = _inputs.FloaterCase(
        num_states=draw(st.integers(0, 3)),
        dim=draw(st.integers(1, 6)),
        hidden_dim=draw(st.integers(1, 6)),
        length=draw(st.integers(0, 5)),
        substeps=draw(st.integers(1, 3)),
        method=draw(st.sampled_from(("euler", "midpoint", "rk4", "rk38"))),
        activation=draw(st.sampled_from(("relu", "tanh", "gelu", "identity"))),
        repeat_time=draw(st.booleans()),
    )
    dtype = draw(st.sampled_from(dtypes))
    weight_scale = draw(st.sampled_from((0.1, 1.0, 2.0)))
    integer_times = draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    return case, dtype, weight_scale, integer_times, seed


@pytest.mark.parametrize("backend", backend_params("floater"))
def test_floater_matches_reference(backend):
    @fuzz(40)
    @given(floater_problems(_dtypes(backend, "floater")))
    def check(problem):
        case, dtype, weight_scale, integer_times, seed = problem
        what = f"floater[{backend}] {case.id} {str(dtype)[6:]} w*{weight_scale} seed={seed}"
        what += " int-times" if integer_times else ""
        note(what)
        p0, w1, b1, w2, b2, times = _inputs.floater_inputs(case, dtype, DEVICE, seed)
        w1, w2 = w1 * weight_scale, w2 * weight_scale
        if integer_times:
            times = torch.arange(case.length, device=DEVICE) // 2  # 0, 0, 1, 1, 2: repeats
        inputs = [p0, w1, b1, w2, b2, times]
        leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
        out = pf.floater(*leaves, case.substeps, case.method, case.activation, backend=backend)
        leaves64 = [t.detach().double().requires_grad_(t.is_floating_point()) for t in inputs]
        expected = ref_fl.floater(*leaves64, case.substeps, case.method, case.activation)
        assert out.shape == (case.num_states, case.length, case.dim) and out.dtype == dtype
        assert_close(out, expected, dtype, "floater", what=what)
        if out.numel():
            g = _inputs.randn(out.shape, _inputs.generator(seed + 1), dtype, DEVICE)
            out.backward(g)
            expected.backward(g.double())
            names = ("p0", "w1", "b1", "w2", "b2", "times")
            _helpers.assert_grads_close(names, leaves, leaves64, dtype, what)

    check()
