"""Shared test configuration.

- Without a CUDA device, TRITON_INTERPRET=1 is set before anything imports the kernels,
  so the "triton" backend runs on CPU tensors through Triton's interpreter (how CI, which
  has no GPU, verifies the kernels).
- POSENC_FAST_BUILD=none unless set: no first-use build of the C++ extension in the tests.
- POSENC_FAST_TEST_DEVICE=cuda runs the device-parametrised tests on CUDA tensors (the
  H200 validation run); the default is cpu.
"""

import os

import pytest
import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
# Test collection asks the backends whether they can run, which loads the C++ extension:
# it must never compile it there (minutes, hidden inside collection). The extension comes
# from tools/setup_venv.sh (`python -m posenc_fast build`) or an ahead-of-time build; the
# tests of the first-use build set their own environment. Subprocesses inherit this.
os.environ.setdefault("POSENC_FAST_BUILD", "none")

import _helpers

import posenc_fast
from posenc_fast.cli import _inputs

DEVICE = os.environ.get("POSENC_FAST_TEST_DEVICE", "cpu")


def pytest_addoption(parser):
    group = parser.getgroup("posenc_fast")
    group.addoption(
        "--emulation-cxxflags",
        default="",
        help="extra compiler flags of the CUDA emulator (tests/floater/"
        "test_extension_cuda_emulation.py), e.g. '-fsanitize=thread -g' "
        "(tools/check_sanitizers.sh)",
    )
    group.addoption(
        "--floater-cuda-layout",
        default="",
        help="force the CUDA FLOATER integrator's layout in every test, "
        "'mode,C,Sg[,resident[,staged]]' (csrc/README.md): every layout on one GPU",
    )


@pytest.fixture(scope="session", autouse=True)
def _forced_floater_cuda_layout(request):
    """--floater-cuda-layout: the layout forced through the CUDA module's
    set_development_options for the whole session."""
    spec = request.config.getoption("--floater-cuda-layout")
    if not spec:
        yield
        return
    from posenc_fast import _extension

    cuda = _extension.load("cuda")
    if cuda is None:
        raise RuntimeError(f"--floater-cuda-layout: {'; '.join(_extension.reasons('cuda'))}")
    before = cuda.set_development_options(floater_layout=spec)["floater_layout"]
    yield
    cuda.set_development_options(floater_layout=before)


def pytest_xdist_auto_num_workers(config):
    """How many processes `-n auto` (pyproject's addopts) starts: POSENC_FAST_TEST_WORKERS
    if set; none on a CUDA test device (the GPU run sizes its own, and one process per GPU
    test keeps the > 2^31-element tests from sharing its memory); else one per core, at
    most 4 (each holds torch, the interpreter's kernels and compiled graphs: ~1-2 GB)."""
    workers = os.environ.get("POSENC_FAST_TEST_WORKERS")
    if workers:
        return int(workers)
    if DEVICE != "cpu":
        return 0
    affinity = getattr(os, "sched_getaffinity", None)
    cpus = len(affinity(0)) if affinity else (os.cpu_count() or 1)
    return max(1, min(4, cpus))


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture
def cpu_teams():
    """The C++ CPU kernels run their teams even on a busy machine (csrc/cpu/parallel.h: the
    contention fallback off, through the extension's set_development_options), as before
    afterwards."""
    from posenc_fast import _extension

    ext = _extension.load()
    if ext is None:
        yield
        return
    before = ext.set_development_options(always_team=True)["always_team"]
    try:
        yield
    finally:
        ext.set_development_options(always_team=before)


def backend_params(op: str, dtype=None, include_reference=False, exclude=()):
    """pytest params for every backend usable here that implements ``op`` on DEVICE; a
    backend that implements it but is unavailable in this environment (e.g. triton under
    an interpreter too old to verify it) is a skipped param whose reason says why."""
    names = _inputs.backends_for(op, DEVICE, dtype, include_reference)
    params = [pytest.param(n, id=n) for n in names if n not in exclude]
    for name, reasons in _helpers.unavailable_backends(op, DEVICE, dtype).items():
        if name not in exclude:
            mark = pytest.mark.skip(reason=f"backend {name!r} unavailable: {'; '.join(reasons)}")
            params.append(pytest.param(name, id=name, marks=mark))
    return params


def backend_dtype_params(op: str, dtypes, include_reference=False):
    """pytest params ``(backend, dtype)``: for each of ``dtypes``, every backend usable here
    that implements ``op`` in that dtype on DEVICE (ids "<backend>-<dtype>")."""
    return [
        pytest.param(bp.values[0], dtype, id=f"{bp.id}-{str(dtype)[6:]}", marks=bp.marks)
        for dtype in dtypes
        for bp in backend_params(op, dtype, include_reference)
    ]


@pytest.fixture
def calls():
    """Lengths (number of intervals) of every FLOATER integration run by any backend
    during the test (_helpers.count_floater_integrations)."""
    seen, restore = _helpers.count_floater_integrations()
    yield seen
    restore()


def pytest_report_header(config):
    usable = posenc_fast.available_backends(verbose=True)
    lines = [f"posenc_fast {posenc_fast.__version__}, test device {DEVICE}"]
    for name, reasons in usable.items():
        lines.append(f"  backend {name}: " + ("usable" if not reasons else "; ".join(reasons)))
    return lines


@pytest.fixture
def triton_interpreter():
    """Skips unless the Triton kernels run on CPU tensors here (TRITON_INTERPRET=1)."""
    reasons = _helpers.environment_reasons("triton")
    if reasons:
        pytest.skip("; ".join(reasons))
    if not _helpers.support("triton", "lff").implements("cpu"):
        pytest.skip("the Triton backend runs CPU tensors only under TRITON_INTERPRET=1")
