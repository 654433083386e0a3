"""ONNX export: every public module and functional op, and the integrations, exported
with torch.onnx.export (dynamo=True, the path torch recommends; and the TorchScript-based
exporter) and run in onnxruntime (and OpenVINO, when installed), against eager on fresh
random inputs of other batch and sequence sizes than the export's (dynamic axes), within
the float32 tolerances of posenc_fast/tolerances.py. Every graph is float32-only (no
float64 tensor, initializer or Cast target) and uses only operators and element types of
TensorRT's published ONNX support matrix (tests/_onnx_ops.py). Frozen FLOATER models
contain no integration; an unfrozen one refuses to export, in seconds, naming freeze(L).
The phases' accuracy against float64 at large |phase| is benchmarks/onnx_accuracy.py's
measurement. Each export costs seconds, so one small model holds every op of a family and
is exported once (module-scoped fixtures).

How it works: ops/_custom_ops.py (the custom ops trace their plain-ATen composition while an
ONNX exporter runs) and ops/_export_phases.py (the float32 phases)."""

from __future__ import annotations

import importlib.util
import io
import pathlib
import time
import warnings

import pytest
import torch
from _timm import import_timm
from torch import nn

import posenc_fast as pf
from posenc_fast.cli import _inputs
from posenc_fast.integrations import timm as pf_timm
from posenc_fast.integrations.attention import add_floater_biases
from posenc_fast.tolerances import ONNX_MAX_PHASE, ONNX_PHASE_ATOL, assert_close

onnx = pytest.importorskip("onnx", reason="onnx is in the test extra (pyproject.toml)")
ort = pytest.importorskip("onnxruntime", reason="onnxruntime is in the test extra")
pytest.importorskip("onnxscript", reason="the dynamo exporter needs onnxscript (test extra)")

from _onnx_ops import float64_tensors, run_openvino, tensorrt_misfits  # noqa: E402

OPSET = 20  # what torch 2.13's dynamo exporter emits by default (README, "Deploying")


def export_dynamo(model, args, dynamic_shapes, names):
    """ONNX bytes of ``model(*args)`` from torch.onnx.export(dynamo=True)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # exporter chatter (deprecations, torchvision)
        program = torch.onnx.export(
            model,
            args,
            dynamo=True,
            dynamic_shapes=dynamic_shapes,
            input_names=names,
            opset_version=OPSET,
            verbose=False,
        )
    return program.model_proto


def export_torchscript(model, args, dynamic_axes, names):
    """ONNX bytes of ``model(*args)`` from the TorchScript-based exporter."""
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            args,
            f,
            dynamo=False,
            input_names=names,
            dynamic_axes=dynamic_axes,
            opset_version=17,
        )
    return onnx.load_from_string(f.getvalue())


def run(proto, *inputs):
    """The outputs of the ONNX model on ``inputs`` (tensors), as float32/64 tensors."""
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    feed = {i.name: t.numpy() for i, t in zip(session.get_inputs(), inputs)}
    return [torch.from_numpy(o) for o in session.run(None, feed)]


def op_types(proto) -> set[str]:
    """Every op type of the graph, its functions included (the exporter may wrap)."""
    types = {(n.domain, n.op_type) for n in proto.graph.node}
    for f in proto.functions:
        types |= {(n.domain, n.op_type) for n in f.node}
    return types


def assert_standard_ops(proto):
    """Only ONNX's own domain: no posenc_fast op left for a runtime to implement."""
    custom = {t for t in op_types(proto) if t[0] not in ("", "ai.onnx")}
    assert not custom, f"non-standard ops in the graph: {custom}"


def assert_deployable(proto):
    """Standard ops only, float32-only, and within TensorRT 10's support matrix."""
    assert_standard_ops(proto)
    assert float64_tensors(proto) == [], float64_tensors(proto)[:10]
    assert tensorrt_misfits(proto) == [], tensorrt_misfits(proto)[:10]


def outputs(model, *inputs):
    with torch.no_grad():
        out = model(*inputs)
    return list(out) if isinstance(out, (tuple, list)) else [out]


# -- every public op and module, in one graph -------------------------------------------


class Ops(nn.Module):
    """Every public op and module of posenc_fast on positions x [B, N, 2] and tokens
    t [B, N, 16] (q and k are t viewed as 2 heads of 8): one output each."""

    def __init__(self):
        super().__init__()
        self.lff_mlp = pf.LearnableFourierFeatures(2, 16, 12, 16, gamma=2.0)
        self.lff_groups = pf.LearnableFourierFeatures(1, 8, 6, 16, groups=2, activation="relu")
        self.lff_features = pf.LearnableFourierFeatures(2, 8, mlp=False, learnable=False)
        self.lff_norm = pf.LearnableFourierFeatures(
            2, 8, 10, 16, layer_norm=True, dropout=0.1, activation="gelu_tanh"
        )
        self.sinusoidal = pf.SinusoidalPE(16)
        self.dft = pf.DFTPE(16)
        self.sine2d = pf.SinusoidalNdPE(16, axes=2)
        self.rotary = pf.LearnableFourierRotary(2, head_dim=8, rotary_dim=6)
        self.floater = pf.Floater(dim=16, num_states=2, hidden_dim=8, substeps=2)
        self.floater_bias = pf.FloaterAttentionBias(dim=8, num_layers=1, substeps=2)
        self.w = nn.Parameter(torch.randn(4, 2))

    def forward(self, x, t):
        B, N = t.shape[0], t.shape[1]
        s = x[..., 0]  # scalar positions [B, N]
        q = t.unflatten(-1, (2, 8)).transpose(1, 2)  # [B, 2, N, 8]
        k = (2.0 * t).unflatten(-1, (2, 8)).transpose(1, 2)
        # (a tensor's size as an int keeps the axis dynamic in the exported graph)
        return (
            self.lff_mlp(x[..., None, :]),
            self.lff_groups(x[..., None]),
            self.lff_features(x[..., None, :]),
            self.lff_norm(x[..., None, :]),
            pf.lff(x[..., None, :], self.w),
            pf.sinusoidal(s, 12),
            pf.sinusoidal(s, 12, block=3.0),
            pf.dft(s, 10),
            pf.dft_inverse(pf.dft(s, 8)),
            pf.sinusoidal_nd(x, 6),
            self.sinusoidal(t),
            self.sinusoidal(t, s),
            self.dft(t),
            self.sine2d(t, x),
            self.rotary(x),
            pf.lff_rotary(x, self.w),
            *self.rotary.rotate(q, k, x),
            *pf.apply_lff_rotary(q, k, x, self.w, "bhnd"),
            self.floater(length=N) + 0 * B,
            self.floater_bias(N),
        )


@pytest.fixture(scope="module")
def ops_model():
    torch.manual_seed(0)
    m = Ops()
    _inputs.randomize_parameters(m.floater, 1, scale=0.3)
    _inputs.randomize_parameters(m.floater_bias, 2, scale=0.3)
    m.floater.freeze(12)
    m.floater_bias.freeze(12)
    return m.eval()


def ops_inputs(B, N, seed):
    gen = _inputs.generator(seed)
    x = _inputs.randn((B, N, 2), gen, scale=3.0)
    return x, _inputs.randn((B, N, 16), gen)


def compare(got, want, what):
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, f"{what}: output {i}: {list(g.shape)} vs {list(w.shape)}"
        assert_close(g, w, torch.float32, "lff", what=f"{what}: output {i}")


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_every_op_and_module_round_trips_with_dynamic_batch_and_length(ops_model, exporter):
    args = ops_inputs(2, 5, seed=1)
    if exporter == "dynamo":
        B, N = torch.export.Dim("batch"), torch.export.Dim("length", max=12)
        proto = export_dynamo(ops_model, args, ({0: B, 1: N}, {0: B, 1: N}), ["x", "t"])
    else:
        axes = {"x": {0: "batch", 1: "length"}, "t": {0: "batch", 1: "length"}}
        proto = export_torchscript(ops_model, args, axes, ["x", "t"])
    assert_deployable(proto)
    for B, N in [(2, 5), (3, 7), (1, 12)]:  # other sizes than the export's
        inputs = ops_inputs(B, N, seed=10 * B + N)
        compare(run(proto, *inputs), outputs(ops_model, *inputs), f"{exporter} B={B} N={N}")
    inputs = ops_inputs(3, 7, seed=37)
    got = run_openvino(proto, *inputs)
    if got is not None:
        compare(got, outputs(ops_model, *inputs), f"{exporter} in OpenVINO")


# -- the integrations, in one graph ------------------------------------------------------


def tiny_vit(**kwargs):
    """A tiny timm VisionTransformer: 8x8 patches, dim 16, dynamic image size."""
    vt = import_timm().models.vision_transformer
    args = dict(img_size=32, patch_size=8, embed_dim=16, depth=2, num_heads=2, num_classes=3)
    return vt.VisionTransformer(dynamic_img_size=True, **{**args, **kwargs})


class Integrations(nn.Module):
    """timm ViTs with use_lff, use_sine2d and FLOATER biases (frozen), and an
    nn.TransformerEncoder with FLOATER biases (frozen): images [B, 3, H, W] and tokens
    [B, L, 16] in, one output each."""

    def __init__(self, frozen_length: int):
        super().__init__()
        torch.manual_seed(0)
        # one block where the encoding is all that matters (export time grows with depth)
        self.vit_lff = tiny_vit(depth=1)
        pf_timm.use_lff(self.vit_lff, fourier_dim=16, hidden_dim=8)
        self.vit_sine = tiny_vit(depth=1)
        pf_timm.use_sine2d(self.vit_sine)
        self.vit_floater = tiny_vit()
        _inputs.randomize_parameters(add_floater_biases(self.vit_floater, substeps=2), 1, 0.3)
        layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        _inputs.randomize_parameters(add_floater_biases(self.encoder, substeps=2), 2, 0.3)
        # the ViT's tokens: (H/8) * (W/8) patches + the class token
        self.vit_floater.floater_bias.freeze(frozen_length)
        self.encoder.floater_bias.freeze(frozen_length)

    def forward(self, images, tokens):
        return (
            self.vit_lff(images),
            self.vit_sine(images),
            self.vit_floater(images),
            self.encoder(tokens),
        )


@pytest.fixture(scope="module")
def integrations():
    return Integrations(frozen_length=1 + 4 * 6).eval()  # up to 32x48 images


def integration_inputs(B, H, W, L, seed):
    gen = _inputs.generator(seed)
    return _inputs.randn((B, 3, H, W), gen), _inputs.randn((B, L, 16), gen)


def test_integrations_round_trip_with_dynamic_batch_and_sizes(integrations):
    args = integration_inputs(2, 32, 32, 9, seed=1)
    B = torch.export.Dim("batch")
    # image sides in patches (8 pixels each), the encoder's length up to the frozen one
    H, W = torch.export.Dim("rows", min=2, max=4), torch.export.Dim("cols", min=2, max=6)
    L = torch.export.Dim("length", max=25)
    shapes = ({0: B, 2: 8 * H, 3: 8 * W}, {0: B, 1: L})
    proto = export_dynamo(integrations, args, shapes, ["images", "tokens"])
    assert_deployable(proto)
    for B, H, W, L in [(2, 32, 32, 9), (3, 16, 48, 25), (1, 24, 40, 4)]:
        inputs = integration_inputs(B, H, W, L, seed=B + H + W + L)
        got, want = run(proto, *inputs), outputs(integrations, *inputs)
        compare(got, want, f"B={B} {H}x{W} L={L}")
    # Not compared in OpenVINO: its own float32 GEMMs and softmax put the FLOATER ViT's
    # logits 2.4e-5 from eager (measured), beyond the "lff" tolerance, with no phase
    # involved; the phases' accuracy there is the float32-graph test's below.


# -- FLOATER unfrozen: a refusal in seconds; the functional op's solver -------------------


class FloaterLength4(nn.Module):
    """x [B, 4, 4] plus the second state of an unfrozen Floater at length 4."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fl = pf.Floater(dim=4, num_states=2, hidden_dim=4, substeps=1, activation="gelu")
        _inputs.randomize_parameters(self.fl, 5, scale=0.5)

    def forward(self, x):
        return x + self.fl(length=4)[1]


def unfrozen_vit():
    """The case that used to unroll for minutes: a timm ViT with FLOATER biases, unfrozen."""
    torch.manual_seed(0)
    vit = tiny_vit()
    _inputs.randomize_parameters(add_floater_biases(vit, substeps=2), 1, 0.3)
    return vit.eval(), (torch.randn(1, 3, 32, 32),)


# A loaded 2-core machine stays far below this; the unrolled solver took minutes.
REFUSAL_SECONDS = 20.0


@pytest.mark.parametrize("case", ["floater-dynamo", "vit-dynamo", "vit-torchscript"])
def test_unfrozen_floater_export_refuses_in_seconds_naming_freeze(case):
    """Exporting an unfrozen Floater (alone, or as a ViT's FLOATER biases) raises at once
    with the fix, freeze(L), instead of unrolling the ODE solver into the graph."""
    if case.startswith("vit"):
        model, args = unfrozen_vit()
    else:
        model, args = FloaterLength4().eval(), (torch.randn(2, 4, 4),)
    start = time.perf_counter()
    with pytest.raises(Exception, match=r"freeze\(L\)") as info:
        if case.endswith("torchscript"):
            export_torchscript(model, args, {"x": {0: "batch"}}, ["x"])
        else:
            export_dynamo(model, args, ({0: torch.export.Dim("batch")},), ["x"])
    elapsed = time.perf_counter() - start
    assert elapsed < REFUSAL_SECONDS, f"{case}: refused after {elapsed:.1f} s"
    assert "unfrozen Floater" in str(info.value)
    if case.startswith("vit"):
        assert not model.floater_bias.frozen  # the refusal changed nothing


def test_functional_floater_exports_its_solver_unrolled():
    """The functional op is how the solver itself exports (a static length): it matches,
    float32-only."""

    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.fl = FloaterLength4().fl  # its parameters, called functionally

        def forward(self, x):  # x [B, 4, 4]
            fl = self.fl
            times = torch.arange(4, dtype=torch.float32) * fl.delta_t
            p = pf.floater(fl.p0, fl.w1, fl.b1, fl.w2, fl.b2, times, 1, activation="gelu")
            return x + p[1]

    model = Functional().eval()
    # the TorchScript-based exporter: ~1 s here, against ~10 s for dynamo=True's unrolled graph
    proto = export_torchscript(model, (torch.randn(2, 4, 4),), {"x": {0: "batch"}}, ["x"])
    assert_deployable(proto)
    y = torch.randn(3, 4, 4)
    compare(run(proto, y), outputs(model, y), "functional floater")


# -- the phases: float32 by default, within ONNX_PHASE_ATOL of float64; float64 on request --


def _onnx_accuracy():
    """benchmarks/onnx_accuracy.py, the one definition of the accuracy measurement."""
    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "onnx_accuracy.py"
    spec = importlib.util.spec_from_file_location("onnx_accuracy", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_float32_graph_is_within_the_stated_tolerance_of_float64_at_large_phases():
    """The README's figure, on fewer positions: the float32 graph's rotary table, LFF
    features, sinusoidal (float and integer positions) and DFT encodings in onnxruntime
    and OpenVINO at |phase| up to ONNX_MAX_PHASE, against float64 math."""
    phases = (ONNX_MAX_PHASE / 10, ONNX_MAX_PHASE)
    rows = _onnx_accuracy().measure(phases, n=512, graphs=(torch.float32,), log=None)
    runtimes = {r["runtime"] for r in rows}
    assert "onnxruntime" in runtimes, runtimes
    bad = [r for r in rows if not r["max_abs_err"] <= ONNX_PHASE_ATOL]
    assert not bad, bad
    assert len(rows) == len(runtimes) * len(phases) * 5


class Phases(nn.Module):
    """LFF rotary table and sinusoidal encoding of positions x [N, 2]."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 2, generator=_inputs.generator(3)))

    def forward(self, x):
        return pf.lff_rotary(x, self.w), pf.sinusoidal(x[:, 0], 8)


def test_float64_phases_by_argument():
    """onnx_phases(torch.float64) gives the float64 reduction (float64 tensors in the
    graph), as accurate in onnxruntime; the default graph of the same model has none; the
    setting ends with the block and rejects other dtypes."""
    model = Phases().eval()
    args = (torch.randn(8, 2),)
    with pf.onnx_phases(torch.float64):
        proto64 = export_torchscript(model, args, {"x": {0: "n"}}, ["x"])
    proto32 = export_torchscript(model, args, {"x": {0: "n"}}, ["x"])
    assert float64_tensors(proto64), "onnx_phases(torch.float64) left no float64 tensor"
    assert float64_tensors(proto32) == [], float64_tensors(proto32)[:10]
    x = _inputs.rand((64, 2), _inputs.generator(4), -2e4, 2e4)  # |phase| up to ~1e5
    with torch.no_grad():
        w, s = model.w.double(), x[:, 0].double()
        want = [pf.lff_rotary(x.double(), w, backend="reference")]
        want.append(pf.sinusoidal(s, 8, backend="reference"))
    for proto in (proto64, proto32):
        for got, ref in zip(run(proto, x), want):
            err = float((got.double() - ref).abs().max())
            assert err <= ONNX_PHASE_ATOL, err
    with pytest.raises(ValueError, match="torch.float32 or torch.float64"):
        pf.onnx_phases(torch.float16).__enter__()
