"""Running on the torch and Triton that users have: what the test suite on the newest
versions can check about the oldest ones. tools/check_versions.sh runs the whole suite on
each torch of the version matrix (README, "Compatibility").

- The custom ops' signatures use only the types torch 2.5's infer_schema accepts.
- Triton's interpreter is used only where it computes the kernels faithfully.
- Kernel configurations a Triton version cannot compile for a GPU are never offered:
  _configs.py's rules, the launchers' pruning and the backward's choice, for every
  supported Triton (3.1 ..) and architecture (sm_80 .. sm_120).
- A configuration whose compilation raises is dropped, not fatal.
- A device whose capability cannot be read is a reason, not a crash.
"""

from __future__ import annotations

import re
import typing
import warnings
from typing import List, Optional  # noqa: UP035 (torch 2.5's accepted spellings)

import _helpers
import pytest
import torch
from posenc_fast.triton_kernels import _env as triton_env
from torch import Tensor

import posenc_fast as pf
from posenc_fast import _extension
from posenc_fast._dispatch import Problem
from posenc_fast.ops import _custom_ops

# What torch 2.5's torch._library.infer_schema accepts (its error message lists them),
# restricted to the kinds this package uses.
_T25_PARAMS = {
    Tensor,
    Optional[Tensor],
    List[Tensor],  # noqa: UP006
    typing.Sequence[Tensor],
    int,
    Optional[int],
    List[int],  # noqa: UP006
    float,
    Optional[float],
    List[float],  # noqa: UP006
    bool,
    Optional[bool],
    List[bool],  # noqa: UP006
    str,
    Optional[str],
    torch.dtype,
    Optional[torch.dtype],
    torch.device,
    Optional[torch.device],
}
_T25_RETURNS = {Tensor, List[Tensor], int, float, bool}  # noqa: UP006
# The argument types of explicit schemas that torch 2.5's parser accepts (used by FLOATER).
_T25_SCHEMA_TYPES = {
    "Tensor",
    "Tensor?",
    "Tensor[]",
    "SymInt",
    "int",
    "float",
    "bool",
    "bool[]",
    "str",
}


def _t25_return_ok(ret) -> bool:
    """torch 2.5 accepts a return of one supported type or a tuple of them."""
    if typing.get_origin(ret) is tuple:
        return all(arg in _T25_RETURNS for arg in typing.get_args(ret))
    return ret in _T25_RETURNS


def test_every_custom_op_is_checked():
    names = {op.op._name for op in _custom_ops.CUSTOM_OPS}
    # the taped and cached FLOATER ops, the rotary ops, the n-d add: all of them
    assert len(names) == len(_custom_ops.CUSTOM_OPS) >= 14, sorted(names)
    assert {"floater_taped", "floater_cached", "rotary", "rotary_table", "encoding_nd_add"} <= names


@pytest.mark.parametrize("custom", _custom_ops.CUSTOM_OPS, ids=lambda c: c.op._name)
def test_custom_op_signatures_are_accepted_by_torch_2_5(custom):
    """torch 2.5 raises at import on e.g. list[bool] (accepted from 2.7): typing.List. And
    it evaluates string annotations (``from __future__ import annotations``) in its own
    module, which has no ``Tuple``: the op bodies' annotations must be objects by the time
    ``custom_op`` reads them (that failed ``import posenc_fast`` on torch 2.5.1). An
    explicit schema is what torch registered, in types torch 2.5 parses."""
    if custom.schema is not None:
        registered = str(custom.op._opoverload._schema)
        assert registered == f"{custom.op._qualname}{custom.schema}", registered
        types = re.findall(r"([\w\[\]?]+) \w+[,)]", custom.schema)
        assert types and set(types) <= _T25_SCHEMA_TYPES, (custom.op._name, types)
        return
    annotations = custom.body.__annotations__
    strings = {k: v for k, v in annotations.items() if isinstance(v, str)}
    assert not strings, f"{custom.op._name}: string annotations {strings} (torch 2.5 rejects)"
    hints = dict(annotations)
    ret = hints.pop("return")
    name = custom.op._name
    for arg, hint in hints.items():
        assert hint in _T25_PARAMS, f"{name}: parameter {arg}: {hint} (torch 2.5 rejects it)"
    assert _t25_return_ok(ret), f"{name}: return type {ret} (torch 2.5 rejects it)"


# ---------------------------------------------------------------- the interpreter


@pytest.mark.parametrize(
    "triton_version, numpy_version, expected",
    [
        ("3.9.0", "2.4.6", None),
        ("3.10.1", "2.5.0", None),
        ("3.8.0", "2.4.6", "rounds tl.fma twice"),
        ("3.6.0", "2.3.5", "rounds tl.fma twice"),
        ("3.6.0", "2.4.0", "numpy 2.4.0 (fixed in 3.7)"),
        ("3.1.0", "1.26.4", "Triton 3.1.0's interpreter"),
    ],
)
def test_interpreter_needs_triton_3_9(triton_version, numpy_version, expected):
    reason = triton_env.interpreter_reason(triton_version, numpy_version)
    if expected is None:
        assert reason == ""
    else:
        assert expected in reason and "needs triton>=3.9" in reason, reason
        if "numpy" not in expected:
            assert "numpy" not in reason


def test_old_interpreter_makes_triton_unavailable_with_its_reason(monkeypatch):
    """Under TRITON_INTERPRET=1 (set by conftest on this CPU run) with an older Triton:
    the backend says why in info and in the dispatcher's refusal, and the tests of the
    shared matrix skip it with that reason instead of reporting its wrong numbers."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if triton_env.import_error():
        pytest.skip(f"triton is not importable here: {triton_env.import_error()}")
    reason = triton_env.interpreter_reason("3.6.0", "2.4.6")
    monkeypatch.setattr(triton_env, "installed_interpreter_reason", lambda: reason)
    assert pf.available_backends(verbose=True)["triton"] == [reason]
    problem = Problem(
        "encoding", "cpu", torch.float32, {"dim": 8}, {"kind": "sinusoidal"},
        {"positions": torch.float32},
    )  # fmt: skip
    with pytest.raises(pf.BackendError, match="needs triton>=3.9"):
        _helpers.chosen(problem, "triton")
    skipped = {p.values[0]: p.marks for p in _conftest().backend_params("encoding")}
    assert skipped.get("triton"), "triton is not a skipped param"
    assert reason in skipped["triton"][0].kwargs["reason"]
    assert _helpers.unavailable_backends("encoding", "cpu") == {"triton": [reason]}


def _conftest():
    import conftest

    return conftest


# ---------------------------------------------------------------- devices


def test_unreadable_device_capability_is_a_reason(monkeypatch):
    """torch.cuda says a device is there but its capability cannot be read (a process that
    faked is_available, a driver gone): every backend that asks reports it, none raises.
    The "cuda" backend asks only when the extension has its CUDA part: simulated."""

    def unreadable(device=None):
        raise RuntimeError("Found no NVIDIA driver on your system")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", unreadable)
    monkeypatch.setattr(_extension, "reasons", lambda part="cpu": [])
    monkeypatch.setattr(_extension, "has_cuda", lambda: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    status = pf.available_backends(verbose=True)
    expected = "cannot read the CUDA device's compute capability (RuntimeError: Found no"
    assert any(expected in r for r in status["cuda"]), status["cuda"]
    if not triton_env.import_error():
        assert any(expected in r for r in status["triton"]), status["triton"]


# ---------------------------------------------------------------- kernel configurations

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
from posenc_fast.triton_kernels import _configs  # noqa: E402
from posenc_fast.triton_kernels import lff_backward_fused as bwd  # noqa: E402
from posenc_fast.triton_kernels import lff_backward_split_k as split_k  # noqa: E402
from posenc_fast.triton_kernels import lff_forward as fwd  # noqa: E402

# Triton versions that torch 2.5 .. 2.13 pin, and the architectures users have
TRITONS = [(3, 1), (3, 2), (3, 3), (3, 4), (3, 5), (3, 6), (3, 9)]
ARCHS = _configs.REPORT_ARCHS
BF16 = dict(MLP=True, COMPUTE=tl.bfloat16, PRECISION=None)
FP32 = dict(MLP=True, COMPUTE=tl.float32, PRECISION="ieee")
TF32 = dict(MLP=True, COMPUTE=tl.float32, PRECISION="tf32")


def _fwd(br, bk, bd, bh, compute=BF16):
    return dict(compute, BLOCK_R=br, BLOCK_K=bk, BLOCK_D=bd, BLOCK_H=bh)


@pytest.mark.parametrize("triton_version", [(3, 1), (3, 2)])
def test_hopper_split_warpgroups_are_refused_where_triton_aborts(triton_version):
    """Triton 3.1 / 3.2 abort the process compiling a 64-row, 8-warp tensor-core LFF
    kernel for sm_90 (assertions "mma -> mma layout conversion is only supported on
    Ampere" / LinearLayout::reshapeOuts, seen by compile_report --probe-refused)."""
    for compute in (BF16, TF32):
        meta = _fwd(64, 32, 64, 32, compute)
        reason = _configs.refusal("lff_fwd", meta, 8, 2, 90, triton_version)
        assert reason is not None and "aborts the process" in reason
        assert "Triton {}.{}".format(*triton_version) in reason
    # Not refused: another Triton, Ampere, no tensor cores, or warps that fit the rows.
    assert _configs.refusal("lff_fwd", _fwd(64, 32, 64, 32), 8, 2, 90, (3, 3)) is None
    assert _configs.refusal("lff_fwd", _fwd(64, 32, 64, 32), 8, 2, 80, triton_version) is None
    assert _configs.refusal("lff_fwd", _fwd(64, 32, 64, 32, FP32), 8, 2, 90, triton_version) is None
    assert _configs.refusal("lff_fwd", _fwd(128, 32, 64, 32), 8, 2, 90, triton_version) is None
    assert _configs.refusal("lff_fwd", _fwd(64, 16, 64, 32), 4, 2, 90, triton_version) is None
    assert _configs.refusal("lff_fwd", _fwd(32, 16, 32, 256), 8, 1, 90, triton_version) is None


def test_blackwell_needs_triton_3_3(monkeypatch):
    """Triton 3.1 / 3.2 know no sm_100 / sm_120: every kernel is refused there (a matmul
    aborts the process), and the triton backend is unavailable on such a GPU."""
    for arch in (100, 120):
        for kernel in ("lff_fwd", "encoding_fwd"):
            reason = _configs.refusal(kernel, _fwd(128, 32, 64, 32), 8, 2, arch, (3, 2))
            assert reason is not None and "does not support sm_" in reason
        assert _configs.refusal("lff_fwd", _fwd(128, 32, 64, 32), 8, 2, arch, (3, 3)) is None
        assert _configs.target_reason(arch, (3, 1)) and not _configs.target_reason(arch, (3, 3))
    assert not _configs.target_reason(90, (3, 1))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    monkeypatch.setattr(_configs, "TRITON", (3, 2))
    reasons = _helpers.environment_reasons("triton")
    assert reasons == [_configs.target_reason(100, (3, 2))], reasons
    monkeypatch.setattr(_configs, "TRITON", (3, 3))
    assert _helpers.environment_reasons("triton") == []


def test_shared_memory_limits_per_architecture():
    assert _configs.shared_limit(86) == _configs.shared_limit(89) == 99 * 1024
    assert _configs.shared_limit(120) == 99 * 1024
    assert _configs.shared_limit(80) == 163 * 1024
    assert _configs.shared_limit(90) == _configs.shared_limit(100) == 227 * 1024
    assert _configs.shared_limit(75) == 99 * 1024  # unknown: the smallest
    big = _fwd(128, 32, 128, 64)
    need = _configs.shared_bound("lff_fwd", big, 8, 3)
    assert 99 * 1024 < need <= 163 * 1024, need
    for arch in (86, 89, 120):
        reason = _configs.refusal("lff_fwd", big, 8, 3, arch, (3, 9))
        assert reason == f"needs up to {need} B of shared memory, sm_{arch} has 101376 B per block"
    for arch in (80, 90, 100):
        assert _configs.refusal("lff_fwd", big, 8, 3, arch, (3, 9)) is None


@pytest.mark.parametrize(
    "triton_version, arch",
    # (where a Triton supports no kernel for an architecture, the backend is unavailable:
    # test_blackwell_needs_triton_3_3)
    [(v, a) for v in TRITONS for a in ARCHS if not _configs.target_reason(a, v)],
    ids=lambda p: f"sm{p}" if isinstance(p, int) else "triton{}.{}".format(*p),
)
def test_every_hidden_size_keeps_a_configuration(triton_version, arch, monkeypatch):
    """The forward's autotuner (its own early prune, as on a GPU of that architecture) and
    the backward's fixed rule leave a configuration for every hidden size and compute
    dtype, and none that the rules refuse there."""
    monkeypatch.setattr(_configs, "TRITON", triton_version)
    monkeypatch.setattr(_configs, "device_arch", lambda device: arch)
    monkeypatch.setattr(bwd, "INTERPRET", False)
    monkeypatch.setattr(split_k, "INTERPRET", False)
    try:
        tuner = fwd._lff_fwd_tuned.tuner
    except RuntimeError as exc:  # Triton 3.3's Autotuner asks the GPU driver when made
        if "active drivers" not in str(exc):
            raise
        pytest.skip(
            f"Triton {triton.__version__} cannot create an autotuner without a GPU ({exc}); "
            "every Triton version's rules are tested here with one that can (CI: 3.9)"
        )
    for block_h in (16, 32, 64, 128, 256):
        for compute in (BF16, FP32, TF32):
            meta = dict(compute, BLOCK_H=block_h, M=2)
            kept = tuner.early_config_prune(tuner.configs, {"X": torch.empty(1)}, **meta)
            assert kept, (block_h, compute)
            for c in kept:
                assert c.kwargs["BLOCK_R"] > 0
                full = {**meta, **c.kwargs}
                assert _configs.refusal("lff_fwd", full, c.num_warps, c.num_stages, arch) is None
            bmeta = dict(meta, BLOCK_M=2)
            blocks, options = bwd.choose_blocks(1 << 20, 128, block_h, 768, bmeta, arch)
            assert _configs.refusal("lff_bwd", {**bmeta, **blocks}, **options, arch=arch) is None
            # the split-K path (large weights): each of its kernels has a configuration
            # (the _*_blocks functions raise where the rules refuse theirs)
            blocks, options = split_k._first_pass_blocks(bmeta, 384, 1024, arch)
            split = dict(bmeta, H_SPLIT=True, **blocks)
            assert _configs.refusal("lff_bwd", split, **options, arch=arch) is None
            assert split_k._phase_blocks(bmeta, 384, block_h, 1 << 17, arch)[0]
            for features in (False, True):
                assert split_k._wgrad_blocks(bmeta, features, 384, 1024, 1 << 17, arch)[0]


def test_autotune_off_offers_one_configuration(monkeypatch):
    """POSENC_FAST_TRITON_AUTOTUNE=0 (the GPU proof's correctness stages): the autotuner
    is offered only the first configuration the rules allow, so one kernel is compiled per
    shape instead of every configuration."""
    monkeypatch.setattr(_configs, "device_arch", lambda device: 90)
    try:
        tuner = fwd._lff_fwd_tuned.tuner
    except RuntimeError as exc:  # as above: Triton 3.3 asks the driver
        pytest.skip(f"cannot create an autotuner without a GPU ({exc})")
    meta = dict(BF16, BLOCK_H=32, M=2)
    every = tuner.early_config_prune(tuner.configs, {"X": torch.empty(1)}, **meta)
    assert len(every) > 1
    monkeypatch.setenv("POSENC_FAST_TRITON_AUTOTUNE", "0")
    one = tuner.early_config_prune(tuner.configs, {"X": torch.empty(1)}, **meta)
    assert one == every[:1]


def test_backward_falls_back_to_32_rows_where_64_are_refused(monkeypatch):
    monkeypatch.setattr(bwd, "INTERPRET", False)
    meta = dict(BF16, BLOCK_H=128, BLOCK_M=2)
    monkeypatch.setattr(_configs, "TRITON", (3, 9))
    assert bwd.choose_blocks(1 << 20, 128, 128, 768, meta, 90)[0]["BLOCK_R"] == 64
    monkeypatch.setattr(_configs, "TRITON", (3, 1))
    assert bwd.choose_blocks(1 << 20, 128, 128, 768, meta, 90)[0]["BLOCK_R"] == 32
    assert bwd.choose_blocks(1 << 20, 128, 128, 768, meta, 80)[0]["BLOCK_R"] == 64


class _FakeTuner:
    """What guard_autotuner needs of a triton Autotuner: its _bench."""

    def _bench(self, *args, config, **meta):
        if config.num_warps == 8:
            raise RuntimeError("PassManager::run failed")
        return [1.0, 0.9, 1.1]


def test_a_configuration_that_fails_to_compile_is_dropped_not_fatal():
    tuner = _configs.guard_autotuner(_FakeTuner(), "lff_fwd")
    good = triton.Config({"BLOCK_R": 64}, num_warps=4, num_stages=2)
    bad = triton.Config({"BLOCK_R": 64}, num_warps=8, num_stages=2)
    assert tuner._bench(config=good) == [1.0, 0.9, 1.1]
    with pytest.warns(RuntimeWarning, match="BR64 w8 s2 .*PassManager::run failed"):
        assert min(tuner._bench(config=bad)) == float("inf")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per configuration
        assert min(tuner._bench(config=bad)) == float("inf")
    assert _configs.dropped()[("lff_fwd", "BR64 w8 s2")].startswith("RuntimeError: PassManager")
