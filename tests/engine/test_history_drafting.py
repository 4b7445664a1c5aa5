"""The history drafter (suffix) and the hybrid one (suffix + EAGLE in one tree) through the
engine: greedy output identical to plain decoding, sampled output distributed as plain sampling
(a near-miss acceptance rule fails the same test), seeded output identical."""

import dataclasses

import pytest
import torch

import reclaim.engine.rejection as rejection_module
from engine_helpers import make_pair
from reclaim.engine.proposers import HybridProposer, history_proposer, merge
from reclaim.engine.eagle import EagleProposer
from reclaim.engine.engine import Engine
from reclaim.engine.history import SuffixProposer
from reclaim.engine.request import SamplingParams
from reclaim.engine.speculative import Draft, SpeculativeConfig
from reclaim.models.drafter import new_drafter
from test_speculative import _joint_chi2_passes, _prompts

# Priced by the priors (measured_costs=False): on tiny random models measured timings would stop
# the drafting these tests verify.
SUFFIX = SpeculativeConfig(method="suffix", max_batch=64, num_speculative_tokens=8, measured_costs=False)
HYBRID = SpeculativeConfig(method="hybrid", model="unused", max_batch=64, num_speculative_tokens=6,
                           hybrid_eagle_tokens=3, num_draft_tokens=10, measured_costs=False)


def _hybrid(target, seed=2):
    torch.manual_seed(seed)
    drafter = new_drafter(target)
    with torch.no_grad():  # lean on the token embedding, so some EAGLE drafts land
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, : target.config.hidden_size] = torch.eye(target.config.hidden_size) * 3
    return HybridProposer(history_proposer(HYBRID), EagleProposer(drafter, target, depth=3),
                         model_tokens=HYBRID.hybrid_eagle_tokens)


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("kind", ["suffix", "hybrid"])
def test_greedy_equals_plain_over_50_prompts_asked_twice(tiny, batch, kind):
    """Each prompt comes twice (a GRPO group, a repeated question), so history drafts land."""
    target, _ = tiny
    prompts = [p for p in _prompts(25, seed=8) for _ in range(2)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = Engine(target, num_blocks=128, block_size=4).generate(prompts, params)
    spec, drafter = (SUFFIX, None) if kind == "suffix" else (HYBRID, _hybrid(target))
    eng = Engine(target, num_blocks=256, block_size=4, max_num_seqs=batch, speculative=spec, proposer=drafter)
    out = []
    for i in range(0, 50, batch):
        out += eng.generate(prompts[i:i + batch], params)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    s = eng.stats()
    assert s["spec_verifies"] > 0 and s["spec_accepted"] > 0 and s["kv_blocks_used"] == 0
    history = eng.proposer if kind == "suffix" else eng.proposer.history
    assert not history._seqs and history.memory()["kept_tokens"] > 0  # every sequence finished into history


def test_stop_eos_and_max_tokens_inside_history_drafts_match_plain(tiny, toy_tokenizer):
    target, _ = tiny
    prompts = _prompts(12, seed=9)
    free = Engine(target, toy_tokenizer, num_blocks=128, block_size=4).generate(
        prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    eng = Engine(target, toy_tokenizer, num_blocks=128, block_size=4, speculative=SUFFIX)
    eng.generate(prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))  # history of every answer
    plain = Engine(target, toy_tokenizer, num_blocks=128, block_size=4)
    for k, o in enumerate(free):
        eos, stop = o.token_ids[5 + k % 7], o.text[3 + k % 5: 5 + k % 5]
        for params in (SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[eos]),
                       SamplingParams(temperature=0, max_tokens=30, stop=[stop], ignore_eos=True),
                       SamplingParams(temperature=0, max_tokens=3 + k % 9, ignore_eos=True, logprobs=2)):
            a, b = plain.generate([prompts[k]], params)[0], eng.generate([prompts[k]], params)[0]
            assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
    assert eng.stats()["spec_accepted"] > 0


def _near_miss(p, q):
    """On rejecting a draft token d, draw the replacement from p itself instead of p with d's
    drafted mass taken out: d comes out too often."""
    return p


@pytest.mark.parametrize("rule", ["right", "wrong"])
def test_sampled_history_drafts_match_plain_distribution(rule, monkeypatch):
    """1500 samples of one prompt: the history of its earlier completions drafts the later ones."""
    target, _ = make_pair(seed=4, vocab_size=8)
    if rule == "wrong":
        monkeypatch.setattr(rejection_module, "residual", _near_miss)
    spec = dataclasses.replace(SUFFIX, num_speculative_tokens=3, dynamic_depth=False)  # every decode drafts
    assert _joint_chi2_passes(target, SuffixProposer(), spec=spec) == (rule == "right")


def test_sampled_hybrid_tree_matches_plain_distribution():
    target, _ = make_pair(seed=4, vocab_size=8)
    spec = dataclasses.replace(HYBRID, num_speculative_tokens=3, num_draft_tokens=6, dynamic_depth=False)
    assert _joint_chi2_passes(target, _hybrid(target, seed=3), spec=spec)


@pytest.mark.parametrize("kind", ["suffix", "hybrid"])
def test_seeded_sampling_is_identical_with_and_without_history_drafts(tiny, kind):
    target, _ = tiny
    prompts = [p for p in _prompts(6, seed=10) for _ in range(3)]
    params = [SamplingParams(temperature=0.3, top_k=6, max_tokens=16, ignore_eos=True, seed=i) for i in range(18)]
    plain = Engine(target, num_blocks=128, block_size=4).generate(prompts, params)
    spec, drafter = (SUFFIX, None) if kind == "suffix" else (HYBRID, _hybrid(target))
    eng = Engine(target, num_blocks=256, block_size=4, max_num_seqs=2, speculative=spec, proposer=drafter)
    assert [o.token_ids for o in eng.generate(prompts, params)] == [o.token_ids for o in plain]
    assert eng.stats()["spec_accepted"] > 0


def test_merge_keeps_shared_prefixes_once_and_the_budget():
    a = Draft([1, 2, 3])
    b = Draft([1, 2, 9, 8])
    m = merge(a, b, 10)
    assert m.tokens == [1, 2, 3, 9, 8] and m.parents == [-1, 0, 1, 1, 3]
    assert merge(a, Draft([1, 2]), 10).parents is None  # nothing new: still a chain
    assert merge(a, b, 4).tokens == [1, 2, 3, 9]
    tree = Draft([5, 6, 7], None, [-1, -1, 0])
    assert merge(tree, Draft([6, 4]), 10).parents == [-1, -1, 0, 1]
