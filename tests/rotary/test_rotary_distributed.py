"""Tokens sharded across ranks (sequence parallelism): two processes, gloo over loopback,
as tests/common/test_distributed.py runs the other ops.

Each rank holds a slice of the tokens of one batch (rank 0 the class token and the first
grid cells, rank 1 the rest) and rotates its q and k from its own tokens' coordinates:
per-head frequencies (RoPE-Mixed, half pairs, the class token as prefix on rank 0) and
shared axial ones (interleaved, partial rotation). The gathered outputs equal one
process's rotation of all tokens, each rank's q / k gradients its slice of that
process's, and the frequency gradients, all-reduced (summed: the loss is a sum over
tokens), that process's. The test launches this file as a script in two processes
(``--worker RANK DIR``), which write their results to DIR; a missing result fails with
the worker's traceback or log.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pathlib
import subprocess
import sys
import traceback

import pytest
import torch

import posenc_fast as pf
from posenc_fast.cli import _inputs
from posenc_fast.tolerances import assert_close

THIS = pathlib.Path(__file__).resolve()
WORLD = 2
PG_TIMEOUT_S = 60
LAUNCH_TIMEOUT_S = 240
B, HEADS, HEAD_DIM, GRID = 2, 2, 16, (9, 7)  # 63 cells + a class token: 33 and 31 tokens


def models():
    """The same modules on every rank."""
    torch.manual_seed(0)
    mixed = pf.Rotary.from_frequencies(pf.rope.mixed(HEAD_DIM, 1, HEADS)[0], pairs="half", prefix=1)
    axial = pf.Rotary(2, HEAD_DIM, rotary_dim=12)
    return mixed, axial


def data():
    """q, k [B, HEADS, 1 + 63, HEAD_DIM], the grid's coordinates [63, 2], the loss weights."""
    g = _inputs.generator(1)
    n = 1 + GRID[0] * GRID[1]
    q, k, wq, wk = (_inputs.randn((B, HEADS, n, HEAD_DIM), g) for _ in range(4))
    return q, k, pf.rope.grid(GRID), wq, wk


def token_slice(rank: int) -> slice:
    """Rank 0: the class token and 32 cells; rank 1: the other 31 cells."""
    return slice(0, 33) if rank == 0 else slice(33, None)


def run(mixed, axial, q, k, x, wq, wk, prefix: int):
    """Both rotations of some tokens and the loss's gradients: (outputs, dq, dk, dfreqs)."""
    q, k = q.clone().requires_grad_(), k.clone().requires_grad_()
    mixed.prefix = prefix
    mq, mk = mixed(q, k, x)
    aq, ak = axial(q[:, :, prefix:], k[:, :, prefix:], x)
    loss = (mq * wq).sum() + (mk * wk).sum() + (aq * wq[:, :, prefix:]).square().sum() + ak.sum()
    loss.backward()
    outs = [t.detach() for t in (mq, mk, aq, ak)]
    return outs, q.grad, k.grad, [mixed.freqs.grad, axial.freqs.grad]


def worker(rank: int, out_dir: pathlib.Path) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{out_dir / 'store'}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
    )
    try:
        q, k, x, wq, wk = data()
        tokens = token_slice(rank)
        cells = slice(0, 32) if rank == 0 else slice(32, None)
        prefix = 1 if rank == 0 else 0
        mine = [t[:, :, tokens] for t in (q, k, wq, wk)]
        outs, dq, dk, dfreqs = run(*models(), mine[0], mine[1], x[cells], mine[2], mine[3], prefix)
        for g in dfreqs:
            dist.all_reduce(g)  # the loss is a sum over tokens: the gradients add up
        gathered = []
        for i, t in enumerate(outs):  # all_gather needs equal sizes: pad the tokens to 33
            padded = torch.zeros(B, HEADS, 33, HEAD_DIM)
            padded[:, :, : t.shape[2]] = t
            parts = [torch.empty_like(padded) for _ in range(WORLD)]
            dist.all_gather(parts, padded)
            sizes = (
                33 if i < 2 else 32,
                31,
            )  # q' and k' of the mixed rotation hold the class token
            gathered.append(torch.cat([p[:, :, :n] for p, n in zip(parts, sizes)], dim=2))
        result = {"outs": gathered, "dq": dq, "dk": dk, "dfreqs": dfreqs}
        torch.save(result, out_dir / f"rank{rank}.pt")
    except BaseException:
        (out_dir / f"rank{rank}.err").write_text(traceback.format_exc())
        sys.stdout.flush()
        os._exit(1)  # the other rank would wait on collectives that never come
    with contextlib.suppress(Exception):
        dist.barrier()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this build")
    out_dir = tmp_path_factory.mktemp("rotary_distributed")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if "GLOO_SOCKET_IFNAME" not in env and os.path.exists("/sys/class/net/lo"):
        env["GLOO_SOCKET_IFNAME"] = "lo"
    procs = []
    for rank in range(WORLD):
        log = open(out_dir / f"rank{rank}.log", "w")  # noqa: SIM115 (closed below)
        cmd = [sys.executable, str(THIS), "--worker", str(rank), str(out_dir)]
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log))
    for proc, log in procs:
        try:
            proc.wait(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
        log.close()
    out = []
    for rank in range(WORLD):
        path = out_dir / f"rank{rank}.pt"
        if not path.exists():
            err = out_dir / f"rank{rank}.err"
            why = err.read_text() if err.exists() else (out_dir / f"rank{rank}.log").read_text()
            pytest.fail(f"no results from rank {rank}:\n{why[-4000:]}", pytrace=False)
        out.append(torch.load(path, weights_only=True))
    return out


def test_tokens_sharded_across_ranks_equal_one_rank(ranks):
    q, k, x, wq, wk = data()
    outs, dq, dk, dfreqs = run(*models(), q, k, x, wq, wk, prefix=1)
    for rank, r in enumerate(ranks):
        for i, (got, want) in enumerate(zip(r["outs"], outs)):
            assert got.shape == want.shape, (rank, i, got.shape, want.shape)
            scale = float(want.abs().max())
            assert_close(got, want.double(), torch.float32, "rotary", scale, f"rank {rank} out {i}")
        tokens = token_slice(rank)
        for name, got, full in (("dq", r["dq"], dq), ("dk", r["dk"], dk)):
            want = full[:, :, tokens]
            assert_close(got, want.double(), torch.float32, "grad", what=f"rank {rank} {name}")
        for i, (got, want) in enumerate(zip(r["dfreqs"], dfreqs)):
            assert_close(got, want.double(), torch.float32, "grad", what=f"rank {rank} dfreqs {i}")
    for a, b in zip(ranks[0]["dfreqs"], ranks[1]["dfreqs"]):
        assert torch.equal(a, b), "the all-reduced gradients differ between ranks"


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--worker":
    worker(int(sys.argv[2]), pathlib.Path(sys.argv[3]))
