"""The engine against oracles: transformers' generate and logits, one-at-a-time decoding, and its
own contracts (finish reasons, stop handling, freed blocks, preemption, hooks, weight swaps)."""

import threading

import pytest
import torch

from engine_helpers import make_pair
from reclaim.engine.engine import Engine
from reclaim.engine.request import SamplingParams
from reclaim.models.hf import hf_generate, hf_logits
from reclaim.models.kernels import linear as kl

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 9, 33, 70, 12, 3], [7, 8], list(range(20, 41)), [44] * 9]


def _engine(model, tok=None, **kw):
    kw = {"num_blocks": 64, "block_size": 4, **kw}
    return Engine(model, tok, **kw)


def _hf_greedy(hf, prompt, n):
    return hf_generate(hf, torch.tensor([prompt]), max_new_tokens=n, ignore_eos=True)[0].tolist()


@pytest.mark.parametrize("family", [
    dict(model_type="llama"),
    dict(model_type="mistral"),
    dict(model_type="qwen2"),
    dict(model_type="qwen3", head_dim=32),
    dict(model_type="llama", tie_word_embeddings=True, num_key_value_heads=1,
         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
])
def test_greedy_equals_transformers_generate(family):
    ours, hf = make_pair(seed=3, **family)
    outs = _engine(ours).generate(PROMPTS[:3], GREEDY)
    for p, o in zip(PROMPTS, outs):
        assert o.token_ids == _hf_greedy(hf, p, GREEDY.max_tokens)
        assert o.finish_reason == "length" and o.finished


@pytest.mark.skipif(kl.status() != "on", reason="the few-row kernel is unavailable here")
@pytest.mark.parametrize("head", ["auto", "linear"])
def test_decode_runs_the_few_row_kernel_unless_head_is_linear(head, monkeypatch):
    """Both equal transformers' greedy tokens; 'auto' decodes through small_linear, 'linear' never."""
    ours, hf = make_pair(seed=3)
    calls = []
    real = kl.small_linear
    monkeypatch.setattr(kl, "small_linear", lambda *a: calls.append(a[0].shape) or real(*a))
    outs = _engine(ours, head=head).generate(PROMPTS[:2], GREEDY)
    for p, o in zip(PROMPTS, outs):
        assert o.token_ids == _hf_greedy(hf, p, GREEDY.max_tokens)
    if head == "auto":
        # the two rows decode together: 7 products a layer, 2 layers, each decode step
        assert len(calls) >= (GREEDY.max_tokens - 1) * 7 * 2
    else:
        assert calls == []


def test_batched_equals_one_at_a_time(tiny):
    ours, _ = tiny
    params = [GREEDY, SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True)]
    batched = _engine(ours).generate(PROMPTS * 2, [params[0]] * 4 + [params[1]] * 4)
    for i, p in enumerate(PROMPTS * 2):
        single = _engine(ours).generate([p], params[i // 4])[0]
        assert batched[i].token_ids == single.token_ids


def test_chunked_prefill_equals_whole_prefill(tiny):
    ours, _ = tiny
    whole = _engine(ours).generate(PROMPTS, GREEDY)
    eng = _engine(ours, max_num_batched_tokens=5)
    chunked = eng.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in chunked] == [o.token_ids for o in whole]


def test_seeded_sampling_reproducible_and_batch_independent(tiny):
    ours, _ = tiny
    p = SamplingParams(temperature=1.0, top_k=20, seed=11, max_tokens=16, ignore_eos=True)
    a = _engine(ours).generate([PROMPTS[0]], p)[0].token_ids
    noise = SamplingParams(temperature=1.2, max_tokens=5, ignore_eos=True)
    b = _engine(ours).generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], [noise, p, noise])[1].token_ids
    c = _engine(ours).generate([PROMPTS[0]], SamplingParams(temperature=1.0, top_k=20, seed=12,
                                                              max_tokens=16, ignore_eos=True))[0]
    assert a == b and a != c.token_ids


def test_awaits_first_token_while_a_request_is_queued_or_mid_prefill(tiny):
    """What co-located training asks before it takes a slice: queued, admitted with its prefill
    in chunks, then decoding (no longer waiting)."""
    ours, _ = tiny
    eng = _engine(ours, max_num_batched_tokens=5)
    assert not eng.awaits_first_token()
    eng.add_request("a", PROMPTS[2], GREEDY)  # 21 tokens: five steps of prefill
    waits = []
    while eng.has_unfinished():
        outs = eng.step()
        waits.append((eng.awaits_first_token(), any(o.new_token_ids for o in outs)))
    first = next(i for i, (_, got) in enumerate(waits) if got)
    assert first == 4 and all(w for w, _ in waits[:first]) and not any(w for w, _ in waits[first:])


def test_logprobs_equal_log_softmax_of_oracle_logits(tiny):
    ours, hf = tiny
    prompt = PROMPTS[0]
    out = _engine(ours).generate([prompt], SamplingParams(temperature=0.9, seed=1, max_tokens=6,
                                                          ignore_eos=True, logprobs=3))[0]
    full = torch.tensor([prompt + out.token_ids])
    ref = hf_logits(hf, full)[0, len(prompt) - 1:-1].log_softmax(-1)
    assert len(out.logprobs) == len(out.token_ids)
    for step, lp in enumerate(out.logprobs):
        assert lp.token_id == out.token_ids[step]
        assert lp.logprob == pytest.approx(ref[step, lp.token_id].item(), abs=1e-4)
        assert [t for t, _ in lp.top] == ref[step].topk(3).indices.tolist()


def test_stop_token_eos_and_max_tokens_finish_reasons(tiny, toy_tokenizer):
    ours, _ = tiny
    free = _engine(ours, toy_tokenizer).generate([PROMPTS[0]], GREEDY)[0].token_ids
    stop_id = free[4]
    first = free.index(stop_id)
    eng = _engine(ours, toy_tokenizer)
    o = eng.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                  stop_token_ids=[stop_id]))[0]
    assert o.finish_reason == "stop" and o.token_ids == free[: first + 1]
    assert o.text == toy_tokenizer.decode(free[:first], skip_special_tokens=True)
    eos = _engine(ours, toy_tokenizer, eos_token_ids=[stop_id]).generate(
        [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12))[0]
    assert eos.finish_reason == "stop" and eos.token_ids == free[: first + 1]
    short = eng.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert short.finish_reason == "length" and short.token_ids == free[:3]


def test_stop_string_streams_nothing_of_it(tiny, toy_tokenizer):
    ours, _ = tiny
    free = _engine(ours, toy_tokenizer).generate([PROMPTS[1]], GREEDY)[0]
    stop = free.text[5:8]
    eng = _engine(ours, toy_tokenizer)
    eng.add_request("r", PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                    stop=[stop]))
    deltas, final = [], None
    while eng.has_unfinished():
        for out in eng.step():
            deltas.append(out.delta_text)
            final = out
    cut = free.text.index(stop)
    assert final.finish_reason == "stop" and "".join(deltas) == final.text == free.text[:cut]
    assert eng.stats()["kv_blocks_used"] == 0


def test_text_prompt_and_incremental_outputs(tiny, toy_tokenizer):
    ours, _ = tiny
    eng = _engine(ours, toy_tokenizer)
    eng.add_request("t", "abc", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert outs[-1].prompt_token_ids == toy_tokenizer.encode("abc")
    assert [len(o.new_token_ids) for o in outs] == [1] * 5
    assert sum((o.new_token_ids for o in outs), []) == outs[-1].token_ids
    assert [o.finished for o in outs] == [False] * 4 + [True]
    # Deltas only while running (no per-token copy of the history); the whole of it at the end.
    assert all(o.token_ids is None and o.text is None for o in outs[:-1])
    assert "".join(o.delta_text for o in outs) == outs[-1].text
    assert [o.text_offset for o in outs] == [sum(len(p.delta_text) for p in outs[:i]) for i in range(5)]


def test_blocks_freed_on_finish_and_abort(tiny):
    ours, _ = tiny
    eng = _engine(ours)
    eng.add_request("a", PROMPTS[2], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    eng.add_request("b", PROMPTS[0], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    eng.add_request("c", PROMPTS[1], GREEDY)
    eng.abort_request("c")  # aborted while still queued
    eng.step()
    assert eng.stats()["kv_blocks_used"] > 0
    eng.abort_request("a")
    finished = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                finished[o.request_id] = o.finish_reason
    assert finished == {"a": "abort", "b": "length"}
    assert eng.stats() | {"kv_blocks_used": 0} == eng.stats() and eng.blocks.num_free == 64


def test_more_requests_than_the_cache_holds_are_all_served(tiny):
    ours, _ = tiny
    prompts = [PROMPTS[i % 4] + [i + 2] for i in range(10)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    roomy = _engine(ours).generate(prompts, params)
    eng = _engine(ours, num_blocks=16, block_size=4, max_model_len=64)  # ~2 sequences fit at once
    tight = eng.generate(prompts, params)
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    assert eng.stats()["num_preemptions"] > 0 and eng.blocks.num_free == 16


def test_prompt_longer_than_cache_is_rejected_clearly(tiny):
    eng = _engine(tiny[0], num_blocks=4, block_size=4, max_model_len=16)
    with pytest.raises(ValueError, match="prompt has 16 tokens; allowed: 1 to 15"):
        eng.add_request("x", list(range(2, 18)))
    with pytest.raises(ValueError, match=r"prompt token ids \[96\] are out of range; allowed: 0 to 95"):
        eng.add_request("y", [3, 96])
    with pytest.raises(ValueError, match="exceeds the cache"):
        _engine(tiny[0], num_blocks=4, block_size=4, max_model_len=32)


def test_on_forward_hook_sees_prefill_hidden_states(tiny):
    ours, _ = tiny
    records = []
    eng = _engine(ours, on_forward=records.extend, max_num_batched_tokens=4)
    eng.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    prefill = [r for r in records if r.is_prefill]
    assert [r.start for r in prefill] == list(range(0, len(PROMPTS[2]), 4))
    hidden = torch.cat([r.hidden for r in prefill])
    want = ours(torch.tensor([PROMPTS[2]]), return_hidden=True).hidden[0]
    torch.testing.assert_close(hidden, want, atol=1e-5, rtol=1e-5)
    assert sum(not r.is_prefill for r in records) == 2


def test_update_weights_bumps_version_and_changes_outputs(tiny):
    ours, _ = make_pair(seed=0)
    other, _ = make_pair(seed=9)
    eng = _engine(ours)
    before = eng.generate([PROMPTS[0]], GREEDY)[0]
    assert before.weights_version == 0
    assert eng.update_weights(other.state_dict()) == 1
    after = eng.generate([PROMPTS[0]], GREEDY)[0]
    fresh = _engine(other).generate([PROMPTS[0]], GREEDY)[0]
    assert after.weights_version == 1 and after.token_ids == fresh.token_ids != before.token_ids
    with pytest.raises(ValueError, match="unknown parameter names"):
        eng.update_weights({"nope": torch.zeros(1)})


def test_add_and_abort_from_another_thread(tiny):
    ours, _ = tiny
    eng = _engine(ours)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    done: dict[str, str] = {}

    def client():
        for i in range(6):
            eng.add_request(f"r{i}", PROMPTS[i % 4], params)
        eng.abort_request("r5")

    t = threading.Thread(target=client)
    t.start()
    while t.is_alive() or eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.finish_reason
    t.join()
    assert set(done) == {f"r{i}" for i in range(6)} and eng.blocks.num_free == 64
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("x", [3], params)
        eng.add_request("x", [3], params)


def _decode_with_dense_cache(model_steps, prompt, n_before, n_after):
    """Oracle for a weight swap mid-response: greedy with a DenseCache, the first `n_before`
    tokens under model_steps[0], the rest under model_steps[1] reusing the cache as it is."""
    from reclaim.models.cache import DenseCache

    cache, ids, out = DenseCache(), list(prompt), []
    x = torch.tensor([prompt])
    for i in range(n_before + n_after):
        model = model_steps[0] if i < n_before else model_steps[1]
        pos = torch.arange(cache.length, cache.length + x.shape[1])[None]
        with torch.no_grad():
            logits = model(x, pos, cache).logits[0, -1]
        tok = int(logits.argmax())
        out.append(tok)
        ids.append(tok)
        x = torch.tensor([[tok]])
    return out


@pytest.mark.parametrize("policy", ["recompute", "keep"])
def test_weight_swap_mid_response_reports_versions_and_follows_the_kv_policy(policy):
    ours, _ = make_pair(seed=0)
    other, _ = make_pair(seed=9)
    eng = _engine(make_pair(seed=0)[0], kv_on_weight_update=policy)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    eng.add_request("r", PROMPTS[2], params)
    outs = []
    while len(outs) < 4:
        outs += eng.step()
    eng.update_weights(other.state_dict())
    while eng.has_unfinished():
        outs += eng.step()
    final = outs[-1]
    assert [o.weights_version for o in outs] == [0] * 4 + [1] * 6
    assert final.first_weights_version == 0 and final.weights_version == 1
    head = final.token_ids[:4]
    if policy == "recompute":  # the rest is what the new weights say after prompt + head, from scratch
        want = _engine(other).generate([PROMPTS[2] + head], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        assert final.token_ids[4:] == want[0].token_ids
    else:  # the old K/V stays: new weights attend to it (the documented, cheaper policy)
        assert final.token_ids == _decode_with_dense_cache((ours, other), PROMPTS[2], 4, 6)


def test_a_request_whose_sampling_fails_fails_alone(tiny):
    """Ten innocent requests share every step with one whose sampling raises; they finish exactly
    as they would alone, and the bad one ends with finish_reason 'error'."""
    ours, _ = tiny
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=8, ignore_eos=True) for i in range(10)]
    prompts = [PROMPTS[i % 4] for i in range(10)]
    alone = _engine(ours).generate(prompts, params)
    eng = _engine(ours)
    bad = SamplingParams(temperature=0.9, max_tokens=8)
    bad.top_k = 2**63  # past validation, as an unchecked caller could
    eng.add_request("bad", PROMPTS[0], bad)
    ids = [eng.add_request(None, p, sp) for p, sp in zip(prompts, params)]
    final = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o
    assert final["bad"].finish_reason == "error" and "Overflow" in final["bad"].error
    assert [final[i].token_ids for i in ids] == [o.token_ids for o in alone]
    assert eng.stats()["num_request_errors"] == 1 and eng.blocks.num_free == 64
