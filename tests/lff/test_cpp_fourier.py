"""The C++ LFF and encoding kernels (csrc/lff, csrc/encodings) beyond the shared matrix,
which already runs their "cpp" rows (tests/lff/test_lff.py,
tests/encodings/test_encodings.py, ...): every
instruction set and every thread count computes the same bits, the numbers are the Triton
kernels' (to float32 rounding; bitwise where no matrix product is involved), phases up to
1e5 stay within 1e-6 on every instruction set, gradients are the derivatives of the forward
(gradcheck at float32 precision), the low-level ops check their arguments and pass
opcheck, and outputs past 2^31 elements are indexed correctly.
"""

from __future__ import annotations

import math

import pytest
import torch
from _cpu_kernels import (
    ISAS,
    assert_every_isa_agrees,
    cpu_isa,
    isas_here,
    threads,
)
from test_lff import BAD_SHAPES

import posenc_fast as pf
from posenc_fast.cli import _inputs
from posenc_fast.ops.encodings import reference as ref_enc
from posenc_fast.ops.lff import reference as ref_lff
from posenc_fast.tolerances import PHASE_ATOL, assert_close


def ops():
    return torch.ops.posenc_fast


# Odd sizes (vector tails everywhere: F/2 = 37, H = 19, Dg = 45, M = 3), two groups, and
# enough rows for several tiles and backward blocks (blocks of >= 96 rows).
LFF_CASE = _inputs.LffCase((173, 2), 2, 3, 74, 19, 45, "gelu_tanh")


def _lff_all(dtype, activation="gelu_tanh", case=LFF_CASE, seed=5):
    """Forward output and every gradient of one LFF call (cpp), in a list."""
    x, *w = _inputs.lff_inputs(case, dtype, "cpu", seed)
    leaves = [x.requires_grad_(), *(t.requires_grad_() for t in w)]
    y = pf.lff(*leaves, activation=activation, backend="cpp")
    y.backward(_inputs.randn(y.shape, _inputs.generator(seed + 1), dtype))
    return [y.detach()] + [t.grad for t in leaves]


def _encodings_all(dtype):
    """Table, fused add (broadcast positions and per-row ones), backward: cpp, one list."""
    g = _inputs.generator(9)
    p = _inputs.rand((5, 83), g, -3e3, 3e3, dtype).requires_grad_()
    pi = torch.randint(-(2**40), 2**40, (83,), generator=g)
    x = _inputs.randn((5, 83, 38), g, dtype).requires_grad_()
    out = []
    for fn, mod in (
        (pf.sinusoidal, pf.SinusoidalPE),
        (pf.dft, pf.DFTPE),
    ):
        t = fn(p, 38, backend="cpp")
        a = mod(38, backend="cpp")(x, p)
        b = mod(38, backend="cpp")(x, pi)
        (t.square().sum() + (a * b).sum()).backward()
        out += [t.detach(), a.detach(), b.detach(), fn(pi, 38, backend="cpp"), p.grad.clone()]
        p.grad = None
    out.append(pf.sinusoidal(p.detach(), 38, block=7.5, backend="cpp"))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_instruction_set_gives_the_same_bits(dtype):
    """AVX-512, AVX2 and the baseline code: explicit FMAs, no compiler contraction and
    width-independent sums (csrc/cpu/per_isa.h, simd.h) make them bitwise equal."""
    assert_every_isa_agrees(lambda: _lff_all(dtype) + _encodings_all(dtype))


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu"])
def test_results_do_not_depend_on_the_thread_count(activation):
    """Forward tiles and backward blocks are fixed by the shapes; the weight gradients are
    summed over blocks in block order: 1, 2 and 3 threads give the same bits."""
    runs = {}
    for n in (1, 2, 3):
        with threads(n):
            runs[n] = _lff_all(torch.float32, activation) + _encodings_all(torch.float32)
    for n in (2, 3):
        for i, (a, b) in enumerate(zip(runs[1], runs[n])):
            assert torch.equal(a, b), f"output {i} differs between 1 and {n} threads"


def test_concurrent_calls_from_python_threads():
    """Each call has its own work counter, scratch and partial sums: two Python threads
    calling at once (each call opening its own parallel region) get the same bits."""
    want = _lff_all(torch.float32)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda _: _lff_all(torch.float32), range(4)))
    for run in got:
        for a, b in zip(want, run):
            assert torch.equal(a, b)


# ---------------------------------------------------------------- the Triton kernels' numbers


def test_features_and_encodings_equal_the_triton_kernels_bitwise(triton_interpreter):
    """Same phase reduction and polynomials, lane for lane (triton_kernels/_phase.py): the
    features and the tables are the same float32 numbers, including integer positions
    beyond 2^24 (split into hi + lo) and phases of 1e4 turns."""
    g = _inputs.generator(0)
    x = _inputs.randn((300, 1, 3), g, scale=50.0)
    wr = _inputs.randn((37, 3), g)
    for isa in isas_here():
        with cpu_isa(isa):
            assert torch.equal(pf.lff(x, wr, backend="cpp"), pf.lff(x, wr, backend="triton")), isa
    p = _inputs.rand((500,), g, -1e4, 1e4)
    pi = torch.randint(-(2**40), 2**40, (500,), generator=g)
    for fn in (pf.dft, pf.sinusoidal):
        for q in (p, pi):
            a, b = fn(q, 70, backend="cpp"), fn(q, 70, backend="triton")
            assert torch.equal(a, b), f"{fn.__name__} {q.dtype}"


def test_lff_and_gradients_agree_with_the_triton_kernels(triton_interpreter):
    """With the MLP, the products are summed in another order: float32 rounding apart."""
    case = _inputs.LffCase((61,), 2, 3, 74, 19, 45)
    x, *w = _inputs.lff_inputs(case, torch.float32, "cpu", 4)
    grad = _inputs.randn((61, 90), _inputs.generator(5))
    res = {}
    for name in ("cpp", "triton"):
        leaves = [x.clone().requires_grad_(), *(t.clone().requires_grad_() for t in w)]
        y = pf.lff(*leaves, backend=name)
        y.backward(grad)
        res[name] = [y.detach()] + [t.grad for t in leaves]
    for i, (a, b) in enumerate(zip(res["cpp"], res["triton"])):
        scale = b.abs().max().item()
        assert (a - b).abs().max().item() <= 4e-6 * scale, f"output {i}"


# ---------------------------------------------------------------- accuracy


@pytest.mark.parametrize("isa", ISAS)
def test_phases_up_to_1e5_on_every_instruction_set(isa):
    """cos / sin features and tables within 1e-6 of float64 math on the same float32
    inputs, |phase| up to 1e5 rad (docs/precision.md), whichever code the CPU runs."""
    if isa not in isas_here():
        pytest.skip(f"CPU lacks {isa}")
    g = _inputs.generator(21)
    wr = _inputs.randn((40, 2), g)
    x = _inputs.rand((257, 1, 2), g, -1.0, 1.0)
    x = (x * (1e5 / (x.double().squeeze(1) @ wr.double().T).abs().max())).float()
    p = _inputs.rand((300,), g, -1e5, 1e5)
    with cpu_isa(isa):
        feats = pf.lff(x, wr, backend="cpp") * math.sqrt(80)
        tables = [pf.sinusoidal(p, 64, backend="cpp"), pf.dft(p, 64, backend="cpp") * 4.0]
    assert (x.double().squeeze(1) @ wr.double().T).abs().max() > 9e4
    assert (feats.double() - ref_lff.lff(x, wr) * math.sqrt(80)).abs().max() <= PHASE_ATOL
    want = [ref_enc.sinusoidal(p, 64), ref_enc.dft(p, 64) * 4.0]
    for got, exp in zip(tables, want):
        assert (got.double() - exp).abs().max() <= PHASE_ATOL


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_gradcheck_at_float32_precision(activation):
    """The backward is the derivative of the C++ forward itself: central differences of
    the float32 forward (step 1e-2: truncation ~1e-4, rounding ~1e-5 relative)."""
    case = _inputs.LffCase((3,), 2, 2, 6, 4, 3, activation)
    inputs = [t.requires_grad_() for t in _inputs.lff_inputs(case, torch.float32, "cpu", 11)]

    def fn(*a):
        return pf.lff(*a, activation=activation, backend="cpp")

    with pytest.warns(UserWarning, match="double precision"):
        assert torch.autograd.gradcheck(fn, inputs, eps=1e-2, atol=2e-3, rtol=2e-2)
    p = (torch.rand(5) * 30).requires_grad_()
    x = torch.randn(2, 5, 8, requires_grad=True)
    for module in (pf.SinusoidalPE(8, backend="cpp"), pf.DFTPE(8, backend="cpp")):
        with pytest.warns(UserWarning, match="double precision"):
            assert torch.autograd.gradcheck(module, (x, p), eps=1e-2, atol=2e-3, rtol=2e-2)


# ---------------------------------------------------------------- the low-level ops


def _lff_args():
    case = _inputs.LffCase((4,), 2, 2, 8, 4, 6)
    return list(_inputs.lff_inputs(case, torch.float32, "cpu", 31))


@pytest.mark.parametrize(
    "mutate,exc,match",
    [
        *BAD_SHAPES,
        pytest.param(lambda a: a.__setitem__(0, a[0].double()), TypeError,
                     "x must be float32, bfloat16", id="x-f64"),
        pytest.param(lambda a: a.__setitem__(2, a[2].half()), TypeError,
                     "w1 must have wr's dtype", id="dtype"),
        pytest.param(lambda a: a.__setitem__(1, a[1].long()), TypeError, "wr must be float32",
                     id="wr-int"),
    ],
)  # fmt: skip
def test_lff_kernel_checks_name_the_argument(mutate, exc, match):
    args = _lff_args()
    mutate(args)
    with pytest.raises(exc, match=match):
        ops().lff_kernel(*args, "gelu", torch.float32)


def test_lff_kernel_checks_options():
    args = _lff_args()
    with pytest.raises(ValueError, match="activation must be one of"):
        ops().lff_kernel(*args, "swish", torch.float32)
    with pytest.raises(TypeError, match="out_dtype must be float32"):
        ops().lff_kernel(*args, "gelu", torch.float64)
    y = ops().lff_kernel(*args, "gelu", torch.float32)
    with pytest.raises(ValueError, match="needs must have 6 entries"):
        ops().lff_kernel_backward(y, *args, "gelu", [True])
    with pytest.raises(ValueError, match="grad must have the output's shape"):
        ops().lff_kernel_backward(y[:, :3], *args, "gelu", [True] * 6)


F32 = torch.float32


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda o: o.encoding_kernel(torch.ones(3), 7, "dft", 1.0, None, F32),
         ValueError, "dim must be a positive even number"),
        (lambda o: o.encoding_kernel(torch.ones(3), 8, "rope", 1.0, None, F32),
         ValueError, "kind must be 'sinusoidal' or 'dft'"),
        (lambda o: o.encoding_kernel(torch.ones(3), 8, "sinusoidal", -1.0, None, F32),
         ValueError, "base must be a finite positive"),
        (lambda o: o.encoding_kernel(torch.ones(3), 8, "sinusoidal", 1e4, float("inf"), F32),
         ValueError, "block must be finite"),
        (lambda o: o.encoding_kernel(torch.ones(3).double(), 8, "dft", 1.0, None, F32),
         TypeError, "positions must be float32, bfloat16, float16 or an integer"),
        (lambda o: o.encoding_kernel(torch.ones(3, dtype=torch.bool), 8, "dft", 1.0, None, F32),
         TypeError, "positions must be float32"),
        (lambda o: o.encoding_add_kernel(torch.ones(2, 3, 8), torch.ones(4), "dft", 1.0, None),
         ValueError, "positions must broadcast to x.shape"),
        (lambda o: o.encoding_add_kernel(torch.ones(3, 8).double(), torch.ones(3), "dft", 1., None),
         TypeError, "x must be float32"),
        (lambda o: o.encoding_kernel_backward(torch.ones(3, 6), torch.ones(3), 8, "dft", 1.0),
         ValueError, r"grad must have shape \[\*positions.shape, dim\]"),
    ],
    ids=["odd-dim", "kind", "base", "block", "positions-f64", "positions-bool", "broadcast",
         "x-f64", "grad-shape"],
)  # fmt: skip
def test_encoding_kernel_checks_name_the_argument(call, exc, match):
    with pytest.raises(exc, match=match):
        call(ops())


def test_opcheck_low_level_ops():
    args = _lff_args()  # the low-level ops have no autograd: the Python ops carry it
    opcheck = torch.library.opcheck
    opcheck(ops().lff_kernel.default, (*args, "gelu_tanh", torch.bfloat16))
    opcheck(
        ops().lff_kernel.default, (args[0], args[1], None, None, None, None, "relu", torch.float32)
    )
    y = ops().lff_kernel(*args, "gelu", torch.float32).detach()
    plain = [t.detach() for t in args]
    opcheck(ops().lff_kernel_backward.default, (torch.randn_like(y), *plain, "gelu", [True] * 6))
    opcheck(
        ops().lff_kernel_backward.default,
        (torch.randn_like(y), *plain, "gelu", [False, True, False, True, False, True]),
    )
    p = torch.rand(3, 5) * 20
    x = torch.randn(2, 3, 5, 8)
    opcheck(ops().encoding_kernel.default, (p, 8, "sinusoidal", 1e4, 3.0, torch.float16))
    opcheck(ops().encoding_add_kernel.default, (x, p, "dft", 1.0, None))
    opcheck(ops().encoding_add_kernel.default, (x, torch.arange(5), "sinusoidal", 1e4, None))
    opcheck(ops().encoding_kernel_backward.default, (torch.randn(3, 5, 8), p, 8, "dft", 1.0))


def test_inputs_are_not_modified_and_strides_are_honoured():
    case = _inputs.LffCase((40,), 2, 3, 10, 5, 7)
    x, *w = _inputs.lff_inputs(case, torch.float32, "cpu", 8)
    before = [t.clone() for t in (x, *w)]
    xs = torch.stack([x, -x], dim=-1)[..., 0]  # strided view equal to x
    grad = torch.randn(40, 14).T.contiguous().T  # column-major
    plain = ops().lff_kernel_backward(grad.contiguous(), x, *w, "gelu", [True] * 6)
    strided = ops().lff_kernel_backward(grad, xs, *w, "gelu", [True] * 6)
    for a, b in zip(plain, strided):
        assert torch.equal(a, b)
    for t, b in zip((x, *w), before):
        assert torch.equal(t, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_outputs_of_16_mib_and_more(dtype):
    """Outputs from 16 MiB on are written with streaming stores (and outputs from 32 MiB
    are advised as huge pages): the same numbers as the reference, tails included
    (Dg = 776 is not a multiple of the vector width)."""
    case = _inputs.LffCase((5800,), 1, 2, 64, 16, 776)
    x, *w = _inputs.lff_inputs(case, dtype, "cpu", 13)
    y = pf.lff(x, *w, backend="cpp")  # 18 MB in float32
    rows = list(range(0, 5800, 7))
    assert_close(y[rows], ref_lff.lff(x[rows], *w), dtype, "lff")
    p = _inputs.rand((12000,), _inputs.generator(14), -500.0, 500.0, dtype)
    for fn, ref in ((pf.sinusoidal, ref_enc.sinusoidal), (pf.dft, ref_enc.dft)):
        t = fn(p, 768, backend="cpp")
        assert t.numel() * t.element_size() >= 16 * 2**20
        assert_close(t[::5], ref(p[::5], 768), dtype, "encoding")
    xa = _inputs.randn((4, 3000, 768), _inputs.generator(15), dtype)
    ya = pf.SinusoidalPE(768, backend="cpp")(xa)
    want = xa[:, ::9].double() + ref_enc.sinusoidal(torch.arange(0, 3000, 9), 768)
    assert_close(ya[:, ::9], want, dtype, "encoding" if dtype == torch.float32 else "lff")


# ---------------------------------------------------------------- 64-bit indexing


def _available_gb() -> float:
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) / 2**20
    except (OSError, KeyError, ValueError):
        return 0.0


@pytest.mark.slow
def test_outputs_past_2_31_elements():
    """A bfloat16 table and LFF features of 2^31 + a few thousand elements (4.3 GB each,
    one after the other): the rows around element 2^31, where a 32-bit offset would wrap,
    and the last rows match the float64 reference."""
    if _available_gb() < 12:
        pytest.skip(f"needs ~12 GB of free memory, {_available_gb():.1f} GB available")
    big = 2**31

    def rows(n, width):
        return sorted({0, (big - 1) // width, big // width, big // width + 1, n - 1})

    n, dim = 2**21 + 3, 1024
    p = torch.arange(n, dtype=torch.float32) * 0.37 - 1000.0
    out = ops().encoding_kernel(p, dim, "sinusoidal", 1e4, None, torch.bfloat16)
    r = rows(n, dim)
    assert_close(out[r], ref_enc.sinusoidal(p[r], dim), torch.bfloat16, "encoding")
    del out
    n, F2 = 2**20 + 3, 1024
    x = (torch.arange(n, dtype=torch.float32) * 1e-3).reshape(n, 1, 1)
    wr = _inputs.randn((F2, 1), _inputs.generator(2))
    out = ops().lff_kernel(x, wr, None, None, None, None, "gelu", torch.bfloat16)
    r = rows(n, 2 * F2)
    assert_close(out[r], ref_lff.lff(x[r], wr), torch.bfloat16, "encoding")


def test_lff_memory_is_the_output_and_a_little_scratch():
    """Forward + backward hold no [N, F] or [N, H] tensor: the peak above the inputs is the
    output, dY's gradient pass and per-block partial sums (profiler allocation records)."""
    from posenc_fast.cli._timing import peak_bytes_cpu

    N = 4096
    case = _inputs.LffCase((N,), 1, 2, 256, 32, 64)
    x, *w = _inputs.lff_inputs(case, torch.float32, "cpu", 12)
    w = [t.requires_grad_() for t in w]
    grad = torch.randn(N, 64)

    def step():
        pf.lff(x, *w, backend="cpp").backward(grad)

    peak = peak_bytes_cpu(step)
    features = N * 256 * 4  # what an unfused implementation would hold (4 MiB)
    assert peak < N * 64 * 4 + features / 2, f"peak {peak / 2**20:.1f} MiB"
