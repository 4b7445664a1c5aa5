"""Per-key rate limits (a token bucket per API key, or per client address without keys).

    limit = RateLimiter(per_minute=120)
    wait = limit.take("key-3f2a...")     # 0.0: allowed (a token taken); else seconds to wait
"""

from __future__ import annotations

import threading
import time
from typing import Callable

MAX_BUCKETS = 10_000  # beyond this many callers, full buckets (idle callers) are forgotten


class RateLimiter:
    """`per_minute` requests a minute per key, in bursts of up to `burst` (default: a minute's)."""

    def __init__(self, per_minute: float, burst: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not per_minute > 0:
            raise ValueError(f"rate limit {per_minute} a minute; allowed: > 0")
        self.rate = per_minute / 60.0
        self.burst = float(burst if burst is not None else max(1, int(per_minute)))
        if self.burst < 1:
            raise ValueError(f"burst={burst}; allowed: >= 1")
        self.clock = clock
        self.buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, when)
        self.lock = threading.Lock()
        self.refused = 0

    def take(self, key: str) -> float:
        """Take a token for `key`: 0.0 if allowed, else the seconds until one is free."""
        now = self.clock()
        with self.lock:
            tokens, when = self.buckets.get(key, (self.burst, now))
            tokens = min(self.burst, tokens + (now - when) * self.rate)
            if tokens >= 1:
                self.buckets[key] = (tokens - 1, now)
                if len(self.buckets) > MAX_BUCKETS:
                    self._forget_full(now)
                return 0.0
            self.buckets[key] = (tokens, now)
            self.refused += 1
            return (1 - tokens) / self.rate

    def _forget_full(self, now: float) -> None:
        for key, (tokens, when) in list(self.buckets.items()):
            if tokens + (now - when) * self.rate >= self.burst:
                del self.buckets[key]
