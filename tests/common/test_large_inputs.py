"""Large inputs: chunking bounds the CPU memory of LFF forward+backward."""

import pytest
import torch

import posenc_fast as pf
from posenc_fast.cli._timing import peak_bytes_cpu


@pytest.mark.slow
def test_lff_forward_backward_memory_is_bounded_by_chunking():
    """N = 2^19 positions, F = 1024: the [N, F] float32 features alone are 2 GiB, the float64
    phases 2 GiB more; an unchunked implementation (or eager autograd saving activations)
    needs over 4 GiB. posenc_fast keeps its temporaries to one chunk (64 MiB by default)."""
    N, M, F, H, D = 2**19, 2, 1024, 16, 4
    g = torch.Generator().manual_seed(0)
    x = torch.rand(N, 1, M, generator=g) * 100
    wr = (torch.randn(F // 2, M, generator=g)).requires_grad_()
    w1 = (torch.randn(F, H, generator=g) * 0.05).requires_grad_()
    b1 = torch.zeros(H).requires_grad_()
    w2 = (torch.randn(H, D, generator=g) * 0.2).requires_grad_()
    b2 = torch.zeros(D).requires_grad_()
    grad = torch.randn(N, D, generator=g)

    def train_step():
        y = pf.lff(x, wr, w1, b1, w2, b2, backend="torch")
        y.backward(grad)

    peak = peak_bytes_cpu(train_step)
    unchunked_features = N * F * 4
    # inputs and outputs (x, y, dx, grad: N * (2M + 2D) floats = 24 MiB) + a few chunks
    assert peak < 512 * 2**20, f"peak {peak / 2**20:.0f} MiB"
    assert peak < unchunked_features / 8
    assert wr.grad is not None and torch.isfinite(wr.grad).all()
