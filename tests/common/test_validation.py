"""Validation matrix: one test per row and backend for every public op.

Ops: lff, sinusoidal, sinusoidal_nd, dft, dft_inverse, SinusoidalPE, SinusoidalNdPE, DFTPE,
floater, LearnableFourierFeatures, Floater, each on every backend usable here that implements its
dispatcher op (reference included). Rows, and the (op, row) pairs that other files already
cover per backend, which are not repeated here:

- non-tensor inputs -> TypeError naming the argument.
- wrong rank / wrong last dimension / sizes that do not match the module -> ValueError
  naming the argument and the expected shape. (sinusoidal and dft take any rank.)
- mismatched devices (the "meta" device as the second one) -> ValueError naming both;
  everything on meta -> shapes only, or a BackendError that says why.
- integer positions (int64, int32, uint8) accepted and converted; complex and bool
  rejected; weights of mixed dtypes rejected; positions in another float dtype than the
  weights; dtypes outside a backend's declaration -> BackendError naming the dtype.
- non-contiguous and expanded (stride 0) inputs (lff: test_lff.py::test_non_contiguous_inputs).
- empty batches, forward and backward (lff: test_lff.py::test_empty_batch_backward;
  floater: test_floater.py::test_empty_shapes_backward).
- N = 1 (lff, sinusoidal, dft, floater: the case matrices of their own files).
- NaN and inf positions stay in their own rows, forward and backward, for every op but
  FLOATER, which rejects non-finite times by design (a later state depends on every
  earlier time); test_lff.py checks lff's forward per group as well.
- huge positions (1e5, docs/precision.md), forward and backward (forward of lff, sinusoidal,
  dft: their files).
- requires_grad on positions only (sinusoidal, dft: test_encodings.py).
- inputs never modified, forward and backward (values and version counters).
- out= aliasing: no op offers out=, so there is no row.

Every error is asserted on its message: the argument's name and what was expected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import _helpers
import pytest
import torch
from conftest import DEVICE

import posenc_fast as pf
from posenc_fast.cli import _inputs
from posenc_fast.ops.encodings import reference as ref_enc
from posenc_fast.ops.floater import reference as ref_fl
from posenc_fast.ops.lff import reference as ref_lff
from posenc_fast.tolerances import PHASE_ATOL, assert_close

F32 = torch.float32
LFF_WEIGHTS = ("wr", "w1", "b1", "w2", "b2")
FL_NAMES = ("p0", "w1", "b1", "w2", "b2", "times")
FL_WEIGHTS = FL_NAMES[:5]


# ---------------------------------------------------------------- the ops


@dataclass(frozen=True)
class Spec:
    name: str
    family: str  # the dispatcher's op: "lff" | "encoding" | "encoding_nd" | "floater"
    make: Callable[[int], dict]  # seed -> every tensor of a valid call (float32)
    run: Callable[[dict, str], torch.Tensor]  # (tensors, backend) -> output
    reference: Callable[[dict], torch.Tensor]  # tensors -> float64 output
    args: tuple[str, ...]  # the tensors a caller passes (a module's weights are not)
    position: str  # the argument that holds positions
    kind: str  # tolerance kind of the output (posenc_fast/tolerances.py)


def _g(seed):
    return _inputs.generator(seed)


def _rand(shape, g, scale=50.0):
    return _inputs.rand(shape, g, -scale, scale, F32, DEVICE)


LFF_CASE = _inputs.LffCase((5,), 2, 2, 8, 4, 6)


def _lff_make(seed):
    return dict(zip(("x", *LFF_WEIGHTS), _inputs.lff_inputs(LFF_CASE, F32, DEVICE, seed)))


def _lff_run(a, backend):
    return pf.lff(a["x"], *(a[k] for k in LFF_WEIGHTS), backend=backend)


def _lff_ref(a):
    return ref_lff.lff(a["x"], *(a[k] for k in LFF_WEIGHTS))


def _lff_module_run(a, backend):
    m = pf.LearnableFourierFeatures(
        2, 8, 4, 12, groups=2, backend=backend, device=a["wr"].device, dtype=a["wr"].dtype
    )
    with torch.no_grad():
        for k in LFF_WEIGHTS:
            getattr(m, k).copy_(a[k])
    return m(a["x"])


def _enc_make(seed):
    return {"positions": _rand((5, 3), _g(seed))}


def _nd_make(seed):
    return {"coords": _rand((5, 2), _g(seed))}


def _inverse_make(seed):
    return {"encoding": _inputs.randn((5, 8), _g(seed), F32, DEVICE)}


def _add_make(seed):
    g = _g(seed)
    return {"x": _inputs.randn((2, 5, 8), g, F32, DEVICE), "positions": _rand((2, 5), g)}


def _nd_add_make(seed):
    g = _g(seed)
    return {"x": _inputs.randn((5, 12), g, F32, DEVICE), "coords": _rand((5, 2), g)}


FL_CASE = _inputs.FloaterCase(3, 4, 5, 4, 2, "rk4", "tanh")


def _fl_make(seed):
    return dict(zip(FL_NAMES, _inputs.floater_inputs(FL_CASE, F32, DEVICE, seed)))


def _fl_run(a, backend):
    return pf.floater(*(a[k] for k in FL_NAMES), 2, "rk4", "tanh", backend=backend)


def _fl_ref(a):
    return ref_fl.floater(*(a[k] for k in FL_NAMES), 2, "rk4", "tanh")


def _fl_module_run(a, backend):
    m = pf.Floater(
        4,
        3,
        hidden_dim=5,
        substeps=2,
        method="rk4",
        activation="tanh",
        backend=backend,
        device=a["p0"].device,
        dtype=a["p0"].dtype,
    )
    with torch.no_grad():
        for k in FL_WEIGHTS:
            getattr(m, k).copy_(a[k])
    return m(times=a["times"])


def _encoding_spec(name, fn, reference):
    """sinusoidal or dft: fn(positions [5, 3], 8) -> [5, 3, 8]."""
    return Spec(
        name,
        "encoding",
        _enc_make,
        lambda a, b: fn(a["positions"], 8, backend=b),
        lambda a: reference(a["positions"], 8),
        ("positions",),
        "positions",
        "encoding",
    )


def _adding_spec(name, module, reference):
    """SinusoidalPE or DFTPE: x [2, 5, 8] plus the encoding of positions [2, 5]."""
    return Spec(
        name,
        "encoding",
        _add_make,
        lambda a, b: module(8, backend=b)(a["x"], a["positions"]),
        lambda a: a["x"].double() + reference(a["positions"], 8),
        ("x", "positions"),
        "positions",
        "encoding",
    )


SPECS = {
    s.name: s
    for s in (
        Spec("lff", "lff", _lff_make, _lff_run, _lff_ref, ("x", *LFF_WEIGHTS), "x", "lff"),
        _encoding_spec("sinusoidal", pf.sinusoidal, ref_enc.sinusoidal),
        Spec(
            "sinusoidal_nd",
            "encoding",
            _nd_make,
            lambda a, b: pf.sinusoidal_nd(a["coords"], 6, backend=b),
            lambda a: ref_enc.sinusoidal(a["coords"], 6).flatten(-2),
            ("coords",),
            "coords",
            "encoding",
        ),
        _encoding_spec("dft", pf.dft, ref_enc.dft),
        Spec(
            "dft_inverse",
            "encoding",
            _inverse_make,
            lambda a, b: pf.dft_inverse(a["encoding"], backend=b),
            lambda a: ref_enc.dft_inverse(a["encoding"]),
            ("encoding",),
            "encoding",
            "lff",  # a matmul, not phases
        ),
        _adding_spec("SinusoidalPE", pf.SinusoidalPE, ref_enc.sinusoidal),
        Spec(
            "SinusoidalNdPE",
            "encoding_nd",
            _nd_add_make,
            lambda a, b: pf.SinusoidalNdPE(12, 2, backend=b)(a["x"], a["coords"]),
            lambda a: a["x"].double() + ref_enc.sinusoidal_nd(a["coords"], 6),
            ("x", "coords"),
            "coords",
            "encoding",
        ),
        _adding_spec("DFTPE", pf.DFTPE, ref_enc.dft),
        Spec("floater", "floater", _fl_make, _fl_run, _fl_ref, FL_NAMES, "times", "floater"),
        Spec(
            "LearnableFourierFeatures",
            "lff",
            _lff_make,
            _lff_module_run,
            _lff_ref,
            ("x",),
            "x",
            "lff",
        ),
        Spec(
            "Floater", "floater", _fl_make, _fl_module_run, _fl_ref, ("times",), "times", "floater"
        ),
    )
}
MODULES = ("SinusoidalPE", "SinusoidalNdPE", "DFTPE", "LearnableFourierFeatures", "Floater")


def _backends(spec):
    return _inputs.backends_for(spec.family, DEVICE, include_reference=True)


def matrix(*ops, exclude=()):
    """(op, backend) params for ``ops`` (default: every op) but ``exclude``."""
    names = ops or tuple(SPECS)
    return [
        pytest.param(op, b, id=f"{op}-{b}")
        for op in names
        if op not in exclude
        for b in _backends(SPECS[op])
    ]


def _call(spec, a, backend, exc, match):
    with pytest.raises(exc, match=match) as info:
        spec.run(a, backend)
    return str(info.value)


def _float_leaves(a, names):
    """Copies of ``a`` where ``names`` are fresh leaves requiring grad (same strides)."""
    out = dict(a)
    for n in names:
        out[n] = a[n].detach().requires_grad_(True)
    return out


def _check_against_reference(spec, a, backend, grad_names=(), what=""):
    """Forward and (for ``grad_names``) backward against the float64 reference."""
    leaves = _float_leaves(a, grad_names)
    out = spec.run(leaves, backend)
    ref_in = dict(a)
    for n in grad_names:
        ref_in[n] = a[n].detach().double().requires_grad_(True)
    expected = spec.reference(ref_in)
    assert out.shape == expected.shape, what
    assert_close(out, expected, out.dtype, spec.kind, what=f"{spec.name} {what}")
    if grad_names and out.numel():
        g = _inputs.randn(out.shape, _g(99), F32, out.device).to(out.dtype)
        out.backward(g)
        expected.backward(g.double())
        for n in grad_names:
            got, want = leaves[n].grad, ref_in[n].grad
            assert got is not None and got.shape == a[n].shape, f"d{n} {what}"
            assert_close(got, want, got.dtype, "grad", what=f"d{n} {what}")
    return out, leaves


# ---------------------------------------------------------------- non-tensor inputs


@pytest.mark.parametrize("op,backend", matrix())
def test_non_tensor_inputs(op, backend):
    spec = SPECS[op]
    for name in spec.args:
        a = spec.make(0)
        a[name] = a[name].tolist()
        _call(spec, a, backend, TypeError, rf"^{name} must be a torch\.Tensor, got list$")
        a[name] = 1.5
        _call(spec, a, backend, TypeError, rf"^{name} must be a torch\.Tensor, got float$")


@pytest.mark.parametrize("op,backend", matrix("Floater"))
def test_floater_length_must_be_an_int(op, backend):
    fl = pf.Floater(4, 2, backend=backend)
    for bad in ("3", 2.0, torch.tensor(3), True):
        with pytest.raises(TypeError, match=r"^length must be an int, got "):
            fl(length=bad)


# ---------------------------------------------------------------- shapes

# (op, row, argument, transform, message): the argument is replaced by transform(argument).
ENC = r"^encoding must have shape \[\.\.\., dim\], got "
PE_X = r"^x must have shape \[\.\.\., L, dim=8\], got "
BCAST = r"^positions must broadcast to x\.shape\[:-1\] = \[2, 5\], got "
ND_COORDS = r"^coords must have shape \[\.\.\., axes=2\] with \[\.\.\.\] broadcasting to .*, got "
LFF_X = r"^x must have shape \[\.\.\., groups=2, pos_dim=2\], got "
WITH_M = r"\(\[F/2, M\] with M = x\.shape\[-1\]\)"
SHAPE_CASES = [
    # lff: x [5, 2, 2], wr [4, 2], w1 [8, 4], b1 [4], w2 [4, 6], b2 [6]
    ("lff", "rank", "x", lambda t: t[0, 0], r"^x must have shape \[\.\.\., G, M\] \(at least"),
    ("lff", "rank", "wr", lambda t: t[0], r"^wr must have shape \[\*, 2\]"),
    ("lff", "rank", "w1", lambda t: t[0], r"^w1 must have shape \[8, \*\]"),
    ("lff", "rank", "b1", lambda t: t[None], r"^b1 must have shape \[4\]"),
    ("lff", "rank", "w2", lambda t: t[0], r"^w2 must have shape \[4, \*\]"),
    ("lff", "rank", "b2", lambda t: t[None], r"^b2 must have shape \[6\]"),
    ("lff", "last", "x", lambda t: t[..., :1], r"^wr must have shape \[\*, 1\] " + WITH_M),
    ("lff", "last", "x", lambda t: t[..., :0], r"^x must have shape \[\.\.\., G, M\] with M >="),
    ("lff", "last", "wr", lambda t: t[:0], r"^wr must have shape \[F/2, M\] with F/2 >= 1"),
    ("lff", "last", "w1", lambda t: t[:-2], r"^w1 must have shape \[8, \*\] \(\[F, H\] with F = 2"),
    ("lff", "last", "w2", lambda t: t[:-1], r"^w2 must have shape \[4, \*\] \(\[H, D/G\] with H"),
    ("lff", "last", "b1", lambda t: t[:-1], r"^b1 must have shape \[4\] \(\[H\] with H = w1"),
    ("lff", "last", "b2", lambda t: t[:-1], r"^b2 must have shape \[6\] \(\[D/G\]"),
    # sinusoidal_nd: coords [5, 2], dim_per_axis 6
    (
        "sinusoidal_nd",
        "rank",
        "coords",
        lambda t: t[0, 0],
        r"^coords must have shape \[\.\.\., M\]",
    ),
    # dft_inverse: encoding [5, 8]
    ("dft_inverse", "rank", "encoding", lambda t: t[0, 0], ENC + "a scalar"),
    ("dft_inverse", "last", "encoding", lambda t: t[:, :7], ENC + r"\[5, 7\]: dim must be even"),
    (
        "dft_inverse",
        "last",
        "encoding",
        lambda t: t[:, :0],
        ENC + r"\[5, 0\]: dim must be positive",
    ),
    # floater: p0 [3, 4], w1 [5, 5], b1 [5], w2 [6, 4], b2 [4], times [4]
    ("floater", "rank", "p0", lambda t: t[0], r"^p0 must have shape \[S, d\]"),
    ("floater", "rank", "w1", lambda t: t[0], r"^w1 must have shape \[5, \*\]"),
    ("floater", "rank", "b1", lambda t: t[None], r"^b1 must have shape \[5\]"),
    ("floater", "rank", "w2", lambda t: t[0], r"^w2 must have shape \[6, 4\]"),
    ("floater", "rank", "b2", lambda t: t[None], r"^b2 must have shape \[4\]"),
    ("floater", "rank", "times", lambda t: t[None], r"^times must be a 1-D tensor \[L\]"),
    ("floater", "last", "p0", lambda t: t[:, :3], r"^w1 must have shape \[4, \*\] \(\[d\+1, H\]"),
    ("floater", "last", "w1", lambda t: t[:, :4], r"^b1 must have shape \[4\] \(\[H\] with H = w1"),
    ("floater", "last", "w2", lambda t: t[:, :3], r"^w2 must have shape \[6, 4\] \(\[H\+1, d\]"),
    ("floater", "last", "b2", lambda t: t[:3], r"^b2 must have shape \[4\] \(\[d\] with d = p0"),
    # modules
    ("SinusoidalPE", "rank", "x", lambda t: t[0, 0], PE_X + r"\[8\]"),
    ("SinusoidalPE", "rank", "positions", lambda t: t[None, None], BCAST + r"\[1, 1, 2, 5\]"),
    ("SinusoidalPE", "last", "x", lambda t: t[..., :6], PE_X + r"\[2, 5, 6\]"),
    ("SinusoidalPE", "module", "positions", lambda t: t[:, :4], BCAST + r"\[2, 4\]"),
    ("SinusoidalNdPE", "rank", "x", lambda t: t[0, 0], r"^x must have shape \[\.\.\., dim=12\]"),
    (
        "SinusoidalNdPE",
        "rank",
        "coords",
        lambda t: t[0, 0],
        r"^coords must have shape \[\.\.\., M\]",
    ),
    ("SinusoidalNdPE", "last", "x", lambda t: t[:, :8], r"^x must have shape \[\.\.\., dim=12\]"),
    ("SinusoidalNdPE", "module", "coords", lambda t: t[:, :1], ND_COORDS + r"\[5, 1\]"),
    ("SinusoidalNdPE", "module", "coords", lambda t: t[:4], ND_COORDS + r"\[4, 2\]"),
    ("DFTPE", "rank", "x", lambda t: t[0, 0], PE_X + r"\[8\]"),
    ("DFTPE", "rank", "positions", lambda t: t[None, None], BCAST + r"\[1, 1, 2, 5\]"),
    ("DFTPE", "last", "x", lambda t: t[..., :6], PE_X + r"\[2, 5, 6\]"),
    ("DFTPE", "module", "positions", lambda t: t[:, :4], BCAST + r"\[2, 4\]"),
    ("LearnableFourierFeatures", "rank", "x", lambda t: t[0, 0], LFF_X + r"\[2\]"),
    ("LearnableFourierFeatures", "last", "x", lambda t: t.repeat(1, 1, 2), LFF_X + r"\[5, 2, 4\]"),
    ("LearnableFourierFeatures", "module", "x", lambda t: t[:, :1], LFF_X + r"\[5, 1, 2\]"),
    ("Floater", "rank", "times", lambda t: t[None], r"^times must be a 1-D tensor \[L\], got"),
]


def _shape_params(row):
    out = []
    for i, (op, r, arg, fn, match) in enumerate(SHAPE_CASES):
        if r == row:
            for b in _backends(SPECS[op]):
                out.append(pytest.param(op, b, arg, fn, match, id=f"{op}-{b}-{arg}-{i}"))
    return out


def _check_shape_case(op, backend, arg, fn, match):
    spec = SPECS[op]
    a = spec.make(1)
    a[arg] = fn(a[arg])
    _call(spec, a, backend, ValueError, match)


@pytest.mark.parametrize("op,backend,arg,fn,match", _shape_params("rank"))
def test_wrong_rank(op, backend, arg, fn, match):
    _check_shape_case(op, backend, arg, fn, match)


@pytest.mark.parametrize("op,backend,arg,fn,match", _shape_params("last"))
def test_wrong_last_dimension(op, backend, arg, fn, match):
    _check_shape_case(op, backend, arg, fn, match)


@pytest.mark.parametrize("op,backend,arg,fn,match", _shape_params("module"))
def test_sizes_not_matching_the_module(op, backend, arg, fn, match):
    _check_shape_case(op, backend, arg, fn, match)


@pytest.mark.parametrize("op,backend", matrix("sinusoidal", "dft", "sinusoidal_nd"))
def test_encoding_size_arguments(op, backend):
    """The output's last dimension is an argument here: odd, zero or non-int is refused."""
    p = _enc_make(2)["positions"]
    name = "dim_per_axis" if op == "sinusoidal_nd" else "dim"
    fn = getattr(pf, op)
    for bad, exc, match in (
        (7, ValueError, rf"^{name} must be even"),
        (0, ValueError, rf"^{name} must be positive, got 0"),
        (-2, ValueError, rf"^{name} must be positive, got -2"),
        (8.0, TypeError, rf"^{name} must be an int, got float"),
        (torch.tensor(8), TypeError, rf"^{name} must be an int, got Tensor"),
    ):
        with pytest.raises(exc, match=match):
            fn(p, bad, backend=backend)


# ---------------------------------------------------------------- devices


SINGLE_TENSOR = ("sinusoidal", "sinusoidal_nd", "dft", "dft_inverse")  # see test_everything_on_meta


@pytest.mark.parametrize("op,backend", matrix(exclude=SINGLE_TENSOR))
def test_mismatched_devices(op, backend):
    """One tensor on "meta", the others on the test device: the error names both."""
    spec = SPECS[op]
    for name in spec.args:
        a = spec.make(3)
        a[name] = a[name].to("meta")
        msg = _call(spec, a, backend, ValueError, "all tensors must be on the same device")
        assert f"{name} is on meta" in msg, msg
        assert f"on {torch.device(DEVICE)}" in msg, msg


@pytest.mark.parametrize("op,backend", matrix(exclude=MODULES))
def test_everything_on_meta(op, backend):
    """All tensors on meta: the output's shape and dtype without computing anything, or a
    BackendError that names the backend and the device."""
    spec = SPECS[op]
    a = {k: v.to("meta") for k, v in spec.make(4).items()}
    expected = spec.reference({k: torch.empty_like(v, device="cpu") for k, v in a.items()})
    sup = _helpers.support(backend, spec.family)
    if sup.devices is not None and "meta" not in sup.devices:
        msg = _call(spec, a, backend, pf.BackendError, f"backend '{backend}' cannot run")
        assert f"{backend}: runs on" in msg and "got meta" in msg, msg
        return
    out = spec.run(a, backend)
    assert out.device.type == "meta" and out.shape == expected.shape and out.dtype == F32


# ---------------------------------------------------------------- dtypes


INT_DTYPES = [torch.int64, torch.int32, torch.uint8]


def _integer_positions(spec, a, dtype):
    """Non-negative integers (uint8-safe), non-decreasing for FLOATER's times."""
    p = a[spec.position]
    g = _g(5)
    if spec.family == "floater":
        return torch.tensor([0, 1, 1, 3], dtype=dtype, device=p.device)
    if spec.family == "lff":
        return torch.randint(0, 200, p.shape, generator=g).to(dtype=dtype, device=p.device)
    return torch.randint(0, 250, p.shape, generator=g).to(dtype=dtype, device=p.device)


def _integer_params():
    # int64 positions of lff, sinusoidal and dft: test_lff.py::test_integer_positions and
    # the integer case of the encodings' matrix (test_encodings.py)
    for p in matrix(exclude=("dft_inverse",)):
        op = p.values[0]
        for dt in INT_DTYPES:
            if not (dt == torch.int64 and op in ("lff", "sinusoidal", "dft")):
                yield pytest.param(*p.values, dt, id=f"{p.id}-{str(dt)[6:]}")


@pytest.mark.parametrize("op,backend,dtype", list(_integer_params()))
def test_integer_positions_are_converted(op, backend, dtype):
    spec = SPECS[op]
    a = spec.make(6)
    a[spec.position] = _integer_positions(spec, a, dtype)
    out = spec.run(a, backend)
    assert out.dtype == F32  # the weights' / x's dtype, or the default dtype
    assert_close(out, spec.reference(a), F32, spec.kind, what=f"{op} {backend} {dtype}")


@pytest.mark.parametrize("op,backend", matrix("dft_inverse"))
def test_integer_encoding_is_rejected(op, backend):
    e = torch.ones(3, 8, dtype=torch.int64, device=DEVICE)
    match = r"^encoding must have a floating dtype .* got torch\.int64"
    with pytest.raises(TypeError, match=match):
        pf.dft_inverse(e, backend=backend)


@pytest.mark.parametrize("op,backend", matrix())
def test_complex_and_bool_rejected(op, backend):
    spec = SPECS[op]
    for name in spec.args:
        for dtype in (torch.complex64, torch.bool):
            a = spec.make(7)
            a[name] = a[name].to(dtype)
            msg = _call(spec, a, backend, TypeError, rf"^{name} must ")
            assert str(dtype) in msg, msg
            if name == spec.position and name != "encoding":
                # positions: "real (floating or integer)" / "floating or integer"
                assert "floating or integer" in msg, msg
            else:
                assert "must have a floating dtype" in msg, msg


@pytest.mark.parametrize("op,backend", matrix("lff", "floater"))
def test_weights_of_mixed_dtypes_rejected(op, backend):
    spec = SPECS[op]
    first = "wr" if op == "lff" else "p0"
    weights = LFF_WEIGHTS if op == "lff" else FL_WEIGHTS
    for name in weights[1:]:
        for dtype in (torch.float64, torch.bfloat16):
            a = spec.make(8)
            a[name] = a[name].to(dtype)
            _call(
                spec,
                a,
                backend,
                TypeError,
                rf"^{name} has dtype {dtype} but {first} has torch\.float32: all weights must "
                "share one dtype",
            )


def _position_dtype_params():
    for op in ("lff", "SinusoidalPE", "SinusoidalNdPE", "DFTPE", "floater",
               "LearnableFourierFeatures", "Floater"):  # fmt: skip
        for b in _backends(SPECS[op]):
            for dt in (torch.float16, torch.bfloat16, torch.float64):
                yield pytest.param(op, b, dt, id=f"{op}-{b}-{str(dt)[6:]}")


@pytest.mark.parametrize("op,backend,dtype", list(_position_dtype_params()))
def test_positions_in_another_float_dtype(op, backend, dtype):
    """Positions in another floating dtype than the weights / x: the output keeps the
    weights' dtype and matches the reference on the positions as given; a backend that
    declares it cannot read that dtype refuses with the argument's name."""
    spec = SPECS[op]
    a = spec.make(9)
    a[spec.position] = a[spec.position].to(dtype)
    sup = _helpers.support(backend, spec.family)
    allowed = sup.input_dtypes.get(spec.position)
    if allowed is not None and dtype not in allowed:
        msg = _call(spec, a, backend, pf.BackendError, f"backend '{backend}' cannot run")
        assert f"{spec.position} dtype must be one of" in msg and str(dtype)[6:] in msg, msg
        return
    out = spec.run(a, backend)
    assert out.dtype == F32
    ref_in = dict(a)
    if spec.family == "floater":  # documented: times are converted to p0's dtype
        ref_in["times"] = a["times"].to(F32)
    assert_close(out, spec.reference(ref_in), F32, spec.kind, what=f"{op} {backend} {dtype}")


def _unsupported_dtype_params():
    for op, spec in SPECS.items():
        for b in _backends(spec):
            declared = _helpers.support(b, spec.family).dtypes
            for dt in (torch.float16, torch.bfloat16, torch.float64):
                if spec.family == "floater" and dt in (torch.float16, torch.bfloat16):
                    # integrated in float32: no backend sees them (test_floater.py, half
                    # precision)
                    continue
                if declared is not None and dt not in declared:
                    yield pytest.param(op, b, dt, id=f"{op}-{b}-{str(dt)[6:]}")


@pytest.mark.parametrize("op,backend,dtype", list(_unsupported_dtype_params()))
def test_dtype_outside_the_declaration_is_refused(op, backend, dtype):
    spec = SPECS[op]
    a = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in spec.make(10).items()}
    msg = _call(spec, a, backend, pf.BackendError, f"backend '{backend}' cannot run")
    assert f"{backend}: " in msg and f"got {str(dtype)[6:]}" in msg, msg
    assert "  torch: " in msg  # every backend's reasons are listed


# ---------------------------------------------------------------- layouts


def _non_contiguous(t):
    """Same values, every stride doubled (a view into a larger tensor)."""
    if t.dim() == 0:
        return t
    big = torch.stack([t, torch.full_like(t, 7.0)], dim=-1)
    view = big[..., 0]
    assert torch.equal(view, t) and (t.numel() < 2 or not view.is_contiguous())
    return view


def _expanded(t):
    """Row 0 repeated along dim 0 with stride 0."""
    e = t[:1].expand_as(t)
    assert e.stride(0) == 0
    return e


@pytest.mark.parametrize("op,backend", matrix(exclude=("lff",)))
def test_non_contiguous_and_expanded_inputs(op, backend):
    spec = SPECS[op]
    for layout in (_non_contiguous, _expanded):
        a = spec.make(11)
        for name in spec.args:
            a[name] = layout(a[name])
        grads = [n for n in spec.args if a[n].is_floating_point()]
        out, _ = _check_against_reference(spec, a, backend, grads, what=layout.__name__)
        dense = spec.run({k: v.contiguous() for k, v in a.items()}, backend)
        assert torch.equal(out, dense), f"{op} {backend}: layout changed the result"


# ---------------------------------------------------------------- batch sizes

# op -> tensors of an empty batch (arguments not listed keep their valid values)
EMPTY = {
    "sinusoidal": {"positions": (0, 3)},
    "sinusoidal_nd": {"coords": (0, 2)},
    "dft": {"positions": (0,)},
    "dft_inverse": {"encoding": (0, 8)},
    "SinusoidalPE": {"x": (0, 5, 8), "positions": (0, 5)},
    "SinusoidalNdPE": {"x": (0, 12), "coords": (0, 2)},
    "DFTPE": {"x": (2, 0, 8), "positions": (0,)},
    "LearnableFourierFeatures": {"x": (0, 2, 2)},
    "Floater": {"times": (0,)},
}


# floater: the compiled and torch backends in test_floater.py::test_empty_shapes_backward
EMPTY["floater"] = {"p0": (0, 4), "times": (0,)}


@pytest.mark.parametrize(
    "op,backend",
    [p for p in matrix(*EMPTY) if p.values[0] != "floater" or p.values[1] == "reference"],
)
def test_empty_batch(op, backend):
    spec = SPECS[op]
    a = spec.make(12)
    for name, shape in EMPTY[op].items():
        a[name] = torch.empty(shape, device=DEVICE)
    leaves = _float_leaves(a, spec.args)
    out = spec.run(leaves, backend)
    assert out.shape == spec.reference(a).shape and out.numel() == 0 and out.dtype == F32
    out.sum().backward()
    for name in spec.args:
        g = leaves[name].grad
        assert g is not None and g.shape == a[name].shape, name
        assert not g.any(), name


# op -> shapes with a single position
SINGLE = {
    "sinusoidal_nd": {"coords": (1, 2)},
    "dft_inverse": {"encoding": (1, 8)},
    "SinusoidalPE": {"x": (1, 1, 8), "positions": (1, 1)},
    "SinusoidalNdPE": {"x": (1, 12), "coords": (1, 2)},
    "DFTPE": {"x": (1, 8), "positions": (1,)},
    "LearnableFourierFeatures": {"x": (1, 2, 2)},
    "Floater": {"times": (1,)},
}


@pytest.mark.parametrize("op,backend", matrix(*SINGLE))
def test_single_position(op, backend):
    spec = SPECS[op]
    a = spec.make(13)
    g = _g(13)
    for name, shape in SINGLE[op].items():
        a[name] = _inputs.rand(shape, g, 0.05, 20.0, F32, DEVICE)
    _check_against_reference(spec, a, backend, spec.args, what="N=1")


# ---------------------------------------------------------------- non-finite positions


def _poison(t):
    """NaN in row 1, +inf in row 3, -inf in row 4 (one entry each)."""
    t = t.clone()
    flat = t.view(t.shape[0], -1)
    flat[1, 0] = float("nan")
    flat[3, -1] = float("inf")
    flat[4, 0] = float("-inf")
    return t


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # interpreter
@pytest.mark.parametrize("op,backend", matrix(exclude=("floater", "Floater")))
def test_nan_and_inf_stay_in_their_rows(op, backend):
    """Forward: the NaN pattern equals the reference's (assert_close checks it), so the
    rows without a non-finite input stay finite. Backward: the gradients to the positions
    of those rows are finite and correct."""
    spec = SPECS[op]
    a = spec.make(14)
    if op in ("SinusoidalPE", "DFTPE"):  # positions [B=2, L=5]: rows are (b, l) pairs
        p = a[spec.position].clone()
        p[1, 1], p[0, 3], p[1, 4] = float("nan"), float("inf"), float("-inf")
        bad = torch.zeros(p.shape, dtype=torch.bool, device=p.device)
        bad[1, 1] = bad[0, 3] = bad[1, 4] = True
        out_rows, p_rows = bad, bad
    else:  # positions [N=5, ...]: rows 1, 3, 4
        p = _poison(a[spec.position])
        out_rows = torch.tensor([False, True, False, True, True], device=p.device)
        p_rows = out_rows
    a[spec.position] = p
    out, leaves = _check_against_reference(spec, a, backend, (spec.position,), what="non-finite")
    assert not torch.isfinite(out[out_rows].flatten(1)).all(dim=1).any(), "a poisoned row is finite"
    assert torch.isfinite(out[~out_rows]).all(), "a clean row was poisoned"
    assert torch.isfinite(leaves[spec.position].grad[~p_rows]).all(), "a clean row's gradient"


@pytest.mark.parametrize("op,backend", matrix("floater", "Floater"))
def test_non_finite_times_are_rejected(op, backend):
    """FLOATER integrates from time 0 through every sample time, so a NaN time would
    poison every later state: refused up front."""
    spec = SPECS[op]
    for bad in (float("nan"), float("inf")):
        a = spec.make(15)
        t = a["times"].clone()
        t[2] = bad
        a["times"] = t
        _call(spec, a, backend, ValueError, r"^times must be finite")


@pytest.mark.parametrize("op,backend", matrix("SinusoidalPE", "SinusoidalNdPE", "DFTPE"))
def test_nan_in_x_stays_in_its_row(op, backend):
    spec = SPECS[op]
    a = spec.make(16)
    x = a["x"].clone()
    at = (1, 2, 3)[-x.dim() :]
    x[at] = float("nan")
    a["x"] = x
    out, _ = _check_against_reference(spec, a, backend, spec.args, what="NaN x")
    assert torch.isnan(out).sum() == 1 and torch.isnan(out[at])


# ---------------------------------------------------------------- huge positions


def _huge(spec, a):
    """Positions scaled so the largest phase is about 1e5 (docs/precision.md's range)."""
    p = a[spec.position]
    if spec.family == "lff":
        phase = (p.double() @ a["wr"].double().T).abs().max()
        return (p.double() * (1e5 / phase)).float()
    return (p.double() * (1e5 / p.abs().max())).float()


HUGE = ("lff", "sinusoidal", "sinusoidal_nd", "dft", "SinusoidalPE", "SinusoidalNdPE", "DFTPE",
        "LearnableFourierFeatures")  # fmt: skip


@pytest.mark.parametrize("op,backend", matrix(*HUGE))
def test_huge_positions(op, backend):
    """Forward within the fp32 tolerance of float64 math on the same fp32 inputs (LFF's
    raw features within PHASE_ATOL); gradients to the positions at fp32 gradient tolerance
    (a DFT backward on naively rounded fp32 phases is off by ~6e-3 relative here)."""
    spec = SPECS[op]
    a = spec.make(17)
    a[spec.position] = _huge(spec, a)
    if spec.family == "lff":
        # Raw cos/sin features (no MLP): the phase error itself, undoing 1/sqrt(F).
        feats = pf.lff(a["x"], a["wr"], backend=backend) * math.sqrt(8)
        err = (feats.double() - ref_lff.lff(a["x"], a["wr"]) * math.sqrt(8)).abs().max().item()
        assert err <= PHASE_ATOL, f"features off by {err:.3g} at phases up to 1e5"
    _check_against_reference(spec, a, backend, (spec.position,), what="|phase| 1e5")


# ---------------------------------------------------------------- autograd


REQUIRES_GRAD = ("lff", "sinusoidal_nd", "dft_inverse", "SinusoidalPE", "SinusoidalNdPE",
                 "DFTPE", "floater", "LearnableFourierFeatures", "Floater")  # fmt: skip


@pytest.mark.parametrize("op,backend", matrix(*REQUIRES_GRAD))
def test_requires_grad_on_positions_only(op, backend):
    spec = SPECS[op]
    a = spec.make(18)
    out, leaves = _check_against_reference(spec, a, backend, (spec.position,), what="positions")
    assert out.requires_grad
    if op not in MODULES:
        for name in spec.args:
            if name != spec.position:
                assert leaves[name].grad is None, f"{name} got a gradient it did not ask for"
    with torch.no_grad():
        assert not spec.run(_float_leaves(a, (spec.position,)), backend).requires_grad


@pytest.mark.parametrize("op,backend", matrix("Floater"))
def test_floater_cached_path_gives_times_gradients(op, backend):
    """In eval mode the module serves cached states; gradients to times still flow."""
    spec = SPECS["Floater"]
    a = spec.make(19)
    m = pf.Floater(4, 3, hidden_dim=5, substeps=2, activation="tanh", backend=backend)
    m = m.to(DEVICE).eval()
    with torch.no_grad():
        for k in FL_WEIGHTS:
            getattr(m, k).copy_(a[k])
        m(times=a["times"])  # fills the cache
    t = a["times"].detach().requires_grad_(True)
    out = m(times=t)
    g = _inputs.randn(out.shape, _g(20), F32, DEVICE)
    out.backward(g)
    t64 = a["times"].double().requires_grad_(True)
    ref_fl.floater(*(a[k] for k in FL_WEIGHTS), t64, 2, "rk4", "tanh").backward(g.double())
    assert_close(t.grad, t64.grad, F32, "grad")


@pytest.mark.parametrize("op,backend", matrix())
def test_inputs_never_modified(op, backend):
    """Forward and backward leave every input's values and version counter untouched."""
    spec = SPECS[op]
    a = spec.make(21)
    leaves = _float_leaves(a, [n for n in spec.args if a[n].is_floating_point()])
    before = {k: (v.detach().clone(), v._version) for k, v in leaves.items()}
    out = spec.run(leaves, backend)
    out.backward(_inputs.randn(out.shape, _g(22), F32, DEVICE))
    for k, v in leaves.items():
        assert torch.equal(v.detach(), before[k][0]), f"{k} was modified"
        assert v._version == before[k][1], f"{k} was written in place"
