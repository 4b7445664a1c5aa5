"""RMSNorm and RoPE through reclaim/models/kernels/rownorm.c against their torch formulas."""

import pytest
import torch
import torch.nn.functional as F

from reclaim.models.kernels import rownorm
from reclaim.models.kernels.linear import torch_kernels
from reclaim.models.llama import apply_rope
from reclaim.models.norm import RMSNorm

needs_kernel = pytest.mark.skipif(rownorm._load() is None, reason="rownorm kernel unavailable here")


def _torch_rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


@needs_kernel
@pytest.mark.parametrize("d", [16, 64, 96, 128])
def test_rope_is_bitwise_the_torch_formula(d):
    g = torch.Generator().manual_seed(d)
    x, cos, sin = torch.randn(37, 9, d, generator=g), torch.randn(37, 1, d, generator=g), torch.randn(37, 1, d, generator=g)
    with torch.no_grad():
        got = rownorm.rope(x, cos, sin)
    assert got is not None and torch.equal(got, _torch_rope(x, cos, sin))
    assert torch.equal(apply_rope(x, cos, sin), got)  # the model's path takes it


@needs_kernel
@pytest.mark.parametrize("n", [1, 15, 64, 576, 1000])
def test_rms_norm_equals_float64_within_rounding_and_is_batch_invariant(n):
    g = torch.Generator().manual_seed(n)
    x, w = 3 * torch.randn(7, 5, n, generator=g), torch.randn(n, generator=g)
    with torch.no_grad():
        got = rownorm.rms_norm(x, w, 1e-5)
        alone = rownorm.rms_norm(x[2, 3:4], w, 1e-5)
    xd = x.double()
    want = w.double() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert got is not None and ((got.double() - want).abs() <= 1e-6 * want.abs().amax(-1, keepdim=True)).all()
    assert torch.equal(alone, got[2, 3:4])
    assert (got - F.rms_norm(x, (n,), w, 1e-5)).abs().max() <= 1e-5 * got.abs().max()


def test_torch_runs_where_the_kernel_must_not():
    """Training (autograd), other dtypes, strided inputs and torch_kernels() get None: torch runs them."""
    x, w = torch.randn(4, 64), torch.randn(64, requires_grad=True)
    assert rownorm.rms_norm(x, w, 1e-5) is None  # a gradient is wanted
    norm = RMSNorm(64, 1e-5)
    norm(x).sum().backward()  # and RMSNorm still trains
    assert norm.weight.grad is not None and norm.weight.grad.abs().sum() > 0
    with torch.no_grad():
        assert rownorm.rms_norm(x.double(), w.double(), 1e-5) is None
        assert rownorm.rms_norm(torch.randn(64, 4).t(), w, 1e-5) is None
        assert rownorm.rope(torch.randn(3, 2, 8).transpose(0, 1), torch.randn(2, 1, 8), torch.randn(2, 1, 8)) is None
        with torch_kernels():
            assert rownorm.rms_norm(x, w, 1e-5) is None
