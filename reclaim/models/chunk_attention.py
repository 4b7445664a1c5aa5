"""Attention of a chunk's queries over every earlier key and, causally, its own, with no mask.

A chunk of t queries at positions s .. s + t - 1 sees all s earlier keys and its own keys up to
itself. SDPA with a [t, s + t] boolean mask takes about 3 bytes per (query, key) pair on a CPU, which
grows with the context (0.40 GiB at 64K for a small hybrid under the adjoint). Here the two parts
run as two fused attentions, earlier keys unmasked and own keys causal, merged by their
log-sum-exps (as ring attention merges blocks); the backward runs each part's fused backward
against the merged output and log-sum-exp, which gives each part's exact share of the gradient.
Nothing of size t x (s + t) is kept. CPU only (PyTorch's fused CPU kernel returns the log-sum-exp);
elsewhere the mask path runs.
"""

from __future__ import annotations

import torch

_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Key or value heads [B, Hkv, T, D] repeated for `groups` query heads each."""
    return x if groups == 1 else x.repeat_interleave(groups, 1)


def _fold(g: torch.Tensor, groups: int) -> torch.Tensor:
    """A gradient of repeated heads summed back onto the key or value heads."""
    if groups == 1:
        return g
    b, h, t, d = g.shape
    return g.view(b, h // groups, groups, t, d).sum(2)


class _EarlierAndCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k0, v0, k, v, scale):  # type: ignore[override]
        groups = q.shape[1] // k.shape[1]
        out0, lse0 = _forward(q, _heads(k0, groups), _heads(v0, groups), 0.0, False, scale=scale)
        out1, lse1 = _forward(q, _heads(k, groups), _heads(v, groups), 0.0, True, scale=scale)
        lse = torch.logaddexp(lse0, lse1)
        out = out0 * (lse0 - lse).exp().unsqueeze(-1) + out1 * (lse1 - lse).exp().unsqueeze(-1)
        ctx.save_for_backward(q, k0, v0, k, v, out, lse)
        ctx.scale, ctx.groups = scale, groups
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        q, k0, v0, k, v, out, lse = ctx.saved_tensors
        g, scale = ctx.groups, ctx.scale
        grad = grad.contiguous()
        dq0, dk0, dv0 = _backward(grad, q, _heads(k0, g), _heads(v0, g), out, lse, 0.0, False, scale=scale)
        dq1, dk1, dv1 = _backward(grad, q, _heads(k, g), _heads(v, g), out, lse, 0.0, True, scale=scale)
        return dq0 + dq1, _fold(dk0, g), _fold(dv0, g), _fold(dk1, g), _fold(dv1, g), None


def chunk_attention(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Queries q [B, H, t, D] over earlier keys/values k0, v0 [B, Hkv, s, D] (all seen) and the
    chunk's own k, v [B, Hkv, t, D] (causally); H a multiple of Hkv. On a CPU with s > 0 no mask is
    built; otherwise SDPA with the [t, s + t] mask."""
    s, t = k0.shape[2], k.shape[2]
    if s and q.device.type == "cpu":
        return _EarlierAndCausal.apply(q.contiguous(), k0.contiguous(), v0.contiguous(), k.contiguous(),
                                       v.contiguous(), scale)
    k1, v1 = torch.cat([k0, k], 2), torch.cat([v0, v], 2)
    mask = None if s == 0 else torch.ones(t, s + t, dtype=torch.bool, device=q.device).tril(s)
    return torch.nn.functional.scaled_dot_product_attention(q, k1, v1, attn_mask=mask, is_causal=s == 0,
                                                            scale=scale, enable_gqa=q.shape[1] != k.shape[1])
