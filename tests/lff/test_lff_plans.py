"""The Triton LFF backend's two plans and the choice between them
(posenc_fast/ops/lff/plan.py).

- The "gemm" plan (triton_kernels/lff_gemm.py: products through torch.mm / addmm, Triton
  kernels for the rest) against the float64 reference, forward and every gradient, on CPU
  tensors: the products run through torch on the CPU and the Triton kernels in the
  interpreter, exactly the code the GPU runs around cuBLAS.
- The choice: the cost model on mocked ceilings, ``auto`` never taking the plan the model
  or a measurement shows slower, the measured choice remembered per GPU and versions,
  the refusal under deterministic algorithms, the forced plan, the debug line.
- float32 products follow torch's TF32 settings (read, not timed).
- Small inputs: the forward is one launch and never synchronises with the host.
"""

import json
import logging

import _helpers
import pytest
import torch
from conftest import DEVICE

import posenc_fast as pf
from posenc_fast.cli import _inputs
from posenc_fast.ops.lff import plan as lff_plan
from posenc_fast.ops.lff import reference as ref
from posenc_fast.ops.lff.registry import LFF
from posenc_fast.tolerances import assert_close

triton = pytest.importorskip("triton")
from posenc_fast.triton_kernels import _gemm_sizes, _launch, lff_gemm  # noqa: E402

TRITON_REASONS = _helpers.environment_reasons("triton")
needs_triton = pytest.mark.skipif(
    bool(TRITON_REASONS) or DEVICE not in LFF["triton"].support.devices,
    reason=f"triton backend unavailable on {DEVICE}: {TRITON_REASONS}",
)
NAMES = _helpers.LFF_NAMES
CACHE_PATH = lff_plan.cache_path  # the fixture below replaces it


@pytest.fixture(autouse=True)
def _fresh_decisions(monkeypatch, tmp_path):
    """Every test decides afresh, with no plan forced, measuring off, its own cache file."""
    monkeypatch.delenv(lff_plan.ENV_PLAN, raising=False)
    monkeypatch.setattr(lff_plan, "cache_path", lambda: str(tmp_path / "lff_plans.json"))
    lff_plan.forget()
    yield
    lff_plan.forget()


@pytest.fixture
def gemm_plan(monkeypatch):
    """The gemm plan for every triton call, in chunks of 256 rows."""
    monkeypatch.setenv(lff_plan.ENV_PLAN, "gemm")
    monkeypatch.setattr(_gemm_sizes, "BUFFER_BYTES", 1)
    lff_plan.forget()


# ---------------------------------------------------------------- the gemm plan


MLP_CASES = [c for c in _inputs.LFF_CASES if c.hidden_dim]


@needs_triton
@pytest.mark.parametrize("case", MLP_CASES, ids=lambda c: c.id)
def test_gemm_plan_shared_matrix_float32(case, gemm_plan):
    """Forward and every gradient through pf.lff (the custom op and its autograd) on the
    shared LFF matrix (N = 0 and 1, batch dimensions, groups, every activation)."""
    inputs = _inputs.lff_inputs(case, torch.float32, DEVICE, seed=7)
    y = pf.lff(*inputs, activation=case.activation, backend="triton")
    assert_close(y, ref.lff(*inputs, case.activation), torch.float32, "lff", what=case.id)
    _helpers.check_lff_backward(case, inputs, "triton", 8, "gemm plan")


@needs_triton
@pytest.mark.parametrize(
    "dtype,act",
    [(torch.float32, "gelu"), (torch.bfloat16, "relu"), (torch.float16, "gelu_tanh")],
    ids=["fp32-gelu", "bf16-relu", "fp16-gelu_tanh"],
)
def test_gemm_plan_chunks_against_float64(dtype, act, gemm_plan):
    """270 rows in chunks of 256 and 14: the features, products and weight-gradient sums
    carried over chunks; relu with a half-precision MLP takes the split features (hi and
    lo in one product), whose pre-activations keep float32's sign."""
    case = _inputs.LffCase((270,), 1, 2, 20, 24, 40, act)
    inputs = _inputs.lff_inputs(case, dtype, DEVICE, seed=61)
    y = pf.lff(*inputs, activation=act, backend="triton")
    assert_close(y, ref.lff(*inputs, act), dtype, "lff", what=case.id)
    _helpers.check_lff_backward(case, inputs, "triton", 62, "gemm plan")


@needs_triton
def test_gemm_plan_deterministic_and_only_needed_gradients(gemm_plan):
    """Two runs give the same bits; each gradient alone is bitwise the one computed with
    the others (the chunks, programs and orders do not depend on ``needs``); db2 alone
    (no hidden layer) and dw2 without db2 take their own products."""
    case = _inputs.LffCase((260,), 1, 2, 16, 24, 40)  # chunks of 256 and 4 rows
    args = _inputs.lff_inputs(case, torch.bfloat16, DEVICE, seed=63)
    g = _inputs.randn((260, 40), _inputs.generator(64), torch.bfloat16, DEVICE)
    first = LFF["triton"].backward(g, *args, "gelu", [True] * 6)
    second = LFF["triton"].backward(g, *args, "gelu", [True] * 6)
    for name, a, b in zip(NAMES, first, second):
        assert torch.equal(a, b), f"d{name} differs between two runs"
    for which in ({0}, {2}, {5}, {1, 3, 4}):
        needs = [i in which for i in range(6)]
        got = LFF["triton"].backward(g, *args, "gelu", needs)
        assert [t is not None for t in got] == needs
        for i in which:
            if i == 5 and which == {5}:  # its own product with a column of ones
                torch.testing.assert_close(got[i], first[i], rtol=1e-2, atol=1e-2)
            else:
                assert torch.equal(got[i], first[i]), f"d{NAMES[i]} with needs {needs}"


@needs_triton
def test_gemm_plan_under_autocast(gemm_plan):
    """float32 weights feeding a bf16 MLP (autocast): converted once per call; float32
    gradients for float32 weights."""
    case = _inputs.LffCase((40,), 1, 2, 32, 16, 24)
    x, *w = _inputs.lff_inputs(case, torch.float32, DEVICE, seed=3)
    leaves = [t.clone().requires_grad_(True) for t in w]
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        y = pf.lff(x, *leaves, backend="triton")
    assert y.dtype == torch.bfloat16
    assert_close(y, ref.lff(x.double(), *w), torch.bfloat16, "lff")
    g = _inputs.randn(y.shape, _inputs.generator(4), torch.bfloat16, DEVICE)
    y.backward(g)
    w64 = [t.detach().double().requires_grad_(True) for t in w]
    ref.lff(x.double(), *w64).backward(g.double())
    for name, got, want in zip(NAMES[1:], leaves, w64):
        assert got.grad.dtype == torch.float32, name
        assert_close(got.grad, want.grad, torch.bfloat16, "grad", what=f"d{name}")


@needs_triton
def test_gemm_plan_agrees_with_the_fused_plan(monkeypatch):
    """float32: both plans agree to float32 rounding (other summation orders)."""
    case = _inputs.LffCase((200,), 1, 3, 24, 16, 20, "gelu_tanh")
    args = _inputs.lff_inputs(case, torch.float32, DEVICE, seed=65)
    g = _inputs.randn((200, 20), _inputs.generator(66), torch.float32, DEVICE)
    results = {}
    for plan in ("fused", "gemm"):
        monkeypatch.setenv(lff_plan.ENV_PLAN, plan)
        y = LFF["triton"].forward(*args, "gelu_tanh", torch.float32)
        results[plan] = [y, *LFF["triton"].backward(g, *args, "gelu_tanh", [True] * 6)]
    for name, a, b in zip(("y", *NAMES), results["fused"], results["gemm"]):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5, msg=f"{name}")


def test_gemm_chunks_are_a_fixed_function_of_the_shapes():
    """Chunks: multiples of 256 rows within the buffer budget, whatever the needs."""
    C = _gemm_sizes.chunk_rows(2**20, 384, 256, 2, True, False)
    assert C % _gemm_sizes.MIN_CHUNK == 0
    assert C * _gemm_sizes.bytes_per_row(384, 256, 2, True, False) <= _gemm_sizes.BUFFER_BYTES
    assert _gemm_sizes.chunk_rows(100, 384, 256, 2, True, False) == 100


# ---------------------------------------------------------------- the choice


def _work(name, dtype="bf16", mode="fwd", **kw):
    R, M, F2, H, Dg = lff_plan.REFERENCE_SHAPES[name]
    kind, itemsize = ("mma16", 2) if dtype == "bf16" else ("ieee", 4)
    return lff_plan.Work(mode, kw.pop("rows", R), M, F2, H, Dg, kind, itemsize, **kw)


def _never_measure(plans):
    raise AssertionError("measured without POSENC_FAST_LFF_PLAN=measure")


@pytest.mark.parametrize(
    "name,dtype,mode,expected",
    [
        ("compute", "bf16", "fwd", "gemm"),
        ("compute", "bf16", "bwd", "gemm"),
        ("compute", "fp32", "fwd", "gemm"),
        ("canonical", "bf16", "fwd", "fused"),
        ("canonical", "bf16", "bwd", "fused"),
        ("small", "bf16", "fwd", "fused"),
        ("seq1d", "bf16", "fwd", "fused"),
    ],
)
def test_model_picks_the_plan_the_counts_favour(name, dtype, mode, expected):
    """On the H200's recorded ceilings: cuBLAS for the compute-bound shape, the fused
    pass where the output's bytes bind and for small inputs (one launch)."""
    w = _work(name, dtype, mode)
    d = lff_plan.decide(w, "NVIDIA H200", _never_measure)
    assert (d.plan, d.how) == (expected, "model"), d.line(w)
    assert d.estimates[d.plan].ms == min(e.ms for e in d.estimates.values())


def test_auto_never_takes_the_plan_the_model_shows_slower():
    """Across a grid of shapes and both kinds: the decision is the model's argmin."""
    for rows in (1, 4096, 2**16, 2**20):
        for F2, H, Dg in ((128, 32, 768), (384, 256, 1024), (64, 128, 256), (16, 16, 2048)):
            for kind, e in (("mma16", 2), ("ieee", 4), ("tf32", 4)):
                for mode in ("fwd", "bwd"):
                    w = lff_plan.Work(mode, rows, 2, F2, H, Dg, kind, e)
                    d = lff_plan.decide(w, "NVIDIA H200", _never_measure)
                    best = min(d.estimates, key=lambda p: d.estimates[p].ms)
                    assert d.plan == best, d.line(w)


def test_the_ceilings_decide(monkeypatch):
    """On a GPU whose memory were as slow as its matmuls are fast, the gemm plan's
    materialised intermediates would cost more than the fused pass's products: the
    fused pass wins the compute shape there."""
    slow_memory = lff_plan.Ceilings("Mock GPU", 1.0, 1e6, 1e6, 1e6, "mocked")
    monkeypatch.setitem(lff_plan.RECORDED, "Mock GPU", slow_memory)
    w = _work("compute", "bf16", "fwd")
    assert lff_plan.decide(w, "NVIDIA H200", None).plan == "gemm"
    d = lff_plan.decide(w, "Mock GPU", None)
    assert d.plan == "fused", d.line(w)
    # an unrecorded GPU uses the H200's figures and says so
    other = lff_plan.ceilings_for("Some GPU")
    assert other.mma16_TFLOPs == lff_plan.H200.mma16_TFLOPs and "H200" in other.source


def test_features_only_has_one_plan(monkeypatch):
    w = lff_plan.Work("fwd", 2**20, 2, 128, 0, 0, "mma16", 2)
    d = lff_plan.decide(w, "NVIDIA H200", _never_measure)
    assert (d.plan, d.how) == ("fused", "only") and "features only" in d.why
    monkeypatch.setenv(lff_plan.ENV_PLAN, "gemm")  # a global setting: features still run
    assert lff_plan.decide(w, "NVIDIA H200", None).plan == "fused"


def test_deterministic_algorithms_need_the_cublas_workspace_config(monkeypatch):
    """torch raises on cuBLAS products under use_deterministic_algorithms without
    CUBLAS_WORKSPACE_CONFIG: auto keeps to the fused plan then, a forced gemm says why."""
    w = _work("compute", "bf16", "fwd")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    d = lff_plan.decide(w, "NVIDIA H200", None)
    assert d.plan == "fused" and "CUBLAS_WORKSPACE_CONFIG" in d.why
    monkeypatch.setenv(lff_plan.ENV_PLAN, "gemm")
    with pytest.raises(RuntimeError, match="CUBLAS_WORKSPACE_CONFIG"):
        lff_plan.decide(w, "NVIDIA H200", None)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    monkeypatch.setenv(lff_plan.ENV_PLAN, "auto")
    assert lff_plan.decide(w, "NVIDIA H200", None).plan == "gemm"


def test_forced_plan_and_a_bad_name(monkeypatch):
    w = _work("compute", "bf16", "fwd")
    monkeypatch.setenv(lff_plan.ENV_PLAN, "fused")
    d = lff_plan.decide(w, "NVIDIA H200", _never_measure)
    assert (d.plan, d.how) == ("fused", "forced")
    monkeypatch.setenv(lff_plan.ENV_PLAN, "fastest")
    with pytest.raises(ValueError, match="POSENC_FAST_LFF_PLAN"):
        lff_plan.decide(w, "NVIDIA H200", None)


def test_measured_choice_is_remembered_per_gpu_and_versions(monkeypatch, tmp_path):
    """With POSENC_FAST_LFF_PLAN=measure the first call of a bucket measures, the
    faster plan wins even against the model, and the record (per GPU name, torch and
    Triton version) serves a later process; another row count in the same power-of-two
    bucket is not measured again; a new GPU name measures again."""
    monkeypatch.setenv(lff_plan.ENV_PLAN, "measure")
    w = _work("compute", "bf16", "fwd")
    assert lff_plan.decide(w, "NVIDIA H200", None).plan == "gemm"  # the model's
    lff_plan.forget()
    asked = []

    def measure(plans):
        asked.append(sorted(plans))
        return {"fused": 1.0, "gemm": 2.0}  # the model is wrong here

    d = lff_plan.decide(w, "NVIDIA H200", measure)
    assert (d.plan, d.how, asked) == ("fused", "measured", [["fused", "gemm"]])
    record = json.loads((tmp_path / "lff_plans.json").read_text())
    key = lff_plan.environment_key("NVIDIA H200")
    assert torch.__version__ in key and triton.__version__ in key
    assert record[key][w.bucket()]["plan"] == "fused"
    lff_plan.forget()  # a new process: from the file, no measuring
    nearby = _work("compute", "bf16", "fwd", rows=2**20 - 5)
    assert nearby.bucket() == w.bucket()
    assert lff_plan.decide(nearby, "NVIDIA H200", _never_measure).plan == "fused"
    lff_plan.decide(w, "NVIDIA H100 80GB HBM3", measure)
    assert len(asked) == 2
    # measuring off: the file is not consulted, the model decides
    monkeypatch.setenv(lff_plan.ENV_PLAN, "auto")
    lff_plan.forget()
    assert lff_plan.decide(w, "NVIDIA H200", _never_measure).plan == "gemm"


def test_measured_choices_live_in_the_cache_folder(monkeypatch, tmp_path):
    """The measured choices' file is lff_plans.json in posenc_fast's cache folder."""
    monkeypatch.setenv("POSENC_FAST_CACHE", str(tmp_path / "folder"))
    assert CACHE_PATH() == str(tmp_path / "folder" / "lff_plans.json")


def test_no_measuring_while_capturing(monkeypatch):
    """measure=None (a CUDA graph being captured): the model decides, nothing is stored,
    and the bucket is measured on its next call where measuring is possible."""
    monkeypatch.setenv(lff_plan.ENV_PLAN, "measure")
    w = _work("compute", "bf16", "fwd")
    assert lff_plan.decide(w, "NVIDIA H200", None).how == "model"
    assert lff_plan.load_measured("NVIDIA H200") == {}
    d = lff_plan.decide(w, "NVIDIA H200", lambda plans: {"fused": 3.0, "gemm": 2.0})
    assert (d.plan, d.how) == ("gemm", "measured")


def test_debug_line_once_per_bucket(caplog):
    caplog.set_level(logging.DEBUG, logger=lff_plan.__name__)
    w = _work("compute", "bf16", "bwd")
    lff_plan.decide(w, "NVIDIA H200", None)
    lff_plan.decide(w, "NVIDIA H200", None)
    err = [r.getMessage() for r in caplog.records if r.name == lff_plan.__name__]
    assert len(err) == 1
    assert "plan gemm (model:" in err[0] and "fused" in err[0] and "ms" in err[0]


def test_info_reports_the_plans(capsys):
    from posenc_fast.cli import info

    info.run(type("Args", (), {"json": False})())
    out = capsys.readouterr().out
    assert "LFF plans" in out and "ceilings for NVIDIA H200" in out
    assert "compute   bf16 fwd: model picks gemm" in out


# ---------------------------------------------------------------- float32 like torch


@pytest.fixture
def restore_precision():
    """Back to the legacy settings afterwards: once the newer fp32_precision API has set
    the precision, torch raises on reading allow_tf32 unless it is reset to "none"."""
    saved = _launch.tf32_allowed()
    yield
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        torch.backends.cuda.matmul.fp32_precision = "none"
    torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.parametrize(
    "how,tf32",
    [
        (lambda: None, False),
        (lambda: torch.set_float32_matmul_precision("high"), True),
        (lambda: torch.set_float32_matmul_precision("highest"), False),
        (lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", True), True),
        (lambda: setattr(torch.backends.cuda.matmul, "fp32_precision", "tf32"), True),
        (lambda: setattr(torch.backends.cuda.matmul, "fp32_precision", "ieee"), False),
    ],
    ids=["default", "precision-high", "precision-highest", "allow_tf32", "new-tf32", "new-ieee"],
)
def test_float32_products_follow_torch_settings(how, tf32, restore_precision):
    """IEEE float32 by default; TF32 only where torch's settings allow it, read through
    the API torch.mm obeys (the newer fp32_precision first: reading allow_tf32 raises
    once it was set). The fused kernels' tl.dot precision and the cost model's kind
    follow; the gemm plan's products are torch.mm's, which read the same settings."""
    if not hasattr(torch.backends.cuda.matmul, "fp32_precision") and "new" in str(how):
        pytest.skip("torch < 2.9 has no fp32_precision")
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        torch.backends.cuda.matmul.fp32_precision = "none"
    torch.backends.cuda.matmul.allow_tf32 = False
    how()
    assert _launch.tf32_allowed() is tf32
    assert _launch.dot_precision(torch.float32) == ("tf32" if tf32 else "ieee")
    assert _launch.matmul_kind(torch.float32) == ("tf32" if tf32 else "ieee")
    assert _launch.dot_precision(torch.bfloat16) is None
    assert _launch.matmul_kind(torch.bfloat16) == "mma16"


@needs_triton
def test_fused_kernel_gets_the_tf32_setting(monkeypatch, restore_precision):
    """The forward's launch carries PRECISION="tf32" only when torch allows TF32."""
    from posenc_fast.triton_kernels import lff_forward

    seen = []
    for name in ("_lff_fwd_kernel", "_lff_fwd_tuned"):
        monkeypatch.setattr(lff_forward, name, _Launches(lambda grid, a, m: seen.append(m)))
    monkeypatch.setenv(lff_plan.ENV_PLAN, "fused")
    inputs = _inputs.lff_inputs(_inputs.LffCase((8,), 1, 2, 8, 16, 8), torch.float32, DEVICE, 1)
    for setting, expected in (("ieee", "ieee"), ("tf32", "tf32")):
        torch.backends.cuda.matmul.fp32_precision = setting
        pf.lff(*inputs, backend="triton")
        assert seen[-1]["PRECISION"] == expected


# ---------------------------------------------------------------- small inputs


class _Launches:
    """Stands for a Triton kernel: ``kernel[grid](*args, **meta)`` calls
    ``record(grid, args, meta)`` instead of launching."""

    def __init__(self, record):
        self.record = record

    def __getitem__(self, grid):
        return lambda *args, **meta: self.record(grid, args, meta)


class _NoHostSync(torch.utils._python_dispatch.TorchDispatchMode):
    """Fails on any op that reads tensor values on the host (.item(), bool(t), nonzero,
    .tolist(): all of them go through these) or copies to another device."""

    FORBIDDEN = {"_local_scalar_dense", "nonzero", "item", "equal", "is_nonzero"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        assert name not in self.FORBIDDEN, f"{func} reads tensor data on the host"
        if name in ("_to_copy", "copy_") and kwargs and "device" in kwargs:
            assert kwargs["device"] == args[0].device, f"{func} crosses devices"
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("shape", ["small", "seq1d"])
def test_small_forward_is_one_launch_and_capturable(shape, monkeypatch):
    """Inputs up to 64k positions: the forward takes the fused plan, one kernel launch,
    and nothing on its path reads tensor data on the host or synchronises (the launch
    itself is recorded, not run). Together: capturable in a CUDA graph once warm (the
    autotuner has chosen outside the capture; the output's allocation comes from the
    caching allocator, which capture supports)."""
    from posenc_fast.triton_kernels import lff_forward

    if DEVICE != "cpu" or not _launch.INTERPRET:
        pytest.skip("checks the host path with the launch recorded (interpreter build)")
    R, M, F2, H, Dg = lff_plan.REFERENCE_SHAPES[shape]
    launches = []
    rows = _Launches(lambda grid, a, m: launches.append(a[7]))  # the kernel's R
    monkeypatch.setattr(lff_forward, "_lff_fwd_kernel", rows)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("synchronised"))
    # the backend's own decision, whatever the device (the interpreter's CPU tensors
    # decide as an H200 would)
    monkeypatch.setattr(_launch, "device_name", lambda device: "NVIDIA H200")
    case = _inputs.LffCase((R,), 1, M, 2 * F2, H, Dg)
    x, *w = _inputs.lff_inputs(case, torch.bfloat16, "cpu", seed=3)
    with _NoHostSync():
        y = LFF["triton"].forward(x, *w, "gelu", torch.bfloat16)
    assert launches == [R] and y.shape == (R, Dg)
    decision = lff_plan.decide(lff_plan._work("fwd", x, w[0], w[1], w[3], torch.bfloat16, "gelu"),
                               "NVIDIA H200", None)  # fmt: skip
    assert decision.plan == "fused"


@needs_triton
def test_gemm_path_reads_nothing_on_the_host(gemm_plan, monkeypatch):
    """The gemm plan, forward and backward, with its Triton launches recorded: no host
    reads of tensor data either (capturable as well)."""
    launched = []
    for name in ("_features_kernel", "_act_fwd_kernel", "_act_bwd_kernel", "_phase_grad_kernel"):
        monkeypatch.setattr(lff_gemm.k, name, _Launches(lambda g, a, m, n=name: launched.append(n)))
    case = _inputs.LffCase((600,), 1, 2, 16, 24, 40)
    x, *w = _inputs.lff_inputs(case, torch.bfloat16, DEVICE, seed=5)
    g = _inputs.randn((600, 40), _inputs.generator(6), torch.bfloat16, DEVICE)
    with _NoHostSync():
        LFF["triton"].forward(x, *w, "gelu", torch.bfloat16)
        LFF["triton"].backward(g, x, *w, "gelu", [True] * 6)
    assert len(launched) == 3 * 2 + 3 * 3  # per chunk (256, 256, 88 rows): 2 fwd, 3 bwd


@needs_triton
def test_measured_choice_through_the_backend(monkeypatch, tmp_path):
    """POSENC_FAST_LFF_PLAN=measure through the backend's forward: both plans are handed
    to the device timer once (mocked: no timing on the CPU), the faster runs and is
    remembered; the next call of the bucket times nothing."""
    monkeypatch.setenv(lff_plan.ENV_PLAN, "measure")
    timed = []

    def time_ms(fn, device, repeats=3):
        timed.append(fn)
        return {0: 5.0, 1: 1.0}[len(timed) - 1]  # fused first, then gemm: gemm faster

    monkeypatch.setattr(_launch, "time_ms", time_ms)
    ran = []
    real_gemm = lff_gemm.gemm_fwd
    monkeypatch.setattr(lff_gemm, "gemm_fwd", lambda *a: ran.append("gemm") or real_gemm(*a))
    case = _inputs.LffCase((40,), 1, 2, 16, 8, 12)
    inputs = _inputs.lff_inputs(case, torch.float32, DEVICE, seed=9)
    for _ in range(2):
        y = LFF["triton"].forward(*inputs, "gelu", torch.float32)
    assert len(timed) == 2 and ran == ["gemm", "gemm"]
    assert_close(y, ref.lff(*inputs), torch.float32, "lff")
    (record,) = json.loads((tmp_path / "lff_plans.json").read_text()).values()
    assert [r["plan"] for r in record.values()] == ["gemm"]
