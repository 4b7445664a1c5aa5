"""A recorded request's prefill is the recorder's forward (e.g. with autograd, for training): the
engine serves from its K/V and hidden states, so outputs equal an unrecorded run, the recorder
is called once per request with the whole prompt, and nothing else changes."""

import pytest
import torch

from engine_helpers import make_pair
from reclaim.engine.engine import Engine
from reclaim.engine.request import SamplingParams
from reclaim.models.cache import DenseCache


class GradRecorder:
    """A recorder as the online learner runs it: the prompt forward with autograd, graph kept."""

    def __init__(self, model):
        self.model, self.calls, self.kept = model, [], {}

    def __call__(self, request_id, prompt_ids, version):
        cache = DenseCache()
        with torch.enable_grad():
            out = self.model(torch.tensor([prompt_ids]), cache=cache, return_hidden=True, compute_logits=False)
        self.calls.append((request_id, list(prompt_ids), version))
        self.kept[request_id] = out.hidden
        n = len(cache.keys)
        return [cache.keys[i] for i in range(n)], [cache.values[i] for i in range(n)], out.hidden[0]


@pytest.mark.parametrize("budget", [2048, 5])  # the whole prompt is recorded even past the budget
def test_recorded_requests_serve_exactly_as_unrecorded(budget):
    model, _ = make_pair(seed=3)
    prompts = [[5, 9, 33, 70, 12, 3, 40], list(range(20, 41)), [7, 8]]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=10, ignore_eos=True, logprobs=1) for i in range(3)]
    plain = Engine(model, num_blocks=64, block_size=4, max_num_batched_tokens=budget).generate(prompts, params)
    rec = GradRecorder(model)
    eng = Engine(model, num_blocks=64, block_size=4, max_num_batched_tokens=budget, recorder=rec)
    ids = [eng.add_request(None, p, sp, record=i != 1) for i, (p, sp) in enumerate(zip(prompts, params))]
    final = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o
    for i, o in zip(ids, plain):
        assert final[i].token_ids == o.token_ids
        assert [lp.logprob for lp in final[i].logprobs] == pytest.approx([lp.logprob for lp in o.logprobs], abs=1e-5)
    assert [(c[0], c[1]) for c in rec.calls] == [(ids[0], prompts[0]), (ids[2], prompts[2])]
    assert all(h.requires_grad for h in rec.kept.values())  # the graph is there for training
    assert eng.stats()["num_recorded"] == 2 and eng.blocks.num_free == 64


def test_record_needs_a_recorder(tiny):
    with pytest.raises(ValueError, match="needs an engine built with a recorder"):
        Engine(tiny[0], num_blocks=16, block_size=4, max_model_len=64).add_request("r", [1, 2], record=True)


def test_a_recorder_that_fails_or_gives_only_the_last_state():
    """A failing recorder leaves the request served unrecorded; one that returns only the last
    hidden state still serves it exactly (no drafts, no prompt logprobs for it)."""
    model, _ = make_pair(seed=3)
    prompt = list(range(20, 35))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = Engine(model, num_blocks=64, block_size=4).generate([prompt], params)[0].token_ids

    def broken(request_id, prompt_ids, version):
        raise RuntimeError("out of record budget")

    last_only = GradRecorder(model)
    for recorder, recorded in ((broken, 0), (lambda *a: (*last_only(*a)[:2], last_only.kept[a[0]][0, -1]), 1)):
        eng = Engine(model, num_blocks=64, block_size=4, recorder=recorder)
        eng.add_request("r", prompt, params, record=True)
        outs = []
        while eng.has_unfinished():
            outs += eng.step()
        assert outs[-1].token_ids == want
        assert eng.stats()["num_recorded"] == recorded and eng.stats()["num_record_failures"] == 1 - recorded


def test_with_record_when_queued_off_a_request_is_recorded_only_when_no_other_waits():
    """co-location's policy: a recorded prefill is slower, so a request is served unrecorded when
    another waits for its first token (counted); outputs are the same either way."""
    model, _ = make_pair(seed=3)
    prompts = [[5, 9, 33, 70, 12, 3, 40], list(range(20, 41)), [7, 8, 9]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = Engine(model, num_blocks=64, block_size=4).generate(prompts, params)
    rec = GradRecorder(model)
    eng = Engine(model, num_blocks=64, block_size=4, recorder=rec)
    eng.record_when_queued = False
    a = eng.add_request(None, prompts[0], params, record=True)  # alone: recorded
    outs = {o.request_id: o for o in eng.step()}
    b = eng.add_request(None, prompts[1], params, record=True)  # arrive together: each waits on
    c = eng.add_request(None, prompts[2], params, record=True)  # the other, neither is recorded
    while eng.has_unfinished():
        outs.update({o.request_id: o for o in eng.step()})
    assert [outs[i].token_ids for i in (a, b, c)] == [w.token_ids for w in want]
    assert [call[0] for call in rec.calls] == [a]
    assert (eng.stats()["num_recorded"], eng.stats()["num_record_skipped"]) == (1, 2)


def test_a_recording_refused_by_may_record_is_served_unrecorded():
    """Co-location's credit check (`may_record(prompt_tokens)`): a refused request is served as
    an ordinary prefill (counted as skipped), with the same output."""
    model, _ = make_pair(seed=3)
    prompts = [[5, 9, 33, 70, 12, 3, 40], list(range(20, 41))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = Engine(model, num_blocks=64, block_size=4).generate(prompts, params)
    rec = GradRecorder(model)
    eng = Engine(model, num_blocks=64, block_size=4, recorder=rec)
    asked = []
    eng.may_record = lambda n: asked.append(n) or n < 10
    ids = [eng.add_request(None, p, params, record=True) for p in prompts]
    outs = {}
    while eng.has_unfinished():
        outs.update({o.request_id: o for o in eng.step()})
    assert [outs[i].token_ids for i in ids] == [w.token_ids for w in want]
    assert sorted(asked) == [7, 21] and [call[0] for call in rec.calls] == [ids[0]]
    assert (eng.stats()["num_recorded"], eng.stats()["num_record_skipped"]) == (1, 1)
