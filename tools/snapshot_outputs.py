"""Bitwise snapshot of every op's outputs and gradients on every CPU backend.

A refactoring that must not change any number (numerical results bitwise unchanged
on every CPU backend) is checked by saving a snapshot before and comparing
after, on the same machine and torch:

    TRITON_INTERPRET=1 python tools/snapshot_outputs.py save /tmp/before.pt
    ... change the code ...
    TRITON_INTERPRET=1 python tools/snapshot_outputs.py compare /tmp/before.pt

Only the public API is used (``posenc_fast.*`` functions and modules with ``backend=``),
so the same script runs on both sides of a change of layout. Inputs are fresh random
values from a fixed seed (never zeros). A backend that refuses a case is recorded as
refused, with its message: a refusal that appears or disappears is a difference too.
Without TRITON_INTERPRET=1 the triton rows are refusals on CPU tensors (still compared).
The comparison is bitwise (NaNs included); it is not a test of accuracy (the test suite
checks every backend against the float64 reference).
"""

from __future__ import annotations

import argparse
import sys

import torch

import posenc_fast as pf

BACKENDS = ("reference", "torch", "cpp", "triton")
DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def _grads(out, inputs):
    """Outputs followed by the gradients of a fixed random projection of them."""
    outs = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator().manual_seed(7)
    loss = sum((o.float() * torch.randn(o.shape, generator=gen)).sum() for o in outs)
    leaves = [t for t in inputs if t.requires_grad]
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [o.detach() for o in outs] + [g if g is not None else torch.empty(0) for g in grads]


def _leaf(gen, shape, dtype, scale=1.0, grad=True):
    t = (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)
    return t.requires_grad_(grad)


def cases():
    """(name, fn(backend, dtype) -> list of tensors)."""

    def lff_case(G, M, F, H, D, mlp, activation):
        def run(backend, dtype):
            gen = torch.Generator().manual_seed(1)
            x = _leaf(gen, (5, 3, G, M), dtype, 3.0)
            wr = _leaf(gen, (F // 2, M), dtype, 2.0)
            args = [x, wr]
            if mlp:
                w1 = _leaf(gen, (F, H), dtype, F**-0.5)
                b1 = _leaf(gen, (H,), dtype, 0.1)
                w2 = _leaf(gen, (H, D // G), dtype, H**-0.5)
                b2 = _leaf(gen, (D // G,), dtype, 0.1)
                args += [w1, b1, w2, b2]
            y = pf.lff(*args, activation=activation, backend=backend)
            return _grads(y, args)

        return run

    def table(kind, nd=False):
        def run(backend, dtype):
            gen = torch.Generator().manual_seed(2)
            if nd:
                pos = _leaf(gen, (4, 7, 2), dtype, 30.0)
                return _grads(pf.sinusoidal_nd(pos, 16, backend=backend), [pos])
            pos = _leaf(gen, (4, 9), dtype, 300.0)
            if kind == "dft":
                return _grads(pf.dft(pos, 24, backend=backend), [pos])
            return _grads(pf.sinusoidal(pos, 24, backend=backend), [pos])

        return run

    def add(module_factory, coords=False):
        def run(backend, dtype):
            gen = torch.Generator().manual_seed(3)
            x = _leaf(gen, (2, 11, 24), dtype)
            mod = module_factory(backend)
            if coords:
                c = _leaf(gen, (2, 11, 2), dtype, 20.0)
                return _grads(mod(x, c), [x, c])
            pos = _leaf(gen, (2, 11), dtype, 50.0)
            return _grads(mod(x, pos), [x, pos])

        return run

    def dft_inverse(backend, dtype):
        gen = torch.Generator().manual_seed(4)
        enc = _leaf(gen, (3, 8), dtype)
        return _grads(pf.dft_inverse(enc, backend=backend), [enc])

    def rotary_table(backend, dtype):
        gen = torch.Generator().manual_seed(5)
        x = _leaf(gen, (2, 6, 2), dtype, 40.0)
        wr = _leaf(gen, (8, 2), dtype)
        return _grads(pf.lff_rotary(x, wr, backend=backend), [x, wr])

    def rotary_apply(layout):
        def run(backend, dtype):
            gen = torch.Generator().manual_seed(6)
            x = _leaf(gen, (2, 6, 2), dtype, 40.0)
            wr = _leaf(gen, (8, 2), dtype)
            shape = (2, 3, 6, 16) if layout == "bhnd" else (2, 6, 3, 16)
            q = _leaf(gen, shape, dtype)
            k = _leaf(gen, shape, dtype)
            out = pf.apply_lff_rotary(q, k, x, wr, layout=layout, backend=backend)
            return _grads(out, [q, k, x, wr])

        return run

    def floater_case(method, activation):
        def run(backend, dtype):
            gen = torch.Generator().manual_seed(8)
            d, H, S = 6, 10, 3
            p0 = _leaf(gen, (S, d), dtype, 0.5)
            w1 = _leaf(gen, (d + 1, H), dtype, 0.3)
            b1 = _leaf(gen, (H,), dtype, 0.1)
            w2 = _leaf(gen, (H + 1, d), dtype, 0.3)
            b2 = _leaf(gen, (d,), dtype, 0.1)
            times = torch.linspace(0.0, 1.5, 7, dtype=torch.float64).to(dtype)
            out = pf.floater(
                p0,
                w1,
                b1,
                w2,
                b2,
                times,
                substeps=3,
                method=method,
                activation=activation,
                backend=backend,
            )
            return _grads(out, [p0, w1, b1, w2, b2])

        return run

    yield "lff/features G1 M2", lff_case(1, 2, 16, 0, 0, False, "gelu")
    yield "lff/mlp gelu G2 M3", lff_case(2, 3, 16, 12, 10, True, "gelu")
    yield "lff/mlp relu G1 M1", lff_case(1, 1, 8, 7, 5, True, "relu")
    yield "encodings/sinusoidal", table("sinusoidal")
    yield "encodings/dft", table("dft")
    yield "encodings/sinusoidal_nd", table("sinusoidal", nd=True)
    yield "encodings/dft_inverse", dft_inverse
    yield "encodings/SinusoidalPE", add(lambda b: pf.SinusoidalPE(24, backend=b))
    yield "encodings/DFTPE", add(lambda b: pf.DFTPE(24, backend=b))
    yield "encodings/SinusoidalNdPE", add(lambda b: pf.SinusoidalNdPE(24, backend=b), True)
    yield "rotary/table", rotary_table
    yield "rotary/apply bhnd", rotary_apply("bhnd")
    yield "rotary/apply bnhd", rotary_apply("bnhd")
    yield "floater/rk4 relu", floater_case("rk4", "relu")
    yield "floater/rk38 tanh", floater_case("rk38", "tanh")


def snapshot() -> dict:
    torch.set_num_threads(1)
    out = {}
    for name, fn in cases():
        for backend in BACKENDS:
            for dtype in DTYPES:
                key = f"{name} | {backend} | {str(dtype).replace('torch.', '')}"
                try:
                    out[key] = fn(backend, dtype)
                except Exception as exc:  # a refusal is part of the snapshot
                    out[key] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return out


def _same(a, b) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
        if not torch.equal(x.contiguous().view(bits), y.contiguous().view(bits)):
            return False
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=("save", "compare"))
    ap.add_argument("path")
    args = ap.parse_args(argv)
    snap = snapshot()
    ran = sum(not isinstance(v, str) for v in snap.values())
    if args.action == "save":
        torch.save(snap, args.path)
        print(f"saved {len(snap)} entries ({ran} ran, {len(snap) - ran} refused) to {args.path}")
        return 0
    old = torch.load(args.path, weights_only=False)
    diffs = [
        k
        for k in sorted(set(old) | set(snap))
        if k not in old or k not in snap or not _same(old[k], snap[k])
    ]
    for k in diffs:
        print(f"DIFFERENT: {k}")
        print(f"  before: {str(old.get(k))[:200]}\n  after:  {str(snap.get(k))[:200]}")
    print(f"{len(snap)} entries ({ran} ran), {len(diffs)} different")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
