"""Distributed training on the CPU: two processes, gloo over loopback.

The tests launch this file as a script (``python tests/common/test_distributed.py --worker RANK
DIR SCENARIO...``) in two processes that rendezvous through a FileStore in DIR and run
every scenario in turn. Each rank writes a scenario's results to DIR before the next one
starts (or the traceback, and stops); the tests judge those files, never the exit code,
since gloo's teardown can abort a process after the work is done. Every wait has a
timeout (the process group's and the launcher's), so a hang fails instead of blocking CI.

Scenarios (the model: 2-D token positions encoded by LearnableFourierFeatures, one
attention block whose Q/K/V carry FloaterAttentionBias biases, a scalar head):

- ``ddp-<backend>``: DistributedDataParallel with its default find_unused_parameters=False,
  the batch split across the ranks. The gradients after DDP's allreduce equal the
  single-process full-batch gradients; the parameters after training equal single-process
  training; every parameter receives a gradient. FLOATER's cache: every training forward
  integrates (no stale cache), eval mode integrates once per rank and then reuses, an
  optimizer step invalidates it.
- ``refresh``: Floater(refresh_every=2) returns detached values on the calls between
  refreshes, so its parameters get no gradient there: DDP needs find_unused_parameters=True
  (with it, training equals single-process training; without it DDP raises).
- ``positions``: each rank encodes its slice of a grid; all_gather gives the encoding of
  the whole grid, and the summed gradients the whole grid's gradients.
- ``fsdp2``: the same model under FSDP2 (``fully_shard``; FLOATER in a group of its own):
  gradients and training equal single-process, the eval cache reuses its states.
- ``fsdp2-mixed``: FSDP2 with MixedPrecisionPolicy(param_dtype=bfloat16). FLOATER given
  bfloat16 parameters integrates in float32 and returns bfloat16; a group that keeps
  param_dtype=float32 with output_dtype=bfloat16 gives float32 gradients.

The tests run on CPU tensors whatever POSENC_FAST_TEST_DEVICE says (gloo). FSDP2 on CPU
tensors needs torch >= 2.6: before, its scenarios are left out and their tests skip.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pathlib
import subprocess
import sys
import time
import traceback

import _helpers
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import posenc_fast as pf
from posenc_fast.cli import _inputs
from posenc_fast.tolerances import assert_close

THIS = pathlib.Path(__file__).resolve()
WORLD = 2
PG_TIMEOUT_S = 60  # every collective
LAUNCH_TIMEOUT_S = 240  # the whole launch (start-up, every scenario, teardown)
BATCH, LENGTH, DIM = 8, 6, 16
STEPS = 3  # training steps before the eval checks (one more follows them)
LR = 0.1
FLOATER_BACKENDS = _inputs.backends_for("floater", "cpu")


# -- the model and its training, shared by the workers and the single-process reference --


class TinyModel(nn.Module):
    """Tokens with 2-D positions (LFF) and one attention block with FLOATER Q/K/V biases."""

    def __init__(self, floater_backend="auto", refresh_every=1):
        super().__init__()
        self.embed = nn.Linear(3, DIM)
        self.pos = pf.LearnableFourierFeatures(2, 16, 8, DIM, gamma=0.5)
        self.bias = pf.FloaterAttentionBias(
            DIM,
            num_layers=1,
            hidden_dim=8,
            delta_t=0.1,
            substeps=2,
            activation="tanh",
            backend=floater_backend,
            refresh_every=refresh_every,
        )
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.head = nn.Linear(DIM, 1)

    def forward(self, feats, coords):  # [B, L, 3], [B, L, 2] -> [B]
        x = self.embed(feats) + self.pos(coords[..., None, :])
        bias = self.bias(x.shape[1])[0]  # [3, L, DIM]: Q, K, V
        qkv = self.qkv(x).unflatten(-1, (3, DIM)) + bias.transpose(0, 1).to(x.dtype)
        q, k, v = qkv.unbind(-2)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.head(x + y).mean(dim=(1, 2))


def make_model(floater_backend="auto", refresh_every=1) -> TinyModel:
    """The same weights in every process; FLOATER's dynamics large enough to matter (the
    default initialisation starts it near zero)."""
    torch.manual_seed(0)
    model = TinyModel(floater_backend, refresh_every)
    _inputs.randomize_parameters(model.bias, 1, fan_in=True)
    return model


def make_data():
    g = _inputs.generator(2)
    feats = _inputs.randn((BATCH, LENGTH, 3), g)
    coords = _inputs.rand((BATCH, LENGTH, 2), g, 0.0, 4.0)
    target = _inputs.randn((BATCH,), g)
    return feats, coords, target


def local_slice(tensors, rank):
    per = BATCH // WORLD
    return [t[rank * per : (rank + 1) * per] for t in tensors]


def train_step(model_call, opt, data) -> torch.Tensor:
    feats, coords, target = data
    opt.zero_grad(set_to_none=True)
    loss = (model_call(feats, coords) - target).square().mean()  # each rank: its mean
    loss.backward()
    return loss


def reference_training(steps, refresh_every=1, data=None):
    """Single process, full batch: (gradients of step 1, parameters after ``steps``)."""
    model = make_model(refresh_every=refresh_every)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data = make_data() if data is None else data
    grads = None
    for step in range(steps):
        train_step(model, opt, data)
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    return grads, {n: p.detach().clone() for n, p in model.named_parameters()}


# -- worker side ---------------------------------------------------------------------------


def _fresh_bias(bias_module: pf.FloaterAttentionBias, length: int) -> torch.Tensor:
    """The biases recomputed from the current parameters, without the module's cache."""
    fl = bias_module.floater
    with torch.no_grad():
        out = pf.floater(
            fl.p0, fl.w1, fl.b1, fl.w2, fl.b2, fl.length_times(length),
            fl.substeps, fl.method, fl.activation, backend=fl.backend,
        )  # fmt: skip
    return out.unflatten(0, (bias_module.num_layers, bias_module.num_projections))


def _scenario_ddp(rank, floater_backend, calls):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_model(floater_backend)
    ddp = DDP(model)  # find_unused_parameters=False: the default
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    data = local_slice(make_data(), rank)
    r = {"train_integrations": []}
    for step in range(STEPS):
        n0 = len(calls)
        train_step(ddp, opt, data)
        r["train_integrations"].append(len(calls) - n0)
        if step == 0:
            r["grads"] = {
                n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
            }
            r["no_grad"] = [
                n for n, p in model.named_parameters() if p.grad is None or not p.grad.any()
            ]
        opt.step()
    ddp.eval()
    with torch.no_grad():
        n0 = len(calls)
        r["eval_out"] = ddp(*data[:2])
        r["eval_out_again"] = ddp(*data[:2])
        r["eval_integrations"] = len(calls) - n0
        r["eval_bias"] = model.bias(LENGTH)
        r["fresh_bias"] = _fresh_bias(model.bias, LENGTH)
    ddp.train()
    train_step(ddp, opt, data)  # one more step: the eval cache is now stale
    opt.step()
    ddp.eval()
    with torch.no_grad():
        n0 = len(calls)
        r["eval2_bias"] = model.bias(LENGTH)
        r["eval2_integrations"] = len(calls) - n0
        r["fresh2_bias"] = _fresh_bias(model.bias, LENGTH)
    r["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return r


def _scenario_refresh(rank, calls):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_model(refresh_every=2)
    ddp = DDP(model, find_unused_parameters=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    data = local_slice(make_data(), rank)
    r = {"train_integrations": [], "floater_grads": []}
    for _ in range(4):
        n0 = len(calls)
        train_step(ddp, opt, data)
        r["train_integrations"].append(len(calls) - n0)
        r["floater_grads"].append(all(p.grad is not None for p in model.bias.parameters()))
        opt.step()
    r["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    # The default (find_unused_parameters=False) on the same configuration.
    ddp = DDP(make_model(refresh_every=2))
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    try:
        for _ in range(3):
            train_step(ddp, opt, data)
            opt.step()
        r["default_error"] = ""
    except RuntimeError as e:
        r["default_error"] = str(e)
    return r


def _scenario_positions(rank):
    import torch.distributed as dist

    torch.manual_seed(3)
    enc = pf.LearnableFourierFeatures(2, 32, 16, 24, gamma=0.5)  # same weights on every rank
    grid = pf.grid_positions(9, 7)  # 63 cells: the ranks get 32 and 31
    mine = grid.tensor_split(WORLD)[rank]
    out = enc(mine[:, None, :])  # [n_rank, 24]
    weights = _inputs.randn((grid.shape[0], 24), _inputs.generator(4))
    (out * weights.tensor_split(WORLD)[rank]).sum().backward()
    longest = -(-grid.shape[0] // WORLD)
    padded = torch.zeros(longest, 24)
    padded[: out.shape[0]] = out.detach()
    parts = [torch.empty_like(padded) for _ in range(WORLD)]
    dist.all_gather(parts, padded)
    sizes = [len(s) for s in grid.tensor_split(WORLD)]
    gathered = torch.cat([p[:n] for p, n in zip(parts, sizes)])
    grads = {}
    for n, p in enc.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)  # sum: the loss is a sum over the grid
        grads[n] = g
    return {"gathered": gathered, "local": out.detach(), "grads": grads}


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _fsdp2():
    """(fully_shard, MixedPrecisionPolicy), public in torch.distributed.fsdp from torch 2.6;
    None before (torch 2.5's torch.distributed._composable.fsdp raises "FSDP requires CUDA
    for streams" on CPU tensors)."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:
        return None
    return fully_shard, MixedPrecisionPolicy


NO_FSDP2 = pytest.mark.skipif(
    _fsdp2() is None,
    reason=f"FSDP2 on CPU tensors needs torch >= 2.6 (fully_shard in torch.distributed.fsdp); "
    f"this is torch {torch.__version__}",
)


def _gloo_reduce_scatter_averages() -> bool:
    """Whether gloo's reduce_scatter_tensor honours ReduceOp.AVG, which FSDP2 asks for
    float32 gradients: torch 2.5 and 2.7 sum instead (2.9 averages), and FSDP2's gradients
    then come out WORLD times too large (a bug of torch's gloo backend, not ours)."""
    import torch.distributed as dist

    out = torch.empty(1)
    dist.reduce_scatter_tensor(out, torch.ones(WORLD), op=dist.ReduceOp.AVG)
    return out.item() == 1.0


def _scenario_fsdp2(rank, calls):
    fully_shard, _ = _fsdp2()

    model = make_model()
    fully_shard(model.bias)  # FLOATER's parameters sharded as a group of their own
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data = local_slice(make_data(), rank)
    r = {"train_integrations": [], "sharded": type(model.bias.floater.w1).__name__}
    r["gloo_averages"] = _gloo_reduce_scatter_averages()
    for step in range(STEPS):
        n0 = len(calls)
        train_step(model, opt, data)
        r["train_integrations"].append(len(calls) - n0)
        if step == 0:
            r["grads"] = {n: _full(p.grad) for n, p in model.named_parameters()}
        opt.step()
    model.eval()
    with torch.no_grad():
        n0 = len(calls)
        r["eval_out"] = model(*data[:2])
        r["eval_out_again"] = model(*data[:2])
        r["eval_out_third"] = model(*data[:2])
        r["eval_integrations"] = len(calls) - n0
    r["params"] = {n: _full(p.detach()) for n, p in model.named_parameters()}
    return r


def _scenario_fsdp2_mixed(rank):
    fully_shard, MixedPrecisionPolicy = _fsdp2()

    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    model = make_model()
    fully_shard(model.bias, mp_policy=bf16)
    fully_shard(model, mp_policy=bf16)
    feats, coords, _ = local_slice(make_data(), rank)
    r = {}
    model.bias.register_forward_hook(lambda m, args, out: r.update(bf16_floater=out))
    out = model(feats, coords)
    r["bf16_finite"] = bool(torch.isfinite(out.float()).all())
    model = make_model()
    fully_shard(
        model.bias,
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, output_dtype=torch.bfloat16),
    )
    # cast_forward_inputs=False: positions must not be rounded to bfloat16 (LFF computes
    # its phases in float32 from float32 positions).
    fully_shard(model, mp_policy=MixedPrecisionPolicy(torch.bfloat16, cast_forward_inputs=False))
    dtypes = r["dtypes"] = {}
    model.pos.register_forward_hook(
        lambda m, args, out: dtypes.update(positions=str(args[0].dtype), lff=str(out.dtype))
    )
    model.bias.register_forward_hook(lambda m, args, out: dtypes.update(floater=str(out.dtype)))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    feats, coords, target = local_slice(make_data(), rank)
    loss = train_step(model, opt, (feats.bfloat16(), coords, target))
    r["loss"] = loss.detach().float()
    r["grads"] = {n: _full(p.grad) for n, p in model.named_parameters()}
    return r


SCENARIOS = {
    **{
        f"ddp-{b}": (lambda rank, calls, _b=b: _scenario_ddp(rank, _b, calls))
        for b in FLOATER_BACKENDS
    },
    "refresh": _scenario_refresh,
    "positions": lambda rank, calls: _scenario_positions(rank),
}
if _fsdp2() is not None:
    SCENARIOS["fsdp2"] = _scenario_fsdp2
    SCENARIOS["fsdp2-mixed"] = lambda rank, calls: _scenario_fsdp2_mixed(rank)


def worker(rank: int, out_dir: pathlib.Path, scenarios: list[str]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{out_dir / 'store'}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
    )
    calls, _ = _helpers.count_floater_integrations()
    for name in scenarios:
        try:
            result = SCENARIOS[name](rank, calls)
        except BaseException:
            (out_dir / f"{name}.rank{rank}.err").write_text(traceback.format_exc())
            sys.stdout.flush()
            os._exit(1)  # the other rank would wait on collectives that never come
        torch.save(result, out_dir / f"{name}.rank{rank}.pt")
    with contextlib.suppress(Exception):
        dist.barrier()
        dist.destroy_process_group()


# -- launcher side -------------------------------------------------------------------------


def launch(out_dir: pathlib.Path, scenarios: list[str]) -> float:
    """Run the scenarios in WORLD worker processes; returns the wall time."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # the workers run this file as a script: tests/ on their path for the test helpers
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(THIS.parents[1]), env.get("PYTHONPATH"))))
    if "GLOO_SOCKET_IFNAME" not in env and os.path.exists("/sys/class/net/lo"):
        env["GLOO_SOCKET_IFNAME"] = "lo"  # loopback
    cmd = [sys.executable, str(THIS), "--worker"]
    t0 = time.monotonic()
    procs = []
    for rank in range(WORLD):
        log = open(out_dir / f"rank{rank}.log", "w")  # noqa: SIM115 (closed below)
        args = [*cmd, str(rank), str(out_dir), *scenarios]
        procs.append((subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env), log))
    deadline = t0 + LAUNCH_TIMEOUT_S
    for proc, log in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
        log.close()
    return time.monotonic() - t0


class Results:
    def __init__(self, out_dir: pathlib.Path, scenarios: list[str]):
        self.dir, self.scenarios = out_dir, scenarios

    def __call__(self, name: str) -> list[dict]:
        """Every rank's results of scenario ``name``, or a failure saying why not."""
        out = []
        for rank in range(WORLD):
            path = self.dir / f"{name}.rank{rank}.pt"
            if not path.exists():
                pytest.fail(self._why_missing(name, rank), pytrace=False)
            out.append(torch.load(path, weights_only=True))
        return out

    def _why_missing(self, name: str, rank: int) -> str:
        for earlier in self.scenarios:
            err = self.dir / f"{earlier}.rank{rank}.err"
            if err.exists():
                what = "failed" if earlier == name else f"did not run: {earlier!r} failed"
                return f"scenario {name!r} {what} on rank {rank}:\n{err.read_text()}"
        log = (self.dir / f"rank{rank}.log").read_text()[-4000:]
        return f"scenario {name!r}: no results from rank {rank} (timeout or crash); log:\n{log}"


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Results:
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this build")
    out_dir = tmp_path_factory.mktemp("distributed")
    scenarios = list(SCENARIOS)
    launch(out_dir, scenarios)
    return Results(out_dir, scenarios)


# -- tests ---------------------------------------------------------------------------------


def _assert_grads_close(got: dict, want: dict, what: str):
    assert set(got) == set(want), f"{what}: parameters {sorted(set(want) ^ set(got))}"
    for n, g in got.items():
        assert_close(g, want[n].double(), torch.float32, "grad", what=f"{what}: {n}")


def _assert_params_close(got: dict, want: dict, what: str):
    assert set(got) == set(want)
    for n, p in got.items():
        assert_close(p, want[n].double(), torch.float32, "lff", what=f"{what}: {n}")


def _assert_same_on_every_rank(ranks: list[dict], key: str):
    for n, t in ranks[0][key].items():
        for r in ranks[1:]:
            assert torch.equal(t, r[key][n]), f"{key}[{n}] differs between ranks"


@pytest.mark.parametrize("floater_backend", FLOATER_BACKENDS)
def test_ddp_gradients_equal_single_process_full_batch(results, floater_backend):
    ranks = results(f"ddp-{floater_backend}")
    grads, _ = reference_training(1)
    # The test can fail: one rank's half of the batch alone gives other gradients.
    half, _ = reference_training(1, data=local_slice(make_data(), 0))
    differ = [n for n in grads if not torch.allclose(half[n], grads[n], rtol=1e-2, atol=1e-4)]
    assert {"pos.wr", "bias.floater.w1", "bias.floater.p0"} <= set(differ)
    for rank, r in enumerate(ranks):
        _assert_grads_close(r["grads"], grads, f"rank {rank} after allreduce")
    _assert_same_on_every_rank(ranks, "grads")


@pytest.mark.parametrize("floater_backend", FLOATER_BACKENDS)
def test_ddp_every_parameter_gets_a_gradient_without_find_unused_parameters(
    results, floater_backend
):
    """DDP ran STEPS + 1 steps with find_unused_parameters=False (it raises on the step
    after one where a parameter got no gradient), and every gradient is nonzero."""
    names = [n for n, _ in make_model().named_parameters()]
    for r in results(f"ddp-{floater_backend}"):
        assert r["no_grad"] == []
        assert sorted(r["grads"]) == sorted(names)


@pytest.mark.parametrize("floater_backend", FLOATER_BACKENDS)
def test_ddp_training_equals_single_process_training(results, floater_backend):
    ranks = results(f"ddp-{floater_backend}")
    _, params = reference_training(STEPS + 1)
    initial = dict(make_model().named_parameters())
    for rank, r in enumerate(ranks):
        _assert_params_close(r["params"], params, f"rank {rank}")
        assert not torch.equal(r["params"]["bias.floater.w1"], initial["bias.floater.w1"])
    _assert_same_on_every_rank(ranks, "params")


@pytest.mark.parametrize("floater_backend", FLOATER_BACKENDS)
def test_ddp_floater_cache(results, floater_backend):
    """Training: every forward integrates. Eval: once per rank, then reused; the cached
    biases are those of the current parameters, also after another optimizer step."""
    for r in results(f"ddp-{floater_backend}"):
        assert r["train_integrations"] == [1] * STEPS
        assert r["eval_integrations"] == 1, "eval mode integrates once, then reuses"
        assert torch.equal(r["eval_out"], r["eval_out_again"])
        assert torch.equal(r["eval_bias"], r["fresh_bias"])
        assert r["eval2_integrations"] == 1, "an optimizer step invalidates the cache"
        assert torch.equal(r["eval2_bias"], r["fresh2_bias"])
        assert not torch.equal(r["eval2_bias"], r["eval_bias"])


def test_refresh_every_needs_find_unused_parameters(results):
    ranks = results("refresh")
    _, params = reference_training(4, refresh_every=2)
    for rank, r in enumerate(ranks):
        assert r["train_integrations"] == [1, 0, 1, 0]
        _assert_params_close(r["params"], params, f"rank {rank}")
        assert "find_unused_parameters" in r["default_error"], r["default_error"]
    _assert_same_on_every_rank(ranks, "params")


def test_positions_split_across_ranks_equal_one_rank(results):
    ranks = results("positions")
    torch.manual_seed(3)
    enc = pf.LearnableFourierFeatures(2, 32, 16, 24, gamma=0.5)
    grid = pf.grid_positions(9, 7)
    full = enc(grid[:, None, :])
    weights = _inputs.randn((grid.shape[0], 24), _inputs.generator(4))
    (full * weights).sum().backward()
    ref = full.detach().double()
    for rank, r in enumerate(ranks):
        assert r["local"].shape[0] == (32, 31)[rank]
        assert_close(r["gathered"], ref, torch.float32, "lff", what=f"rank {rank} all_gather")
        want = {n: p.grad for n, p in enc.named_parameters()}
        _assert_grads_close(r["grads"], want, f"rank {rank} summed gradients")


@NO_FSDP2
def test_fsdp2_gradients_and_training_equal_single_process(results):
    ranks = results("fsdp2")
    if not all(r["gloo_averages"] for r in ranks):
        pytest.skip(
            f"torch {torch.__version__}: gloo's reduce_scatter_tensor sums where FSDP2 asks "
            f"for ReduceOp.AVG, so FSDP2's CPU gradients are {WORLD}x too large (a torch bug, "
            "fixed by 2.9)"
        )
    grads, _ = reference_training(1)
    _, params = reference_training(STEPS)
    for rank, r in enumerate(ranks):
        assert r["sharded"] == "DTensor", "fully_shard did not shard FLOATER's parameters"
        assert r["train_integrations"] == [1] * STEPS
        _assert_grads_close(r["grads"], grads, f"FSDP2 rank {rank}")
        _assert_params_close(r["params"], params, f"FSDP2 rank {rank}")


@NO_FSDP2
def test_fsdp2_eval_cache_reuses_states(results):
    """FSDP2 gathers the parameters into fresh storage on every forward (and frees them
    after it): the cache must recognise unchanged values, not only unchanged tensors."""
    for r in results("fsdp2"):
        assert torch.equal(r["eval_out"], r["eval_out_again"])
        assert torch.equal(r["eval_out"], r["eval_out_third"])
        assert r["eval_integrations"] == 1


@NO_FSDP2
def test_fsdp2_mixed_precision(results):
    for r in results("fsdp2-mixed"):
        assert r["bf16_floater"].dtype == torch.bfloat16 and r["bf16_finite"]
        assert r["dtypes"] == {
            "positions": "torch.float32",  # not rounded to bfloat16 on the way in
            "lff": "torch.bfloat16",
            "floater": "torch.bfloat16",  # computed in float32, cast by output_dtype
        }
        assert torch.isfinite(r["loss"])
        for n, g in r["grads"].items():
            assert g.dtype == torch.float32 and torch.isfinite(g).all(), n
            assert g.any(), f"{n} received no gradient"


if __name__ == "__main__" and len(sys.argv) > 3 and sys.argv[1] == "--worker":
    worker(int(sys.argv[2]), pathlib.Path(sys.argv[3]), sys.argv[4:])
