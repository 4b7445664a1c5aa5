"""Logits processing inside the engine's sampler, against oracles: transformers' repetition
penalty, OpenAI's presence/frequency formula applied in a plain decoding loop, logit_bias,
min_tokens, grammar constraints (tokens outside the mask never appear; a raising constraint fails
its request alone), and prompt logprobs equal to log_softmax of one full forward."""

import pytest
import torch

from conftest import make_pair
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
