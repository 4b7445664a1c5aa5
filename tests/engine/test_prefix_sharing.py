"""Prefix sharing: sequences with the same prompt prefix (GRPO's n completions, a chat's next
turn) take the computed prompt blocks instead of prefilling them again. Outputs equal an engine
that shares nothing; blocks are reference-counted and all come back; nothing computed with old
weights is shared after a weight update."""

import pytest
import torch

from engine_helpers import make_pair
from reclaim.engine.engine import Engine
from reclaim.engine.kv_cache import BlockManager
from reclaim.engine.request import SamplingParams

PROMPT = list(range(10, 33))  # 23 tokens: 5 full blocks of 4, the last token left to compute


def _engine(model, **kw):
    return Engine(model, **{"num_blocks": 96, "block_size": 4, **kw})


def _no_sharing(model, prompts, params, **kw):
    """The same requests one at a time in fresh engines: nothing can be shared."""
    return [_engine(model, **kw).generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_n_completions_of_one_prompt_share_its_blocks(tiny, temperature):
    ours, _ = tiny
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=10, ignore_eos=True) for i in range(8)]
    eng = _engine(ours)
    outs = eng.generate([PROMPT] * 8, params)
    assert [o.token_ids for o in outs] == _no_sharing(ours, [PROMPT] * 8, params)
    assert eng.stats()["num_shared_prefix_tokens"] == 7 * 20  # 5 blocks of 4, for 7 of the 8
    assert eng.blocks.num_free == 96 and not eng.blocks._refs


def test_a_later_turn_shares_the_earlier_prompt(tiny):
    ours, _ = tiny
    eng = _engine(ours)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    eng.add_request("first", PROMPT, params)
    for _ in range(3):
        eng.step()
    follow = PROMPT + [40, 41, 42]
    eng.add_request("second", follow, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.token_ids
    assert eng.stats()["num_shared_prefix_tokens"] == 20
    assert done["second"] == _no_sharing(ours, [follow], [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)])[0]


def test_sharing_under_preemption_and_abort(tiny):
    ours, _ = tiny
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=16, ignore_eos=True) for i in range(6)]
    eng = _engine(ours, num_blocks=24, max_model_len=48)
    eng.add_request("gone", PROMPT, params[0])
    ids = [eng.add_request(None, PROMPT, p) for p in params]
    eng.step()
    eng.step()
    eng.abort_request("gone")  # the sequence that computed the shared blocks leaves early
    final = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o.token_ids
    assert [final[i] for i in ids] == _no_sharing(ours, [PROMPT] * 6, params, num_blocks=24, max_model_len=48)
    s = eng.stats()
    assert s["num_preemptions"] > 0 and s["num_shared_prefix_tokens"] > 0 and eng.blocks.num_free == 24


def test_no_sharing_of_old_weights_kv(tiny):
    ours, _ = make_pair(seed=0)
    other, _ = make_pair(seed=9)
    eng = _engine(make_pair(seed=0)[0])
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    eng.add_request("old", PROMPT, params)
    eng.step()
    eng.step()
    eng.update_weights(other.state_dict())
    short = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    eng.add_request("new", PROMPT, short)
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.token_ids
    assert done["new"] == _engine(other).generate([PROMPT], short)[0].token_ids


def test_block_references_count_down():
    bm = BlockManager(8, 4)
    bm.allocate("a", 12)
    hashes = bm.prefix_hashes(list(range(12)), 3)
    bm.index("a", hashes)
    found = bm.cached_prefix(bm.prefix_hashes(list(range(8)) + [99] * 4, 3))
    assert found == bm.tables["a"][:2]  # the third block's tokens differ
    bm.share("b", found)
    bm.allocate("b", 12)
    bm.free("a")
    assert bm.num_free == 8 - 3 and bm.cached_prefix(hashes[:2]) == found  # b still holds them
    bm.free("b")
    assert bm.num_free == 8 and bm.cached_prefix(hashes) == []


def test_eagle_speculation_with_shared_prefixes_equals_plain(tiny):
    from reclaim.engine.eagle import EagleProposer
    from reclaim.engine.speculative import SpeculativeConfig
    from reclaim.models.drafter import new_drafter

    ours, _ = tiny
    torch.manual_seed(0)
    proposer = EagleProposer(new_drafter(ours), ours)
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 4
    # Fixed depth: an untrained drafter misses, and dynamic depth would let the machine's timings
    # decide how often it still verifies (20 of 44 steps here, the bound below, when idle).
    eng = _engine(ours, speculative=SpeculativeConfig(max_batch=8, num_speculative_tokens=3, dynamic_depth=False),
                  proposer=proposer)
    outs = eng.generate([PROMPT] * 4, params)
    assert [o.token_ids for o in outs] == _no_sharing(ours, [PROMPT] * 4, params)
    assert eng.stats()["num_shared_prefix_tokens"] == 60 and eng.stats()["spec_verifies"] >= 4 * 5
