"""A call reaches its kernel in a few plain hops: from a module's forward (or a public
function) to the kernel's launch at most MAX_FRAMES frames of our own code, on the cpp and
the (interpreted) triton backends (FLOATER: cpp), forward and backward. Counted with
sys.setprofile: the frames of posenc_fast/ and triton_kernels/ on the stack when the
kernel is entered (a posenc_fast:: C++ kernel op, or a Triton kernel's launch)."""

import os
import sys

import pytest
import torch

import posenc_fast as pf
from posenc_fast.cli import _inputs

MAX_FRAMES = 6
_PACKAGE = os.path.dirname(os.path.abspath(pf.__file__)) + os.sep
_OURS = (_PACKAGE, os.path.join(os.path.dirname(_PACKAGE[:-1]), "triton_kernels") + os.sep)


# What ``kernel[grid]`` indexes: a Triton kernel, its interpreted form, an autotuner.
_TRITON_KERNELS = ("JITFunction", "InterpretedFunction", "Autotuner", "Heuristics")


def _ours(frame) -> bool:
    return frame.f_code.co_filename.startswith(_OURS)


def _kernel(frame):
    """The kernel a call event enters, or None."""
    code = frame.f_code
    self = frame.f_locals.get("self")
    if code.co_name == "__getitem__" and type(self).__name__ in _TRITON_KERNELS:
        return f"triton {type(self).__name__}"
    if code.co_name == "__call__" and type(self).__name__ == "OpOverloadPacket":
        name = self._qualified_op_name
        if name.startswith("posenc_fast::") and ("kernel" in name or "integrate" in name):
            return name
    return None


def deepest_kernel_call(fn):
    """(frames of our code, their names, kernel) of the deepest kernel entry in fn()."""
    hits = []

    def profile(frame, event, arg):
        if event != "call" or frame.f_back is None or not _ours(frame.f_back):
            return
        kernel = _kernel(frame)
        if kernel is None:
            return
        stack, f = [], frame.f_back
        while f is not None:
            if _ours(f):
                stack.append(f"{os.path.basename(f.f_code.co_filename)}:{f.f_code.co_name}")
            f = f.f_back
        hits.append((len(stack), stack[::-1], kernel))

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    assert hits, "no kernel was entered"
    return max(hits, key=lambda h: h[0])


def _calls(backend):
    g = _inputs.generator(5)
    lff = pf.LearnableFourierFeatures(2, 16, 8, 12, backend=backend)
    rotary = pf.LearnableFourierRotary(2, 8, backend=backend)
    x = _inputs.randn((10, 1, 2), g)
    q, k = _inputs.randn((1, 2, 10, 8), g), _inputs.randn((1, 2, 10, 8), g)
    pos = _inputs.randn((10, 2), g)
    tokens = _inputs.randn((2, 10, 16), g, scale=0.1)
    # the general op: RoPE-Mixed's per-head frequencies, rotate-half, a class token
    mixed = pf.Rotary(2, 8, heads=2, pairs="half", prefix=1, backend=backend)
    grid = _inputs.randn((9, 2), g)
    return {
        "lff": lambda: lff(x),
        "rotary": lambda: rotary.rotate(q.requires_grad_(), k, pos),
        "rotary table": lambda: rotary(pos),
        "rotary, general": lambda: mixed(q, k.requires_grad_(), grid),
        "rotary table, general": lambda: mixed.table(grid),
        "sinusoidal table": lambda: pf.sinusoidal(
            torch.arange(10.0, requires_grad=True), 16, backend=backend
        ),
        "sinusoidal add": lambda: pf.SinusoidalPE(16, backend=backend)(
            tokens, torch.arange(10.0, requires_grad=True)
        ),
    }


@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_calls_reach_their_kernels_within_six_frames(backend):
    if pf.available_backends(verbose=True)[backend]:
        pytest.skip(f"{backend} unavailable here")
    for name, call in _calls(backend).items():
        depth, stack, kernel = deepest_kernel_call(call)
        assert depth <= MAX_FRAMES, f"{name} forward: {depth} frames to {kernel}: {stack}"
        out = call()
        outs = out if isinstance(out, tuple) else (out,)
        loss = sum(o.float().square().sum() for o in outs)
        depth, stack, kernel = deepest_kernel_call(loss.backward)
        assert depth <= MAX_FRAMES, f"{name} backward: {depth} frames to {kernel}: {stack}"


def _eval(module, call):
    """``call()`` with ``module`` in eval mode (its result cache serves it)."""

    def run():
        module.eval()
        try:
            return call()
        finally:
            module.train()

    return run


def _floater_calls():
    fl = pf.Floater(8, 3, hidden_dim=6, backend="cpp")
    refreshing = pf.Floater(8, 3, hidden_dim=6, backend="cpp", refresh_every=2)
    bias = pf.FloaterAttentionBias(8, num_layers=2, hidden_dim=6, backend="cpp")
    for m in (fl, refreshing, bias):
        _inputs.randomize_parameters(m, 3, scale=0.3)

    def extended():  # the cache holds 5 positions: the call integrates the 4 new ones
        fl.clear_cache()
        fl(length=5)
        return fl(length=9)

    def extended_bias():
        bias.floater.clear_cache()
        bias(5)
        return bias(9)

    return {
        "Floater training": lambda: fl(length=7),
        "Floater training, refresh_every": lambda: (refreshing.clear_cache(), refreshing(7))[1],
        "Floater eval, cached": _eval(fl, lambda: (fl.clear_cache(), fl(length=7))[1]),
        "Floater eval, extended": _eval(fl, extended),
        "FloaterAttentionBias training": lambda: bias(7),
        "FloaterAttentionBias eval, extended": _eval(bias, extended_bias),
        "FloaterAttentionBias.block_biases training": lambda: tuple(
            bias.block_biases(n, 7) for n in range(2)
        ),
        "FloaterAttentionBias.block_biases per block": lambda: tuple(
            bias.block_biases(n, 7, share=False) for n in range(2)
        ),
        "FloaterAttentionBias.block_biases eval": _eval(
            bias, lambda: (bias.floater.clear_cache(), bias.block_biases(1, 7))[1]
        ),
    }


def test_floater_reaches_its_kernels_within_six_frames():
    """Training (the taped forward), the eval cache (a fresh integration and an extension)
    and the blocks' shared training integration, and their backward, on the cpp backend."""
    if pf.available_backends(verbose=True)["cpp"]:
        pytest.skip("cpp unavailable here")
    for name, call in _floater_calls().items():
        depth, stack, kernel = deepest_kernel_call(call)
        assert depth <= MAX_FRAMES, f"{name} forward: {depth} frames to {kernel}: {stack}"
        out = call()
        outs = out if isinstance(out, tuple) else (out,)
        loss = sum(o.square().sum() for o in outs)
        depth, stack, kernel = deepest_kernel_call(loss.backward)
        assert depth <= MAX_FRAMES, f"{name} backward: {depth} frames to {kernel}: {stack}"
