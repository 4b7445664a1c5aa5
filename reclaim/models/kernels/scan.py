"""Mamba-1 selective scan with an initial state in and the final state out, in plain PyTorch.

h_t = exp(dt_t A) * h_{t-1} + (dt_t x_t) B_t,  y_t = h_t C_t  (per channel d, state n).

The forward keeps only the state at the start of each time block; the backward (hand written,
one reverse scan for the state adjoint mu_t = dL/dh_t) recomputes one block at a time, so memory
is O(T (D + N)) plus one block's O(block D N). Inside a block the recurrence runs as a two-level
scan: sequential over sub-chunk offsets, vectorised over sub-chunks, with a short pass between that
carries sub-chunk start states. Every decay factor is a product of exp(dt A) <= 1, so nothing can overflow.

The backward takes an optional `adjoint` hook: a function that rewrites each block's state adjoint
before the parameter and input gradients are taken from it (the carry to earlier tokens stays
exact). Training engines use it, e.g. to truncate the adjoint to a window (`reclaim.ssm.window`);
the kernel itself knows nothing of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

# adjoint(mu [B, L, D, N], dt [B, L, D], A [D, N]) -> mu', called block by block, last block first.
AdjointHook = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# What a model calls: scan(x, dt, A, B, C, h0) -> (y, final state), e.g. `selective_scan`.
ScanFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]

# Elements (batch x block x D x N) of one time block. On a CPU, blocks of ~64-128 tokens of a
# small model (measured) balance Python overhead against cache misses; on a GPU, kernel launches
# dominate, so blocks are made much longer.
BLOCK_ELEMENTS = 1 << 19
GPU_BLOCK_ELEMENTS = 1 << 25


def linear_scan(a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor, reverse: bool = False) -> torch.Tensor:
    """All states of h_t = a_t * h_{t-1} + b_t along dim 1 (a, b [B, L, ...], h0 [B, ...]).

    reverse: run from the end instead, h_t = a_t * h_{t+1} + b_t with h0 entering after the end.
    """
    bs, n = a.shape[:2]
    rest = a.shape[2:]
    s = max(1, math.isqrt(n))
    m = -(-n // s)
    pad = m * s - n
    if pad:  # a = 1, b = 0 pass the state through unchanged, in either direction
        a = torch.cat([a, a.new_ones(bs, pad, *rest)], 1)
        b = torch.cat([b, b.new_zeros(bs, pad, *rest)], 1)
    a = a.reshape(bs, m, s, *rest)
    b = b.reshape(bs, m, s, *rest)
    steps = list(reversed(range(s))) if reverse else list(range(s))
    subs = reversed(range(m)) if reverse else range(m)
    # Pass 1: each sub-chunk's end state from zero and its total decay, all sub-chunks at once.
    h, p = b[:, :, steps[0]], a[:, :, steps[0]]
    for i in steps[1:]:
        h = torch.addcmul(b[:, :, i], a[:, :, i], h)
        p = p * a[:, :, i]
    # Carry the true start state of each sub-chunk across the m sub-chunks.
    starts = torch.empty_like(h)
    carry = h0
    for j in subs:
        starts[:, j] = carry
        carry = torch.addcmul(h[:, j], p[:, j], carry)
    # Pass 2: rerun every sub-chunk from its true start, keeping all states.
    out = torch.empty_like(b)
    h = starts
    for i in steps:
        h = torch.addcmul(b[:, :, i], a[:, :, i], h)
        out[:, :, i] = h
    return out.reshape(bs, m * s, *rest)[:, :n]


def _block_len(x: torch.Tensor, n_state: int) -> int:
    bs, _, d = x.shape
    budget = BLOCK_ELEMENTS if x.device.type == "cpu" else GPU_BLOCK_ELEMENTS
    return max(16, budget // max(1, bs * d * n_state))


def _discretize(x, dt, A, B):
    """Per-token decay a = exp(dt A) and input b = (dt x) B, both [B, L, D, N]."""
    a = torch.exp(dt[..., None] * A)
    b = (dt * x)[..., None] * B[:, :, None, :]
    return a, b


def _scan_forward(x, dt, A, B, C, h0, blk):
    """y [B, T, D] and the state at the start of every block (last entry: final state)."""
    t = x.shape[1]
    ys, states = [], [h0]
    h = h0
    for s in range(0, t, blk):
        e = min(t, s + blk)
        a, b = _discretize(x[:, s:e], dt[:, s:e], A, B[:, s:e])
        hs = linear_scan(a, b, h)
        ys.append((hs * C[:, s:e, None, :]).sum(-1))
        h = hs[:, -1].clone()  # not a view: it would keep the whole block alive
        states.append(h)
    return torch.cat(ys, 1), states


class SelectiveScan(torch.autograd.Function):
    """Autograd wrapper: saves inputs and block-start states; backward recomputes per block."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, h0, adjoint):
        blk = _block_len(x, A.shape[1])
        y, states = _scan_forward(x, dt, A, B, C, h0, blk)
        ctx.save_for_backward(x, dt, A, B, C, *states)
        ctx.blk, ctx.adjoint = blk, adjoint
        return y, states[-1]

    @staticmethod
    def backward(ctx, gy, ghT):
        x, dt, A, B, C, *states = ctx.saved_tensors
        blk, adjoint = ctx.blk, ctx.adjoint
        t = x.shape[1]
        gx, gdt, gB, gC = (torch.zeros_like(v) for v in (x, dt, B, C))
        gA = torch.zeros_like(A)
        if gy is None:
            gy = torch.zeros_like(x)
        carry = ghT if ghT is not None else torch.zeros_like(states[-1])
        starts = list(range(0, t, blk))
        for i in reversed(range(len(starts))):
            s = starts[i]
            e = min(t, s + blk)
            xs, dts, Bs, Cs, g = x[:, s:e], dt[:, s:e], B[:, s:e], C[:, s:e], gy[:, s:e]
            a, b = _discretize(xs, dts, A, Bs)
            hs = linear_scan(a, b, states[i])
            # Sums over D as [1, D] @ [D, N] products per token (3x faster than multiply-and-sum
            # here, measured); sums over the 16-wide N stay elementwise (faster that way).
            gC[:, s:e] = torch.matmul(g[:, :, None, :], hs).squeeze(-2)
            # mu_t = g_t C_t + a_{t+1} mu_{t+1}, seeded with the carry: a reverse linear scan.
            inj = g[..., None] * Cs[:, :, None, :]
            a_next = torch.cat([a[:, 1:], torch.ones_like(a[:, :1])], 1)
            mu = linear_scan(a_next, inj, carry, reverse=True)
            carry = a[:, 0] * mu[:, 0]
            if adjoint is not None:
                mu = adjoint(mu, dts, A)
            # dL/d(dt A) = mu * a * h_prev, and a_t h_{t-1} = h_t - b_t: no shifted copy of hs.
            q = hs.sub_(b).mul_(mu)
            mu_b = (mu * Bs[:, :, None, :]).sum(-1)
            gdt[:, s:e] = (q * A).sum(-1) + xs * mu_b
            gx[:, s:e] = dts * mu_b
            gB[:, s:e] = torch.matmul((dts * xs)[:, :, None, :], mu).squeeze(-2)
            gA += (q * dts[..., None]).sum((0, 1))
        return gx, gdt, gA, gB, gC, carry, None


def selective_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    h0: torch.Tensor | None = None,
    *,
    adjoint: AdjointHook | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Selective scan from state h0; returns (y [B, T, D], final state [B, D, N]).

    x, dt: [B, T, D] (dt already softplus-ed); A: [D, N]; B, C: [B, T, N]; h0: [B, D, N] or None
    (zeros). Computes in float32 at least; differentiable (first order) in every input.
    adjoint: a backward hook on the state adjoint (see the module docstring); None is exact.
    """
    if x.ndim != 3 or dt.shape != x.shape:
        raise ValueError(f"x and dt must be [B, T, D] and equal; got {x.shape} and {dt.shape}")
    if B.shape != C.shape or B.shape[:2] != x.shape[:2] or A.shape != (x.shape[2], B.shape[2]):
        raise ValueError(
            f"shape mismatch: x {tuple(x.shape)}, A {tuple(A.shape)}, B {tuple(B.shape)}, "
            f"C {tuple(C.shape)}; expected A [D, N], B and C [B, T, N]"
        )
    dtype = torch.promote_types(x.dtype, torch.float32)
    x, dt, A, B, C = (v.to(dtype) for v in (x, dt, A, B, C))
    if h0 is None:
        h0 = x.new_zeros(x.shape[0], x.shape[2], A.shape[1])
    return SelectiveScan.apply(x, dt, A, B, C, h0.to(dtype), adjoint)


def selective_scan_ref(x, dt, A, B, C, h0=None):
    """Reference: the recurrence one token at a time (slow; for tests)."""
    h = h0 if h0 is not None else x.new_zeros(x.shape[0], x.shape[2], A.shape[1])
    ys = []
    for t in range(x.shape[1]):
        h = torch.exp(dt[:, t, :, None] * A) * h + (dt[:, t] * x[:, t])[..., None] * B[:, t, None, :]
        ys.append((h * C[:, t, None, :]).sum(-1))
    return torch.stack(ys, 1), h
