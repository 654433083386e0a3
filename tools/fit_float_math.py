"""Fit the polynomial coefficients of the float32 tanh / erf used by the C++ CPU kernels.

csrc/cpu/vec.h (F32Math) evaluates tanh and erf in float32 with polynomials (vectorisable,
no libm calls), because glibc's scalar tanhf/erff cost more than the two small matvecs of
a stage at d = 64. This script reproduces the coefficients (weighted least squares at
Chebyshev nodes, float64 truth from scipy) and reports the float32 error of the C++-style
evaluation; rerun it if a range or degree changes.

    python tools/fit_float_math.py
"""

from __future__ import annotations

import numpy as np
from scipy import special


def fit(f, lo, hi, deg, basis):
    """Coefficients c (lowest first) minimising max relative error of sum c_k basis_k(x)."""
    n = 4000
    x = 0.5 * (lo + hi) + 0.5 * (hi - lo) * np.cos(np.pi * (np.arange(n) + 0.5) / n)
    A = np.stack([basis(x, k) for k in range(deg + 1)], axis=1)
    y = f(x)
    w = 1.0 / np.abs(y)
    # A few IRLS rounds move least squares towards minimax.
    for _ in range(30):
        c, *_ = np.linalg.lstsq(A * w[:, None], y * w, rcond=None)
        r = np.abs(A @ c - y) / np.abs(y)
        w = w * (r / r.max() + 1e-3) ** 0.5
        w /= w.max()
    return c


def horner32(c, u):
    acc = np.float32(c[-1])
    for ck in reversed(c[:-1]):
        acc = np.float32(acc * u + np.float32(ck))
    return acc


def report(name, got, ref):
    err = np.abs(got - ref)
    rel = err / np.maximum(np.abs(ref), 1e-30)
    print(f"{name}: max abs err {err.max():.3g}, max rel err {rel.max():.3g}")


def main():
    np.set_printoptions(precision=10)
    # tanh(x) = x + x^3 * P(x^2) on |x| < 0.625
    c_tanh = fit(lambda x: (np.tanh(x) - x) / x**3, 1e-4, 0.625, 6, lambda x, k: x ** (2 * k))
    # erf(x) = x * P(x^2) on |x| < 1
    c_erf_small = fit(lambda x: special.erf(x) / x, 1e-4, 1.0, 7, lambda x, k: x ** (2 * k))
    # erfc(x) = exp(-x^2) * Q(x) on 1 <= x <= 4 (erf(x) rounds to 1 in float32 beyond ~3.9)
    c_erfc = fit(lambda x: special.erfcx(x), 1.0, 4.0, 11, lambda x, k: (x - 2.5) ** k)
    fits = (("tanh P(x^2)", c_tanh), ("erf small P(x^2)", c_erf_small), ("erfcx Q(x-2.5)", c_erfc))
    for name, c in fits:
        print(name)
        for v in c:
            print(f"    {np.float32(v)!r:>18}  # {v:.17g}")
    # float32 evaluation error
    x = np.linspace(-6, 6, 2_000_001).astype(np.float32)
    ax = np.abs(x)
    t_small = x + x * x * x * horner32(c_tanh, x * x)
    e = np.exp(np.float32(-2) * ax).astype(np.float32)
    t_big = np.sign(x) * ((np.float32(1) - e) / (np.float32(1) + e))
    t = np.where(ax < 0.625, t_small, t_big).astype(np.float32)
    ref = np.tanh(x.astype(np.float64))
    report("tanh", t, ref)
    e_small = x * horner32(c_erf_small, x * x)
    axc = np.minimum(ax, np.float32(4))
    q = horner32(c_erfc, axc - np.float32(2.5))
    e_big = np.sign(x) * (np.float32(1) - np.exp(-axc * axc).astype(np.float32) * q)
    er = np.where(ax < 1, e_small, e_big).astype(np.float32)
    ref = special.erf(x.astype(np.float64))
    report("erf", er, ref)


if __name__ == "__main__":
    main()
