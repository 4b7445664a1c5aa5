"""Mamba-2 scan (state-space duality, SSD) with an initial state in and the final state out.

Per head h (one decay per head, a_t = exp(dt_t A_h)), with B and C shared by the heads of a group:
h_t = a_t h_{t-1} + dt_t x_t B_t^T  (state [head_dim, state]),  y_t = h_t C_t.

The forward is the chunked SSD form: inside a block of tokens, the quadratic ("attention-like")
product (C_t . B_s) * prod_{s<j<=t} a_j; across blocks, the [heads, head_dim, state] state carried
from one block to the next. It is plain differentiable PyTorch, so autograd gives the exact
gradient, including the final state's adjoint flowing back to the initial state.

With an `adjoint` hook the backward is hand written instead (one reverse scan per block for the
state adjoint mu_t = dL/dh_t): the hook rewrites each block's mu before the parameter and input
gradients are taken from it; the carry to earlier tokens stays exact. Training engines use it to
truncate the adjoint to a window (`reclaim.ssm.window`); the kernel knows nothing of them.
"""

from __future__ import annotations

import torch

from reclaim.models.kernels.scan import AdjointHook, linear_scan

# The chunked forward's block: its quadratic part grows with the block squared, its Python loop
# with the number of blocks. The hand-written backward materialises h and mu for a whole block,
# so its block is cut to about this many elements (batch x block x heads x head_dim x state).
CPU_MAX_BLOCK, GPU_MAX_BLOCK = 64, 256
BLOCK_ELEMENTS, GPU_BLOCK_ELEMENTS = 1 << 19, 1 << 25
MIN_BACKWARD_BLOCK = 16


def _block_len(x: torch.Tensor, n_state: int, hand_written: bool = False) -> int:
    """Tokens per block of the forward, or of the hand-written backward (bounded memory)."""
    cpu = x.device.type == "cpu"
    cap = CPU_MAX_BLOCK if cpu else GPU_MAX_BLOCK
    if not hand_written:
        return cap
    bs, _, heads, head_dim = x.shape
    budget = BLOCK_ELEMENTS if cpu else GPU_BLOCK_ELEMENTS
    return max(MIN_BACKWARD_BLOCK, min(cap, budget // max(1, bs * heads * head_dim * n_state)))


def _segsum(la: torch.Tensor) -> torch.Tensor:
    """S[..., t, s] = sum of la[..., j] over s < j <= t (la [..., L]); -inf above the diagonal.

    Summed by a masked cumsum, not as a difference of cumsums, so no cancellation error.
    """
    n = la.shape[-1]
    strict = torch.ones(n, n, dtype=torch.bool, device=la.device).tril(-1)
    s = la[..., :, None].expand(*la.shape, n).masked_fill(~strict, 0).cumsum(-2)
    return s.masked_fill(~torch.ones_like(strict).tril(), float("-inf"))


def _grouped(x, dt, A, groups):
    """Split the head axis into (group, head in group): x [b,L,G,R,P], dt [b,L,G,R], A [G,R]."""
    b, n, heads, p = x.shape
    r = heads // groups
    return x.view(b, n, groups, r, p), dt.view(b, n, groups, r), A.view(groups, r)


def ssd_block(x, dt, A, B, C, h):
    """One block of the chunked form: (y [b,L,H,P], end state [b,H,P,N]) from start state h.

    x [b,L,H,P], dt [b,L,H], A [H], B and C [b,L,G,N], h [b,H,P,N].
    """
    b, n, heads, p = x.shape
    g = B.shape[2]
    x, dt, A = _grouped(x, dt, A, g)
    h = h.view(b, g, heads // g, p, -1)
    la = (dt * A).permute(0, 2, 3, 1)  # log decays [b, G, R, L]
    seg = _segsum(la)  # [b, G, R, L(t), L(s)]
    xdt = x * dt[..., None]
    scores = torch.einsum("btgn,bsgn->bgts", C, B)
    y = torch.einsum("bgrts,bsgrp->btgrp", scores[:, :, None] * torch.exp(seg), xdt)
    from_start = torch.exp(la.cumsum(-1)).permute(0, 3, 1, 2)[..., None]  # [b, L, G, R, 1]
    y = y + torch.einsum("btgn,bgrpn->btgrp", C, h) * from_start
    to_end = torch.exp(seg[..., -1, :])  # decay from each token to the block's end [b, G, R, L]
    h = from_start[:, -1, ..., None] * h + torch.einsum("bgrs,bsgn,bsgrp->bgrpn", to_end, B, xdt)
    return y.reshape(b, n, heads, p), h.reshape(b, heads, p, -1)


def _ssd_forward(x, dt, A, B, C, h0, blk):
    """y [b,T,H,P] and the state at the start of every block (last entry: the final state)."""
    ys, states = [], [h0]
    h = h0
    for s in range(0, x.shape[1], blk):
        e = min(x.shape[1], s + blk)
        y, h = ssd_block(x[:, s:e], dt[:, s:e], A, B[:, s:e], C[:, s:e], h)
        ys.append(y)
        states.append(h)
    return torch.cat(ys, 1), states


def _heads(v: torch.Tensor, heads: int) -> torch.Tensor:
    """Group-shared [b, L, G, N] -> per head [b, L, H, N]."""
    return v.repeat_interleave(heads // v.shape[2], dim=2)


def _groups(v: torch.Tensor, groups: int) -> torch.Tensor:
    """Per-head gradient [b, L, H, N] -> summed over each group's heads [b, L, G, N]."""
    b, n, heads, d = v.shape
    return v.view(b, n, groups, heads // groups, d).sum(3)


class SSDScan(torch.autograd.Function):
    """SSD with a hand-written backward that exposes each block's state adjoint to a hook."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, h0, adjoint):
        blk = _block_len(x, B.shape[-1], hand_written=True)
        y, states = _ssd_forward(x, dt, A, B, C, h0, blk)
        ctx.save_for_backward(x, dt, A, B, C, *states)
        ctx.blk, ctx.adjoint = blk, adjoint
        return y, states[-1]

    @staticmethod
    def backward(ctx, gy, ghT):
        x, dt, A, B, C, *states = ctx.saved_tensors
        blk, adjoint = ctx.blk, ctx.adjoint
        t, heads, groups = x.shape[1], x.shape[2], B.shape[2]
        gx, gdt, gB, gC = (torch.zeros_like(v) for v in (x, dt, B, C))
        gA = torch.zeros_like(A)
        gy = torch.zeros_like(x) if gy is None else gy
        carry = torch.zeros_like(states[-1]) if ghT is None else ghT
        starts = list(range(0, t, blk))
        for i in reversed(range(len(starts))):
            s, e = starts[i], min(t, starts[i] + blk)
            xs, dts, g = x[:, s:e], dt[:, s:e], gy[:, s:e]
            Bs, Cs = _heads(B[:, s:e], heads), _heads(C[:, s:e], heads)
            a = torch.exp(dts * A)  # [b, L, H]
            b_in = (dts[..., None] * xs)[..., None] * Bs[:, :, :, None, :]  # [b, L, H, P, N]
            hs = linear_scan(a[..., None, None].expand_as(b_in), b_in, states[i])
            gC[:, s:e] = _groups(torch.einsum("blhp,blhpn->blhn", g, hs), groups)
            # mu_t = g_t C_t^T + a_{t+1} mu_{t+1}, seeded with the carry: a reverse linear scan.
            inj = g[..., None] * Cs[:, :, :, None, :]
            a_next = torch.cat([a[:, 1:], torch.ones_like(a[:, :1])], 1)
            mu = linear_scan(a_next[..., None, None].expand_as(inj), inj, carry, reverse=True)
            carry = a[:, 0, :, None, None] * mu[:, 0]
            if adjoint is not None:
                mu = adjoint(mu.flatten(3), dts, A[:, None]).view_as(mu)
            # dL/d(dt A) = <mu_t, a_t h_{t-1}>, and a_t h_{t-1} = h_t - b_t.
            q = (hs - b_in).mul_(mu).sum((-2, -1))  # [b, L, H]
            mu_b = torch.einsum("blhpn,blhn->blhp", mu, Bs)
            gdt[:, s:e] = q * A + (xs * mu_b).sum(-1)
            gx[:, s:e] = dts[..., None] * mu_b
            gB[:, s:e] = _groups(torch.einsum("blhp,blhpn->blhn", dts[..., None] * xs, mu), groups)
            gA += (q * dts).sum((0, 1))
        return gx, gdt, gA, gB, gC, carry, None


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    h0: torch.Tensor | None = None,
    *,
    adjoint: AdjointHook | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SSD scan from state h0; returns (y [b, T, H, P], final state [b, H, P, N]).

    x [b, T, H, P]; dt [b, T, H] (bias, softplus and limits applied); A [H] (negative); B, C
    [b, T, G, N] with G dividing H; h0 [b, H, P, N] or None (zeros). Computes in float32 at least.
    adjoint: a backward hook on the state adjoint, called as adjoint(mu [b, L, H, P*N], dt
    [b, L, H], A [H, 1]) block by block, last block first; None is exact (plain autograd).
    """
    b, t, heads, p = x.shape
    if dt.shape != (b, t, heads) or A.shape != (heads,):
        raise ValueError(f"shape mismatch: x {tuple(x.shape)}, dt {tuple(dt.shape)}, A {tuple(A.shape)}; "
                         "expected dt [b, T, H] and A [H]")
    if B.shape != C.shape or B.ndim != 4 or B.shape[:2] != (b, t):
        raise ValueError(f"shape mismatch: B {tuple(B.shape)}, C {tuple(C.shape)}; expected [b, T, G, N]")
    if heads % B.shape[2]:
        raise ValueError(f"the head count ({heads}) must be divisible by the group count ({B.shape[2]})")
    dtype = torch.promote_types(x.dtype, torch.float32)
    x, dt, A, B, C = (v.to(dtype) for v in (x, dt, A, B, C))
    h0 = x.new_zeros(b, heads, p, B.shape[3]) if h0 is None else h0.to(dtype)
    if adjoint is not None:
        return SSDScan.apply(x, dt, A, B, C, h0, adjoint)
    y, states = _ssd_forward(x, dt, A, B, C, h0, _block_len(x, B.shape[-1]))
    return y, states[-1]


def ssd_scan_ref(x, dt, A, B, C, h0=None):
    """Reference: the recurrence one token at a time (slow; for tests)."""
    b, t, heads, p = x.shape
    Bh, Ch = _heads(B, heads), _heads(C, heads)
    h = h0 if h0 is not None else x.new_zeros(b, heads, p, B.shape[3])
    ys = []
    for i in range(t):
        a = torch.exp(dt[:, i] * A)[..., None, None]
        h = a * h + (dt[:, i, :, None] * x[:, i])[..., None] * Bh[:, i, :, None, :]
        ys.append((h * Ch[:, i, :, None, :]).sum(-1))
    return torch.stack(ys, 1), h
