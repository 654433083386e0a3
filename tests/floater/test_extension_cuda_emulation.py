"""The CUDA FLOATER kernels (csrc/floater/floater_cuda.cu) run on the CPU through
tools/cuda_emulation: every CUDA thread a std::thread, barriers and warp shuffles
emulated, thread-block clusters with distributed shared memory, and every access to the
teams' exchange buffers checked against the barriers (a race aborts the emulator). This
checks the kernels' logic in every layout - solo, cluster, grid; weights in shared
memory, from L2 or split; vectors staged or read from L2 - the forward's tape, the
backward's chunks (taped intervals read from the tape, the others integrated again), the
reduce-scatters of the adjoint and the weight gradients made from the tape, against the
float64 reference loop, on machines without a GPU. It cannot check the GPU memory model
beyond barrier order, timing or resource limits: that is the GPU run
(POSENC_FAST_TEST_DEVICE=cuda).
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

from posenc_fast.cli._inputs import FloaterCase, floater_inputs
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
RESIDENT, VECTORS_FROM_L2, HALF_RESIDENT = 1, 2, 4
NO_TIMES = (1, 1, 1, 1, 1, 0)  # every gradient but the times': the taped backward
ALL = (1,) * 6

EMULATION = ROOT / "tools" / "cuda_emulation"


def _build(tmp_path_factory, threads, extra_flags: str = ""):
    """The emulator, from outside the CUDA sources: its header force-included (the hooks of
    csrc/floater/floater_cuda_hooks.h, blocks of ``threads``) and its stand-ins for the
    CUDA headers first on the include path; ``extra_flags``: pytest's --emulation-cxxflags
    (tools/check_sanitizers.sh: "-fsanitize=thread -g", a data race between emulated CUDA
    threads, blocks or teams is then a failed case, with ThreadSanitizer's report)."""
    exe = tmp_path_factory.mktemp("emu") / f"emulate_floater_{threads}"
    cmd = [
        CXX,
        f"-DFLOATER_CUDA_THREADS={threads}",
        "-std=c++20",
        "-O1",
        "-pthread",
        "-Wall",
        "-Werror",
        "-Wno-unknown-pragmas",
        "-Wno-unused-function",
        "-include",
        str(EMULATION / "cuda_emulation.h"),
        "-I",
        str(EMULATION / "include"),
        "-I",
        str(ROOT / "csrc"),
        str(EMULATION / "emulate_floater.cpp"),
        "-o",
        str(exe),
        *shlex.split(extra_flags),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    return exe


@pytest.fixture(scope="module")
def emulation_flags(request):
    return request.config.getoption("--emulation-cxxflags")


@pytest.fixture(scope="module")
def emulator(tmp_path_factory, emulation_flags):
    """Blocks of 64 threads: every code path, a quarter of the host threads (this kind of
    machine is shared; a case spawns blocks x threads std::threads)."""
    return _build(tmp_path_factory, 64, emulation_flags)


def run_emulated(exe, tmp, case, seed, needs=NO_TIMES, env=None, check=True):
    """(inputs, grad_output, [out, dp0, dw1, db1, dw2, db2, dtimes, tape], stderr) of one
    emulated forward + backward; case: (S, d, H, L, substeps, method, activation, dtype,
    mode, C, Sg, layout, tape intervals, chunk intervals)."""
    S, d, H, L, n, method, act, dtype, mode, C, Sg, layout, tape, chunk = case
    fc = FloaterCase(S, d, H, L, repeat_time=True)
    args = [a.to(dtype).double() for a in floater_inputs(fc, torch.float64, "cpu", seed)]
    grad = torch.randn(
        (S, L, d), generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64
    )
    grad = grad.to(dtype).double()
    header = [S, d, H, L, n, METHODS[method], ACTIVATIONS[act], 4 if dtype == torch.float32 else 8]
    header += [mode, C, Sg, layout, *needs, tape, chunk]
    inp, outp = tmp / "in.bin", tmp / "out.bin"
    with open(inp, "wb") as f:
        f.write((" ".join(map(str, header)) + "\n").encode())
        for a in (*args, grad):
            f.write(a.numpy().astype(np.float64).tobytes())
    r = subprocess.run(
        [str(exe), str(inp), str(outp)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, **(env or {})},
    )
    if not check:
        return r
    assert r.returncode == 0, f"emulator rc={r.returncode}: {_report(r.stderr)}"
    data = torch.from_numpy(np.fromfile(outp, dtype=np.float64))
    stages = {"euler": 1, "midpoint": 2, "rk4": 4, "rk38": 4}[method]
    shapes = [(S, L, d), (S, d), (d + 1, H), (H,), (H + 1, d), (d,), (L,)]
    shapes.append((tape * n * stages * S * (d + H),))
    parts, o = [], 0
    for shp in shapes:
        k = int(np.prod(shp))
        parts.append(data[o : o + k].reshape(shp))
        o += k
    assert o == data.numel()
    return args, grad, parts, r.stderr


def _report(stderr: str) -> str:
    """The emulator's error output: a sanitizer's first report from its start, else the end."""
    start = stderr.find("WARNING: ThreadSanitizer")
    if start < 0:
        start = stderr.find("ERROR: ")
    return stderr[start : start + 6000] if start >= 0 else stderr[-2000:]


def reference_tape(args, n, method, act, intervals) -> torch.Tensor:
    """The stage values of the first ``intervals`` intervals in float64, in the tape's
    layout: Y [intervals][substeps][stages][S][d], then Z (the pre-activations)."""
    p0, w1, b1, w2, b2, times = args
    d, H = p0.shape[1], w1.shape[1]
    ys, zs = [], []

    def h(t, p):
        z = p @ w1[:d] + t * w1[d] + b1
        ys.append(p)
        zs.append(z)
        return ref.activation(act, z) @ w2[:H] + t * w2[H] + b2

    y, t_prev = p0, torch.zeros((), dtype=torch.float64)
    for j in range(intervals):
        dt = (times[j] - t_prev) / n
        for k in range(n):
            y = ref.STEPS[method](h, t_prev + k * dt, y, dt)
        t_prev = times[j]
    return torch.cat([torch.stack(ys).flatten(), torch.stack(zs).flatten()])


def check_case(exe, tmp, case, needs=NO_TIMES, seed=None):
    S, d, H, _, n, method, act, dtype = case[:8]
    tape = case[12]
    seed = S + d + H if seed is None else seed
    args, grad, parts, log = run_emulated(exe, tmp, case, seed, needs)
    leaves = [a.clone().requires_grad_(True) for a in args]
    expected = ref.floater(*leaves, n, method, act)
    layouts = " / ".join(log.splitlines()[:2])
    assert_close(parts[0], expected, dtype, "floater", what=f"forward [{layouts}]")
    ref_grads = torch.autograd.grad(expected, leaves, grad)
    names = ("p0", "w1", "b1", "w2", "b2", "times")
    for name, need, got, want in zip(names, needs, parts[1:7], ref_grads):
        if need:
            assert_close(got, want, dtype, "grad", what=f"d{name} [{layouts}]")
        else:
            assert float(got.abs().sum()) == 0.0, f"d{name} was not asked for"
    if tape:
        want = reference_tape(args, n, method, act, tape)
        assert_close(parts[7], want, dtype, "floater", what=f"tape [{layouts}]")
    return parts


# (S, d, H, L, substeps, method, activation, dtype, mode, C, Sg, layout, tape, chunk)
CASES = [
    # a partial tape, one interval per chunk: intervals 2 and 3 integrated again, 0 and 1
    # read from the tape
    (3, 5, 7, 4, 2, "rk4", "tanh", torch.float64, SOLO, 1, 2, RESIDENT, 2, 1),
    (4, 6, 5, 3, 1, "euler", "gelu", torch.float32, SOLO, 1, 4, RESIDENT, 3, 0),
    # 9 states in one block: items of 4 states, the last group partial
    (9, 3, 5, 2, 1, "rk4", "gelu", torch.float64, SOLO, 1, 9, RESIDENT, 1, 0),
    # clusters: slices of unequal sizes, two teams, chunks of two intervals
    (3, 5, 7, 4, 2, "rk38", "gelu", torch.float64, CLUSTER, 2, 2, RESIDENT, 0, 2),
    (3, 5, 7, 4, 2, "rk4", "relu", torch.float32, CLUSTER, 3, 2, RESIDENT, 4, 3),
    (1, 3, 40, 3, 3, "rk4", "tanh", torch.float64, CLUSTER, 3, 1, HALF_RESIDENT, 1, 0),
    (3, 9, 70, 3, 2, "rk4", "tanh", torch.float32, CLUSTER, 2, 2, RESIDENT, 2, 0),
    # the largest cluster (16 blocks, the non-portable size), one state
    (1, 16, 18, 2, 1, "midpoint", "relu", torch.float32, CLUSTER, 16, 1, RESIDENT, 1, 0),
    # cooperative grids: weights from L2, vectors from L2, split residency, 3 states a team
    (3, 5, 7, 4, 2, "midpoint", "relu", torch.float64, GRID, 3, 1, 0, 2, 1),
    (3, 5, 7, 4, 2, "midpoint", "identity", torch.float64, GRID, 3, 1, VECTORS_FROM_L2, 0, 0),
    (5, 9, 6, 3, 1, "rk4", "gelu", torch.float32, GRID, 2, 3, HALF_RESIDENT, 3, 0),
    (7, 40, 3, 2, 2, "rk38", "relu", torch.float64, GRID, 3, 2, RESIDENT, 1, 0),
]


def _id(c):
    mode = {SOLO: "solo", CLUSTER: "cluster", GRID: "grid"}[c[8]]
    res = "halfW" if c[11] & HALF_RESIDENT else ("smemW" if c[11] & RESIDENT else "l2W")
    layout = res + ("-l2X" if c[11] & VECTORS_FROM_L2 else "")
    shape = f"S{c[0]}-d{c[1]}-H{c[2]}-L{c[3]}-K{c[4]}"
    return (
        f"{shape}-{c[5]}-{c[6]}-{str(c[7])[6:]}-{mode}C{c[9]}-Sg{c[10]}-{layout}"
        f"-tape{c[12]}-chunk{c[13]}"
    )


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_emulated_cuda_kernels_match_reference(emulator, tmp_path, case):
    check_case(emulator, tmp_path, case)


# the times' gradient: every chunk integrated again with its slopes (the tape ignored)
TIME_CASES = [CASES[0], CASES[3], CASES[8]]


@pytest.mark.parametrize("case", TIME_CASES, ids=[_id(c) for c in TIME_CASES])
def test_emulated_times_gradient(emulator, tmp_path, case):
    check_case(emulator, tmp_path, case, needs=ALL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_emulated_tape_matches_the_cpu_tape(emulator, tmp_path, dtype):
    """The GPU tape has the CPU tape's layout and values: the cpp backend's taped forward
    (posenc_fast::floater_integrate_taped) on the same inputs."""
    from posenc_fast import _dispatch

    try:
        ops = _dispatch.extension_ops("cpp")
    except RuntimeError as exc:
        pytest.skip(str(exc))
    case = (3, 5, 7, 4, 2, "rk38", "tanh", dtype, CLUSTER, 3, 2, RESIDENT, 3, 0)
    args, _, parts, _ = run_emulated(emulator, tmp_path, case, 11)
    out, tape = ops.floater_integrate_taped(*[a.to(dtype) for a in args], 2, "rk38", "tanh", 3)
    assert parts[7].shape == tape.shape
    assert_close(parts[7], tape.double(), dtype, "floater", what="tape")
    assert_close(parts[0], out.double(), dtype, "floater", what="forward")


def test_emulated_needs_subset(emulator, tmp_path):
    """Gradients not asked for stay zero (the kernels and GEMMs skip them), the others
    agree bitwise with a call that asked for everything."""
    case = (4, 5, 6, 3, 2, "rk4", "tanh", torch.float64, CLUSTER, 2, 2, RESIDENT, 2, 1)
    full = check_case(emulator, tmp_path, case, needs=NO_TIMES, seed=3)
    part = check_case(emulator, tmp_path, case, needs=(0, 1, 0, 0, 1, 0), seed=3)
    for need, a, b in zip((0, 1, 0, 0, 1), part[1:6], full[1:6]):
        if need:
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_emulated_runs_are_bitwise_reproducible(emulator, tmp_path):
    """Every sum runs in an order fixed by the shapes and the layout: two runs (with the host
    threads scheduled differently) agree bitwise, tape included."""
    case = (3, 5, 7, 4, 2, "rk4", "relu", torch.float32, CLUSTER, 3, 2, RESIDENT, 2, 1)
    a = run_emulated(emulator, tmp_path, case, 5)[2]
    b = run_emulated(emulator, tmp_path, case, 5)[2]
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize(
    ("case", "barrier"),
    [
        # cluster: the first stage's phase-A and phase-B barriers
        ((2, 4, 6, 2, 1, "euler", "tanh", torch.float32, CLUSTER, 2, 1, RESIDENT, 1, 0), 2),
        ((2, 4, 6, 2, 1, "euler", "tanh", torch.float32, CLUSTER, 2, 1, RESIDENT, 1, 0), 3),
        # grid: a barrier inside the adjoint's stages (the forward has fewer)
        ((2, 4, 6, 1, 3, "rk4", "tanh", torch.float64, GRID, 2, 1, RESIDENT, 1, 0), 20),
    ],
    ids=["cluster-phaseA", "cluster-phaseB", "grid-adjoint"],
)
def test_emulated_race_checker_catches_a_missing_barrier(emulator, tmp_path, case, barrier):
    """Fault injection: with one team barrier skipped, the race checker stops the run
    naming the race (the tests above pass, so their barriers are where they must be)."""
    r = run_emulated(
        emulator,
        tmp_path,
        case,
        1,
        env={"POSENC_FAST_EMU_SKIP_TEAM_BARRIER": str(barrier)},
        check=False,
    )
    assert r.returncode != 0 and "emulated device: race" in r.stderr, r.stderr[-2000:]


def test_emulated_cuda_kernels_256_threads(tmp_path_factory, tmp_path, emulation_flags):
    """The real block size (the products' splits depend on it)."""
    exe = _build(tmp_path_factory, 256, emulation_flags)
    check_case(exe, tmp_path, CASES[4])


def _layout(emulator, *args):
    r = subprocess.run([str(emulator), "--layout", *map(str, args)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    head, why = r.stdout.splitlines()[:2]
    mode, C, G, Sg, kr1, kr2 = map(int, head.split()[:6])
    return {"mode": mode, "C": C, "G": G, "Sg": Sg, "kr1": kr1, "kr2": kr2, "why": why}


@pytest.mark.parametrize("backward", [0, 1], ids=["fwd", "adj"])
@pytest.mark.parametrize(
    ("shape", "mode"),
    [
        ((12, 64, 64), SOLO),  # everything in one block's shared memory
        ((12, 512, 512), CLUSTER),  # the first GPU run's case
        ((36, 384, 384), CLUSTER),  # ViT-S/16's
    ],
)
def test_layout_on_an_h100_like_device(emulator, shape, mode, backward):
    """choose_layout's choices on the emulated H100-like device (132 SMs in 8 GPCs): small
    dynamics in one block, the models' shapes in thread-block clusters whose shared
    memory holds every weight, all clusters co-resident (one wave: the first H200 run
    launched 12 clusters of 10 blocks where 8 fit, and took twice the time)."""
    S, d, H = shape
    p = _layout(emulator, S, d, H, 1024, 5, 2, 4, backward)
    assert p["mode"] == mode, p["why"]
    assert p["G"] * p["Sg"] >= S, p["why"]
    assert p["kr1"] == d + 1 and p["kr2"] == H + 1, p["why"]
    if mode == CLUSTER:
        assert p["G"] <= 8 if p["C"] > 8 else p["G"] * p["C"] <= 132, p["why"]


def test_layout_beyond_a_cluster(emulator):
    """Dynamics larger than 16 blocks' shared memory: BERT-base's (d = H = 768) stream
    part of their weight rows from L2; d = H = 4096 (134 MB of weights) fit nowhere, and
    choose_layout still has a layout."""
    bert = _layout(emulator, 36, 768, 768, 512, 5, 2, 4, 0)
    assert bert["kr1"] < 769 or bert["kr2"] < 769 or bert["mode"] == GRID, bert["why"]
    big = _layout(emulator, 12, 4096, 4096, 64, 1, 2, 4, 1)
    assert big["kr1"] < 4097 and big["kr2"] < 4097, big["why"]


def test_layout_without_clusters(emulator):
    """An A100-like device (no clusters): one block where it holds the weights, else a
    cooperative grid."""
    assert _layout(emulator, 12, 64, 64, 1024, 5, 2, 4, 0, 0, "a100")["mode"] == SOLO
    assert _layout(emulator, 12, 512, 512, 1024, 5, 2, 4, 1, 0, "a100")["mode"] == GRID
