"""The general rotary op in the tools users ship with: opcheck of its four custom ops (every
backend that implements them), torch.compile(fullgraph=True) (no graph break), torch.export
with a dynamic number of tokens, and ONNX (both exporters; float32-only graphs within
TensorRT 10's support matrix, run in onnxruntime), including the static-shape table path:
positions of a fixed grid built in the model, whose table the exporter folds into
constants, leaving no If / Tile / Range / Shape node for TensorRT to reject."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from conftest import backend_params
from torch import nn
from torch.library import opcheck

import posenc_fast as pf
from posenc_fast.cli import _inputs
from posenc_fast.tolerances import ONNX_PHASE_ATOL, assert_close

OPS = torch.ops.posenc_fast


def _randn(shape, seed, device="cpu", scale=1.0):
    return _inputs.randn(shape, _inputs.generator(seed), torch.float32, device, scale)


@pytest.mark.parametrize("backend", backend_params("rotary", torch.float32))
@pytest.mark.parametrize(
    "layout,pairs,per_head,prefix",
    [("bnhd", "half", True, 1), ("bhnd", "interleaved", False, 0)],
    ids=["bnhd-half-per_head-prefix1", "bhnd-interleaved-shared"],
)
def test_opcheck(backend, layout, pairs, per_head, prefix, device):
    shape = (2, 5, 2, 8) if layout == "bnhd" else (2, 2, 5, 8)
    q, k = _randn(shape, 1, device), _randn(shape, 2, device)
    x = _randn((2, 5 - prefix, 2), 3, device, 3.0)
    w = _randn((2, 3, 2) if per_head else (3, 2), 4, device)
    leaves = [t.clone().requires_grad_() for t in (q, k, x, w)]
    opcheck(OPS.rotary.default, (*leaves, pairs, layout, prefix, backend))
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    for needs in ((True, True, True, True), (False, True, False, True)):
        args = (gq, gk, q, k, x, w, pairs, layout, prefix, backend, *needs)
        opcheck(OPS.rotary_backward.default, args)
    xt, wt = x.clone().requires_grad_(), w.clone().requires_grad_()
    opcheck(OPS.rotary_table.default, (xt, wt, pairs, torch.float32, backend))
    grad = torch.randn_like(pf.rotary_table(x, w, pairs, backend=backend))
    for need_x, need_w in ((True, True), (False, True)):
        args = (grad, x, w, pairs, backend, need_x, need_w)
        opcheck(OPS.rotary_table_backward.default, args)


class MixedBlocks(nn.Module):
    """Two attention blocks' rotations with RoPE-Mixed frequencies (one [depth, heads, F/2,
    2] Parameter, sliced per block) after an axial one with a class token."""

    def __init__(self, heads=2, head_dim=8):
        super().__init__()
        torch.manual_seed(0)
        self.freqs = nn.Parameter(pf.rope.mixed(head_dim, depth=2, heads=heads))
        self.axial = pf.Rotary(2, head_dim, pairs="half", prefix=1, layout="bnhd")

    def forward(self, q, k, x):  # q, k [B, heads, 1 + N, d], x [N, 2]
        a, b = self.axial(q.transpose(1, 2), k.transpose(1, 2), x)
        a, b = a.transpose(1, 2)[:, :, 1:], b.transpose(1, 2)[:, :, 1:]
        for d in range(self.freqs.shape[0]):
            a, b = pf.rotary(a, b, x, self.freqs[d])
        return a @ b.transpose(-1, -2), self.axial.table(x)


def test_compile_fullgraph_without_graph_breaks(device):
    m = MixedBlocks().to(device)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    q, k = _randn((2, 2, 13, 8), 5, device), _randn((2, 2, 13, 8), 6, device)
    x = pf.rope.grid((3, 4)).to(device)
    got, want = compiled(q, k, x), m(q, k, x)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    sum(o.square().sum() for o in got).backward()
    grads = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    sum(o.square().sum() for o in want).backward()
    for g, p in zip(grads, m.parameters()):
        torch.testing.assert_close(g, p.grad)


def test_export_with_a_dynamic_number_of_tokens(device):
    """torch.export, the number of positioned tokens dynamic (the class token static)."""
    from torch.export import Dim

    m = MixedBlocks().to(device)
    n = Dim("n", min=2, max=4096)
    dynamic = {"q": {2: n + 1}, "k": {2: n + 1}, "x": {0: n}}

    def make(count, seed):
        return (
            _randn((2, 2, count + 1, 8), seed, device),
            _randn((2, 2, count + 1, 8), seed + 1, device),
            _randn((count, 2), seed + 2, device, 3.0),
        )

    ep = torch.export.export(m, make(6, 7), dynamic_shapes=dynamic)
    args = make(11, 8)
    for g, w in zip(ep.module()(*args), m(*args)):
        torch.testing.assert_close(g, w)


# ------------------------------------------------------------------ ONNX

onnx = pytest.importorskip("onnx", reason="onnx is in the test extra (pyproject.toml)")
ort = pytest.importorskip("onnxruntime", reason="onnxruntime is in the test extra")
pytest.importorskip("onnxscript", reason="the dynamo exporter needs onnxscript (test extra)")

from _onnx_ops import float64_tensors, tensorrt_misfits  # noqa: E402


def export(model, args, exporter, dynamic=None):
    """ONNX of ``model(*args)``: dynamo (``dynamic``: its dynamic_shapes) or TorchScript
    (``dynamic``: its dynamic_axes)."""
    names = [f"in{i}" for i in range(len(args))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # exporter chatter
        if exporter == "dynamo":
            program = torch.onnx.export(
                model, args, dynamo=True, dynamic_shapes=dynamic, input_names=names,
                opset_version=20, verbose=False,
            )  # fmt: skip
            return program.model_proto
        f = io.BytesIO()
        torch.onnx.export(
            model, args, f, dynamo=False, input_names=names, dynamic_axes=dynamic,
            opset_version=17,
        )  # fmt: skip
        return onnx.load_from_string(f.getvalue())


def run(proto, *inputs):
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    feed = {i.name: t.numpy() for i, t in zip(session.get_inputs(), inputs)}
    return [torch.from_numpy(o) for o in session.run(None, feed)]


def op_types(proto) -> set:
    types = {n.op_type for n in proto.graph.node}
    for f in proto.functions:
        types |= {n.op_type for n in f.node}
    return types


def assert_deployable(proto):
    assert {d for n in proto.graph.node for d in [n.domain]} <= {"", "ai.onnx"}
    assert float64_tensors(proto) == [], float64_tensors(proto)[:10]
    assert tensorrt_misfits(proto) == [], tensorrt_misfits(proto)[:10]


class Family(nn.Module):
    """Every case of the op on q, k [B, 1 + N, H, 16] (bnhd) and positions x [B, N, 2]:
    per-head half pairs after a class token, shared interleaved partial rotation with
    fewer key heads, and both tables."""

    def __init__(self):
        super().__init__()
        self.per_head = pf.Rotary(
            2, 16, heads=2, pairs="half", layout="bnhd", prefix=1,
            frequencies=_randn((2, 8, 2), 9),
        )  # fmt: skip
        self.shared = pf.Rotary.from_frequencies(_randn((6, 2), 10), head_dim=16)

    def forward(self, q, k, x):
        a, b = self.per_head(q, k, x)
        c, d = self.shared(q[:, 1:].transpose(1, 2), k[:, 1:, :1].transpose(1, 2), x)
        return a, b, c, d, self.per_head.table(x), self.shared.table(x)


def family_inputs(B, N, seed):
    return (_randn((B, N + 1, 2, 16), seed), _randn((B, N + 1, 2, 16), seed + 1),
            _randn((B, N, 2), seed + 2, scale=3.0))  # fmt: skip


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_onnx_round_trip_with_dynamic_batch_and_tokens(exporter):
    model = Family().eval()
    args = family_inputs(2, 5, 11)
    if exporter == "dynamo":
        B, n = torch.export.Dim("batch"), torch.export.Dim("n", max=64)
        proto = export(model, args, exporter, ({0: B, 1: n + 1}, {0: B, 1: n + 1}, {0: B, 1: n}))
    else:
        axes = {"in0": {0: "b", 1: "t"}, "in1": {0: "b", 1: "t"}, "in2": {0: "b", 1: "n"}}
        proto = export(model, args, exporter, axes)
    assert_deployable(proto)
    for B, N in [(2, 5), (3, 9), (1, 1)]:
        inputs = family_inputs(B, N, 10 * B + N)
        with torch.no_grad():
            want = model(*inputs)
        got = run(proto, *inputs)
        assert len(got) == len(want)
        for i, (g, w) in enumerate(zip(got, want)):
            assert g.shape == w.shape, (i, g.shape, w.shape)
            assert_close(g, w.double(), torch.float32, "lff", what=f"{exporter} output {i}")


class FixedGrid(nn.Module):
    """A ViT's rotary for a fixed image size: DINOv3 frequencies on a 6 x 8 patch grid
    built in the model from Python ints, a class token and 4 registers."""

    def __init__(self):
        super().__init__()
        self.rope = pf.Rotary.from_frequencies(pf.rope.dinov3(32), pairs="half", prefix=5)

    def forward(self, q, k):
        x = pf.rope.grid((6, 8), "centered")
        return (*self.rope(q, k, x), self.rope.table(x))


def test_onnx_static_table_path_has_no_dynamic_shape_nodes():
    """Static shapes and positions from pf.rope.grid: the dynamo exporter folds the table
    into constants; no node that TensorRT rejects on dynamic shapes (If, Tile, Loop,
    Range, Shape, Expand, ConstantOfShape), float32 only, and within 1e-6 of the float64
    table in onnxruntime."""
    model = FixedGrid().eval()
    q, k = _randn((2, 3, 53, 32), 12), _randn((2, 3, 53, 32), 13)
    for exporter in ("dynamo", "torchscript"):
        proto = export(model, (q, k), exporter)
        assert_deployable(proto)
        dynamic = {"If", "Tile", "Loop", "Range", "Shape", "Expand", "ConstantOfShape"}
        assert not op_types(proto) & dynamic, (exporter, op_types(proto) & dynamic)
        got = run(proto, q, k)
        with torch.no_grad():
            want = model(q, k)
        for g, w in zip(got[:2], want[:2]):
            assert_close(g, w.double(), torch.float32, "rotary", scale=float(w.abs().max()))
        x = pf.rope.grid((6, 8), "centered")
        table64 = pf.rotary_table(x.double(), model.rope.freqs.detach().double(), "half")
        err = float((got[2].double() - table64).abs().max())
        assert err <= ONNX_PHASE_ATOL, (exporter, err)
    assert op_types(export(model, (q, k), "dynamo")) <= {"Slice", "Mul", "Add", "Concat"}
