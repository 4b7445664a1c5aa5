"""Truncated adjoint: the scan under a Window equals backprop through the last W transitions."""

import pytest
import torch

from reclaim.models.kernels import scan
from reclaim.models.kernels.scan import selective_scan, selective_scan_ref
from reclaim.ssm.window import Window, scan_for

pytestmark = pytest.mark.usefixtures("one_thread")


def grads(outs, ins, cots):
    return torch.autograd.grad(outs, ins, cots, allow_unused=True)


def truncated_oracle(ins, gy, w):
    """Each output y_t back-propagates through only the last w transitions: h_{t-w} is detached."""
    x, dt, A, B, C, h0 = ins
    with torch.no_grad():
        _, hs = zip(*(selective_scan_ref(x[:, :s], dt[:, :s], A, B[:, :s], C[:, :s], h0)
                      for s in range(1, x.shape[1] + 1)))
    total = 0
    for t in range(x.shape[1]):
        s = max(0, t + 1 - w)
        start = h0 if s == 0 else hs[s - 1].detach()
        y, _ = selective_scan_ref(x[:, s:t + 1], dt[:, s:t + 1], A, B[:, s:t + 1], C[:, s:t + 1], start)
        total = total + (y[:, -1] * gy[:, t]).sum()
    return grads([total], ins[:5], None)


@pytest.mark.parametrize("w", [1, 3, 7])
@pytest.mark.parametrize("block_elements", [1 << 21, 60])
def test_truncated_adjoint_equals_windowed_backprop(scan_inputs, w, block_elements, monkeypatch):
    monkeypatch.setattr(scan, "BLOCK_ELEMENTS", block_elements)
    ins = scan_inputs(t=37)
    y, _ = scan_for(Window(w))(*ins)
    gy = torch.randn_like(y)
    got = grads([y], ins[:5], [gy])
    for g, r in zip(got, truncated_oracle(ins, gy, w)):
        assert (g - r).abs().max() <= 1e-11 * r.abs().max()


def test_window_covering_the_sequence_is_exact(scan_inputs):
    ins = scan_inputs(t=21)
    y, h = scan_for(Window(21))(*ins)
    yr, hr = selective_scan(*ins)
    gy, gh = torch.randn_like(y), torch.randn_like(h)
    for g, r in zip(grads([y, h], ins, [gy, gh]), grads([yr, hr], ins, [gy, gh])):
        assert (g - r).abs().max() <= 1e-13 * max(1.0, r.abs().max().item())


def test_rejects_empty_window():
    with pytest.raises(ValueError, match="window"):
        Window(0)
