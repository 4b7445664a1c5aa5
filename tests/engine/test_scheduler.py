"""The scheduler alone: budgets, chunked prefill, queueing and preemption, with a fake model
(each sampled chunk appends one token) standing in for the engine."""

import pytest

from reclaim.engine.kv_cache import BlockManager
from reclaim.engine.scheduler import Scheduler, Sequence


def _seq(rid, n):
    """Tokens differ between sequences, so no prompt prefix is shared (test_prefix_sharing does that)."""
    return Sequence(rid, [sum(map(ord, rid)) * 1000 + i for i in range(n)], n)


def _run(sched, seqs, max_new, max_steps=1000):
    """Drive the scheduler like the engine does; returns per-step outputs and finish order."""
    by_id = {s.request_id: s for s in seqs}
    for s in seqs:
        sched.add(s)
    steps, done = [], []
    while sched.has_unfinished():
        out = sched.schedule()
        steps.append(out)
        assert out.chunks or not sched.running, "no progress while sequences run"
        for c in out.chunks:
            s = by_id[c.request_id]
            assert c.start + c.num_tokens <= s.num_tokens
            if c.sample:
                s.token_ids.append(0)
                if len(s.output_token_ids) == max_new:
                    sched.remove(s.request_id)
                    done.append(s.request_id)
        assert len(steps) < max_steps
    return steps, done


def test_prefill_then_decode_and_blocks_freed():
    bm = BlockManager(32, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    steps, done = _run(sched, [_seq("a", 5), _seq("b", 9)], max_new=3)
    first = steps[0].chunks
    assert [(c.request_id, c.start, c.num_tokens, c.sample) for c in first] == [
        ("a", 0, 5, True), ("b", 0, 9, True)]
    assert all(c.num_tokens == 1 for s in steps[1:] for c in s.chunks)  # then pure decode
    assert sorted(done) == ["a", "b"] and bm.num_free == 32


def test_long_prompt_is_chunked_under_token_budget():
    bm = BlockManager(32, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=8, max_model_len=64)
    steps, _ = _run(sched, [_seq("a", 20)], max_new=2)
    chunks = [(c.start, c.num_tokens, c.sample) for s in steps for c in s.chunks]
    assert chunks[:3] == [(0, 8, False), (8, 8, False), (16, 4, True)]


def test_decodes_go_first_and_budget_shared_with_a_new_prompt():
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=10, max_model_len=128)
    a = _seq("a", 3)
    sched.add(a)
    sched.schedule()
    a.token_ids.append(0)
    sched.add(_seq("b", 30))
    out = sched.schedule()
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 9)]


def test_max_num_seqs_queues_the_rest():
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=100, max_model_len=64)
    steps, done = _run(sched, [_seq(str(i), 4) for i in range(5)], max_new=2)
    assert max(len(s.chunks) for s in steps) == 2
    assert done == ["0", "1", "2", "3", "4"]


def test_cache_pressure_preempts_newest_and_everyone_finishes():
    bm = BlockManager(6, 4)  # 24 tokens in all; each sequence grows to 4 + 10 = 14
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100, max_model_len=24)
    seqs = [_seq(str(i), 4) for i in range(4)]
    steps, done = _run(sched, seqs, max_new=10)
    preempted = [r for s in steps for r in s.preempted]
    assert preempted and "0" not in preempted  # the oldest is never the victim
    assert sorted(done) == ["0", "1", "2", "3"] and bm.num_free == 6
    assert all(s.num_preemptions == preempted.count(s.request_id) for s in seqs)


def test_prompt_too_long_is_rejected_at_add():
    sched = Scheduler(BlockManager(4, 4), max_model_len=16)
    with pytest.raises(ValueError, match="16 prompt tokens; allowed: 1 to 15"):
        sched.add(_seq("x", 16))


def test_max_model_len_beyond_cache_is_rejected():
    with pytest.raises(ValueError, match="max_model_len=32 exceeds the cache's 16 tokens"):
        Scheduler(BlockManager(4, 4), max_model_len=32)


def test_decode_first_a_long_prompt_never_holds_back_running_decodes():
    """Running decodes are scheduled every step; a long prompt fills only what is left of the budget."""
    bm = BlockManager(256, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=16, max_model_len=512)
    short, long = _seq("short", 3), _seq("long", 200)
    sched.add(short)
    out = sched.schedule()  # short's prefill
    short.token_ids.append(0)
    sched.add(long)
    for _ in range(10):
        out = sched.schedule()
        ids = {c.request_id: c for c in out.chunks}
        assert ids["short"].num_tokens == 1  # its decode runs every step
        assert out.num_tokens <= 16 and ids["long"].num_tokens == 15  # the prefill takes the rest
        short.token_ids.append(0)


def test_recompute_all_reruns_every_cached_token():
    bm = BlockManager(32, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    s = _seq("a", 5)
    sched.add(s)
    sched.schedule()
    s.token_ids.append(7)
    sched.recompute_all()
    out = sched.schedule()
    assert [(c.start, c.num_tokens, c.sample) for c in out.chunks] == [(0, 6, True)]
