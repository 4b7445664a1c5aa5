"""Mamba-1 selective scan with an initial state in and the final state out, in plain PyTorch.

h_t = exp(dt_t A) * h_{t-1} + (dt_t x_t) B_t,  y_t = h_t C_t  (per channel d, state n).

The forward keeps only the state at the start of each time block; the backward (hand written,
one reverse scan for the state adjoint mu_t = dL/dh_t) recomputes one block at a time, so memory
is O(T (D + N)) plus one block's O(block D N). Inside a block the recurrence runs as a two-level
scan: sequential over sub-chunk offsets, vectorised over sub-chunks, with a short pass between that
carries sub-chunk start states. Every decay factor is a product of exp(dt A) <= 1, so nothing can overflow.

An optional `Window` truncates the adjoint to the last W state transitions (see `Window`).
"""

from __future__ import annotations

import math

import torch

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


def _min_log_decay(dtype: torch.dtype) -> float:
    """A log-decay floor whose exp stays a normal number of `dtype` (e times its smallest one)."""
    return math.log(torch.finfo(dtype).tiny) + 1.0


def _discretize(x, dt, A, B):
    """Per-token decay a = exp(dt A) and input b = (dt x) B, both [B, L, D, N]."""
    a = torch.exp(dt[..., None] * A)
    b = (dt * x)[..., None] * B[:, :, None, :]
    return a, b


class Window:
    """Adjoint truncation state for one layer: keep only the last `size` transitions per output.

    With the exact adjoint mu, the truncated one is mu_W(i) = mu(i) - (prod_{j=i+1}^{i+W} a_j) *
    mu(i+W): the gradient that reaches h_i only from outputs t < i + W. It is used for the
    parameter and input gradients; the carry to earlier tokens stays exact (mu_W needs exact mu).
    Backward walks time in reverse, so this object keeps the exact mu of the W tokens after the
    current segment; reuse one Window per layer across that layer's chunks, last chunk first.
    Decays come from R, a running sum of dt in float64 (log prod a over (i, j] = A (R_j - R_i)).
    """

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"window size must be >= 1, got {size}")
        self.size = size
        self.segments: list[tuple[torch.Tensor, torch.Tensor]] = []  # (mu, R), nearest first
        self.r_before: torch.Tensor | None = None  # R at the token before the last segment seen

    def truncate(self, mu: torch.Tensor, dt: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
        """mu_W for a segment: exact mu [B, L, D, N], dt [B, L, D], A [D, N]; then remember it."""
        w, n = self.size, mu.shape[1]
        c = torch.cumsum(dt.double(), 1)
        r_end = self.r_before if self.r_before is not None else c.new_zeros(c[:, -1].shape)
        r = r_end[:, None] - (c[:, -1:] - c)  # R_t = R_end - sum of dt over (t, end]
        self.r_before = r_end - c[:, -1]
        self.segments.insert(0, (mu, r))
        out = mu
        available = sum(m.shape[1] for m, _ in self.segments)
        k = min(n, available - w)  # tokens i of this segment whose partner i + W is known
        if k > 0:
            mu_far, r_far = self._take(w, w + k)
            # Decays near or below the smallest normal float are raised to e times it: exp with a
            # subnormal result runs ~35x slower on a CPU (measured), and the term is far below
            # rounding either way.
            log_decay = ((r_far - r[:, :k]).to(mu.dtype)[..., None] * A).clamp_min_(
                _min_log_decay(mu.dtype))
            decay = torch.exp(log_decay)
            out = mu.clone()
            out[:, :k] -= decay * mu_far
        # Only the W tokens after the next (earlier) segment can still be partners.
        kept, size = [], 0
        for seg in self.segments:
            if size >= w:
                break
            kept.append(seg)
            size += seg[0].shape[1]
        self.segments = kept
        return out

    def handoff(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(mu, R, R before) of the `size` buffered tokens nearest the last segment seen: all a
        Window over the tokens before it needs (the time-sharded backward sends it back a rank)."""
        n = min(self.size, sum(m.shape[1] for m, _ in self.segments))
        mu, r = self._take(0, n)
        return mu, r, self.r_before

    @classmethod
    def resume(cls, size: int, mu: torch.Tensor, r: torch.Tensor, r_before: torch.Tensor) -> "Window":
        """A Window that continues another's backward from that one's `handoff()`."""
        w = cls(size)
        w.segments, w.r_before = [(mu, r)], r_before
        return w

    def _take(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(mu, R) of buffered tokens lo..hi-1, counted from the current segment's start."""
        mus, rs, off = [], [], 0
        for m, r in self.segments:
            a, b = max(lo, off), min(hi, off + m.shape[1])
            if a < b:
                mus.append(m[:, a - off : b - off])
                rs.append(r[:, a - off : b - off])
            off += m.shape[1]
        return torch.cat(mus, 1), torch.cat(rs, 1)


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
    def forward(ctx, x, dt, A, B, C, h0, window):
        blk = _block_len(x, A.shape[1])
        y, states = _scan_forward(x, dt, A, B, C, h0, blk)
        ctx.save_for_backward(x, dt, A, B, C, *states)
        ctx.blk, ctx.window = blk, window
        return y, states[-1]

    @staticmethod
    def backward(ctx, gy, ghT):
        x, dt, A, B, C, *states = ctx.saved_tensors
        blk, window = ctx.blk, ctx.window
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
            if window is not None:
                mu = window.truncate(mu, dts, A)
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
    window: Window | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Selective scan from state h0; returns (y [B, T, D], final state [B, D, N]).

    x, dt: [B, T, D] (dt already softplus-ed); A: [D, N]; B, C: [B, T, N]; h0: [B, D, N] or None
    (zeros). Computes in float32 at least; differentiable (first order) in every input.
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
    return SelectiveScan.apply(x, dt, A, B, C, h0.to(dtype), window)


def selective_scan_ref(x, dt, A, B, C, h0=None):
    """Reference: the recurrence one token at a time (slow; for tests)."""
    h = h0 if h0 is not None else x.new_zeros(x.shape[0], x.shape[2], A.shape[1])
    ys = []
    for t in range(x.shape[1]):
        h = torch.exp(dt[:, t, :, None] * A) * h + (dt[:, t] * x[:, t])[..., None] * B[:, t, None, :]
        ys.append((h * C[:, t, None, :]).sum(-1))
    return torch.stack(ys, 1), h
