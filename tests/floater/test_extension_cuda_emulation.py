"""The CUDA FLOATER kernels (csrc/floater/floater_cuda.cu) run on the CPU through
tools/cuda_emulation: every CUDA thread a std::thread, barriers and warp shuffles
emulated. This checks the kernels' logic (phases, slicing, reduce-scatters, adjoint,
weight and time gradients, cross-team reductions) in every layout - solo, cluster, grid;
weights in shared memory or from L2; vectors staged or read from L2 - against the
float64 reference loop, on machines without a GPU. It cannot check the GPU memory
model, timing or resource limits: that is the GPU run (POSENC_FAST_TEST_DEVICE=cuda).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from posenc_fast._testing import FloaterCase, floater_inputs
from posenc_fast.ops.floater import reference as ref
from posenc_fast.tolerances import assert_close

ROOT = Path(__file__).resolve().parents[2]
CXX = shutil.which("g++") or shutil.which("clang++")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        CXX is None or not sys.platform.startswith("linux"), reason="needs g++ on Linux"
    ),
]

METHODS = {"euler": 0, "midpoint": 1, "rk4": 2, "rk38": 3}
ACTIVATIONS = {"relu": 0, "tanh": 1, "gelu": 2, "identity": 3}
SOLO, CLUSTER, GRID = 0, 1, 2
RESIDENT, VECTORS_FROM_L2 = 1, 2


# Extra compiler flags of the emulator, e.g. "-fsanitize=thread -g" (tools/check_sanitizers.sh
# runs these tests so: a data race between emulated CUDA threads, blocks or teams is then a
# failed case, with ThreadSanitizer's report).
FLAGS_ENV = "POSENC_FAST_EMULATION_CXXFLAGS"


def _build(tmp_path_factory, threads):
    exe = tmp_path_factory.mktemp("emu") / f"emulate_floater_{threads}"
    cmd = [
        CXX,
        f"-DPOSENC_FAST_CUDA_THREADS={threads}",
        "-std=c++20",
        "-O1",
        "-pthread",
        "-Wall",
        "-Werror",
        "-Wno-unknown-pragmas",
        "-Wno-unused-function",
        "-I",
        str(ROOT / "csrc"),
        "-I",
        str(ROOT / "tools" / "cuda_emulation"),
        str(ROOT / "tools" / "cuda_emulation" / "emulate_floater.cpp"),
        "-o",
        str(exe),
        *shlex.split(os.environ.get(FLAGS_ENV, "")),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    return exe


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    """Blocks of 64 threads: every code path, a quarter of the host threads (this kind of
    machine is shared; a case spawns blocks x threads std::threads)."""
    return _build(tmp_path_factory, 64)


@pytest.fixture(scope="module")
def emulator256(tmp_path_factory):
    """The real block size, for a few cases."""
    return _build(tmp_path_factory, 256)


def run_emulated(
    exe, tmp, S, d, H, L, n, method, act, dtype, mode, C, Sg, layout, seed, needs=(1,) * 6
):
    case = FloaterCase(S, d, H, L, repeat_time=True)
    args = [a.to(dtype).double() for a in floater_inputs(case, torch.float64, "cpu", seed)]
    grad = torch.randn(
        (S, L, d), generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64
    )
    grad = grad.to(dtype).double()
    header = [S, d, H, L, n, METHODS[method], ACTIVATIONS[act], 4 if dtype == torch.float32 else 8]
    header += [mode, C, Sg, layout, *needs]
    inp, outp = tmp / "in.bin", tmp / "out.bin"
    with open(inp, "wb") as f:
        f.write((" ".join(map(str, header)) + "\n").encode())
        for a in (*args, grad):
            f.write(a.numpy().astype(np.float64).tobytes())
    r = subprocess.run([str(exe), str(inp), str(outp)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"emulator rc={r.returncode}: {_report(r.stderr)}"
    data = torch.from_numpy(np.fromfile(outp, dtype=np.float64))
    shapes = [(S, L, d), (S, d), (d + 1, H), (H,), (H + 1, d), (d,), (L,)]
    parts, o = [], 0
    for shp in shapes:
        k = int(np.prod(shp))
        parts.append(data[o : o + k].reshape(shp))
        o += k
    return args, grad, parts, r.stderr


def _report(stderr: str) -> str:
    """The emulator's error output: a sanitizer's first report from its start, else the end."""
    start = stderr.find("WARNING: ThreadSanitizer")
    if start < 0:
        start = stderr.find("ERROR: ")
    return stderr[start : start + 6000] if start >= 0 else stderr[-2000:]


# (S, d, H, L, substeps, method, activation, dtype, mode, C, Sg, layout)
CASES = [
    (3, 5, 7, 4, 2, "rk4", "tanh", torch.float64, SOLO, 1, 2, RESIDENT),
    (4, 6, 5, 3, 1, "euler", "gelu", torch.float32, SOLO, 1, 4, RESIDENT),
    (3, 5, 7, 4, 2, "rk38", "gelu", torch.float64, CLUSTER, 2, 2, RESIDENT),
    (3, 5, 7, 4, 2, "rk4", "relu", torch.float32, CLUSTER, 3, 2, RESIDENT | VECTORS_FROM_L2),
    (1, 3, 40, 3, 3, "rk4", "tanh", torch.float64, CLUSTER, 3, 1, RESIDENT),
    (3, 5, 7, 4, 2, "midpoint", "relu", torch.float64, GRID, 3, 1, 0),
    (3, 5, 7, 4, 2, "midpoint", "identity", torch.float64, GRID, 3, 1, VECTORS_FROM_L2),
    (5, 9, 6, 3, 1, "rk4", "gelu", torch.float32, GRID, 2, 3, RESIDENT),
    (7, 40, 3, 2, 2, "rk38", "relu", torch.float64, GRID, 3, 2, RESIDENT),
    # the weight-gradient pass stages X in chunks of the block's scratch (64 threads: 512
    # elements): H=70 with 4 stages x 2 states = 8 rows takes two column chunks (64 + 6),
    # the second team has one state, d=9 and 6 leave partial groups of 4 rows
    (3, 9, 70, 3, 2, "rk4", "tanh", torch.float32, CLUSTER, 2, 2, RESIDENT | VECTORS_FROM_L2),
    # ... and 4 stages x 130 states = 520 rows take two row chunks (512 + 8)
    (130, 3, 5, 2, 1, "rk4", "gelu", torch.float64, GRID, 2, 130, 0),
]


def _id(c):
    mode = {SOLO: "solo", CLUSTER: "cluster", GRID: "grid"}[c[8]]
    layout = ("smemW" if c[11] & RESIDENT else "l2W") + ("-l2X" if c[11] & VECTORS_FROM_L2 else "")
    shape = f"S{c[0]}-d{c[1]}-H{c[2]}-L{c[3]}-K{c[4]}"
    return f"{shape}-{c[5]}-{c[6]}-{str(c[7])[6:]}-{mode}C{c[9]}-Sg{c[10]}-{layout}"


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_emulated_cuda_kernels_match_loop(emulator, tmp_path, case):
    S, d, H, _, n, method, act, dtype = case[:8]
    args, grad, parts, log = run_emulated(emulator, tmp_path, *case, seed=S + d + H)
    leaves = [a.clone().requires_grad_(True) for a in args]
    expected = ref.floater(*leaves, n, method, act)
    assert_close(parts[0], expected, dtype, "floater", what=f"forward [{log.splitlines()[0]}]")
    ref_grads = torch.autograd.grad(expected, leaves, grad)
    for name, got, want in zip(("p0", "w1", "b1", "w2", "b2", "times"), parts[1:], ref_grads):
        assert_close(got, want, dtype, "grad", what=f"d{name}")


@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=[_id(CASES[0]), _id(CASES[3])])
def test_emulated_cuda_kernels_256_threads(emulator256, tmp_path, case):
    test_emulated_cuda_kernels_match_loop(emulator256, tmp_path, case)


def test_emulated_needs_subset(emulator, tmp_path):
    """Gradients not asked for stay zero (the kernels skip them) and the others agree."""
    case = (4, 5, 6, 3, 2, "rk4", "tanh", torch.float64, CLUSTER, 2, 2, RESIDENT)
    needs = (0, 1, 0, 0, 1, 1)
    _, _, full, _ = run_emulated(emulator, tmp_path, *case, seed=3)
    _, _, part, _ = run_emulated(emulator, tmp_path, *case, seed=3, needs=needs)
    for need, a, b in zip(needs, part[1:], full[1:]):
        if need:
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        else:
            assert float(a.abs().sum()) == 0.0


@pytest.mark.parametrize(
    ("shape", "expected"),
    [
        ((12, 64, 64, 1024, 5, 2, 4, 1), "solo"),
        ((12, 512, 512, 1024, 5, 2, 4, 1), "cluster"),
        ((36, 1024, 1024, 4096, 1, 2, 4, 1), "grid"),
        ((12, 1024, 1024, 1024, 1, 2, 8, 1), "weights in shared memory"),
        ((12, 4096, 4096, 64, 1, 2, 8, 1), "weights from L2"),
    ],
)
def test_plan_on_an_h100_like_device(emulator, shape, expected):
    r = subprocess.run([str(emulator), "--plan", *map(str, shape)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert expected in r.stdout, r.stdout


@pytest.mark.parametrize("backward", [0, 1], ids=["fwd", "bwd"])
@pytest.mark.parametrize("shape", [(12, 512, 512), (36, 384, 384), (40, 256, 256)])
def test_cluster_plans_run_in_one_wave(emulator, shape, backward):
    """All teams of a cluster plan are co-resident (the emulated device runs 8 clusters at
    once, as the H200 does for clusters of 9+ blocks): no second wave. The first H200 run
    launched 12 clusters of 10 blocks for S=12, d=H=512, and took twice the time."""
    S, d, H = shape
    r = subprocess.run([str(emulator), "--plan", str(S), str(d), str(H), "1024", "5", "2", "4",
                        str(backward)], capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    mode, _blocks, G, Sg = map(int, r.stdout.split()[:4])
    assert mode == CLUSTER, r.stdout
    assert G <= 8 and G * Sg >= S, r.stdout
