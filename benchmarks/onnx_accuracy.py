"""Accuracy of exported ONNX graphs against float64 math, per phase range and runtime.

Exports one small model whose outputs are cos / sin features only (the rotary table and
the LFF features of 2-D positions, the sinusoidal encoding of float and of integer
positions, the DFT encoding) with torch.onnx.export(dynamo=True), once with the default
float32 phases and once under ``posenc_fast.onnx_phases(torch.float64)``, runs both in
onnxruntime (and OpenVINO, when installed) on fresh random inputs whose phases reach
|phase| <= P, and prints the largest error of every output against the float64
reference evaluated on the same float32 inputs, then whether the float32 graph meets
the tolerance of posenc_fast/tolerances.py (ONNX_PHASE_ATOL up to ONNX_MAX_PHASE). The
README's "Deploying" figures come from this script; tests/common/test_onnx.py runs its
measure() on the float32 graph at the two largest phase bounds:

    python benchmarks/onnx_accuracy.py                  # 45 s on 2 cores
    python benchmarks/onnx_accuracy.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import warnings

import torch
from torch import nn

import posenc_fast as pf
from posenc_fast.cli import _inputs
from posenc_fast.tolerances import ONNX_MAX_PHASE, ONNX_PHASE_ATOL

# |phase| bounds: the README promises 1e-6 up to 1e5; the others are informative
PHASES = (1e1, 1e3, 1e5, 1e6)
INT_TOP = 2**24  # integer positions are exact in float32 up to here (README, "Precision")
N = 4096  # positions per run
DIM = 64  # encodings' width; the rotary / LFF frequencies: DIM / 2


class Features(nn.Module):
    """x [N, 2] float positions, s [N] float positions, i [N] integer positions ->
    (rotary table [2, N, DIM], LFF features [N, DIM] * sqrt(DIM), sinusoidal(s),
    sinusoidal(i), dft(s)): phases x.wr, s / base^(2k/DIM), i / ..., 2pi k s / DIM."""

    def __init__(self, wr: torch.Tensor):
        super().__init__()
        self.wr = nn.Parameter(wr)

    def forward(self, x, s, i):
        return (
            pf.lff_rotary(x, self.wr)[..., ::2],  # each frequency once
            pf.lff(x[:, None, :], self.wr) * math.sqrt(DIM),
            pf.sinusoidal(s, DIM),
            pf.sinusoidal(i, DIM),
            pf.dft(s, DIM),
        )


OUTPUTS = ("rotary table", "LFF features", "sinusoidal", "sinusoidal (int)", "DFT")


def reference(model: Features, x, s, i) -> list[torch.Tensor]:
    """float64 math on the same (float32) inputs."""
    wr = model.wr.detach().double()
    with torch.no_grad():
        return [
            pf.lff_rotary(x.double(), wr, backend="reference")[..., ::2],
            pf.lff(x.double()[:, None, :], wr, backend="reference") * math.sqrt(DIM),
            pf.sinusoidal(s.double(), DIM, backend="reference"),
            pf.sinusoidal(i, DIM, backend="reference", dtype=torch.float64),
            pf.dft(s.double(), DIM, backend="reference"),
        ]


def inputs(model: Features, phase: float, seed: int, n: int = N):
    """n of x, s, i whose phases stay within |phase| (i: integer positions up to INT_TOP)."""
    gen = _inputs.generator(seed)
    row_sum = float(model.wr.detach().abs().sum(1).max())
    x = _inputs.rand((n, 2), gen, -phase / row_sum, phase / row_sum)
    s = _inputs.rand((n,), gen, -phase / math.pi, phase / math.pi)  # dft: 2pi k/DIM < pi
    i = torch.randint(-INT_TOP, INT_TOP, (n,), generator=gen)
    return x, s, i


def export(model: Features, phases: torch.dtype, path: str) -> None:
    """The ONNX graph of ``model`` with dynamic N, phases reduced in ``phases``, at path."""
    n = torch.export.Dim("n")
    x, s, i = inputs(model, 1.0, seed=0)
    with warnings.catch_warnings(), pf.onnx_phases(phases):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            model, (x, s, i), dynamo=True, dynamic_shapes=({0: n}, {0: n}, {0: n}), verbose=False
        )
    program.save(path)


def runtimes(path: str) -> dict:
    """name -> callable(list of numpy inputs) -> list of outputs: onnxruntime, and OpenVINO
    when it is installed (its CPU plugin asked for float32 inference, not its bf16 default
    on CPUs that have it)."""
    out = {}
    import onnxruntime as ort

    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    names = [a.name for a in session.get_inputs()]
    out["onnxruntime"] = lambda feed: session.run(None, dict(zip(names, feed)))
    try:
        import openvino as ov
    except ImportError:
        return out
    core = ov.Core()
    compiled = core.compile_model(core.read_model(path), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    out["openvino"] = lambda feed: list(compiled(feed).values())
    return out


def model() -> Features:
    torch.manual_seed(0)
    return Features(torch.randn(DIM // 2, 2)).eval()


def measure(
    phases=PHASES, n: int = N, graphs=(torch.float32, torch.float64), log=sys.stderr
) -> list[dict]:
    """One row per graph (phase dtype), runtime, |phase| bound and output: the largest
    absolute error against float64 math on the same float32 inputs (n positions)."""
    features, rows = model(), []
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in graphs:
            path = os.path.join(tmp, f"{dtype}.onnx")
            export(features, dtype, path)
            for runtime, run in runtimes(path).items():
                for k, phase in enumerate(phases):
                    x, s, i = inputs(features, phase, seed=k + 1, n=n)
                    got = run([t.numpy() for t in (x, s, i)])
                    for name, g, want in zip(OUTPUTS, got, reference(features, x, s, i)):
                        row = {
                            "graph": str(dtype)[6:],
                            "runtime": runtime,
                            "output": name,
                            "max_phase": INT_TOP if "int" in name else phase,
                            "max_abs_err": float((torch.from_numpy(g).double() - want).abs().max()),
                        }
                        rows.append(row)
                        if log is not None:
                            print(
                                f"{row['graph']:<8} {runtime:<12} {name:<17} |phase| <= "
                                f"{row['max_phase']:<9.3g} max error {row['max_abs_err']:.2e}",
                                file=log,
                            )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    rows = measure()
    print(f"\n{'graph':<8} {'runtime':<12} {'|phase| <=':>10}  max error over every output")
    floats = [r for r in rows if "int" not in r["output"]]
    keys = sorted({(r["graph"], r["runtime"], r["max_phase"]) for r in floats})
    for graph, runtime, phase in keys:
        err = max(
            r["max_abs_err"]
            for r in rows
            if (r["graph"], r["runtime"], r["max_phase"]) == (graph, runtime, phase)
        )
        print(f"{graph:<8} {runtime:<12} {phase:>10.3g}  {err:.2e}")
    for graph, runtime in sorted({(r["graph"], r["runtime"]) for r in rows}):
        err = max(
            r["max_abs_err"]
            for r in rows
            if (r["graph"], r["runtime"]) == (graph, runtime) and "int" in r["output"]
        )
        print(f"{graph:<8} {runtime:<12} integer positions < 2^24: {err:.2e}")
    worst = max(
        r["max_abs_err"]
        for r in rows
        if r["graph"] == "float32" and ("int" in r["output"] or r["max_phase"] <= ONNX_MAX_PHASE)
    )
    ok = worst <= ONNX_PHASE_ATOL
    print(
        f"float32 graph, |phase| <= {ONNX_MAX_PHASE:.0e}: worst {worst:.2e} "
        f"{'within' if ok else 'OUTSIDE'} ONNX_PHASE_ATOL = {ONNX_PHASE_ATOL:.0e}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
