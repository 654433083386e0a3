"""Forward and backward are bitwise identical across runs, on every backend, and
torch.use_deterministic_algorithms(True) is respected (no op raises, same bits)."""

import functools

import pytest
import torch
from conftest import backend_params

import posenc_fast as pf
from posenc_fast.cli import _inputs
from posenc_fast.ops import _torch_math
from posenc_fast.tolerances import assert_close


@pytest.fixture
def deterministic(request):
    """torch.use_deterministic_algorithms(True) for the test; a test parametrising this
    fixture indirectly with False runs with the flag off (PyTorch's default)."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(getattr(request, "param", True))
    yield
    torch.use_deterministic_algorithms(before)


def _lff_run(backend, device, dtype):
    case = _inputs.LffCase((257,), 2, 2, 32, 16, 12)
    x, *w = _inputs.lff_inputs(case, dtype, device, 41)
    leaves = [x.requires_grad_(), *(t.requires_grad_() for t in w)]
    y = pf.lff(*leaves, activation="gelu_tanh", backend=backend)
    y.backward(_inputs.randn(y.shape, _inputs.generator(42), dtype, device))
    return [y.detach()] + [t.grad for t in leaves]


def _encoding_run(backend, device, dtype):
    p = _inputs.rand((3, 65), _inputs.generator(43), -500.0, 500.0, dtype, device).requires_grad_()
    x = _inputs.randn((3, 65, 24), _inputs.generator(44), dtype, device).requires_grad_()
    y1 = pf.sinusoidal(p, 24, backend=backend)
    y2 = pf.DFTPE(24, backend=backend)(x, p)
    (y1.sum() + (y2 * y2).sum()).backward()
    return [y1.detach(), y2.detach(), p.grad, x.grad]


@pytest.mark.parametrize("backend", backend_params("lff", torch.float32))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_lff_bitwise_reproducible(backend, dtype, device, deterministic):
    first, second = _lff_run(backend, device, dtype), _lff_run(backend, device, dtype)
    for i, (a, b) in enumerate(zip(first, second)):
        assert torch.equal(a, b), f"output {i} differs between two identical runs"


@pytest.mark.parametrize("backend", backend_params("encoding", torch.float32))
def test_encodings_bitwise_reproducible(backend, device, deterministic):
    first, second = (
        _encoding_run(backend, device, torch.float32),
        _encoding_run(backend, device, torch.float32),
    )
    for i, (a, b) in enumerate(zip(first, second)):
        assert torch.equal(a, b), f"output {i} differs between two identical runs"


def test_chunking_does_not_change_the_numbers(monkeypatch):
    """Chunk boundaries change nothing beyond float32 rounding (BLAS picks its kernels and
    summation order by matrix size, so bits may differ between chunk sizes; bitwise
    reproducibility is promised for repeated runs of one configuration)."""
    full = _lff_run("torch", "cpu", torch.float32)
    monkeypatch.setattr(_torch_math, "CHUNK_BYTES_OVERRIDE", 4096)  # a handful of rows per chunk
    chunked = _lff_run("torch", "cpu", torch.float32)
    for i, (a, b) in enumerate(zip(full, chunked)):
        assert_close(a, b.double(), torch.float32, "grad", what=f"output {i}")


@pytest.mark.parametrize("kind", ["sinusoidal", "dft"])
def test_encodings_in_many_chunks_match_the_reference(kind, monkeypatch):
    from posenc_fast.ops.encodings import reference as enc_ref

    monkeypatch.setattr(_torch_math, "CHUNK_BYTES_OVERRIDE", 4096)  # ~3 positions per chunk
    p = _inputs.rand((101,), _inputs.generator(7), -300.0, 300.0).requires_grad_()
    fn, ref = (pf.dft, enc_ref.dft) if kind == "dft" else (pf.sinusoidal, enc_ref.sinusoidal)
    y = fn(p, 96, backend="torch")
    p64 = p.detach().double().requires_grad_()
    want = ref(p64, 96)
    assert_close(y, want, torch.float32, "encoding", what="forward")
    g = _inputs.randn(y.shape, _inputs.generator(8))
    (got,) = torch.autograd.grad(y, p, g)
    (expected,) = torch.autograd.grad(want, p64, g.double())
    assert_close(got, expected, torch.float32, "grad", what="d positions")


def test_chunk_budget_follows_the_thread_count(monkeypatch):
    """One thread: cache-sized chunks; more threads or a GPU: few large chunks (one
    parallel region per op and chunk); CHUNK_BYTES_OVERRIDE overrides both."""
    monkeypatch.setattr(_torch_math, "CHUNK_BYTES_OVERRIDE", None)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert _torch_math.row_chunk_bytes("cpu") == _torch_math.SERIAL_CHUNK_BYTES
        assert _torch_math.row_chunk_bytes("cuda") == _torch_math.PARALLEL_CHUNK_BYTES
        rows_per_chunk = [sl.stop - sl.start for sl in _torch_math.row_chunks(16384, 10240, "cpu")]
        assert len(rows_per_chunk) > 30 and max(rows_per_chunk) * 10240 <= 4 * 2**20
        torch.set_num_threads(2)
        assert _torch_math.row_chunk_bytes("cpu") == _torch_math.PARALLEL_CHUNK_BYTES
        assert list(_torch_math.row_chunks(16384, 10240, "cpu")) == [slice(0, 16384)]
        monkeypatch.setattr(_torch_math, "CHUNK_BYTES_OVERRIDE", 4096)
        assert _torch_math.row_chunk_bytes("cpu") == 4096
    finally:
        torch.set_num_threads(before)


# -- FLOATER -------------------------------------------------------------------------------


def _floater_functional_run(backend, device, dtype, method="rk38", activation="tanh"):
    case = _inputs.FloaterCase(6, 16, 24, 20, 3, method, activation)
    leaves = [t.requires_grad_() for t in _inputs.floater_inputs(case, dtype, device, 45)]
    y = pf.floater(*leaves, case.substeps, case.method, case.activation, backend=backend)
    y.backward(_inputs.randn(y.shape, _inputs.generator(46), dtype, device))
    return [y.detach()] + [t.grad for t in leaves]


def _floater_module_run(backend, device, dtype):
    """Every path of the modules: training (recompute), eval with gradients (cached states
    with the adjoint attached), a longer eval call (extension of the cache)."""
    m = pf.FloaterAttentionBias(
        8, num_layers=2, hidden_dim=12, delta_t=0.05, substeps=2, activation="tanh",
        backend=backend, device=device, dtype=dtype,
    )  # fmt: skip
    _inputs.randomize_parameters(m, 47, 0.5)
    w = _inputs.randn((2, 3, 40, 8), _inputs.generator(48), dtype, device)
    train = m(25)
    (train * w[:, :, :25]).sum().backward()
    m.eval()
    cached = m(25)  # computed under no_grad, returned with the adjoint attached
    longer = m(40)  # the cache extended from its last state
    (cached * w[:, :, :25]).sum().backward()
    (longer * w).sum().backward()
    return [train.detach(), cached.detach(), longer.detach()] + [p.grad for p in m.parameters()]


FLOATER_RUNS = {
    "op": _floater_functional_run,
    "op-rk4-gelu": functools.partial(_floater_functional_run, method="rk4", activation="gelu"),
    "module": _floater_module_run,
}


@pytest.mark.parametrize("backend", backend_params("floater"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("run", list(FLOATER_RUNS.values()), ids=list(FLOATER_RUNS))
@pytest.mark.parametrize(
    "deterministic", [True, False], ids=["deterministic", "default"], indirect=True
)
def test_floater_bitwise_reproducible(run, backend, dtype, device, deterministic):
    first, second = run(backend, device, dtype), run(backend, device, dtype)
    assert len(first) > 3
    for i, (a, b) in enumerate(zip(first, second)):
        assert a is not None and torch.isfinite(a).all(), f"output {i}"
        assert torch.equal(a, b), f"output {i} differs between two identical runs"
