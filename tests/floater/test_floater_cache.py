"""The Floater module's cache: eval mode / no_grad reuse, extension to longer lengths,
invalidation on every kind of parameter change, gradients through cached states, and
refresh_every. Work is measured by counting the calls that reach the backend's
integrator (and the number of intervals each call integrates)."""

import pytest
import torch
from conftest import backend_params
from torch.library import opcheck

import posenc_fast as pf
from posenc_fast.cli import _inputs
from posenc_fast.ops.floater import functional as floater_functional
from posenc_fast.ops.floater import reference as ref
from posenc_fast.tolerances import assert_close

BACKENDS = backend_params("floater")


def _module(backend, device, dtype=torch.float64, seed=0, **kw):
    kw = {"hidden_dim": 6, "delta_t": 0.05, "substeps": 3, "activation": "tanh", **kw}
    fl = pf.Floater(5, 3, backend=backend, device=device, dtype=dtype, **kw)
    _inputs.randomize_parameters(fl, seed, fan_in=True)
    return fl


def _fresh(fl, length):
    """The same computation without any cache: the reference on the module's times."""
    t = fl.length_times(length)
    return ref.floater(fl.p0, fl.w1, fl.b1, fl.w2, fl.b2, t, fl.substeps, fl.method, fl.activation)


@pytest.mark.parametrize("backend", BACKENDS)
def test_repeated_call_costs_nothing(backend, calls, device):
    fl = _module(backend, device).eval()
    a = fl(length=12)
    b = fl(length=12)
    assert calls == [12]
    assert torch.equal(a, b)
    c = fl(length=7)  # a prefix: a view of the cached states
    assert calls == [12] and torch.equal(c, a[:, :7])
    fl.train()
    with torch.no_grad():  # training mode under no_grad is cached too
        assert torch.equal(fl(length=12), a)
    assert calls == [12]


@pytest.mark.parametrize("backend", BACKENDS)
def test_training_mode_recomputes(backend, calls, device):
    fl = _module(backend, device).train()
    fl(length=6)
    fl(length=6)
    assert calls == [6, 6]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_longer_length_extends_from_last_state(backend, dtype, calls, device):
    fl = _module(backend, device, dtype).eval()
    short = fl(length=10)
    long = fl(length=27)
    assert calls == [10, 17], "the extension must integrate only the 17 new intervals"
    assert torch.equal(long[:, :10], short)
    assert_close(long, _fresh(fl, 27), dtype, "floater", what="extension vs fresh")
    fl.clear_cache()
    full = fl(length=27)
    assert calls == [10, 17, 27]
    assert_close(long, full, dtype, "floater", what="extension vs full")


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_maximum_length(backend, calls, device):
    fl = _module(backend, device, substeps=1, method="euler").eval()
    out = fl(length=3000)
    out2 = fl(length=3500)
    assert out2.shape == (3, 3500, 5) and calls == [3000, 500]
    assert torch.equal(out2[:, :3000], out)
    assert torch.isfinite(out2).all()


def _in_place_add(fl):
    with torch.no_grad():
        fl.w1.add_(0.1)


def _data_write(fl):
    fl.w2.data.mul_(1.5)  # .data: no _version bump


def _replace_tensor(fl):
    fl.b1.data = fl.b1.data + 0.2  # a new tensor: data_ptr changes


def _fused_optimizer(fl):
    for p in fl.parameters():
        p.grad = torch.ones_like(p)
    opt = torch.optim.AdamW(fl.parameters(), lr=0.05, fused=True)
    opt.step()  # fused kernels write in place without bumping _version


def _load_state_dict(fl):
    sd = {k: v + 0.05 for k, v in fl.state_dict().items()}
    fl.load_state_dict(sd)


def _sgd_step(fl):
    for p in fl.parameters():
        p.grad = torch.full_like(p, 0.3)
    torch.optim.SGD(fl.parameters(), lr=0.1).step()


CHANGES = [
    _in_place_add,
    _data_write,
    _replace_tensor,
    _fused_optimizer,
    _load_state_dict,
    _sgd_step,
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("change", CHANGES, ids=[f.__name__[1:] for f in CHANGES])
def test_parameter_change_invalidates(backend, change, calls, device):
    fl = _module(backend, device).eval()
    before = fl(length=9).detach().clone()
    try:
        change(fl)
    except RuntimeError as exc:  # e.g. no fused AdamW for this device / dtype
        pytest.skip(str(exc))
    after = fl(length=9)
    assert calls == [9, 9]
    assert not torch.equal(after, before)
    assert_close(after, _fresh(fl, 9), torch.float64, "floater")


@pytest.mark.parametrize("backend", BACKENDS)
def test_in_place_edit_of_a_result_invalidates(backend, calls, device):
    fl = _module(backend, device).eval()
    with torch.no_grad():
        out = fl(length=8)
        expected = out.clone()
        out[0, 3] = 100.0  # the caller owns what it got; the cache must not serve this
        again = fl(length=8)
    assert calls == [8, 8]
    assert torch.equal(again, expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_configuration_change_invalidates(backend, calls, device):
    fl = _module(backend, device).eval()
    a = fl(length=6)
    fl.substeps = 1
    b = fl(length=6)
    assert calls == [6, 6] and not torch.equal(a, b)
    assert_close(b, _fresh(fl, 6), torch.float64, "floater")


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_through_cached_states(backend, calls, device):
    """In eval mode with gradients on, cached states still backpropagate (the discrete
    adjoint attached to the stored states), once per returned tensor, and equal the
    gradients of a fresh training-mode computation; extension included."""
    fl = _module(backend, device)
    fl.train()
    (fl(length=14) ** 2).sum().backward()
    expected = [p.grad.clone() for p in fl.parameters()]
    fl.zero_grad()
    fl.eval()
    fl(length=6)  # cached, then extended to 14 below
    n = len(calls)
    for _ in range(2):  # two graphs over the same cached states
        out = fl(length=14)
        assert out.requires_grad
        (out**2).sum().backward()
    assert len(calls) == n + 1  # only the extension 6 -> 14 integrated anything
    for (name, p), want in zip(fl.named_parameters(), expected):
        assert_close(
            p.grad, 2 * want, torch.float64, "grad", scale=want.abs().max().item(), what=name
        )


@pytest.mark.parametrize("backend", BACKENDS)
def test_refresh_every(backend, calls, device):
    """refresh_every=3 in training mode: one differentiable computation, then its values
    (detached, stale by design) for the next two calls, then a fresh one."""
    fl = _module(backend, device, refresh_every=3).train()
    opt = torch.optim.SGD(fl.parameters(), lr=0.1)
    outs = []
    for _ in range(5):
        out = fl(length=5)
        outs.append(out)
        if out.requires_grad:  # a refresh: the current parameters' solution
            assert_close(out, _fresh(fl, 5), torch.float64, "floater")
            out.sum().backward()
            opt.step()
            opt.zero_grad()
    assert calls == [5, 5]
    assert [o.requires_grad for o in outs] == [True, False, False, True, False]
    assert torch.equal(outs[1], outs[0].detach()) and torch.equal(outs[2], outs[0].detach())
    assert not torch.equal(outs[3].detach(), outs[0].detach())  # the parameters moved
    longer = fl(length=8)  # longer than the stored result: recomputed at once
    assert calls == [5, 5, 8] and longer.requires_grad


@pytest.mark.parametrize("backend", BACKENDS)
def test_times_form_is_cached_by_value(backend, calls, device):
    fl = _module(backend, device).eval()
    t = torch.tensor([0.1, 0.4, 0.45, 1.0], dtype=torch.float64, device=device)
    a = fl(times=t)
    b = fl(times=t.clone())
    assert calls == [4] and torch.equal(a, b)
    c = fl(times=t * 2)
    assert calls == [4, 4] and not torch.equal(a, c)
    d = fl(length=4)  # the length form has its own entry
    assert calls == [4, 4, 4] and d.shape == a.shape


def test_attention_bias_is_cached(calls, device):
    pos = pf.FloaterAttentionBias(8, num_layers=3, device=device).eval()
    a = pos(10)
    b = pos(10)
    assert len(calls) == 1 and torch.equal(a, b) and a.shape == (3, 3, 10, 8)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inference_mode_is_cached(backend, calls, device):
    fl = _module(backend, device).eval()
    with torch.inference_mode():
        a = fl(length=8)
        b = fl(length=8)
        assert calls == [8] and torch.equal(a, b)
        a.mul_(2)  # an edit of a returned tensor, made in inference mode
        c = fl(length=8)
    assert calls == [8, 8]
    assert_close(c, _fresh(fl, 8), torch.float64, "floater")


def _compiled(module):
    # aot_eager: the graph as inductor receives it (the op is opaque to both), without
    # the C++ compile of inductor's CPU kernels (~30 s here; run by hand, it passes too).
    torch._dynamo.reset()
    return torch.compile(module, fullgraph=True, backend="aot_eager")


def test_compiled_eval_calls_are_served_from_the_cache(calls, device):
    """torch.compile keeps the cache (through the op posenc_fast::floater_cached): repeats
    integrate nothing, a longer length only its new positions, a parameter change
    recomputes; compiled and eager calls share one cache."""
    fl = _module("auto", device, dtype=torch.float32).eval()
    compiled = _compiled(fl)
    a, b, c = (compiled(length=6) for _ in range(3))
    assert calls == [6], "three compiled eval calls, one integration"
    assert torch.equal(a, b) and torch.equal(b, c)
    assert_close(a, _fresh(fl, 6), torch.float32, "floater")
    a.mul_(2)  # the caller owns what it got: the cache is unaffected
    assert torch.equal(compiled(length=6), b) and calls == [6]
    longer = compiled(length=10)
    assert calls == [6, 4] and torch.equal(longer[:, :6], b)
    assert torch.equal(fl(length=10), longer) and calls == [6, 4], "eager shares the cache"
    _sgd_step(fl)
    moved = compiled(length=10)
    assert calls == [6, 4, 10] and not torch.equal(moved, longer)
    assert_close(moved, _fresh(fl, 10), torch.float32, "floater")


def test_compiled_cached_states_backpropagate(calls, device):
    """Eval mode with gradients on, compiled: served from the cache, with the discrete
    adjoint attached (as eagerly)."""
    fl = _module("auto", device)
    fl.train()
    (fl(length=9) ** 2).sum().backward()
    expected = [p.grad.clone() for p in fl.parameters()]
    fl.zero_grad()
    compiled = _compiled(fl.eval())
    for _ in range(2):
        (compiled(length=9) ** 2).sum().backward()
    assert calls == [9, 9], "one training integration, then one for both eval calls"
    for (name, p), want in zip(fl.named_parameters(), expected):
        assert_close(
            p.grad, 2 * want, torch.float64, "grad", scale=want.abs().max().item(), what=name
        )


def test_compiled_inference_mode_and_times_form_are_cached(calls, device):
    fl = _module("auto", device).eval()
    compiled = _compiled(fl)
    t = torch.tensor([0.1, 0.4, 0.45, 1.0], dtype=torch.float64, device=device)
    with torch.inference_mode():
        a = compiled(length=5)
        b = compiled(length=5)
    x = compiled(times=t)
    y = compiled(times=t.clone())
    assert calls == [5, 4] and torch.equal(a, b) and torch.equal(x, y)
    assert_close(x, ref.floater(*fl.parameters(), t, 3, "rk4", "tanh"), torch.float64, "floater")


def test_compiled_training_recomputes(calls, device):
    """Where the README says the cache does not apply under torch.compile: training steps
    (refresh_every too)."""
    fl = _module("auto", device, refresh_every=3).train()
    compiled = _compiled(fl)
    for _ in range(3):
        compiled(length=4).sum().backward()
    assert calls == [4, 4, 4]


def test_export_detection_ignores_is_exporting(monkeypatch):
    """dynamo before torch 2.13 folds torch.compiler.is_exporting() to True in every
    torch.compile, which turned the compiled cache off on torch 2.7 to 2.11 (the compiled
    tests above failed there): the module reads the flag that torch.export sets."""
    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: True, raising=False)
    assert not floater_functional.is_exporting()


@pytest.mark.skipif(
    not hasattr(torch.compiler, "_is_exporting_flag"),
    reason="torch 2.5 has no export flag: an export cannot be told from a compile, and the "
    "exported program keeps the cache op (README, Compatibility)",
)
def test_export_recomputes(calls, device):
    """torch.export (non-strict) does not cache: every call of the exported program
    integrates."""
    fl = _module("auto", device, refresh_every=3).eval()
    ep = torch.export.export(fl, (), {"length": 4}, strict=False)
    n = len(calls)
    first, second = ep.module()(length=4), ep.module()(length=4)
    assert len(calls) == n + 2 and torch.equal(first, second)
    assert_close(first, _fresh(fl, 4), torch.float64, "floater")


def test_compiled_module_under_reference_environment(monkeypatch, calls, device):
    """POSENC_FAST_BACKEND=reference makes "auto" the reference, which has no op: compiled
    calls run it directly, uncached (they failed with an AttributeError before)."""
    monkeypatch.setenv("POSENC_FAST_BACKEND", "reference")
    fl = _module("auto", device, substeps=1, method="euler")  # dynamo unrolls the loop
    compiled = _compiled(fl)
    compiled(length=3).sum().backward()
    fl.eval()
    a, b = compiled(length=3), compiled(length=3)
    assert calls == [] and torch.equal(a, b)  # the reference is no backend's integrator
    assert_close(a, _fresh(fl, 3), torch.float64, "floater")


def test_cached_op(calls, device):
    """posenc_fast::floater_cached: an op check, and the cache of a module that no longer
    exists (its graph outlived it) is never consulted."""
    fl = _module("auto", device).eval()
    inputs = [p.detach() for p in fl.parameters()]
    t = fl.length_times(5)
    cache_id = fl._cache.id
    for args in ((*inputs, t), (*(p.clone().requires_grad_() for p in inputs), t)):
        opcheck(
            torch.ops.posenc_fast.floater_cached.default,
            (*args, 3, "rk4", "tanh", "auto", cache_id, "length"),
        )
    del fl
    n = len(calls)
    args = (*inputs, t, 3, "rk4", "tanh", "auto", cache_id, "length")
    out, out2 = (
        torch.ops.posenc_fast.floater_cached(*args),
        torch.ops.posenc_fast.floater_cached(*args),
    )
    assert len(calls) == n + 2 and torch.equal(out, out2)
