"""Which speculative config to use at a given batch size: a bandit per batch-size bucket (TLT).

The running batch shrinks through a rollout, and the best draft shape shrinks with it: at large
batches verification costs nearly a full step per extra token, in the long tail it is almost
free. Each bucket of batch sizes keeps its own estimate of every arm's reward (accepted tokens
per second, measured on the step it chose) and picks epsilon-greedily (TLT's BEG-MAB) or by UCB1.
Each decision is returned as data and logged by the caller.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

POLICIES = ("epsilon_greedy", "ucb1")


@dataclass
class Decision:
    """One choice: the bucket, the arm and why (explore, exploit, untried)."""

    bucket: int
    arm: int
    reason: str


@dataclass
class _Stats:
    pulls: list[int]
    mean: list[float]


@dataclass
class BucketedBandit:
    """Arms (e.g. SpeculativeConfigs, or None for plain decoding) chosen per batch-size bucket."""

    arms: list[Any]
    buckets: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])  # upper bounds
    policy: str = "epsilon_greedy"
    epsilon: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"bandit policy {self.policy!r} is unknown; allowed: {list(POLICIES)}")
        if not self.arms:
            raise ValueError("a bandit needs at least one arm")
        if not 0 <= self.epsilon <= 1:
            raise ValueError(f"epsilon={self.epsilon}; allowed: 0 to 1")
        if sorted(self.buckets) != self.buckets or not self.buckets or self.buckets[0] < 1:
            raise ValueError(f"buckets={self.buckets}; need ascending batch sizes >= 1")
        self._rng = random.Random(self.seed)
        self._stats = [_Stats([0] * len(self.arms), [0.0] * len(self.arms)) for _ in self.buckets]

    def bucket(self, batch_size: int) -> int:
        """Index of the bucket holding `batch_size` (the last holds everything larger)."""
        return next((i for i, b in enumerate(self.buckets) if batch_size <= b), len(self.buckets) - 1)

    def choose(self, batch_size: int) -> Decision:
        b = self.bucket(batch_size)
        st = self._stats[b]
        untried = [a for a, n in enumerate(st.pulls) if n == 0]
        if untried:
            return Decision(b, untried[0], "untried")
        if self.policy == "ucb1":
            total = sum(st.pulls)
            scale = max(abs(m) for m in st.mean) or 1.0  # rewards are tokens/s, not in [0, 1]
            score = [m + scale * math.sqrt(2 * math.log(total) / n) for m, n in zip(st.mean, st.pulls)]
            return Decision(b, max(range(len(score)), key=score.__getitem__), "ucb1")
        if self._rng.random() < self.epsilon:
            return Decision(b, self._rng.randrange(len(self.arms)), "explore")
        return Decision(b, max(range(len(st.mean)), key=st.mean.__getitem__), "exploit")

    def update(self, decision: Decision, reward: float) -> None:
        """Fold the reward the chosen arm earned into its bucket's running mean."""
        st = self._stats[decision.bucket]
        st.pulls[decision.arm] += 1
        st.mean[decision.arm] += (reward - st.mean[decision.arm]) / st.pulls[decision.arm]

    def best(self, batch_size: int) -> int:
        """The arm with the best mean so far in `batch_size`'s bucket."""
        st = self._stats[self.bucket(batch_size)]
        return max(range(len(st.mean)), key=st.mean.__getitem__)

    def state_dict(self) -> dict[str, Any]:
        return {"pulls": [s.pulls for s in self._stats], "mean": [s.mean for s in self._stats],
                "rng": self._rng.getstate()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._stats = [_Stats(list(p), list(m)) for p, m in zip(state["pulls"], state["mean"])]
        rng = state["rng"]
        self._rng.setstate((rng[0], tuple(rng[1]), rng[2]))
