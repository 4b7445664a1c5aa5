"""Speculative decoding against its oracles: greedy output identical to plain decoding (with stop
strings, EOS and max_tokens inside drafts, preemption, abort), sampled output distributed as plain
sampling (a chi-square test that a deliberately wrong acceptance rule fails), blocks all freed."""

import random

import pytest
import torch

from engine_helpers import TINY, make_pair
from reclaim.engine.engine import Engine
from reclaim.engine.request import SamplingParams
from reclaim.engine.speculative import Draft, DraftRequest, NgramProposer, SpeculativeConfig
from reclaim.engine.rejection import accept

# Drafts priced by the priors, not by this machine's timings: tiny random models gain nothing from
# speculating, so measured costs would (rightly) stop the drafting that these tests verify.
NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, max_batch=64, prompt_lookup_max=3,
                          measured_costs=False)


def _prompts(n, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        base = [rng.randrange(2, TINY["vocab_size"]) for _ in range(rng.randrange(2, 6))]
        out.append((base * 4)[: rng.randrange(3, 16)])  # repetitive, so prompt lookup finds drafts
    return out


def _engine(model, tok=None, **kw):
    return Engine(model, tok, **{"num_blocks": 128, "block_size": 4, **kw})


def _run(eng, prompts, params):
    return [o.token_ids for o in eng.generate(prompts, params)]


@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_ngram_equals_plain_over_50_prompts(tiny, batch):
    ours, _ = tiny
    prompts = _prompts(50)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain, spec = _engine(ours), _engine(ours, speculative=NGRAM, max_num_seqs=batch)
    for i in range(0, 50, batch):
        assert _run(spec, prompts[i:i + batch], params) == _run(plain, prompts[i:i + batch], params)
    s = spec.stats()
    assert s["spec_verifies"] > 0 and s["spec_accepted"] > 0  # it did speculate, and drafts landed
    assert s["kv_blocks_used"] == 0


def test_stop_eos_and_max_tokens_inside_drafts_match_plain(tiny, toy_tokenizer):
    ours, _ = tiny
    prompts = _prompts(20, seed=1)
    plain_free = _engine(ours, toy_tokenizer).generate(prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    for k, o in enumerate(plain_free):  # EOS = a token the output really produces mid-draft
        eos = o.token_ids[5 + k % 7]
        stop = o.text[3 + k % 5: 5 + k % 5]
        for params in (SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[eos]),
                       SamplingParams(temperature=0, max_tokens=30, stop=[stop], ignore_eos=True),
                       SamplingParams(temperature=0, max_tokens=3 + k % 9, ignore_eos=True, logprobs=2)):
            a = _engine(ours, toy_tokenizer).generate([prompts[k]], params)[0]
            b = _engine(ours, toy_tokenizer, speculative=NGRAM).generate([prompts[k]], params)[0]
            assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
            if params.logprobs:
                assert [lp.token_id for lp in b.logprobs] == b.token_ids
                for x, y in zip(a.logprobs, b.logprobs):
                    assert x.logprob == pytest.approx(y.logprob, abs=1e-4)


def test_preemption_and_abort_mid_speculation(tiny):
    ours, _ = tiny
    prompts = _prompts(10, seed=2)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = _run(_engine(ours), prompts, params)
    eng = _engine(ours, num_blocks=20, max_model_len=48, speculative=NGRAM)  # ~2 sequences fit
    assert _run(eng, prompts, params) == want
    assert eng.stats()["num_preemptions"] > 0 and eng.blocks.num_free == 20
    eng.add_request("a", prompts[0], params)
    eng.add_request("b", prompts[1], params)
    for _ in range(3):
        eng.step()
    eng.abort_request("a")
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            done[o.request_id] = o
    assert done["a"].finish_reason == "abort" and done["b"].token_ids == want[1]
    assert eng.blocks.num_free == 20


def test_speculation_turns_off_above_max_batch(tiny):
    ours, _ = tiny
    eng = _engine(ours, speculative=SpeculativeConfig(method="ngram", max_batch=2))
    eng.generate(_prompts(6, seed=3), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert eng.stats()["spec_verifies"] == 0


# ---- the acceptance rule, alone: sampled output distributed as the target's ----

V = 6


class _FixedDrafter:
    """Drafts from a fixed distribution q (random draws), so acceptance is exercised everywhere."""

    def __init__(self, q: torch.Tensor, k: int, seed: int = 0) -> None:
        self.q, self.k, self.g = q, k, torch.Generator().manual_seed(seed)

    def draft(self) -> Draft:
        toks = torch.multinomial(self.q, self.k, replacement=True, generator=self.g).tolist()
        return Draft(toks, self.q.expand(self.k, V).double())


def _wrong_accept(logits, draft, params, generator=None, fallback=None):
    """The classic near-miss: accept with min(1, p/q), but on rejection draw from p itself
    instead of the residual norm(max(0, p - q))."""
    from reclaim.engine.sampling import probs

    p = probs(logits[:1], [params])[0]
    d = draft.tokens[0]
    if torch.rand((), generator=generator, dtype=torch.float64) < min(1.0, float(p[d] / draft.q[0, d])):
        return [d]
    return [int(torch.multinomial(p.float(), 1, generator=generator).item())]


CHI2_CRITICAL_5DF = 20.52  # p = 0.001 for 5 degrees of freedom (V = 6): fixed before running
# Draws per rule test. The near-miss rules' statistic grows with the draws: at 3,000 the weakest
# (top_p 0.8) expects about 65, three standard deviations above the threshold; the right rule's
# false-alarm rate stays 0.001 whatever the count.
DRAWS = 3000


def _chi2(counts: torch.Tensor, expected_p: torch.Tensor) -> float:
    n = counts.sum()
    exp = expected_p * n
    keep = exp > 0
    assert counts[~keep].sum() == 0, "a token the target gives no mass came out"
    return float(((counts[keep] - exp[keep]) ** 2 / exp[keep]).sum())


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.9, min_p=0.1, top_k=5, top_p=0.9),
])
@pytest.mark.parametrize("rule", ["right", "wrong"])
def test_first_token_distribution_matches_target(params, rule):
    from reclaim.engine.sampling import probs

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, V, generator=g) * 1.5
    q = torch.softmax(torch.randn(V, generator=g) * 2, -1).double()
    drafter = _FixedDrafter(q, k=1)
    target = probs(logits[:1], [params])[0]
    n = DRAWS
    gen = torch.Generator().manual_seed(1)
    fn = accept if rule == "right" else _wrong_accept
    counts = torch.zeros(V, dtype=torch.float64)
    for _ in range(n):
        counts[fn(logits, drafter.draft(), params, gen)[0]] += 1
    stat = _chi2(counts, target) if (counts[target == 0] == 0).all() else float("inf")
    if rule == "right":
        assert stat < CHI2_CRITICAL_5DF, (stat, counts / n, target)
    else:
        assert stat > CHI2_CRITICAL_5DF, ("the chi-square test cannot tell a wrong rule apart", stat)


def _joint_chi2_passes(target, drafter, n: int = 1500, top_k: int = 6, spec: SpeculativeConfig | None = None) -> bool:
    """Sample n four-token continuations with and without speculation on a tiny-vocabulary
    target; two-sample chi-square over the joint of the first two tokens (the second comes from
    a verified draft) at p = 0.001, a threshold fixed here before any run."""
    params = SamplingParams(temperature=1.0, top_k=top_k, max_tokens=4, ignore_eos=True)
    prompt = [3, 5, 3, 5, 3]
    v = target.config.vocab_size
    plain = _engine(target, max_num_seqs=64, seed=1)
    spec = _engine(target, max_num_seqs=64, seed=2, proposer=drafter,
                   speculative=spec or SpeculativeConfig(max_batch=64, num_speculative_tokens=2,
                                                         measured_costs=False))

    def hist(eng):
        c = torch.zeros(v, v, dtype=torch.float64)
        for o in eng.generate([prompt] * n, params):
            c[o.token_ids[0], o.token_ids[1]] += 1
        return c

    a, b = hist(plain), hist(spec)
    assert spec.stats()["spec_accepted"] > 0  # drafts were accepted, and some rejected
    assert spec.stats()["spec_accepted"] < spec.stats()["spec_drafted"]
    return same_distribution(a, b, n)


def same_distribution(a: torch.Tensor, b: torch.Tensor, n: int) -> bool:
    """Two-sample chi-square over two histograms of n draws each (cells with fewer than 10 draws
    in both dropped) at p = 0.001."""
    keep = (a + b) >= 10
    pooled = (a + b)[keep] / (2 * n)
    stat = float((((a[keep] - n * pooled) ** 2 + (b[keep] - n * pooled) ** 2) / (n * pooled)).sum())
    df = int(keep.sum()) - 1
    z = 3.09  # the 0.999 quantile of N(0, 1); Wilson-Hilferty's chi-square quantile from it
    return stat < df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


class _AlwaysDraft:
    """A deterministic draft that is sometimes right: [5, 3]."""

    def propose(self, reqs):
        return [Draft([5, 3][: r.max_tokens]) for r in reqs]

    def observe(self, *a):
        pass

    def finish(self, *a):
        pass

    def release(self, *a):
        pass


def test_engine_sampled_speculative_matches_plain_distribution():
    target, _ = make_pair(seed=4, vocab_size=8)
    assert _joint_chi2_passes(target, _AlwaysDraft())


def test_ngram_lookup_proposes_what_followed_the_latest_match():
    d = NgramProposer(1, 3)
    req = lambda ids, k: DraftRequest("s", ids, k, SamplingParams())  # noqa: E731
    assert d.propose([req([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 3)])[0].tokens == [7, 1, 2]
    assert d.propose([req([4, 5, 6], 3)])[0].tokens == []


def test_bad_speculative_config_is_refused_by_name():
    with pytest.raises(ValueError, match="'medusa' is unknown; allowed"):
        SpeculativeConfig(method="medusa")
    with pytest.raises(ValueError, match="needs a drafter directory"):
        SpeculativeConfig(method="eagle")


def _wrong_tree_accept(logits, draft, params, generator=None, fallback=None):
    """Near miss for trees: tries each child with its original p(c), never removing rejected
    children's mass, and draws the fallback from p itself."""
    from reclaim.engine.sampling import probs

    p = probs(logits[:1], [params])[0]
    for i, parent in enumerate(draft.parents):
        if parent == -1 and torch.rand((), generator=generator, dtype=torch.float64) < p[draft.tokens[i]]:
            return [draft.tokens[i]], [i]
    return [int(torch.multinomial(p.float(), 1, generator=generator).item())], []


def _tree_case():
    """Sampling params, target logits [4, V] (the pending token, then each draft token), the
    target's distribution at the pending token, and a tree of its 1st and 2nd most likely tokens
    under it and the 4th under the first."""
    from reclaim.engine.sampling import probs

    params = SamplingParams(temperature=0.8, top_k=5)
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(0)) * 1.5
    target = probs(logits[:1], [params])[0]
    ranked = target.argsort(descending=True).tolist()
    return params, logits, target, Draft([ranked[0], ranked[1], ranked[3]], None, [-1, -1, 0])


@pytest.mark.parametrize("rule", ["right", "wrong"])
def test_tree_first_token_distribution_matches_target(rule):
    from reclaim.engine.rejection import accept_tree

    params, logits, target, draft = _tree_case()
    fn = accept_tree if rule == "right" else _wrong_tree_accept
    counts = torch.zeros(V, dtype=torch.float64)
    gen = torch.Generator().manual_seed(1)
    for _ in range(DRAWS):
        counts[fn(logits, draft, params, gen)[0][0]] += 1
    stat = _chi2(counts, target)
    assert (stat < CHI2_CRITICAL_5DF) == (rule == "right"), (rule, stat)


def test_batched_tree_verify_samples_the_target_distribution():
    """verify_batch's sampled trees (every node's recursive rejection at once, then a walk on the
    host) draw the first token from the target at the pending token, and after an accepted first
    child the second from the target at that child; a batch of DRAWS copies of one tree."""
    from reclaim.engine.rejection import verify_batch
    from reclaim.engine.sampling import probs, read

    params, logits, target, draft = _tree_case()
    got = read([verify_batch([logits] * DRAWS, [draft] * DRAWS, [params] * DRAWS, [0] * DRAWS, [None] * DRAWS,
                             torch.Generator().manual_seed(1))])[0]
    first = torch.zeros(V, dtype=torch.float64)
    second = torch.zeros(V, dtype=torch.float64)
    for tokens, path in got:
        first[tokens[0]] += 1
        assert path in ([], [0], [1], [0, 2]) and tokens[:-1] == [draft.tokens[k] for k in path]
        if path[:1] == [0]:  # child 0 accepted: the next token comes from draft token 0's row
            second[tokens[1]] += 1
    assert _chi2(first, target) < CHI2_CRITICAL_5DF
    assert second.sum() > 500 and _chi2(second, probs(logits[1:2], [params])[0]) < CHI2_CRITICAL_5DF
    assert _chi2(first, probs(logits[1:2], [params])[0]) > CHI2_CRITICAL_5DF  # the test can fail


def test_depth_controller_picks_the_depth_with_most_tokens_per_cost():
    """The chosen depth maximises E(k) / cost(k) (checked against every depth); a drafter that
    always misses ends in plain decoding with a one-token probe every probe_every steps; one
    that always hits keeps the deepest draft."""
    from reclaim.engine.spec_policy import DepthController, expected_tokens

    dc = DepthController(8, overhead=0.05, token_cost=0.05, probe_every=4)
    for alpha in (0.0, 0.05, 0.2, 0.5, 0.8, 0.95, 1.0):
        k = dc.best_depth(alpha)
        rates = [expected_tokens(alpha, j) / (1 + (0.05 + 0.05 * j if j else 0)) for j in range(9)]
        assert rates[k] == max(rates)
    assert dc.best_depth(0.02) == 0 and dc.best_depth(0.99) == 8
    assert expected_tokens(0.5, 2) == 1.75 and expected_tokens(1.0, 3) == 4
    for _ in range(30):
        k = dc.depth("miss")
        if k:
            dc.update("miss", k, 0)
        dc.update("hit", dc.depth("hit"), dc.depth("hit"))
    assert dc.alpha("miss") < 0.1 and [dc.depth("miss") for _ in range(8)].count(1) == 2
    assert dc.depth("hit") == 8


def test_step_costs_fit_the_engines_steps_and_shrink_depths_as_the_batch_grows():
    """Steps timed on a known line s = a + b*B + c*X + d*V are fit back exactly; nothing is
    claimed before steps with different B and X determine the line; while every draft has the
    same length (X = k*V) the per-verify part cannot be told apart and the line without it is
    fit; the measured cost of a draft token grows with the batch (a plain step's fixed part is
    shared by more sequences), so the controller drafts deep at batch 1 and stops at batch 16
    for the same acceptance, and a large per-verify cost stops it drafting at all."""
    from reclaim.engine.spec_policy import DepthController, StepCosts

    a, b, c, d = 0.02, 0.004, 0.003, 0.002
    costs = StepCosts(min_steps=4)
    for _ in range(10):  # plain steps at one batch size: B and X never vary
        costs.observe(1, 0, a + b)
    assert costs.token_cost(1) is None and costs.verify_cost(1) is None
    for batch, k in [(1, 4), (4, 4), (16, 4), (2, 4), (8, 4)]:  # every sequence drafts 4 tokens
        costs.observe(batch, k * batch, a + b * batch + (c * k + d) * batch, verified=batch)
    fit = costs.fit()
    assert fit[:2] == pytest.approx((a, b), rel=1e-6) and fit[3] == 0.0
    assert fit[2] == pytest.approx(c + d / 4, rel=1e-6)  # the per-verify part folded into the token's
    for batch, drafted, verified in [(1, 2, 1), (4, 16, 2), (4, 0, 0), (16, 8, 8), (2, 3, 1)]:
        costs.observe(batch, drafted, a + b * batch + c * drafted + d * verified, verified)
    assert costs.fit() == pytest.approx((a, b, c, d), rel=1e-6)
    assert costs.token_cost(1) == pytest.approx(c / (a + b))
    assert costs.token_cost(16) == pytest.approx(16 * c / (a + 16 * b))
    assert costs.verify_cost(4) == pytest.approx(4 * d / (a + 4 * b))
    dc = DepthController(8, overhead=0.0, token_cost=0.05, costs=costs)
    assert dc.best_depth(0.5, batch=1) == 2 and dc.best_depth(0.5, batch=16) == 0
    assert dc.overhead_per_verify(1) == pytest.approx(d / (a + b))
    assert DepthController(8, 0.0, 0.05).cost_per_token(16) == 0.05  # no measurements: the prior
    assert DepthController(8, 0.07, 0.05).overhead_per_verify(16) == 0.07
    heavy = StepCosts(min_steps=4)
    for batch, drafted, verified in [(1, 0, 0), (2, 0, 0), (1, 2, 1), (4, 16, 2), (4, 4, 4), (16, 8, 8), (2, 3, 1)]:
        heavy.observe(batch, drafted, a + b * batch + c * drafted + 0.05 * verified, verified)
    assert DepthController(8, 0.0, 0.05, costs=heavy).best_depth(0.7, batch=1) == 0


def test_step_costs_at_one_batch_size_still_price_draft_tokens_exactly():
    """A full batch decodes every step at one batch size, so a and b cannot be told apart: the
    fit takes a + b * B as one constant and still prices a draft token and a verify exactly at
    that batch size (without this, the caller fell back to its prior at every full batch)."""
    from reclaim.engine.spec_policy import StepCosts

    a, b, c, d, batch = 0.02, 0.004, 0.003, 0.002, 4
    costs = StepCosts(min_steps=4)
    for drafted, verified in [(0, 0), (8, 2), (16, 4), (4, 4), (0, 0), (12, 3), (6, 1), (20, 4)]:
        costs.observe(batch, drafted, a + b * batch + c * drafted + d * verified, verified)
    fit = costs.fit()
    assert fit[1] == 0.0 and fit[0] == pytest.approx(a + b * batch, rel=1e-6)
    assert fit[2:] == pytest.approx((c, d), rel=1e-6)
    assert costs.token_cost(batch) == pytest.approx(batch * c / (a + b * batch))
    assert costs.verify_cost(batch) == pytest.approx(batch * d / (a + b * batch))
    same = StepCosts(min_steps=4)  # every draft as long too: d folds into c, b and d are 0
    for drafted in (0, 16, 0, 16, 16, 0):
        same.observe(batch, drafted, a + b * batch + (c * 4 + d) * (drafted // 4))
    assert same.fit() == pytest.approx((a + b * batch, 0.0, c + d / 4, 0.0), rel=1e-6)


def test_spec_gate_keeps_speculation_only_where_it_yields_more_tokens_per_second():
    """At a batch size where speculative steps commit fewer tokens per second than plain ones
    the gate turns speculation off, but for one probe step in probe_every; where they commit
    more it keeps it on; batch sizes are judged apart."""
    from reclaim.engine.spec_policy import SpecGate

    gate = SpecGate(("plain", "spec"), probe_every=4)
    assert gate.choose(4) == "spec"  # nothing measured: speculate
    gate.update(4, "spec", tokens=6, seconds=0.3)  # 20 tok/s speculating
    gate.update(4, "plain", tokens=4, seconds=0.16)  # 25 tok/s plain
    gate.update(1, "spec", tokens=2, seconds=0.1)  # 20 tok/s speculating at batch 1
    gate.update(1, "plain", tokens=1, seconds=0.08)  # 12.5 tok/s plain
    at4 = [gate.choose(4) for _ in range(12)]
    at1 = [gate.choose(1) for _ in range(12)]
    assert at4.count("spec") == 3 and at1.count("plain") == 3  # the probes
    for _ in range(20):  # the drafter starts hitting at batch 4: its rate overtakes plain's
        gate.update(4, "spec", tokens=12, seconds=0.3)
    assert [gate.choose(4) for _ in range(4)].count("spec") == 3


def test_spec_gate_over_several_drafters_runs_the_best_and_probes_the_rest_in_turn():
    """With a hybrid drafter's arms the gate tries every speculative arm first, then runs the
    one with the most tokens per second, each other arm (plain too) probed in turn."""
    from reclaim.engine.spec_policy import SpecGate

    gate = SpecGate(("plain", "suffix", "eagle", "hybrid"), probe_every=4)
    rates = {"plain": 10.0, "suffix": 30.0, "eagle": 15.0, "hybrid": 25.0}
    seen = []
    for _ in range(3):  # untried speculative arms first, in order
        arm = gate.choose(1)
        seen.append(arm)
        gate.update(1, arm, tokens=int(rates[arm]), seconds=1.0)
    assert seen == ["suffix", "eagle", "hybrid"]
    gate.update(1, "plain", tokens=10, seconds=1.0)
    picks = [gate.choose(1) for _ in range(36)]
    assert picks.count("suffix") == 27 and {a: picks.count(a) for a in ("plain", "eagle", "hybrid")} == \
        {"plain": 3, "eagle": 3, "hybrid": 3}
    with pytest.raises(ValueError, match="need 'plain'"):
        SpecGate(("suffix",))


def test_dynamic_depth_stops_paying_for_a_drafter_that_misses(tiny):
    """A drafter whose tokens are never right: with dynamic depth most decodes run plain (its
    probes still verify now and then), with the same greedy output; without it, every decode
    verifies a draft. Depth follows the config's cost priors: measured step costs follow the load
    of the test run's workers, and under it a drafter that misses could still look worth probing."""
    from reclaim.engine.speculative import Proposer

    ours, _ = tiny

    class Wrong(Proposer):
        def propose(self, requests):
            return [Draft([(r.token_ids[-1] + 1) % TINY["vocab_size"]] * r.max_tokens) for r in requests]

        def observe(self, *a):
            pass

        def release(self, seq_id):
            pass

    prompts = _prompts(4, seed=3)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = _run(_engine(ours), prompts, params)
    runs = {}
    for dynamic in (True, False):
        cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=4, max_batch=64, dynamic_depth=dynamic,
                                measured_costs=False)
        eng = _engine(ours, speculative=cfg, proposer=Wrong(), max_num_seqs=4)
        assert _run(eng, prompts, params) == want
        runs[dynamic] = eng.stats()
    assert runs[False]["spec_verifies"] >= 4 * 35 and runs[False]["spec_plain_decodes"] == 0
    assert runs[True]["spec_plain_decodes"] > 1.5 * runs[True]["spec_verifies"] > 0


class _Parity:
    """A toy grammar with state: after an even token only odd ones, after an odd one only even
    ones (the first token free); it can roll back, so the engine speculates it."""

    def __init__(self) -> None:
        self.history: list[int] = []

    def allowed(self, vocab_size):
        if not self.history:
            return None
        return torch.arange(vocab_size) % 2 != self.history[-1] % 2

    def accept(self, token_id):
        if self.history and token_id % 2 == self.history[-1] % 2:
            raise ValueError(f"token {token_id} breaks the parity rule")
        self.history.append(token_id)

    def finished(self):
        return False

    def rollback(self, n):
        del self.history[len(self.history) - n:]


def _processed_params(i, **kw):
    return [SamplingParams(max_tokens=24, ignore_eos=True, presence_penalty=0.5, frequency_penalty=0.3, **kw),
            SamplingParams(max_tokens=24, ignore_eos=True, constraint=_Parity(), **kw),
            SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=1.3, min_tokens=20,
                           logit_bias={3: 2.0}, **kw)][i % 3]


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (0.3, 7)])
def test_requests_with_processed_logits_speculate_and_match_plain(tiny, temperature, seed):
    """Penalties, min_tokens, logit_bias and a grammar (with rollback) are speculated in chains,
    each draft position processed as if the tokens before it were committed: greedy and seeded
    outputs identical to plain decoding, and drafts did land."""
    ours, _ = tiny
    prompts = _prompts(12, seed=4)
    mk = lambda: [_processed_params(i, temperature=temperature, seed=seed) for i in range(12)]  # noqa: E731
    plain = _run(_engine(ours, max_num_seqs=6), prompts, mk())
    eng = _engine(ours, speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4, max_batch=64,
                                                      prompt_lookup_max=3, dynamic_depth=False), max_num_seqs=6)
    params = mk()
    assert _run(eng, prompts, params) == plain
    for i in range(1, 12, 3):  # the grammar held, and was rolled back to exactly what was committed
        out = plain[i]
        assert all(a % 2 != b % 2 for a, b in zip(out, out[1:]))
        assert params[i].constraint.history == out
    s = eng.stats()
    assert s["spec_verifies"] > 0 and s["spec_accepted"] > 0 and s["kv_blocks_used"] == 0


def test_json_schema_output_speculated_equals_plain_on_the_default_model(smol):
    """A real grammar (llguidance, JSON schema) on SmolLM2: the speculated answer is the plain
    one, it parses, and drafts were verified and accepted inside the grammar."""
    import json

    from reclaim.models.tokenizer import encode_chat
    from reclaim.server.structured import GrammarCompiler

    model, tok, _ = smol
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                               "city": {"type": "string"}},
              "required": ["name", "age", "city"], "additionalProperties": False}
    grammars = GrammarCompiler(tok)
    grammar = grammars.json_schema(schema, "response_format")
    prompt = encode_chat(tok, [{"role": "user", "content": "Describe Ada, 36, from London, as JSON."}])
    outs = []
    for spec in (None, SpeculativeConfig(method="ngram", num_speculative_tokens=4, dynamic_depth=False)):
        eng = Engine(model, tok, max_num_seqs=1, max_model_len=512, speculative=spec)
        params = SamplingParams(temperature=0, max_tokens=48, constraint=grammars.constraint(grammar))
        outs.append(eng.generate([prompt], params)[0])
    assert outs[0].token_ids == outs[1].token_ids and outs[1].finish_reason == "stop"
    assert set(json.loads(outs[1].text)) == {"name", "age", "city"}
    s = eng.stats()
    assert s["spec_verifies"] > 0 and s["spec_accepted"] > 0
