"""FLOATER biases in training: one integration of all blocks' states per
training forward, shared by the blocks and their backward, equal to the per-block path;
the paper's training options (Sec. 4.4): reusing the biases for k steps, a larger
learning rate for the flow, the initialisation scale."""

import copy
import pickle

import pytest
import torch
from _timm import import_timm
from conftest import DEVICE, backend_params
from torch import nn

from posenc_fast import Floater, FloaterAttentionBias
from posenc_fast.cli import _inputs
from posenc_fast.integrations.attention import add_floater_biases, floater_param_groups
from posenc_fast.ops.floater.registry import FLOATER
from posenc_fast.tolerances import mismatch

# The backends with the op (the reference is differentiated by autograd: no shared adjoint)
BACKENDS = backend_params("floater")


def vit(depth=3, seed=0):
    vt = import_timm().models.vision_transformer
    torch.manual_seed(seed)
    return vt.VisionTransformer(
        img_size=16, patch_size=4, embed_dim=32, depth=depth, num_heads=2, num_classes=3
    )


def encoder(depth=3, seed=0):
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)


def images(seed=0):
    return _inputs.randn((2, 3, 16, 16), _inputs.generator(seed), device=DEVICE)


def tokens(seed=0):
    return _inputs.randn((2, 11, 16), _inputs.generator(seed), device=DEVICE)


def with_biases(make, backend, share=True, seed=1, **kwargs):
    """The model on the test device, FLOATER biases added (on the model's device)."""
    model = make().to(DEVICE)
    biases = add_floater_biases(model, share_integration=share, backend=backend, **kwargs)
    _inputs.randomize_parameters(biases, seed, scale=0.3)  # the init is near zero
    return model, biases


@pytest.fixture
def adjoints():
    """Number of discrete-adjoint (backward) passes of any backend during the test."""
    seen, patched = [], []
    for impl in FLOATER.values():
        if impl.differentiable:
            continue
        backward = impl.backward

        def counting(*args, _backward=backward, **kwargs):
            seen.append(args[2].shape[0])  # p0 [S, d]: the states differentiated
            return _backward(*args, **kwargs)

        impl.backward = counting
        patched.append((impl, backward))
    yield seen
    for impl, backward in patched:
        impl.backward = backward


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_match(shared, per_block, exact_names):
    """``exact_names`` bitwise (cpp: each state's adjoint is computed on its own), the
    other gradients within the "grad" tolerance (the dynamics' gradients are the same
    terms added in another order: over all states at once instead of block by block)."""
    assert shared.keys() == per_block.keys()
    for name, g in shared.items():
        if name in exact_names:
            assert torch.equal(g, per_block[name]), name
        else:
            assert not mismatch(g, per_block[name], g.dtype, "grad"), name


def train_step(model, x):
    out = model(x)
    loss = out.square().sum()
    loss.backward()
    return out.detach()


@pytest.mark.parametrize("make,inputs", [(vit, images), (encoder, tokens)], ids=["timm", "mha"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_one_integration_equals_the_per_block_path(make, inputs, backend, calls, adjoints):
    model, _ = with_biases(make, backend)
    twin, _ = with_biases(make, backend, share=False)
    out = train_step(model, inputs())
    L = calls[0]
    assert calls == [L] and adjoints == [9]  # one forward and one adjoint of all 3 x 3 states
    calls.clear()
    adjoints.clear()
    ref = train_step(twin, inputs())
    assert calls == [L] * 3 and adjoints == [3] * 3  # per block
    if backend == "cpp":  # every state's trajectory is the same arithmetic for any S
        assert torch.equal(out, ref)
        exact = {"floater_bias.floater.p0"}
    else:  # torch: BLAS products of 9 rows and of 3 rows may round differently
        torch.testing.assert_close(out, ref)
        exact = set()
    assert_grads_match(grads(model), grads(twin), exact)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradient_accumulation_and_several_forwards(backend, calls):
    """Each forward integrates afresh (a backward frees the shared graph): accumulating
    two steps' gradients, or backpropagating two forwards at once, gives twice one step's."""
    model, _ = with_biases(vit, backend)
    train_step(model, images())
    once = grads(model)
    model.zero_grad()
    calls.clear()
    train_step(model, images())
    train_step(model, images())
    assert len(calls) == 2
    for name, g in grads(model).items():
        torch.testing.assert_close(g, 2 * once[name], msg=name)
    model.zero_grad()
    (model(images()).square().sum() + model(images()).square().sum()).backward()
    for name, g in grads(model).items():
        torch.testing.assert_close(g, 2 * once[name], msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_parameter_updates_between_forwards_recompute(backend):
    """After an optimizer step (fused too: no version counter moves) the next forward
    integrates with the new parameters: the same output as a fresh copy of the model."""
    model, _ = with_biases(vit, backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    train_step(model, images())
    opt.step()
    out = model(images())
    fresh = copy.deepcopy(model)
    assert torch.equal(out, fresh(images()))


def test_copies_and_pickles_during_a_forward():
    """Nothing is stored on a module: the model copies and pickles with a shared result
    alive (after a forward, before its backward), and the copy integrates its own."""
    model, biases = with_biases(vit, "auto")
    out = model(images())
    twin = copy.deepcopy(model)
    clone = pickle.loads(pickle.dumps(model))
    for other in (twin, clone):
        with torch.no_grad():
            other.floater_bias.floater.p0.add_(0.5)
        assert not torch.allclose(other(images()), out, atol=1e-3)
    out.sum().backward()
    assert biases.floater.p0.grad.abs().sum() > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_activation_checkpointing_matches(backend):
    """Non-reentrant checkpointing (timm's set_grad_checkpointing) recomputes blocks in the
    backward from the shared result: the same outputs and gradients as without."""
    model, _ = with_biases(vit, backend)
    ref_out = train_step(model, images())
    ref = grads(model)
    model.zero_grad()
    model.set_grad_checkpointing(True)
    out = train_step(model, images())
    assert torch.equal(out, ref_out)
    for name, g in grads(model).items():
        torch.testing.assert_close(g, ref[name], msg=name)


def test_reentrant_checkpointing_of_every_block_integrates_per_block(calls):
    model, _ = with_biases(encoder, "auto")
    ref_out = train_step(model, tokens())
    ref = grads(model)
    model.zero_grad()
    calls.clear()
    x = tokens().requires_grad_()  # reentrant checkpointing needs an input with a grad
    for layer in model.layers:
        x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=True)
    x.square().sum().backward()
    assert len(calls) == 1 + 3  # the no_grad forward (cached), then each block's own
    torch.testing.assert_close(x.detach(), ref_out)
    for name, g in grads(model).items():
        torch.testing.assert_close(g, ref[name], msg=name)


# -- torch.compile -------------------------------------------------------------------------


def compiled_step(model, x, **compile_kwargs):
    """A training step of torch.compile(model) (aot_eager: the graphs torch.compile
    traces, without inductor's C++ compile of CPU kernels)."""
    return train_step(torch.compile(model, backend="aot_eager", **compile_kwargs), x)


@pytest.mark.parametrize("how", ["fullgraph", "graph breaks", "blocks compiled"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_training_shares_one_integration(how, backend, calls, adjoints):
    """Under torch.compile, one integration and one adjoint of all 3 x 3 states per step
    (the whole model in one graph, in several graphs, or each block compiled on its own)
    and the eager step's outputs and gradients; the next step's new parameters are used."""
    model, _ = with_biases(vit, backend)
    eager, _ = with_biases(vit, backend)
    run = torch.compile(model, backend="aot_eager", fullgraph=how == "fullgraph")
    if how == "graph breaks":  # a graph ends before block 1 (a no-op when not compiling)
        model.blocks[1].register_forward_pre_hook(lambda *_: torch._dynamo.graph_break())
    elif how == "blocks compiled":
        for block in model.blocks:
            block.compile(backend="aot_eager")
        run = model
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, eager)]
    exact = set(grads(model)) if backend == "cpp" else set()
    for step in range(2):
        ref = train_step(eager, images(step))
        calls.clear()
        adjoints.clear()
        out = train_step(run, images(step))
        assert calls == [calls[0]] and adjoints == [9], (calls, adjoints)
        assert torch.equal(out, ref) if backend == "cpp" else torch.allclose(out, ref)
        assert_grads_match(grads(model), grads(eager), exact)
        for opt in opts:
            opt.step()
            opt.zero_grad()


def test_compiled_training_with_activation_checkpointing(calls):
    """Non-reentrant checkpointing of every block under torch.compile: with graph breaks
    (the checkpoints run eagerly, recomputing from the shared result), with fullgraph and
    share_integration=False, and with fullgraph and dynamo's flag that lets a checkpointed
    forward keep its side effects (the shared result's bookkeeping: without the flag,
    dynamo refuses it inside a checkpoint); the eager step's outputs and gradients."""
    eager, _ = with_biases(encoder, "auto")
    ref = train_step(eager, tokens())

    def checkpointed(model):
        def forward(x):
            for layer in model.layers:
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
            return x

        return forward

    flag = "skip_fwd_side_effects_in_bwd_under_checkpoint"
    cases = [(True, False, {}), (False, True, {})]
    if hasattr(torch._dynamo.config, flag):
        cases.append((True, True, {flag: True}))
    for share, fullgraph, config in cases:
        model, _ = with_biases(encoder, "auto", share=share)
        calls.clear()
        with torch._dynamo.config.patch(**config):
            run = torch.compile(checkpointed(model), backend="aot_eager", fullgraph=fullgraph)
            out = train_step(run, tokens())
        assert len(calls) == (2 if share else 6)  # the forward's and the recomputation's
        torch.testing.assert_close(out, ref)
        for name, g in grads(model).items():
            torch.testing.assert_close(g, grads(eager)[name], msg=name)
        torch._dynamo.reset()


def test_compiled_training_copies_and_pickles(calls, adjoints):
    """The shared result of a compiled forward sits in a slot of the bias module that
    copies and pickles leave behind: the model copies with it alive, and a copy shares."""
    model, _ = with_biases(vit, "auto")
    run = torch.compile(model, backend="aot_eager", fullgraph=True)
    out = run(images())
    twin = copy.deepcopy(model)
    clone = pickle.loads(pickle.dumps(model))
    out.square().sum().backward()
    for other in (twin, clone):
        calls.clear()
        adjoints.clear()
        twin_out = train_step(torch.compile(other, backend="aot_eager", fullgraph=True), images())
        assert len(calls) == 1 and adjoints == [9]
        assert torch.equal(twin_out, out.detach())
        for name, g in grads(other).items():
            torch.testing.assert_close(g, grads(model)[name], msg=name)


# -- the paper's training options ------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_refresh_every_reuses_detached_biases(backend, calls):
    """refresh_every=3: steps 0 and 3 integrate (once for all blocks) and the FLOATER
    parameters get gradients; steps 1 and 2 reuse step 0's biases as constants (the
    output is that of step 0's FLOATER parameters, although they have moved since) and
    the FLOATER parameters get no gradient (.grad None), while every other parameter does."""
    model, biases = with_biases(vit, backend, refresh_every=3)
    flow = {id(p) for p in biases.parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        calls.clear()
        opt.zero_grad(set_to_none=True)
        x = images(step)
        out = train_step(model, x)
        refresh = step % 3 == 0
        assert len(calls) == (1 if refresh else 0)
        for p in model.parameters():
            assert (p.grad is None) == (id(p) in flow and not refresh)
        current = copy.deepcopy(model)  # integrates from the current parameters
        with torch.no_grad():
            fresh_out = current(x)
        if refresh:
            assert torch.equal(out, fresh_out)
            flow_state = copy.deepcopy(biases.state_dict())
        else:
            assert not torch.allclose(out, fresh_out)  # the biases are stale
            current.floater_bias.load_state_dict(flow_state)
            with torch.no_grad():
                assert torch.equal(out, current(x))
        opt.step()


def test_param_groups_give_the_flow_its_learning_rate():
    model, biases = with_biases(vit, "auto")
    model.head.weight.requires_grad_(False)
    groups = floater_param_groups(model, lr=1e-3, flow_lr_scale=10.0)
    assert [g["lr"] for g in groups] == [1e-3, pytest.approx(1e-2)]
    assert groups[1]["params"] == list(biases.parameters())
    every = [p for g in groups for p in g["params"]]
    assert len(every) == len({id(p) for p in every})
    assert {id(p) for p in every} == {id(p) for p in model.parameters() if p.requires_grad}
    torch.optim.AdamW(groups).step()  # accepted by an optimizer
    with pytest.raises(ValueError, match="flow_lr_scale"):
        floater_param_groups(model, lr=1e-3, flow_lr_scale=0)
    with pytest.raises(ValueError, match="lr"):
        floater_param_groups(model, lr=-1.0, flow_lr_scale=2.0)
    with pytest.raises(ValueError, match="no FLOATER module"):
        floater_param_groups(nn.Linear(2, 2), lr=1e-3, flow_lr_scale=2.0)


def test_init_scale():
    for scale in (0.5, 1e-3):
        fl = Floater(8, 2, hidden_dim=6, init_scale=scale)
        bound = scale / 7**0.5
        assert fl.w2.abs().max() <= bound and fl.w2.abs().max() > bound / 2
        assert f"init_scale={scale:g}" in repr(fl)
    zero = FloaterAttentionBias(8, 2, init_scale=0.0)
    assert torch.equal(zero(5), torch.zeros(2, 3, 5, 8))
    model = vit()
    biases = add_floater_biases(model, init_scale=0.25)
    assert biases.floater.init_scale == 0.25
    with pytest.raises(ValueError, match="init_scale"):
        Floater(8, 2, init_scale=-1.0)
    with pytest.raises(ValueError, match="init_scale"):
        Floater(8, 2, init_scale=float("nan"))
    with pytest.raises(TypeError, match="init_scale"):
        Floater(8, 2, init_scale="small")


def test_training_benchmark_smoke(tmp_path, capsys):
    """benchmarks/floater_train.py --quick on its smallest case (a 2-layer encoder, one
    thread, one measured step: ~2 s): the table and its JSON. Timings are not checked."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "floater_train.py"
    spec = importlib.util.spec_from_file_location("floater_train", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "train.json"
    args = ["--quick", "--models", "bert", "--threads", "1", "--steps", "1", "--json", str(out)]
    assert bench.main(args) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["model"] == "bert" and row["integration_fwd_s"] > 0
    assert set(row["reuse"]) == {"10", "400"}  # refresh_every 10 and the paper's 400
    assert bench.main(["--render", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| BERT-base-like | 2 | 1 |" in table and "k=400:" in table
