"""The bandit finds each bucket's best arm on a synthetic reward; the adaptive rollout's greedy
outputs equal plain decoding's, speculating only in the tail, with every decision logged."""

import random

import pytest

from rl_helpers import tiny_target
from reclaim.engine.engine import Engine
from reclaim.engine.request import SamplingParams
from reclaim.engine.speculative import SpeculativeConfig
from reclaim.rl.bandit import BucketedBandit
from reclaim.rl.rollout import AdaptiveRollout


@pytest.mark.parametrize("policy", ["epsilon_greedy", "ucb1"])
def test_bandit_finds_the_best_arm_per_bucket(policy):
    # Arm 2 pays most at small batches, arm 0 at large ones (as plain decoding does): noisy rewards.
    means = {1: [10.0, 14.0, 20.0], 16: [30.0, 24.0, 12.0]}
    bandit = BucketedBandit(arms=["plain", "chain", "tree"], buckets=[1, 4, 16], policy=policy, seed=0)
    rng = random.Random(1)
    for _ in range(400):
        for batch in (1, 16):
            d = bandit.choose(batch)
            bandit.update(d, rng.gauss(means[batch][d.arm], 3.0))
    assert bandit.best(1) == 2 and bandit.best(16) == 0
    picks = [bandit.choose(1).arm for _ in range(200)]
    assert picks.count(2) > 150  # mostly exploits once it knows


def test_bandit_refuses_bad_settings():
    with pytest.raises(ValueError, match="'thompson' is unknown"):
        BucketedBandit(arms=[None], policy="thompson")
    with pytest.raises(ValueError, match="at least one arm"):
        BucketedBandit(arms=[])


def test_adaptive_rollout_equals_plain_and_speculates_only_in_the_tail():
    target = tiny_target(96, seed=2)
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 90) for _ in range(3)] * 3 for _ in range(8)]
    # A long tail: most requests are short, two are long.
    params = [SamplingParams(temperature=0, max_tokens=40 if i < 2 else 6, ignore_eos=True) for i in range(8)]
    plain = Engine(target, num_blocks=128, block_size=4).generate(prompts, params)
    arms = [None, SpeculativeConfig(method="ngram", num_speculative_tokens=2, max_batch=64),
            SpeculativeConfig(method="ngram", num_speculative_tokens=4, max_batch=64)]
    logged = []
    rollout = AdaptiveRollout(BucketedBandit(arms, buckets=[1, 2, 4]), threshold=2, log=logged.append)
    engine = Engine(target, num_blocks=128, block_size=4)
    outs, stats = rollout.generate(engine, prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert stats.tail_seconds > 0 and stats.tail_tokens > 0 and stats.tokens == sum(len(o.token_ids) for o in outs)
    assert logged == stats.decisions and all(d["batch"] <= 2 for d in logged)
    assert stats.spec["verifies"] > 0  # it did speculate in the tail
    assert engine.blocks.num_free == 128
