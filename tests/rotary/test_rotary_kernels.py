"""The compiled kernels of the general rotary op (triton_kernels/rotary.py, csrc/rotary/),
called as the "rotary" / "rotary_table" registries hold them, against the float64
reference: frequencies shared [F/2, M] or per head [H, F/2, M] (strided views too),
pairs "interleaved" and "half", prefix tokens, positions per token or per sample, both
layouts, F < head_dim, fewer key heads, N = 1, empty batches, forward and backward; the
same bits twice, for 1 and 2 threads and on every instruction set (C++), C++ equal to the
Triton interpreter, and phases up to 1e5 within 1e-6.
"""

from __future__ import annotations

import _helpers
import pytest
import torch
from _rotary_cases import Case, case_inputs, output_scale
from conftest import DEVICE

from posenc_fast import _extension
from posenc_fast.cli import _inputs
from posenc_fast.ops.rotary import reference, registry
from posenc_fast.tolerances import PHASE_ATOL, assert_close

# ------------------------------------------------------------------ the float64 formula


def reference_rotary(q, k, x, freqs, pairs, layout, prefix):
    """(q', k') in float64 (posenc_fast/ops/rotary/reference.py)."""
    return reference.rotary(q, k, x, freqs, pairs, layout, prefix, out_dtype=torch.float64)


def reference_table(x, freqs, pairs):
    return reference.rotary_table(x, freqs, pairs)


def _first_channels(F2: int, pairs: str) -> list[int]:
    """The first channel of each pair 0..F2-1."""
    return list(range(0, 2 * F2, 2)) if pairs == "interleaved" else list(range(F2))


# ------------------------------------------------------------------ the kernels


def _cpp_ok() -> str:
    if DEVICE != "cpu":
        return "CPU kernels"
    if _extension.load() is None:
        return "; ".join(_extension.reasons()) or "the extension is missing"
    return ""


def _triton_ok() -> str:
    import os

    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "the Triton kernels run CPU tensors only under TRITON_INTERPRET=1"
    return ""


# backend -> (rotary forward, backward, table forward, backward), as registered
KERNELS = {
    b: (
        registry.ROTARY[b].forward,
        registry.ROTARY[b].backward,
        registry.TABLE[b].forward,
        registry.TABLE[b].backward,
    )
    for b in ("cpp", "triton")
}
BACKENDS = [
    pytest.param(b, marks=pytest.mark.skipif(bool(why()), reason=why() or "-"))
    for b, why in (("cpp", _cpp_ok), ("triton", _triton_ok))
]


CASES = [
    Case(2, 3, 3, 9, 16, 16, 2, strided=True),  # LightGlue's case, fused qkv
    Case(2, 3, 3, 11, 12, 8, 2, "bnhd", "half", per_head=True, prefix=1, shared_x=True),
    Case(1, 4, 2, 7, 10, 6, 3, pairs="half", prefix=5),  # fewer key heads, N' = 2
    Case(2, 5, 5, 1, 6, 6, 1, "bnhd", per_head=True, strided=True),  # N = 1, 5 heads
    Case(2, 2, 2, 5, 8, 4, 2, "bnhd", "half", prefix=5, shared_x=True),  # every token prefix
    Case(2, 3, 3, 6, 7, 4, 2, pairs="half", per_head=True, prefix=1, strided=True),  # odd D
    Case(1, 2, 2, 70, 164, 160, 2, per_head=True, prefix=1),  # 2 tiles of tokens, 2 chunks of F
    Case(0, 2, 2, 4, 8, 8, 2, "bnhd", per_head=True, prefix=1),  # empty batch
    Case(2, 2, 1, 0, 8, 8, 2),  # no tokens
]
CASE_PARAMS = [pytest.param(c, id=c.id) for c in CASES]


def make_inputs(case: Case, dtype, seed: int, x_dtype=torch.float32):
    """(q, k, x, freqs) on DEVICE: q, k in dtype, x and freqs in x_dtype."""
    return case_inputs(case, dtype, DEVICE, seed, x_dtype)


def _expected_grads(case, inputs, gq, gk):
    """float64 (dq, dk, dx, dfreqs) of the formula for the upstream gradients gq, gk."""
    leaves = [t.detach().double().requires_grad_() for t in inputs]
    oq, ok = reference_rotary(*leaves, case.pairs, case.layout, case.prefix)
    grads = torch.autograd.grad((oq, ok), leaves, (gq.double(), gk.double()), allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads)]


def run_rotary(backend, case, inputs, gq, gk, needs=(True, True, True, True)):
    fwd, bwd, _, _ = KERNELS[backend]
    q, k, x, freqs = inputs
    oq, ok = fwd(q, k, x, freqs, case.pairs, case.layout, case.prefix)
    grads = bwd(gq, gk, q, k, x, freqs, case.pairs, case.layout, case.prefix, list(needs))
    return [oq, ok, *grads]


# ------------------------------------------------------------------ against float64


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASE_PARAMS)
def test_rotary_matches_float64(backend, case):
    dtype = torch.float32
    inputs = make_inputs(case, dtype, _helpers.seed_of(case.id))
    before = [t.clone() for t in inputs]
    q, k = inputs[:2]
    g = _inputs.generator(3)
    gq, gk = _inputs.randn(q.shape, g, dtype, DEVICE), _inputs.randn(k.shape, g, dtype, DEVICE)
    oq, ok, dq, dk, dx, dw = run_rotary(backend, case, inputs, gq, gk)
    want = reference_rotary(*inputs, case.pairs, case.layout, case.prefix)
    s = output_scale(*want)
    for got, ref, name in zip((oq, ok), want, ("q'", "k'")):
        assert got.shape == ref.shape and got.dtype == dtype and got.is_contiguous()
        assert_close(got, ref, dtype, "rotary", scale=s, what=f"{backend} {name}")
    # prefix tokens and channels beyond F pass through bitwise
    n_axis = 2 if case.layout == "bhnd" else 1
    F, p = case.rotary_dim, case.prefix
    for got, t in ((oq, q), (ok, k)):
        assert torch.equal(got.narrow(n_axis, 0, p), t.narrow(n_axis, 0, p))
        assert torch.equal(got[..., F:], t[..., F:])
    for (
        got,
        t,
    ) in zip((dq, dk), (gq, gk)):
        assert torch.equal(got.narrow(n_axis, 0, p), t.narrow(n_axis, 0, p))
        assert torch.equal(got[..., F:], t[..., F:])
    expected = _expected_grads(case, inputs, gq, gk)
    for got, ref, t, name in zip((dq, dk, dx, dw), expected, inputs, ("q", "k", "x", "freqs")):
        assert got.shape == t.shape and got.dtype == t.dtype, name
        assert_close(got, ref, dtype, "grad", what=f"{backend} d{name}")
    for t, b in zip(inputs, before):
        assert torch.equal(t, b), "inputs must not be modified"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", [CASE_PARAMS[1], CASE_PARAMS[3], CASE_PARAMS[5]])
def test_rotary_half_precision(backend, dtype, case):
    """q, k (and x, freqs) in bfloat16 / float16: one rounding of the float32 result."""
    inputs = make_inputs(case, dtype, _helpers.seed_of(case.id) + 1, x_dtype=dtype)
    g = _inputs.generator(4)
    q, k = inputs[:2]
    gq, gk = _inputs.randn(q.shape, g, dtype, DEVICE), _inputs.randn(k.shape, g, dtype, DEVICE)
    oq, ok, *grads = run_rotary(backend, case, inputs, gq, gk)
    want = reference_rotary(*inputs, case.pairs, case.layout, case.prefix)
    s = output_scale(*want)
    for got, ref, name in zip((oq, ok), want, ("q'", "k'")):
        assert got.dtype == dtype
        assert_close(got, ref, dtype, "rotary", scale=s, what=f"{backend} {name}")
    expected = _expected_grads(case, inputs, gq, gk)
    for got, ref, t, name in zip(grads, expected, inputs, ("q", "k", "x", "freqs")):
        assert got.dtype == t.dtype, name
        assert_close(got, ref, dtype, "grad", what=f"{backend} d{name}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_rotary_backward_computes_only_what_is_needed(backend):
    """Each gradient alone equals the same gradient computed with all the others."""
    case = CASES[1]
    inputs = make_inputs(case, torch.float32, 8)
    g = _inputs.generator(9)
    gq, gk = (_inputs.randn(t.shape, g, torch.float32, DEVICE) for t in inputs[:2])
    full = run_rotary(backend, case, inputs, gq, gk)[2:]
    for i in range(4):
        needs = [j == i for j in range(4)]
        alone = run_rotary(backend, case, inputs, gq, gk, needs)[2:]
        assert all(a is None for j, a in enumerate(alone) if j != i)
        # dx / dfreqs: sums whose rounding may differ with what else is computed (Triton
        # fuses them); the rotations are the same bits
        if i < 2:
            assert torch.equal(alone[i], full[i])
        else:
            assert_close(alone[i], full[i].double(), torch.float32, "grad")


TABLE_CASES = [  # (x shape, F, per head (H), pairs)
    ((2, 17, 2), 16, 0, "interleaved"),
    ((5, 3), 6, 0, "half"),
    ((2, 3, 9, 2), 8, 3, "half"),
    ((9, 1), 10, 5, "interleaved"),
    ((1, 70, 2), 160, 2, "half"),
    ((0, 3, 2), 6, 2, "interleaved"),
    ((0, 2), 6, 0, "half"),
]
TABLE_PARAMS = [
    pytest.param(c, id=f"x{'x'.join(map(str, c[0]))}-F{c[1]}-H{c[2]}-{c[3]}") for c in TABLE_CASES
]


def _table_inputs(tcase, dtype, seed):
    shape, F, H, _ = tcase
    g = _inputs.generator(seed)
    x = _inputs.randn(shape, g, torch.float32, DEVICE, 3.0)
    if H:  # per head, as a transposed view
        freqs = _inputs.randn((H, shape[-1], F // 2), g, dtype, DEVICE).transpose(1, 2)
    else:
        freqs = _inputs.randn((F // 2, shape[-1]), g, dtype, DEVICE)
    return x, freqs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tcase", TABLE_PARAMS)
def test_table_matches_float64(backend, dtype, tcase):
    fwd, bwd = KERNELS[backend][2:]
    pairs = tcase[3]
    x, freqs = _table_inputs(tcase, dtype, 11)
    table = fwd(x, freqs, pairs, dtype)
    want = reference_table(x, freqs, pairs)
    assert table.shape == want.shape and table.dtype == dtype
    assert_close(table, want, dtype, "encoding", what=f"{backend} table")
    grad = _inputs.randn(table.shape, _inputs.generator(12), dtype, DEVICE)
    xl, wl = (t.detach().double().requires_grad_() for t in (x, freqs))
    ex, ew = torch.autograd.grad(reference_table(xl, wl, pairs), (xl, wl), grad.double(),
                                 allow_unused=True)  # fmt: skip
    ex = torch.zeros_like(xl) if ex is None else ex
    ew = torch.zeros_like(wl) if ew is None else ew
    dx, dw = bwd(grad, x, freqs, pairs, True, True)
    assert dx.shape == x.shape and dx.dtype == x.dtype
    assert dw.shape == freqs.shape and dw.dtype == freqs.dtype
    assert_close(dx, ex, dtype, "grad", what=f"{backend} table dx")
    assert_close(dw, ew, dtype, "grad", what=f"{backend} table dfreqs")
    assert bwd(grad, x, freqs, pairs, False, True)[0] is None
    assert bwd(grad, x, freqs, pairs, True, False)[1] is None


# ------------------------------------------------------------------ |phase| up to 1e5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "perhead"])
@pytest.mark.parametrize("pairs", ["interleaved", "half"])
def test_phases_up_to_1e5(backend, per_head, pairs):
    """The table and the rotation of unit pairs within 1e-6 of float64 math on the same
    float32 inputs, |phase| up to 1e5 rad."""
    fwd, _, tfwd, _ = KERNELS[backend]
    g = _inputs.generator(21)
    H, F2 = 2, 20
    freqs = _inputs.randn((H, F2, 2) if per_head else (F2, 2), g, torch.float32, DEVICE)
    x = _inputs.rand((97, 2), g, -1.0, 1.0, torch.float32, DEVICE)
    x = (x * (1e5 / reference.angles(x, freqs).abs().max())).float()
    assert reference.angles(x, freqs).abs().max() > 9e4
    table = tfwd(x, freqs, pairs, torch.float32)
    assert (table.double() - reference_table(x, freqs, pairs)).abs().max() <= PHASE_ATOL
    q = torch.zeros(1, H, 97 + 1, 2 * F2 + 2, device=DEVICE)
    q[..., _first_channels(F2, pairs)] = 1.0
    oq, _ = fwd(q, q, x, freqs, pairs, "bhnd", 1)
    want = reference_rotary(q, q, x, freqs, pairs, "bhnd", 1)[0]
    assert (oq.double() - want).abs().max() <= PHASE_ATOL


# ------------------------------------------------------------------ determinism


def _everything(backend, seed=5):
    """Outputs and gradients of a few cases (one with several C++ backward blocks), and of
    a per-head table, in a list."""
    cases = [CASES[1], CASES[2], Case(3, 2, 2, 300, 20, 18, 2, "bnhd", "half", per_head=True,
                                      prefix=3, shared_x=True)]  # fmt: skip
    results = []
    for case in cases:
        if backend == "triton" and DEVICE == "cpu" and case.n > 100:
            continue  # the interpreter is slow
        inputs = make_inputs(case, torch.float32, seed)
        g = _inputs.generator(seed + 1)
        gq, gk = (_inputs.randn(t.shape, g, torch.float32, DEVICE) for t in inputs[:2])
        results += run_rotary(backend, case, inputs, gq, gk)
    tfwd, tbwd = KERNELS[backend][2:]
    x, freqs = _table_inputs(((2, 150, 2), 12, 3, "half"), torch.float32, 13)
    if backend == "triton" and DEVICE == "cpu":
        x = x[:, :40]
    table = tfwd(x, freqs, "half", torch.float32)
    results += [table, *tbwd(torch.ones_like(table), x, freqs, "half", True, True)]
    return results


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_same_bits_twice(backend):
    a, b = _everything(backend), _everything(backend)
    for i, (u, v) in enumerate(zip(a, b)):
        assert torch.equal(u, v), f"output {i}"


def test_cpp_bits_do_not_depend_on_threads_or_instruction_set():
    why = _cpp_ok()
    if why:
        pytest.skip(why)
    from _cpu_kernels import assert_every_isa_agrees, threads

    runs = {}
    for n in (1, 2):
        with threads(n):
            runs[n] = _everything("cpp")
    for i, (a, b) in enumerate(zip(runs[1], runs[2])):
        assert torch.equal(a, b), f"output {i} differs between 1 and 2 threads"
    assert_every_isa_agrees(lambda: _everything("cpp"))


def test_cpp_equals_the_triton_interpreter(triton_interpreter):
    """Same phases, the same products rounded at the same places: q', k', dq, dk and the
    tables are the Triton interpreter's bits; dx and dfreqs are sums in another order."""
    if _cpp_ok():
        pytest.skip(_cpp_ok())
    for case in (CASES[1], CASES[2], CASES[5]):
        inputs = make_inputs(case, torch.float32, 17)
        g = _inputs.generator(18)
        gq, gk = (_inputs.randn(t.shape, g, torch.float32, DEVICE) for t in inputs[:2])
        a = run_rotary("cpp", case, inputs, gq, gk)
        b = run_rotary("triton", case, inputs, gq, gk)
        for i, (u, v) in enumerate(zip(a, b)):
            if i < 4:
                assert torch.equal(u, v), f"{case.id} output {i}"
            else:
                err = (u - v).abs().max().item()
                assert err <= 4e-6 * v.abs().max().item(), f"{case.id} output {i}: {err:.3g}"
    for tcase in TABLE_CASES[:4]:
        x, freqs = _table_inputs(tcase, torch.float32, 19)
        ta = KERNELS["cpp"][2](x, freqs, tcase[3], torch.float32)
        tb = KERNELS["triton"][2](x, freqs, tcase[3], torch.float32)
        assert torch.equal(ta, tb), tcase


@pytest.mark.parametrize("pairs", ["interleaved", "half"])
def test_triton_gpu_block_sizes_in_the_interpreter(triton_interpreter, monkeypatch, pairs):
    """The GPU's block rule (16 tokens x 32 frequencies, 16 for halves) through the
    interpreter: several tiles of tokens and of prefix tokens, per-head groups, chunks of
    frequencies with a partial last one."""
    from posenc_fast.triton_kernels import rotary as kernels

    monkeypatch.setattr(
        kernels, "blocks", lambda n, f, half=False: (kernels.gpu_blocks(f, half), {})
    )
    case = Case(2, 2, 2, 40, 84, 80, 2, "bnhd", pairs, per_head=True, prefix=18)
    inputs = make_inputs(case, torch.float32, 41)
    g = _inputs.generator(42)
    gq, gk = (_inputs.randn(t.shape, g, torch.float32, DEVICE) for t in inputs[:2])
    oq, ok, *grads = run_rotary("triton", case, inputs, gq, gk)
    want = reference_rotary(*inputs, case.pairs, case.layout, case.prefix)
    for got, ref in zip((oq, ok), want):
        assert_close(got, ref, torch.float32, "rotary", scale=output_scale(*want))
    for got, ref in zip(grads, _expected_grads(case, inputs, gq, gk)):
        assert_close(got, ref, torch.float32, "grad")


# ------------------------------------------------------------------ the C++ ops' checks


def _ops():
    return torch.ops.posenc_fast


@pytest.mark.skipif(bool(_cpp_ok()), reason=_cpp_ok() or "-")
@pytest.mark.parametrize(
    "change,exc,match",
    [
        (dict(pairs="rot"), ValueError, "pairs must be 'interleaved' or 'half'"),
        (dict(prefix=12), ValueError, r"prefix must be in \[0, N\]"),
        (dict(prefix=2), ValueError, r"x must have shape \[B, N - prefix, M\]"),
        (dict(freqs=torch.zeros(2, 4, 2)), ValueError, "freqs per head"),
        (dict(freqs=torch.zeros(4, 3)), ValueError, r"freqs must have shape \[F/2, M\]"),
        (dict(freqs=torch.zeros(3, 7, 2)), ValueError, "more than head_dim = 12"),
        (dict(freqs=torch.zeros(3, 4, 2).double()), TypeError, "freqs must be float32"),
    ],
    ids=["pairs", "prefix-range", "prefix-x", "perhead-heads", "freqs-shape", "freqs-wide",
         "freqs-f64"],
)  # fmt: skip
def test_cpp_ops_check_and_name_the_argument(change, exc, match):
    case = CASES[1]
    q, k, x, freqs = make_inputs(case, torch.float32, 31)
    args = dict(q=q, k=k, x=x, freqs=freqs, pairs=case.pairs, layout=case.layout,
                prefix=case.prefix)  # fmt: skip
    args.update(change)
    with pytest.raises(exc, match=match):
        _ops().rotary_kernel(*args.values())
    oq, ok = q.clone(), k.clone()
    with pytest.raises(exc, match=match):
        _ops().rotary_kernel_backward(oq, ok, *args.values(), [True] * 4)


@pytest.mark.skipif(bool(_cpp_ok()), reason=_cpp_ok() or "-")
def test_cpp_table_ops_check_and_opcheck():
    x, freqs = _table_inputs(TABLE_CASES[2], torch.float32, 32)
    with pytest.raises(ValueError, match="pairs must be"):
        _ops().rotary_table_kernel(x, freqs, "rot", torch.float32)
    with pytest.raises(ValueError, match=r"x must have shape \[..., N, M\]"):
        _ops().rotary_table_kernel(x[0, 0, 0], freqs, "half", torch.float32)
    t = _ops().rotary_table_kernel(x, freqs, "half", torch.float32)
    with pytest.raises(ValueError, match="grad must have the table's shape"):
        _ops().rotary_table_kernel_backward(t[:1], x, freqs, "half", True, True)
    opcheck = torch.library.opcheck
    opcheck(_ops().rotary_table_kernel.default, (x, freqs, "half", torch.bfloat16))
    opcheck(_ops().rotary_table_kernel_backward.default,
            (torch.randn_like(t), x, freqs, "half", True, True))  # fmt: skip
    case = CASES[1]
    q, k, xq, fq = make_inputs(case, torch.float32, 33)
    args = (q, k, xq, fq, case.pairs, case.layout, case.prefix)
    opcheck(_ops().rotary_kernel.default, args)
    oq, ok = _ops().rotary_kernel(*args)
    for needs in ([True] * 4, [False, True, False, True]):
        opcheck(_ops().rotary_kernel_backward.default, (oq, ok, *args, needs))


@pytest.mark.skipif(bool(_cpp_ok()), reason=_cpp_ok() or "-")
def test_cpp_gradcheck_at_float32_precision():
    """The backward is the derivative of the C++ forward itself (central differences of the
    float32 forward, step 1e-2), with per-head frequencies, halves and a prefix."""
    case = Case(2, 2, 2, 4, 6, 4, 2, "bnhd", "half", per_head=True, prefix=1)
    inputs = [t.requires_grad_() for t in make_inputs(case, torch.float32, 34)]

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, x, freqs):
            ctx.save_for_backward(q, k, x, freqs)
            return KERNELS["cpp"][0](q, k, x, freqs, case.pairs, case.layout, case.prefix)

        @staticmethod
        def backward(ctx, gq, gk):
            q, k, x, freqs = ctx.saved_tensors
            return tuple(KERNELS["cpp"][1](
                gq.contiguous(), gk.contiguous(), q, k, x, freqs, case.pairs, case.layout,
                case.prefix, [True] * 4,
            ))  # fmt: skip

    with pytest.warns(UserWarning, match="double precision"):
        assert torch.autograd.gradcheck(Fn.apply, inputs, eps=1e-2, atol=2e-3, rtol=2e-2)
