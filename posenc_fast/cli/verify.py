"""``python -m posenc_fast verify``: every usable backend against the float64 reference on
fresh random inputs (seed printed), forward and gradients; exit status 1 on any failure."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch

from .. import _dispatch
from ..ops import encodings as enc_api
from ..ops.encodings import reference as enc_ref
from ..ops.floater import Floater, floater
from ..ops.floater import reference as floater_ref
from ..ops.lff import lff
from ..ops.lff import reference as lff_ref
from ..ops.rotary import apply_lff_rotary, lff_rotary, rotary, rotary_table
from ..ops.rotary import reference as rotary_ref
from ..tolerances import mismatch
from . import _inputs

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


@dataclass
class Result:
    cases: int = 0
    fwd_err: float = 0.0  # largest |out - ref| seen
    grad_err: float = 0.0  # largest |grad - ref| / max|ref grad| seen
    failures: list = field(default_factory=list)

    def add(self, out, ref, dtype, kind, what, scale=None):
        self.fwd_err = max(self.fwd_err, _max_err(out, ref))
        msg = mismatch(out, ref, dtype, kind, scale)
        if msg:
            self.failures.append(f"{what}: {msg}")

    def add_grad(self, got, want, dtype, what):
        scale = want.abs().max().item() + 1e-30
        self.grad_err = max(self.grad_err, _max_err(got, want) / scale)
        msg = mismatch(got, want, dtype, "grad", scale=scale)
        if msg:
            self.failures.append(f"{what}: {msg}")


def _max_err(a, b) -> float:
    if a.numel() == 0:
        return 0.0
    d = (a.detach().double().cpu() - b.detach().double().cpu()).abs()
    d = d[~torch.isnan(d)]
    return d.max().item() if d.numel() else 0.0


def check_lff(backend: str, dtype, device: str, seed: int) -> Result:
    res = Result()
    for i, case in enumerate(_inputs.LFF_CASES):
        inputs = _inputs.lff_inputs(case, dtype, device, seed + i)
        leaves = [
            t.detach().clone().requires_grad_(True) if t is not None else None for t in inputs
        ]
        out = lff(*leaves, activation=case.activation, backend=backend)
        kind = "lff" if case.hidden_dim else "encoding"
        leaves64 = [
            t.detach().double().requires_grad_(True) if t is not None else None for t in inputs
        ]
        ref = lff_ref.lff(*leaves64, case.activation)
        res.add(out, ref, dtype, kind, f"{case.id} forward")
        if out.numel():
            g = _inputs.randn(out.shape, _inputs.generator(seed + 100 + i), dtype, device)
            out.backward(g)
            ref.backward(g.double())
            for name, a, b in zip(("x", "wr", "w1", "b1", "w2", "b2"), leaves, leaves64):
                if a is not None:
                    res.add_grad(a.grad, b.grad, dtype, f"{case.id} d{name}")
        res.cases += 1
    return res


def _add_kind(dtype) -> str:
    """Tolerance kind (posenc_fast.tolerances) of a fused add's output in ``dtype``."""
    return "encoding" if dtype in (torch.float32, torch.float64) else "lff"


def check_encoding(backend: str, dtype, device: str, seed: int) -> Result:
    res = Result()
    funcs = {"sinusoidal": enc_api.sinusoidal, "dft": enc_api.dft}
    for i, case in enumerate(_inputs.ENCODING_CASES):
        p = _inputs.positions(case, dtype, device, seed + i)
        out_dtype = dtype if p.is_floating_point() else torch.get_default_dtype()
        if p.is_floating_point():
            p.requires_grad_(True)
        out = funcs[case.kind](p, case.dim, backend=backend)
        p64 = p.detach().double().requires_grad_(p.is_floating_point())
        ref = (
            enc_ref.dft(p64, case.dim) if case.kind == "dft" else enc_ref.sinusoidal(p64, case.dim)
        )
        res.add(out, ref, out_dtype, "encoding", f"{case.id} forward")
        if p.requires_grad and out.numel():
            g = _inputs.randn(out.shape, _inputs.generator(seed + 200 + i), dtype, device)
            out.backward(g)
            ref.backward(g.double())
            res.add_grad(p.grad, p64.grad, dtype, f"{case.id} dpositions")
        # the fused add
        x = _inputs.randn(
            (*case.shape, case.dim), _inputs.generator(seed + 300 + i), out_dtype, device
        )
        if x.dim() >= 2:
            module = (
                enc_api.DFTPE(case.dim, backend)
                if case.kind == "dft"
                else enc_api.SinusoidalPE(case.dim, backend=backend)
            )
            y = module(x, p.detach())
            res.add(
                y,
                x.double() + ref.detach(),
                out_dtype,
                _add_kind(out_dtype),
                f"{case.id} fused add",
            )
        res.cases += 1
    return res


# (coords shape, dim): a grid's [L, 2] broadcast over a batch, and 3 axes per token
ENCODING_ND_CASES = (((64, 2), (3, 64, 32)), ((2, 16, 3), (2, 16, 48)))


def check_encoding_nd(backend: str, dtype, device: str, seed: int) -> Result:
    """Sine-nD added to x (SinusoidalNdPE): the sum and the gradients to x and coords."""
    res = Result()
    for i, (cshape, xshape) in enumerate(ENCODING_ND_CASES):
        g = _inputs.generator(seed + 600 + i)
        cdtype = torch.float64 if dtype == torch.float64 else torch.float32
        coords = (_inputs.randn(cshape, g, cdtype, device) * 40).requires_grad_(True)
        x = _inputs.randn(xshape, g, dtype, device).requires_grad_(True)
        axes = cshape[-1]
        y = enc_api.SinusoidalNdPE(xshape[-1], axes, backend=backend)(x, coords)
        c64, x64 = _leaves((coords, x), torch.float64)
        ref = x64 + enc_ref.sinusoidal_nd(c64, xshape[-1] // axes)
        what = f"coords {list(cshape)} + x {list(xshape)}"
        res.add(y, ref, dtype, _add_kind(dtype), f"{what} fused add")
        gy = _inputs.randn(y.shape, g, dtype, device)
        y.backward(gy)
        ref.backward(gy.double())
        res.add_grad(x.grad, x64.grad, dtype, f"{what} dx")
        res.add_grad(coords.grad, c64.grad, dtype, f"{what} dcoords")  # it flows through x.dtype
        res.cases += 1
    return res


def _leaves(tensors, dtype=None):
    """Fresh leaves that require grad: copies, or float64 ones for the reference."""
    return [
        (t.detach().clone() if dtype is None else t.detach().to(dtype)).requires_grad_(True)
        for t in tensors
    ]


def check_lff_rotary(backend: str, dtype, device: str, seed: int) -> Result:
    """The rotary cos / sin table (LightGlue's layout) and its gradients to x and wr."""
    res = Result()
    for i, shape in enumerate(_inputs.ROTARY_TABLE_SHAPES):
        inputs = _inputs.rotary_table_inputs(shape, dtype, device, seed + i)
        leaves, leaves64 = _leaves(inputs), _leaves(inputs, torch.float64)
        out = lff_rotary(*leaves, backend=backend)
        ref = rotary_ref.lff_rotary_table(*leaves64)
        res.add(out, ref, dtype, "encoding", f"table {shape} forward")
        if out.numel():
            g = _inputs.randn(out.shape, _inputs.generator(seed + 400 + i), dtype, device)
            out.backward(g)
            ref.backward(g.double())
            for name, a, b in zip(("x", "wr"), leaves, leaves64):
                res.add_grad(a.grad, b.grad, dtype, f"table {shape} d{name}")
        res.cases += 1
    return res


def _check_rotations(res: Result, cases, run, spec, names, dtype, device, seed, grad_seed):
    """``run(case, leaves)`` -> (q', k') on every case against ``spec`` on float64 copies
    (outputs relative to their largest entry: "rotary"), then the gradients to the inputs
    ``names`` where the spec's are defined."""
    for i, case in enumerate(cases):
        inputs = _inputs.rotary_inputs(case, dtype, device, seed + i)
        leaves, leaves64 = _leaves(inputs), _leaves(inputs, torch.float64)
        out, ref = run(case, leaves), spec(case, leaves64)
        scale = max([float(r.detach().abs().max()) for r in ref if r.numel()] or [0.0])
        for o, r, name in zip(out, ref, ("q", "k")):
            res.add(o, r, dtype, "rotary", f"{case.id} {name}'", scale)
        if out[0].numel():
            g = _inputs.generator(grad_seed + i)
            grads = [_inputs.randn(o.shape, g, dtype, device) for o in out]
            torch.autograd.backward(out, grads)
            torch.autograd.backward(ref, [t.double() for t in grads])
            for name, a, b in zip(names, leaves, leaves64):
                if b.grad is not None and b.grad.numel():
                    res.add_grad(a.grad, b.grad, dtype, f"{case.id} d{name}")
        res.cases += 1
    return res


def check_apply_lff_rotary(backend: str, dtype, device: str, seed: int) -> Result:
    """q and k rotated (both layouts, shared positions, ...) and the gradients to q, k,
    x and wr."""
    return _check_rotations(
        Result(), _inputs.ROTARY_CASES,
        lambda c, t: apply_lff_rotary(*t, c.layout, backend=backend),
        lambda c, t: rotary_ref.apply_lff_rotary(*t, c.layout),
        ("q", "k", "x", "wr"), dtype, device, seed, seed + 500,
    )  # fmt: skip


def check_rotary(backend: str, dtype, device: str, seed: int) -> Result:
    """The general op on every family's options (pairs, per-head frequencies, prefix
    tokens, layouts, positions per sample, GQA, strided q): q', k' and the gradients to q,
    k, x and the frequencies."""
    return _check_rotations(
        Result(), _inputs.ROTARY_FAMILY_CASES,
        lambda c, t: rotary(*t, c.pairs, c.layout, c.prefix, backend=backend),
        lambda c, t: rotary_ref.rotary(*t, c.pairs, c.layout, c.prefix),
        ("q", "k", "x", "freqs"), dtype, device, seed, seed + 600,
    )  # fmt: skip


def check_rotary_table(backend: str, dtype, device: str, seed: int) -> Result:
    """The general cos / sin table and its gradients to x and the frequencies."""
    res = Result()
    for i, (x_shape, f_shape, pairs) in enumerate(_inputs.ROTARY_FAMILY_TABLES):
        inputs = _inputs.rotary_family_table_inputs(x_shape, f_shape, dtype, device, seed + i)
        leaves, leaves64 = _leaves(inputs), _leaves(inputs, torch.float64)
        out = rotary_table(*leaves, pairs, backend=backend)
        ref = rotary_ref.rotary_table(*leaves64, pairs)
        what = f"table x{list(x_shape)} freqs{list(f_shape)} {pairs}"
        res.add(out, ref, dtype, "encoding", f"{what} forward")
        if out.numel():
            g = _inputs.randn(out.shape, _inputs.generator(seed + 700 + i), dtype, device)
            out.backward(g)
            ref.backward(g.double())
            for name, a, b in zip(("x", "freqs"), leaves, leaves64):
                res.add_grad(a.grad, b.grad, dtype, f"{what} d{name}")
        res.cases += 1
    return res


def check_floater(backend: str, dtype, device: str, seed: int) -> Result:
    """``_inputs.FLOATER_CASES``: forward and gradients to p0, weights and times against
    autograd through the float64 reference loop; plus the module's cache extension."""
    res = Result()
    for i, case in enumerate(_inputs.FLOATER_CASES):
        inputs = _inputs.floater_inputs(case, dtype, device, seed + i)
        leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
        args = (case.substeps, case.method, case.activation)
        out = floater(*leaves, *args, backend=backend)
        leaves64 = [t.detach().double().requires_grad_(True) for t in inputs]
        expected = floater_ref.floater(*leaves64, *args)
        res.add(out, expected, dtype, "floater", f"{case.id} forward")
        if out.numel():
            g = _inputs.randn(out.shape, _inputs.generator(seed + 400 + i), dtype, device)
            out.backward(g)
            expected.backward(g.double())
            for name, a, b in zip(("p0", "w1", "b1", "w2", "b2", "times"), leaves, leaves64):
                res.add_grad(a.grad, b.grad, dtype, f"{case.id} d{name}")
        res.cases += 1
    res.cases += _check_extension(backend, dtype, device, seed, res)
    return res


def _check_extension(backend, dtype, device, seed, res: Result) -> int:
    """Eval-mode cache: a longer length continues from the cached state, equal to the reference."""
    fl = Floater(7, 3, hidden_dim=5, delta_t=0.05, substeps=2, activation="gelu",
                 backend=backend, device=device, dtype=dtype)  # fmt: skip
    _inputs.randomize_parameters(fl, seed + 500, 0.5)
    fl.eval()
    with torch.no_grad():
        fl(length=9)
        out = fl(length=20)
    weights = (fl.p0, fl.w1, fl.b1, fl.w2, fl.b2)
    expected = floater_ref.floater(*weights, fl.length_times(20), 2, "rk4", "gelu")
    res.add(out, expected, dtype, "floater", "module cache extension 9 -> 20")
    return 1


CHECKS = {
    "lff": check_lff,
    "encoding": check_encoding,
    "encoding_nd": check_encoding_nd,
    "lff_rotary": check_lff_rotary,
    "apply_lff_rotary": check_apply_lff_rotary,
    "rotary": check_rotary,
    "rotary_table": check_rotary_table,
    "floater": check_floater,
}


def _last_line(exc: Exception) -> str:
    """The error's message, shortened to what fits a report line."""
    text = str(exc).strip().splitlines()
    return (text[-1] if text else "")[-300:]


def run(args) -> int:
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    device = args.device
    checks = CHECKS
    wanted = list(checks) if args.ops == "all" else [o.strip() for o in args.ops.split(",")]
    unknown = [o for o in wanted if o not in checks]
    if unknown:
        print(f"unknown op(s) {unknown}; choose from {list(checks)}")
        return 2
    print(f"posenc_fast verify: device {device}, seed {seed} (replay with --seed {seed})")
    failed = 0
    for op in wanted:
        for name, b in _dispatch.BACKENDS.items():
            impl = _dispatch.REGISTRIES[op].get(name)
            if impl is None or impl.differentiable or not impl.support.implements(device):
                continue
            env = b.environment_reasons()
            if env:
                print(f"SKIP  {op:<9} {name:<7} unavailable: {'; '.join(env)}")
                continue
            sup = impl.support
            for dtype in DTYPES:
                if sup.dtypes is not None and dtype not in sup.dtypes:
                    continue
                t0 = time.perf_counter()
                try:
                    res = checks[op](name, dtype, device, seed)
                except Exception as exc:  # a backend that raises fails; the others go on
                    res = Result()
                    res.failures.append(f"raised {type(exc).__name__}: {_last_line(exc)}")
                status = "FAIL" if res.failures else "PASS"
                failed += bool(res.failures)
                print(
                    f"{status}  {op:<9} {name:<7} {str(dtype)[6:]:<8} {res.cases:>2} cases  "
                    f"max fwd err {res.fwd_err:.2e}  max grad rel err {res.grad_err:.2e}  "
                    f"({time.perf_counter() - t0:.1f} s)"
                )
                for f in res.failures[:5]:
                    print(f"      {f}")
                if len(res.failures) > 5:
                    print(f"      ... and {len(res.failures) - 5} more")
    if failed:
        print(f"{failed} mismatching op/backend/dtype combination(s); seed {seed}")
        return 1
    print("all backends agree with the reference")
    return 0
