"""The engine's sleep (vLLM's `LLM.sleep`): level 1 gives the K/V pool's memory back, level 2 the
weights' too; after `wake_up` (and, at level 2, `update_weights`) it generates what it generated
before, and what would touch freed memory is refused by name."""

import pytest
import torch

from engine_helpers import make_pair
from reclaim.engine.engine import Engine
from reclaim.engine.request import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=3)
PROMPTS = [[5, 9, 33, 70, 12, 3], [7, 8], list(range(20, 41))]


def _engine(model):
    return Engine(model, None, max_num_seqs=4, block_size=16, num_blocks=32)


def _stored(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_memory_and_wakes_to_the_same_outputs(level):
    model, _ = make_pair(seed=0)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    eng = _engine(model)
    before = [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] + [eng.generate(PROMPTS[:1], SAMPLED)[0].token_ids]
    pool = [*eng.runner.pool.k, *eng.runner.pool.v]
    pool_bytes, weight_bytes = _stored(pool), _stored(model.parameters())
    # the few-row kernel's packed copies of the weights (linear.packed), on a CPU with the kernel
    packed = sum(p._reclaim_packed[1].nbytes for p in model.parameters() if hasattr(p, "_reclaim_packed"))
    freed = eng.sleep(level)
    assert _stored(pool) == 0 and freed >= pool_bytes
    if level == 2:
        assert _stored(model.parameters()) == 0 and freed == pool_bytes + weight_bytes + packed
        assert not any(hasattr(p, "_reclaim_packed") for p in model.parameters())
    else:
        assert _stored(model.parameters()) == weight_bytes
    with pytest.raises(RuntimeError, match="sleeps; call wake_up"):
        eng.generate(PROMPTS[:1], GREEDY)
    eng.wake_up()
    assert _stored(pool) == pool_bytes and all(t.abs().sum() == 0 for t in pool)  # zeroed, old K/V gone
    if level == 2:
        with pytest.raises(RuntimeError, match="call update_weights"):
            eng.generate(PROMPTS[:1], GREEDY)
        with pytest.raises(ValueError, match="were not given"):
            eng.update_weights({"model.norm.weight": weights["model.norm.weight"]})
        eng.update_weights(weights)
    after = [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] + [eng.generate(PROMPTS[:1], SAMPLED)[0].token_ids]
    assert after == before


def test_sleep_refuses_bad_levels_requests_in_flight_and_sleeping_twice():
    model, _ = make_pair(seed=0)
    eng = _engine(model)
    with pytest.raises(ValueError, match="sleep level=3; allowed: 1"):
        eng.sleep(3)
    eng.add_request("r", PROMPTS[0], GREEDY)
    with pytest.raises(RuntimeError, match=r"1 request\(s\) in flight"):
        eng.sleep()
    while eng.has_unfinished():
        eng.step()
    eng.sleep()
    with pytest.raises(RuntimeError, match="sleeps already"):
        eng.sleep(2)
    with pytest.raises(RuntimeError, match="while the engine sleeps"):
        eng.update_weights({})
    eng.wake_up()
    eng.wake_up()  # awake: nothing to do
    assert eng.generate(PROMPTS[:1], GREEDY)[0].token_ids


def test_a_woken_engine_does_not_reuse_prefixes_cached_before_sleep():
    model, _ = make_pair(seed=0)
    eng = _engine(model)
    prompt = list(range(10, 60))  # three blocks of 16 to cache
    first = eng.generate([prompt], GREEDY)[0].token_ids
    eng.sleep()
    eng.wake_up()
    assert eng.blocks.cached_prefix(eng.blocks.prefix_hashes(prompt, 3)) == []
    assert eng.generate([prompt], GREEDY)[0].token_ids == first
