"""Adaptive rollouts (TLT): plain decoding while the batch is large, speculation in the long tail,
with the speculative config picked per step by a bandit over batch-size buckets.

`AdaptiveRollout.generate` drives the engine one step at a time. While more than `threshold`
sequences are in flight it decodes plainly; below, it asks the bandit for an arm (a
SpeculativeConfig or None) for the current batch size, runs the step and pays the arm the tokens
committed per second of that step. Speculation is lossless, so the outputs are those of plain
decoding (greedy: identical; sampled: identically distributed). Each decision is logged.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from reclaim.engine.engine import Engine
from reclaim.engine.request import RequestOutput, SamplingParams
from reclaim.rl.bandit import BucketedBandit


@dataclass
class RolloutStats:
    """What one rollout cost and how the tail went."""

    tokens: int = 0
    seconds: float = 0.0
    tail_tokens: int = 0  # produced while at most `threshold` sequences were in flight
    tail_seconds: float = 0.0
    steps: int = 0
    decisions: list[dict[str, Any]] = field(default_factory=list)
    spec: dict[str, float] = field(default_factory=dict)  # the engine's drafted/accepted/verifies

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tokens_per_s"] = self.tokens_per_s
        d["tail_tokens_per_s"] = self.tail_tokens / self.tail_seconds if self.tail_seconds else 0.0
        return d


class AdaptiveRollout:
    """Generates with an engine, choosing speculation per step (None bandit: never speculates)."""

    def __init__(self, bandit: BucketedBandit | None, threshold: int = 4,
                 log: Callable[[dict[str, Any]], None] | None = None) -> None:
        if threshold < 0:
            raise ValueError(f"threshold={threshold}; allowed: >= 0 sequences")
        self.bandit, self.threshold, self.log = bandit, threshold, log

    def generate(self, engine: Engine, prompts: list[list[int]],
                 params: list[SamplingParams]) -> tuple[list[RequestOutput], RolloutStats]:
        """Run every prompt to completion; outputs in order and the rollout's stats."""
        stats = RolloutStats()
        before = dict(engine.spec_stats)
        ids = [engine.add_request(None, p, sp) for p, sp in zip(prompts, params)]
        final: dict[str, RequestOutput] = {}
        start = time.perf_counter()
        while len(final) < len(ids):
            sched = engine.scheduler
            in_flight = min(len(sched.running) + len(sched.waiting) + len(engine._inbox), sched.max_num_seqs)
            decision = None
            if self.bandit is not None and in_flight <= self.threshold:
                decision = self.bandit.choose(in_flight)
                engine.set_speculative(self.bandit.arms[decision.arm])
            else:
                engine.set_speculative(None)
            t = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t
            made = sum(len(o.new_token_ids) for o in outs)
            stats.steps += 1
            stats.tokens += made
            if in_flight <= self.threshold:
                stats.tail_tokens += made
                stats.tail_seconds += dt
            if decision is not None:
                reward = made / dt if dt > 0 else 0.0
                self.bandit.update(decision, reward)
                record = {"batch": in_flight, "bucket": decision.bucket, "arm": decision.arm,
                          "reason": decision.reason, "tokens": made, "seconds": dt, "reward": reward}
                stats.decisions.append(record)
                if self.log is not None:
                    self.log(record)
            for o in outs:
                if o.finished:
                    final[o.request_id] = o
        stats.seconds = time.perf_counter() - start
        stats.spec = {k: engine.spec_stats[k] - before.get(k, 0) for k in engine.spec_stats}
        return [final[i] for i in ids], stats
