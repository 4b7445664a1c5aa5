"""Selective scan kernel: equals the token-by-token recurrence, forward and backward."""

import pytest
import torch

from reclaim.models.kernels import scan
from reclaim.models.kernels.scan import linear_scan, selective_scan, selective_scan_ref

pytestmark = pytest.mark.usefixtures("one_thread")


def grads(outs, ins, cots):
    return torch.autograd.grad(outs, ins, cots, allow_unused=True)


@pytest.mark.parametrize("t", [1, 2, 5, 29, 64])
@pytest.mark.parametrize("block_elements", [1 << 21, 60])  # one block, or many 16-token blocks
def test_scan_equals_reference_forward_and_backward(scan_inputs, t, block_elements, monkeypatch):
    monkeypatch.setattr(scan, "BLOCK_ELEMENTS", block_elements)
    ins = scan_inputs(t=t)
    y, h = selective_scan(*ins)
    yr, hr = selective_scan_ref(*ins)
    assert (y - yr).abs().max() <= 1e-12 and (h - hr).abs().max() <= 1e-12
    gy, gh = torch.randn_like(y), torch.randn_like(h)
    for g, r in zip(grads([y, h], ins, [gy, gh]), grads([yr, hr], ins, [gy, gh])):
        assert (g - r).abs().max() <= 1e-12 * max(1.0, r.abs().max().item())


def test_float32_scan_matches_float64_reference(scan_inputs):
    ins = scan_inputs(t=200, d=8, n=16)
    y, h = selective_scan(*(v.detach().float() for v in ins))
    yr, hr = selective_scan_ref(*(v.detach() for v in ins))
    assert (y.double() - yr).abs().max() <= 1e-4 * yr.abs().max()


def test_without_initial_state_starts_from_zero(scan_inputs):
    x, dt, A, B, C, _ = scan_inputs(t=9)
    y, h = selective_scan(x, dt, A, B, C)
    yr, hr = selective_scan_ref(x, dt, A, B, C, torch.zeros_like(h))
    assert torch.allclose(y, yr) and torch.allclose(h, hr)


def test_split_sequence_with_carried_state_equals_whole(scan_inputs):
    x, dt, A, B, C, h0 = scan_inputs(t=30)
    y, h = selective_scan(x, dt, A, B, C, h0)
    y1, h1 = selective_scan(x[:, :13], dt[:, :13], A, B[:, :13], C[:, :13], h0)
    y2, h2 = selective_scan(x[:, 13:], dt[:, 13:], A, B[:, 13:], C[:, 13:], h1)
    assert torch.allclose(torch.cat([y1, y2], 1), y) and torch.allclose(h2, h)


@pytest.mark.parametrize("reverse", [False, True])
def test_linear_scan_equals_loop(reverse):
    a, b = torch.rand(3, 23, 4, dtype=torch.float64), torch.randn(3, 23, 4, dtype=torch.float64)
    h0 = torch.randn(3, 4, dtype=torch.float64)
    got = linear_scan(a, b, h0, reverse=reverse)
    h, ref = h0, [None] * 23
    for i in (reversed(range(23)) if reverse else range(23)):
        h = a[:, i] * h + b[:, i]
        ref[i] = h
    assert torch.allclose(got, torch.stack(ref, 1), atol=1e-13)


def test_rejects_bad_shapes(scan_inputs):
    x, dt, A, B, C, h0 = scan_inputs(t=4)
    with pytest.raises(ValueError, match="A"):
        selective_scan(x, dt, A[:, :2], B, C, h0)
    with pytest.raises(ValueError, match="dt"):
        selective_scan(x, dt[:, :3], A, B, C, h0)
