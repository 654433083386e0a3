"""What an exported graph may hold for the runtimes users deploy to (tests/common/test_onnx.py).

TensorRT cannot be installed on a machine without an NVIDIA GPU, so its ONNX parser is
not run here: the graphs are checked against TensorRT's published operator support
matrix instead. Source: the ONNX-TensorRT parser's docs/operators.md as of its "10.1 GA"
release (github.com/onnx/onnx-tensorrt, commit 96e7811, 2024-06-17; read 2026-11-28),
which documents TensorRT 10.0, opsets 9 to 20: every operator it marks supported, with
the element types it lists (its "INF64" for ConstantOfShape read as INT64; the quantized
DequantizeLinear left out). It notes that DOUBLE is supported only by casting it down to
FLOAT, which is why a graph with float64 phases would lose their accuracy there. OpenVINO
installs as a CPU wheel and runs the graphs itself (run_openvino).
"""

from __future__ import annotations

import os
import tempfile

import onnx
import torch
from onnx import TensorProto, shape_inference

FLOATS = ("FP32", "FP16", "BF16")
NUMBERS = (*FLOATS, "INT32", "INT64")
ANY = (*NUMBERS, "BOOL")

_GROUPS = {
    FLOATS: """Acos Acosh Asin Asinh Atan Atanh AveragePool BatchNormalization Ceil Celu Clip
        Conv ConvTranspose Cos Cosh CumSum Dropout Einsum Elu Erf Exp Floor GRU Gemm
        GlobalAveragePool GlobalLpPool GlobalMaxPool GroupNormalization HardSigmoid HardSwish
        Hardmax ImageScaler InstanceNormalization IsInf LRN LSTM LayerNormalization LeakyRelu
        Log LogSoftmax LpNormalization LpPool MatMul MaxPool MeanVarianceNormalization PRelu
        ParametricSoftplus Pow QuantizeLinear RNN RandomNormal RandomNormalLike RandomUniform
        RandomUniformLike Reciprocal Resize Round ScaledTanh Scan Selu Sigmoid Sin Sinh Softmax
        Softplus Softsign Sqrt Tan Tanh ThresholdedRelu Upsample""",
    NUMBERS: """Abs Add ArgMax ArgMin DepthToSpace Div Equal Greater GreaterOrEqual IsNaN Less
        LessOrEqual Max Min Mod Mul Neg Pad Range ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp
        ReduceMax ReduceMean ReduceMin ReduceProd ReduceSum ReduceSumSquare Relu Scatter
        ScatterElements ScatterND Shrink Sign SpaceToDepth Sub Sum TopK""",
    ANY: """Concat Constant Expand EyeLike Flatten Gather GatherElements GatherND Identity If
        Loop OneHot Reshape ReverseSequence Shape Size Slice Split Squeeze Tile Transpose Trilu
        Unsqueeze Where ConstantOfShape""",
    ("FP32", "FP16"): "DeformConv GridSample Mish NonMaxSuppression NonZero RoiAlign",
    ("BOOL",): "And Not Or Xor",
    (*ANY, "UINT8"): "Cast CastLike",
    (*NUMBERS, "INT8"): "Gelu",
    (*NUMBERS, "FP8"): "Mean",
}
# ONNX operator -> the element types TensorRT 10 supports for it
TENSORRT_10 = {op: types for types, ops in _GROUPS.items() for op in ops.split()}

_TYPE_NAMES = {
    TensorProto.FLOAT: "FP32",
    TensorProto.FLOAT16: "FP16",
    TensorProto.BFLOAT16: "BF16",
    TensorProto.INT32: "INT32",
    TensorProto.INT64: "INT64",
    TensorProto.BOOL: "BOOL",
    TensorProto.UINT8: "UINT8",
    TensorProto.INT8: "INT8",
    TensorProto.DOUBLE: "DOUBLE",
}


def element_types(proto: onnx.ModelProto) -> dict[str, int]:
    """Every named tensor of the main graph -> its element type, after shape inference:
    inputs, outputs, initializers, Constant outputs and the inferred value_info."""
    graph = shape_inference.infer_shapes(proto).graph
    types = {v.name: v.type.tensor_type.elem_type for v in graph.input}
    types.update({v.name: v.type.tensor_type.elem_type for v in graph.value_info})
    types.update({v.name: v.type.tensor_type.elem_type for v in graph.output})
    types.update({t.name: t.data_type for t in graph.initializer})
    for node in graph.node:
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.type == onnx.AttributeProto.TENSOR:
                    types[node.output[0]] = a.t.data_type
    return types


def float64_tensors(proto: onnx.ModelProto) -> list[str]:
    """The float64 tensors of the graph (named tensors, Cast targets, the functions' Cast
    targets and tensor attributes): [] for a float32-only graph."""
    found = [name for name, t in element_types(proto).items() if t == TensorProto.DOUBLE]
    nodes = list(proto.graph.node) + [n for f in proto.functions for n in f.node]
    for node in nodes:
        for a in node.attribute:
            if a.name == "to" and a.i == TensorProto.DOUBLE:
                found.append(f"{node.op_type} {node.name} -> DOUBLE")
            if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == TensorProto.DOUBLE:
                found.append(f"{node.op_type} {node.name}: DOUBLE attribute")
    return found


def tensorrt_misfits(proto: onnx.ModelProto) -> list[str]:
    """Nodes TensorRT 10 does not support: an operator outside its matrix, or a data input
    (a Cast's target too) of an element type the matrix does not list for that operator.
    The data input is the first (Where's: its second, after the condition); the others are
    index and shape tensors (Resize's sizes, Slice's starts, Gather's indices) that the
    matrix does not type, and any float64 among them is float64_tensors' to find."""
    types = element_types(proto)
    bad = []
    nodes = [(n, True) for n in proto.graph.node]
    nodes += [(n, False) for f in proto.functions for n in f.node]  # types unknown there
    for node, typed in nodes:
        allowed = TENSORRT_10.get(node.op_type) if node.domain in ("", "ai.onnx") else None
        if allowed is None:
            bad.append(f"{node.domain or 'ai.onnx'}::{node.op_type} is not supported")
            continue
        data = node.input[1 if node.op_type == "Where" else 0] if node.input else ""
        used = [types[data]] if typed and data in types else []
        used += [a.i for a in node.attribute if node.op_type == "Cast" and a.name == "to"]
        for t in used:
            name = _TYPE_NAMES.get(t, str(t))
            if name not in allowed:
                bad.append(f"{node.op_type} {node.name} on {name} (supported: {allowed})")
    return bad


def run_openvino(proto: onnx.ModelProto, *inputs: torch.Tensor) -> list[torch.Tensor] | None:
    """The graph's outputs on ``inputs`` in OpenVINO's CPU plugin (float32 inference, not
    its bf16 default on CPUs that have it); None when OpenVINO is not installed."""
    try:
        import openvino as ov
    except ImportError:
        return None
    core = ov.Core()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.onnx")
        onnx.save(proto, path)
        model = core.read_model(path)
        compiled = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    out = compiled([t.numpy() for t in inputs])
    return [torch.from_numpy(out[o].copy()) for o in compiled.outputs]
