"""A chunk's attention over earlier keys and its own, without a mask: equal to softmax attention
with the causal mask (values and every gradient, float64), and nothing of size t x (s + t) made."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from reclaim.models.chunk_attention import chunk_attention


def _inputs(b, h, hkv, s, t, d):
    g = torch.Generator().manual_seed(s * 100 + t)
    return [torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
            for shape in ((b, h, t, d), (b, hkv, s, d), (b, hkv, s, d), (b, hkv, t, d), (b, hkv, t, d))]


def _oracle(q, k0, v0, k, v, scale):
    groups = q.shape[1] // k.shape[1]
    keys = torch.cat([k0, k], 2).repeat_interleave(groups, 1)
    values = torch.cat([v0, v], 2).repeat_interleave(groups, 1)
    s, t = k0.shape[2], k.shape[2]
    allowed = torch.ones(t, s + t, dtype=torch.bool).tril(s)
    scores = (q @ keys.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    return scores.softmax(-1) @ values


@pytest.mark.parametrize("b, h, hkv, s, t, d", [(1, 2, 1, 7, 5, 8), (2, 4, 2, 13, 6, 4), (1, 3, 3, 1, 1, 8),
                                               (2, 4, 1, 30, 10, 16), (1, 2, 2, 0, 4, 8)])
def test_equals_masked_softmax_attention_with_its_gradients(b, h, hkv, s, t, d):
    xs = _inputs(b, h, hkv, s, t, d)
    got, want = chunk_attention(*xs, 0.37), _oracle(*xs, 0.37)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-13)
    g = torch.randn_like(want)
    for a, w in zip(torch.autograd.grad((got * g).sum(), xs, allow_unused=True),
                    torch.autograd.grad((want * g).sum(), xs, allow_unused=True)):
        if w is not None and w.numel():  # s = 0: no earlier keys
            assert ((a - w).abs().max() / w.abs().max()).item() <= 1e-12


class _Largest(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor):
                self.most = max(self.most, o.numel())
        return out


def test_nothing_the_size_of_queries_by_keys_is_made():
    b, h, hkv, s, t, d = 1, 2, 1, 512, 64, 4
    xs = _inputs(b, h, hkv, s, t, d)
    with _Largest() as seen:
        y = chunk_attention(*xs, 0.5)
        y.sum().backward()
    assert seen.most < t * (s + t)  # the mask alone would be t * (s + t) = 36,864 elements
    assert seen.most <= b * h * s * d  # the earlier keys repeated for the query heads: 4,096
