"""Accuracy of exported ONNX graphs against float64 math, per phase range and runtime.

Exports one small model whose outputs are cos / sin features only (the rotary table and
the LFF features of 2-D positions, the sinusoidal encoding of float and of integer
positions, the DFT encoding) with torch.onnx.export(dynamo=True), once with the default
float32 phases and once under ``posenc_fast.onnx_phases(torch.float64)``, runs both in
onnxruntime (and OpenVINO, when installed) on fresh random inputs whose phases reach
|phase| <= P, and prints the largest error of every output against the float64
reference evaluated on the same float32 inputs. The README's "Deploying" figure comes
from this script:

    python benchmarks/onnx_accuracy.py                  # ~1 min on 2 cores
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
from posenc_fast import _testing

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


def inputs(model: Features, phase: float, seed: int):
    """x, s, i whose phases stay within |phase| (i: integer positions up to INT_TOP)."""
    gen = _testing.generator(seed)
    row_sum = float(model.wr.detach().abs().sum(1).max())
    x = _testing.rand((N, 2), gen, -phase / row_sum, phase / row_sum)
    s = _testing.rand((N,), gen, -phase / math.pi, phase / math.pi)  # dft: 2pi k/DIM < pi
    i = torch.randint(-INT_TOP, INT_TOP, (N,), generator=gen)
    return x, s, i


def export(model: Features, phases: torch.dtype, path: str) -> None:
    n = torch.export.Dim("n")
    x, s, i = inputs(model, 1.0, seed=0)
    with warnings.catch_warnings(), pf.onnx_phases(phases):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            model, (x, s, i), dynamo=True, dynamic_shapes=({0: n}, {0: n}, {0: n}), verbose=False
        )
    program.save(path)


def runtimes(path: str) -> dict:
    """name -> callable(list of numpy inputs) -> list of outputs."""
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


def measure() -> list[dict]:
    torch.manual_seed(0)
    model = Features(torch.randn(DIM // 2, 2)).eval()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for phases in (torch.float32, torch.float64):
            path = os.path.join(tmp, f"{phases}.onnx")
            export(model, phases, path)
            for runtime, run in runtimes(path).items():
                for n, phase in enumerate(PHASES):
                    x, s, i = inputs(model, phase, seed=n + 1)
                    got = run([t.numpy() for t in (x, s, i)])
                    for name, g, want in zip(OUTPUTS, got, reference(model, x, s, i)):
                        err = float((torch.from_numpy(g).double() - want).abs().max())
                        bound = INT_TOP if "int" in name else phase
                        rows.append(
                            {
                                "graph": str(phases)[6:],
                                "runtime": runtime,
                                "output": name,
                                "max_phase": bound,
                                "max_abs_err": err,
                            }
                        )
                        print(
                            f"{rows[-1]['graph']:<8} {runtime:<12} {name:<17} "
                            f"|phase| <= {bound:<9.3g} max error {err:.2e}",
                            file=sys.stderr,
                        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    rows = measure()
    print(f"\n{'graph':<8} {'runtime':<12} {'|phase| <=':>10}  max error over every output")
    keys = sorted({(r["graph"], r["runtime"], r["max_phase"]) for r in rows if "int" not in r["output"]})
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
