"""Logits processing inside the engine's sampler, against oracles: transformers' repetition
penalty, OpenAI's presence/frequency formula applied in a plain decoding loop, logit_bias,
min_tokens, allowed_token_ids (transformers' prefix_allowed_tokens_fn) and bad words
(transformers' bad_words_ids), grammar constraints (tokens outside the mask never appear; a
raising constraint fails its request alone), and prompt logprobs equal to log_softmax of one
full forward."""

import pytest
import torch

from engine_helpers import make_pair
from reclaim.engine.engine import Engine
from reclaim.engine.request import SamplingParams
from reclaim.engine.speculative import SpeculativeConfig
from reclaim.models.cache import DenseCache

PROMPT = [5, 9, 33, 70, 12, 3, 9, 33]


def _engine(model, **kw):
    return Engine(model, **{"num_blocks": 64, "block_size": 4, **kw})


def test_repetition_penalty_equals_transformers(tiny):
    ours, hf = tiny
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.8)
    got = _engine(ours).generate([PROMPT], p)[0].token_ids
    with torch.no_grad():
        want = hf.generate(input_ids=torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                           max_new_tokens=12, min_new_tokens=12, do_sample=False, repetition_penalty=1.8,
                           pad_token_id=0)[0, len(PROMPT):].tolist()
    plain = _engine(ours).generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert got == want and got != plain.token_ids


def _openai_penalised_greedy(model, prompt, n, presence, frequency):
    """OpenAI's documented formula, applied by hand in a plain decoding loop."""
    cache, out, x = DenseCache(), [], torch.tensor([prompt])
    for _ in range(n):
        pos = torch.arange(cache.length, cache.length + x.shape[1])[None]
        with torch.no_grad():
            logits = model(x, pos, cache).logits[0, -1].clone()
        for tok in set(out):
            logits[tok] -= out.count(tok) * frequency + presence
        out.append(int(logits.argmax()))
        x = torch.tensor([[out[-1]]])
    return out


@pytest.mark.parametrize("presence,frequency", [(1.5, 0.0), (0.0, 1.2), (0.7, 0.6), (-1.0, 0.0)])
def test_presence_and_frequency_penalties_follow_openai(tiny, presence, frequency):
    ours, _ = tiny
    p = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, presence_penalty=presence,
                       frequency_penalty=frequency)
    assert _engine(ours).generate([PROMPT], p)[0].token_ids == _openai_penalised_greedy(
        ours, PROMPT, 14, presence, frequency)


def test_logit_bias_and_min_tokens(tiny):
    ours, _ = tiny
    forced = _engine(ours).generate([PROMPT], SamplingParams(temperature=0.8, seed=1, max_tokens=6,
                                                             ignore_eos=True, logit_bias={42: 100.0}))[0]
    assert forced.token_ids == [42] * 6
    free = _engine(ours).generate([PROMPT], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    eos = free.token_ids[2]  # a token greedy produces early: as EOS it would stop at step 3
    stopped = _engine(ours, eos_token_ids=[eos]).generate([PROMPT], SamplingParams(temperature=0, max_tokens=20))[0]
    held = _engine(ours, eos_token_ids=[eos]).generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=20, min_tokens=8))[0]
    assert len(stopped.token_ids) == 3 and len(held.token_ids) >= 8
    assert eos not in held.token_ids[:7]


class OnlyTokens:
    """A toy grammar: tokens from `allowed`, finished after `n` of them."""

    def __init__(self, allowed, n, fail_at=None):
        self.allowed_ids, self.n, self.seen, self.fail_at = allowed, n, [], fail_at

    def allowed(self, v):
        if self.fail_at is not None and len(self.seen) == self.fail_at:
            raise RuntimeError("grammar state broken")
        mask = torch.zeros(v, dtype=torch.bool)
        mask[self.allowed_ids] = True
        return mask

    def accept(self, token):
        assert token in self.allowed_ids, token
        self.seen.append(token)

    def finished(self):
        return len(self.seen) >= self.n


def test_constraint_masks_every_token_and_finishes(tiny):
    ours, _ = tiny
    eng = _engine(ours, speculative=SpeculativeConfig(max_batch=8))  # constrained rows are not speculated
    good = SamplingParams(temperature=1.0, seed=3, max_tokens=30, ignore_eos=True, constraint=OnlyTokens([7, 8, 9], 5))
    bad = SamplingParams(temperature=1.0, seed=3, max_tokens=30, constraint=OnlyTokens([7, 8], 9, fail_at=2))
    plain = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = eng.generate([PROMPT, PROMPT, PROMPT], [good, bad, plain])
    assert set(outs[0].token_ids) <= {7, 8, 9} and len(outs[0].token_ids) == 5 and outs[0].finish_reason == "stop"
    assert outs[1].finish_reason == "error" and "grammar state broken" in outs[1].error
    assert outs[2].token_ids == _engine(ours).generate([PROMPT], plain)[0].token_ids


def test_prompt_logprobs_equal_a_full_forward(tiny):
    ours, _ = tiny
    prompt = list(range(20, 43))
    want = torch.log_softmax(ours(torch.tensor([prompt])).logits[0], -1)
    for chunk in (4, 2048):  # chunked prefill and whole
        out = _engine(ours, max_num_batched_tokens=chunk).generate(
            [prompt], SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=3))[0]
        assert out.token_ids == [] and out.finish_reason == "length"
        lps = out.prompt_logprobs
        assert lps[0] is None and len(lps) == len(prompt)
        for j in range(1, len(prompt)):
            assert lps[j].token_id == prompt[j]
            assert lps[j].rank == int((want[j - 1] > want[j - 1, prompt[j]]).sum()) + 1
            assert lps[j].logprob == pytest.approx(want[j - 1, prompt[j]].item(), abs=1e-4)
            assert [t for t, _ in lps[j].top] == want[j - 1].topk(3).indices.tolist()


def test_processed_requests_stay_lossless_next_to_speculation(tiny):
    ours, _ = tiny
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, frequency_penalty=0.5),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    spec = _engine(ours, speculative=SpeculativeConfig(max_batch=8)).generate([PROMPT, PROMPT[:5] * 3], params)
    plain = _engine(ours).generate([PROMPT, PROMPT[:5] * 3], params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


def test_processor_values_are_bounded():
    for kw in ({"presence_penalty": 3.0}, {"repetition_penalty": 0.0}, {"logit_bias": {1: 200.0}},
               {"min_tokens": 20, "max_tokens": 10}, {"prompt_logprobs": 50}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            SamplingParams(**kw)


def test_prompt_logprobs_come_with_the_first_output(tiny):
    ours, _ = tiny
    eng = _engine(ours)
    eng.add_request("r", list(range(20, 31)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                             prompt_logprobs=0))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert outs[0].prompt_logprobs is not None and len(outs[0].prompt_logprobs) == 11
    assert all(o.prompt_logprobs is None for o in outs[1:-1]) and outs[-1].prompt_logprobs == outs[0].prompt_logprobs


def _hf_greedy(hf, prompt, n, **kw):
    with torch.no_grad():
        return hf.generate(input_ids=torch.tensor([prompt]),
                           attention_mask=torch.ones(1, len(prompt), dtype=torch.long), max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, pad_token_id=0, **kw)[0, len(prompt):].tolist()


def _contains(seq, word):
    return any(seq[i:i + len(word)] == word for i in range(len(seq) - len(word) + 1))


def test_allowed_token_ids_equal_transformers_prefix_allowed_tokens(tiny):
    ours, hf = tiny
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = _engine(ours).generate([PROMPT], greedy)[0].token_ids
    allowed = sorted(set(range(40, 90)) - set(plain))  # binds: greedy's own tokens are left out
    got = _engine(ours).generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                          allowed_token_ids=allowed))[0].token_ids
    assert got == _hf_greedy(hf, PROMPT, 12, prefix_allowed_tokens_fn=lambda _b, _ids: allowed)
    assert set(got) <= set(allowed)
    loose = sorted(set(plain) | {1, 2, 3})  # does not bind: plain greedy comes out unchanged
    assert _engine(ours).generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                           allowed_token_ids=loose))[0].token_ids == plain
    sampled = _engine(ours).generate([PROMPT], SamplingParams(temperature=1.0, seed=5, max_tokens=30, ignore_eos=True,
                                                              allowed_token_ids=[3, 17, 64]))[0].token_ids
    assert len(sampled) == 30 and set(sampled) <= {3, 17, 64}


def test_bad_words_equal_transformers_no_bad_words(tiny):
    ours, hf = tiny
    plain = _engine(ours).generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].token_ids
    words = [[plain[4]], plain[7:9], plain[10:13]]  # one, two and three tokens that greedy produces
    assert not any(PROMPT[-len(w) + 1:] == w[:-1] for w in words if len(w) > 1)  # HF also matches the prompt
    p = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, bad_words_token_ids=words)
    got = _engine(ours).generate([PROMPT], p)[0].token_ids
    assert got == _hf_greedy(hf, PROMPT, 16, bad_words_ids=words) and got != plain
    assert not any(_contains(got, w) for w in words)
    unused = [t for t in range(ours.config.vocab_size) if t not in plain]
    absent = [[unused[0]], [plain[0], unused[1]], [unused[2], plain[1]]]  # never completed: no change
    assert _engine(ours).generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                           bad_words_token_ids=absent))[0].token_ids == plain
    for seed in range(3):  # sampled, the banned sequences never complete
        p = SamplingParams(temperature=1.5, seed=seed, max_tokens=40, ignore_eos=True,
                           bad_words_token_ids=words + [[5], [9, 33]])
        out = _engine(ours).generate([PROMPT], p)[0]
        assert not any(_contains(out.token_ids, w) for w in words + [[5], [9, 33]])


def test_token_restrictions_are_lossless_under_speculation(tiny):
    """Speculated (ngram drafts over a repetitive prompt), bad words and allowed ids give plain
    decoding's tokens, greedy and seeded."""
    ours, _ = tiny
    prompt = PROMPT[:5] * 3
    plain = _engine(ours).generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].token_ids
    restricted = [dict(bad_words_token_ids=[plain[2:4], [plain[6]]]),
                  dict(allowed_token_ids=sorted(set(range(96)) - {plain[1], plain[5]}))]
    params = [SamplingParams(max_tokens=16, ignore_eos=True, **t, **kw)
              for kw in restricted for t in ({"temperature": 0}, {"temperature": 1.0, "seed": 11})]
    eng = _engine(ours, speculative=SpeculativeConfig(max_batch=8))
    spec = eng.generate([prompt] * len(params), params)
    alone = _engine(ours).generate([prompt] * len(params), params)
    assert eng.spec_stats["drafted"] > 0  # drafts were verified for these rows
    assert [o.token_ids for o in spec] == [o.token_ids for o in alone]
    assert spec[0].token_ids != plain and spec[2].token_ids != plain  # the restrictions bind


def test_token_restrictions_out_of_vocabulary_fail_the_request_alone(tiny):
    ours, _ = tiny
    v = ours.config.vocab_size
    ok = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = _engine(ours).generate([PROMPT] * 4, [
        SamplingParams(temperature=0, max_tokens=4, allowed_token_ids=[3, v + 5]),
        SamplingParams(temperature=0, max_tokens=4, bad_words_token_ids=[[v]]),
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, allowed_token_ids=[7], bad_words_token_ids=[[7]]),
        ok])
    assert outs[0].finish_reason == "error"
    assert f"allowed_token_ids has token id {v + 5}; allowed: 0 to {v - 1}" in outs[0].error
    assert outs[1].finish_reason == "error" and f"bad_words has token id {v}; allowed: 0 to {v - 1}" in outs[1].error
    assert outs[2].finish_reason == "error" and "leave no token" in outs[2].error
    assert outs[3].token_ids == _engine(ours).generate([PROMPT], ok)[0].token_ids
    for kw in ({"allowed_token_ids": []}, {"allowed_token_ids": [-1]}, {"bad_words_token_ids": [[]]}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            SamplingParams(**kw)


def test_penalties_over_a_batch_equal_their_formulas_row_by_row():
    """`penalize` over rows with different settings: each row as its formulas written out (bias
    added, repetition divides positive and multiplies negative logits of seen tokens, OpenAI's
    frequency * count + presence, stop ids masked before min_tokens), as that row alone, and no
    setting leaks into another row."""
    from reclaim.engine.sampling import penalize

    torch.manual_seed(0)
    v = 50
    logits = torch.randn(5, v) * 3
    rows = [(SamplingParams(logit_bias={3: 2.5, 49: -100.0, 60: 1.0}), [1, 2], [3, 3, 4]),
            (SamplingParams(repetition_penalty=1.7), [1, 2, 7], [7, 9]),
            (SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [1], [4, 4, 4, 8]),
            (SamplingParams(), [1, 2], [5]),
            (SamplingParams(min_tokens=3, logit_bias={2: 1.0}, repetition_penalty=0.8), [2], [6])]
    params, prompts, outputs = ([r[i] for r in rows] for i in range(3))
    stops = [{0, 11}] * len(rows)
    got = penalize(logits, params, prompts, outputs, stops)

    want = logits.clone()
    want[0, 3] += 2.5
    want[0, 49] -= 100.0
    for t in (1, 2, 7, 9):
        want[1, t] = want[1, t] / 1.7 if want[1, t] > 0 else want[1, t] * 1.7
    want[2, 4] -= 3 * 0.25 + 0.5
    want[2, 8] -= 0.25 + 0.5
    want[4, 2] += 1.0
    for t in (2, 6):
        want[4, t] = want[4, t] / 0.8 if want[4, t] > 0 else want[4, t] * 0.8
    want[4, [0, 11]] = float("-inf")
    torch.testing.assert_close(got, want)
    assert torch.equal(got[3], logits[3]) and torch.equal(logits, logits.clone())
    for i in range(len(rows)):
        alone = penalize(logits[i: i + 1], params[i: i + 1], prompts[i: i + 1], outputs[i: i + 1], stops[i: i + 1])
        assert torch.equal(alone[0], got[i])
