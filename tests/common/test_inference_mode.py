"""A first call under torch.inference_mode() must not poison later differentiable calls.

The ops cache constants per device (frequency tables, the DFT basis, Runge-Kutta tableau
rows, the block row). Built inside inference mode they would be inference tensors, which
autograd refuses to save ("Inference tensors cannot be saved for backward"). The caches
are process-wide, so the check runs in a fresh interpreter: there the inference-mode call
really is the first one.
"""

import subprocess
import sys
import textwrap

from conftest import DEVICE

SCRIPT = textwrap.dedent(
    """
    import torch
    import posenc_fast as pf

    device = {device!r}
    f64 = dict(dtype=torch.float64, device=device)

    def calls(requires_grad):
        p = torch.arange(5.0, **f64).requires_grad_(requires_grad)
        e = torch.randn(3, 16, **f64).requires_grad_(requires_grad)
        x = torch.randn(2, 5, 16, **f64).requires_grad_(requires_grad)
        yield "sinusoidal", lambda b: pf.sinusoidal(p, 16, backend=b)
        yield "sinusoidal block", lambda b: pf.sinusoidal(p, 16, block=3, backend=b)
        yield "dft", lambda b: pf.dft(p, 16, backend=b)
        yield "dft_inverse", lambda b: pf.dft_inverse(e)
        yield "SinusoidalPE", lambda b: pf.SinusoidalPE(16, backend=b)(x)
        yield "DFTPE", lambda b: pf.DFTPE(16, backend=b)(x)
        fl = pf.Floater(4, 2, method="rk38", backend="torch", **f64)
        yield "Floater", lambda b: fl(length=3)

    with torch.inference_mode():
        for name, call in calls(False):
            call("torch")
    failures = []
    for name, call in calls(True):
        try:
            out = call("torch")
            out.sum().backward()
        except RuntimeError as e:
            failures.append(f"{{name}}: {{e}}")
    print("\\n".join(failures) if failures else "ok")
    """
)


def test_first_call_in_inference_mode_keeps_later_calls_differentiable():
    code = SCRIPT.format(device=DEVICE)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "ok", res.stdout
