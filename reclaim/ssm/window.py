"""The truncated adjoint: each output back-propagates through at most W state transitions per layer.

Applied from outside the model: `scan_for(window, kernel)` is a layer family's scan (Mamba-1's
selective scan, Mamba-2's SSD) whose backward hook (`kernel(..., adjoint=...)`) truncates the state
adjoint; the ssm engine passes it to a layer's `forward_chunk(..., scan=...)`. The model and the
kernel know nothing about windows. A Mamba-2 layer has one decay per head: its hook sees mu as
[B, L, heads, head_dim * state] and A as [heads, 1], which the same formula broadcasts over.
"""

from __future__ import annotations

import functools
import math

import torch

from reclaim.models.kernels.scan import ScanFn, selective_scan


def _min_log_decay(dtype: torch.dtype) -> float:
    """A log-decay floor whose exp stays a normal number of `dtype` (e times its smallest one)."""
    return math.log(torch.finfo(dtype).tiny) + 1.0


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
        """mu_W for a segment: exact mu [B, L, D, N], dt [B, L, D], A [D, N] (or [D, 1] for one
        decay per D); then remember it."""
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


def scan_for(window: Window | None, kernel: ScanFn = selective_scan) -> ScanFn:
    """The scan a layer runs under this window: `kernel` (its family's scan) as is when window is
    None, else with the window's truncation as its adjoint hook."""
    return kernel if window is None else functools.partial(kernel, adjoint=window.truncate)
