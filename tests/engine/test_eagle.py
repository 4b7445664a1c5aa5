"""The EAGLE drafter in the engine: lossless (greedy equals plain decoding), its cache kept in step
with the target (each draft equals one computed from scratch over the true hidden states), and
its checkpoint in the EAGLE layout vLLM and SGLang load."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from engine_helpers import make_pair
from reclaim.engine.eagle import EagleProposer
from reclaim.engine.engine import Engine
from reclaim.engine.request import SamplingParams
from reclaim.engine.speculative import DraftRequest, SpeculativeConfig
from reclaim.models.cache import DenseCache
from reclaim.models.drafter import load_drafter, new_drafter, save_drafter
from test_speculative import _prompts

SPEC = SpeculativeConfig(method="ngram", num_speculative_tokens=3, max_batch=64,  # drafter passed in
                         measured_costs=False)  # priced by the priors: tiny models gain nothing


@pytest.fixture(scope="module")
def target_and_drafter():
    target, _ = make_pair(seed=1)
    torch.manual_seed(2)
    drafter = new_drafter(target)
    with torch.no_grad():  # lean the drafter on the token embedding, so some drafts land
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, : target.config.hidden_size] = torch.eye(target.config.hidden_size) * 3
    return target, drafter


@pytest.mark.parametrize("batch,topk", [(1, 1), (8, 1), (1, 3), (8, 4)])
def test_greedy_eagle_equals_plain_over_50_prompts(target_and_drafter, batch, topk):
    """Chains (topk 1) and trees (topk 3, 4: 3 levels, up to 8 tokens verified per step)."""
    target, drafter = target_and_drafter
    prompts = _prompts(50, seed=5)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = Engine(target, num_blocks=128, block_size=4).generate(prompts, params)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, max_batch=64, num_draft_tokens=8,
                             measured_costs=False)
    eng = Engine(target, num_blocks=256, block_size=4, max_num_seqs=batch, speculative=spec,
                 proposer=EagleProposer(drafter, target, topk=topk, depth=3, total=8 if topk > 1 else 3))
    spec = []
    for i in range(0, 50, batch):
        spec += eng.generate(prompts[i:i + batch], params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    s = eng.stats()
    assert s["spec_verifies"] > 0 and s["kv_blocks_used"] == 0
    assert not eng.proposer._states  # every sequence released its drafter state


def _from_scratch(target, drafter, ids, k):
    """The greedy draft after `ids` (last one pending), computed with no state carried over."""
    n = len(ids) - 1
    with torch.no_grad():
        f = target(torch.tensor([ids[:n]]), return_hidden=True, compute_logits=False).hidden
        cache = DenseCache()
        emb = target.model.embed_tokens
        g = drafter(emb(torch.tensor([ids[1:n + 1]])), f, torch.arange(n)[None], cache)[0, -1]
        out = []
        for j in range(k):
            tok = int(target.lm_head(g).argmax())
            out.append(tok)
            g = drafter(emb(torch.tensor([[tok]])), g[None, None], torch.tensor([[n + j]]), cache)[0, -1]
    return out


def test_drafter_state_follows_the_target(target_and_drafter):
    """Drafts made incrementally (after accepts, rejects, chunked prefill and a preemption) equal
    drafts computed from scratch over the target's true hidden states."""
    target, drafter = target_and_drafter
    proposer = EagleProposer(drafter, target)
    seen = []
    propose = proposer.propose

    def recording(reqs):
        drafts = propose(reqs)
        seen.extend((list(r.token_ids), d.tokens) for r, d in zip(reqs, drafts))
        return drafts

    proposer.propose = recording
    # fixed depth: every decode drafts, so there are accepts and rejects to follow (dynamic depth
    # would stop drafting for this random drafter once the measured step costs say it does not pay)
    eng = Engine(target, num_blocks=14, block_size=4, max_model_len=40, max_num_batched_tokens=7,
                 speculative=dataclasses.replace(SPEC, dynamic_depth=False), proposer=proposer)
    eng.generate(_prompts(8, seed=6), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    s = eng.stats()
    assert s["num_preemptions"] > 0 and len(seen) > 20 and 0 < s["spec_accepted"] < s["spec_drafted"], s
    for ids, tokens in seen[::3]:
        assert tokens == _from_scratch(target, drafter, ids, len(tokens))


def test_sampled_eagle_matches_plain_distribution():
    from test_speculative import _joint_chi2_passes

    target, _ = make_pair(seed=4, vocab_size=8)
    torch.manual_seed(3)
    proposer = EagleProposer(new_drafter(target), target)
    assert _joint_chi2_passes(target, proposer)


def test_drafter_round_trip_in_eagle_layout(tmp_path, target_and_drafter):
    target, drafter = target_and_drafter
    path = save_drafter(drafter, tmp_path / "d")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["architectures"] == ["LlamaForCausalLM"]
    keys = set(load_file(str(path / "model.safetensors")))
    assert "fc.weight" in keys and all(k == "fc.weight" or k.startswith("layers.0.") for k in keys)
    assert "layers.0.input_layernorm.weight" not in keys  # EAGLE's first layer has no input norm
    again = load_drafter(path, target)
    for (k, a), (k2, b) in zip(drafter.state_dict().items(), again.state_dict().items()):
        assert k == k2 and torch.equal(a, b)


def test_drafter_that_does_not_fit_is_refused(tmp_path, target_and_drafter):
    target, drafter = target_and_drafter
    path = save_drafter(drafter, tmp_path / "d")
    other, _ = make_pair(seed=1, hidden_size=32, intermediate_size=64)
    with pytest.raises(ValueError, match="hidden_size=64 but the target has hidden_size=32"):
        load_drafter(path, other)
    small_vocab, _ = make_pair(seed=1, vocab_size=50)
    with pytest.raises(ValueError, match="vocab_size=96 but the target has vocab_size=50"):
        load_drafter(path, small_vocab)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        Engine(target, num_blocks=32, block_size=4, max_model_len=64,
               speculative=SpeculativeConfig(method="eagle", model=str(tmp_path / "nowhere")))


def test_tree_row_sees_exactly_each_path():
    """One verify row holding a tree gives, at every node, the hidden state of running the prefix
    and that node's path as a plain sequence."""
    from reclaim.engine.kv_cache import BlockManager
    from reclaim.engine.runner import ModelRunner, Row

    target, _ = make_pair(seed=7)
    blocks = BlockManager(32, 4)
    runner = ModelRunner(target, blocks, torch.device("cpu"))
    prefix = [5, 9, 33, 70, 12, 3, 40]
    #            0   1   2   3   4   5   6     tree over new tokens: 0 is the pending token
    tokens = [11, 21, 22, 31, 32, 33, 41]
    parents = [-1, 0, 0, 1, 1, 2, 4]
    blocks.allocate("s", len(prefix) + len(tokens))
    other = [7, 8, 9]  # a plain row in the same forward
    blocks.allocate("o", 3 + 2)
    with torch.no_grad():
        runner.run([Row("s", 0, prefix), Row("o", 0, other)])
        got = runner.run([Row("s", len(prefix), tokens, parents), Row("o", 3, [50, 51])])
        for i in range(len(tokens)):
            path, j = [], i
            while j >= 0:
                path.insert(0, tokens[j])
                j = parents[j]
            want = target(torch.tensor([prefix + path]), return_hidden=True).hidden[0, -1]
            torch.testing.assert_close(got[0][i], want, atol=1e-5, rtol=1e-5)
        want = target(torch.tensor([other + [50, 51]]), return_hidden=True).hidden[0, -2:]
        torch.testing.assert_close(got[1], want, atol=1e-5, rtol=1e-5)


def test_sampled_eagle_tree_matches_plain_distribution():
    from test_speculative import _joint_chi2_passes

    target, _ = make_pair(seed=4, vocab_size=8)
    torch.manual_seed(3)
    proposer = EagleProposer(new_drafter(target), target, topk=3, depth=2, total=5)
    assert _joint_chi2_passes(target, proposer, top_k=0)  # top-k's own tree case: test_speculative


def test_weight_swap_during_speculation_continues_as_the_new_weights_would(target_and_drafter):
    """After update_weights mid-response, the target's K/V is recomputed and the drafter's cache
    truncated with it: the rest of the output is the new weights' greedy continuation."""
    target, drafter = target_and_drafter
    other, _ = make_pair(seed=9)
    eng = Engine(make_pair(seed=1)[0], num_blocks=128, block_size=4, speculative=SPEC,
                 proposer=EagleProposer(drafter, target))
    prompt = _prompts(1, seed=8)[0]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    eng.add_request("r", prompt, params)
    head = []
    while len(head) < 4:
        for o in eng.step():
            head += o.new_token_ids
    eng.update_weights(other.state_dict())
    rest = []
    while eng.has_unfinished():
        for o in eng.step():
            rest += o.new_token_ids
    want = Engine(other, num_blocks=128, block_size=4).generate(
        [prompt + head], SamplingParams(temperature=0, max_tokens=16 - len(head), ignore_eos=True))[0]
    assert rest == want.token_ids


def test_reduced_draft_vocabulary_is_lossless_and_round_trips(tmp_path, target_and_drafter):
    """A drafter scoring only a subset of the vocabulary (EAGLE-3's d2t) proposes only those
    tokens, stays lossless, and saves/loads its map."""
    from reclaim.models.drafter import EagleDrafter, most_frequent

    target, drafter = target_and_drafter
    prompts = _prompts(20, seed=11)
    ids = most_frequent(prompts, 40, target.config.vocab_size)
    small = EagleDrafter(target.config, ids)
    small.load_state_dict(drafter.state_dict())
    seen = []
    proposer = EagleProposer(small, target, topk=3, depth=3, total=6)  # a tree over the reduced vocabulary
    propose = proposer.propose
    proposer.propose = lambda reqs: [seen.extend(d.tokens) or d for d in propose(reqs)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = Engine(target, num_blocks=128, block_size=4).generate(prompts, params)
    eng = Engine(target, num_blocks=256, block_size=4, proposer=proposer,
                 speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3, max_batch=64, num_draft_tokens=6,
                                               measured_costs=False))
    assert [o.token_ids for o in eng.generate(prompts, params)] == [o.token_ids for o in plain]
    assert seen and set(seen) <= set(ids.tolist())
    path = save_drafter(small, tmp_path / "small")
    keys = set(load_file(str(path / "model.safetensors")))
    assert {"d2t", "t2d"} <= keys and json.loads((path / "config.json").read_text())["draft_vocab_size"] == 40
    assert torch.equal(load_drafter(path, target).draft_ids, ids)


def test_sampled_reduced_vocabulary_matches_plain_distribution():
    from reclaim.models.drafter import EagleDrafter
    from test_speculative import _joint_chi2_passes

    target, _ = make_pair(seed=4, vocab_size=8)
    torch.manual_seed(3)
    proposer = EagleProposer(EagleDrafter(target.config, torch.tensor([1, 3, 5, 6])), target)
    assert _joint_chi2_passes(target, proposer, top_k=0)
    tree = EagleProposer(EagleDrafter(target.config, torch.tensor([1, 3, 5, 6])), target, topk=2, depth=2, total=3)
    assert _joint_chi2_passes(target, tree, top_k=0)  # a tree over the reduced vocabulary


@pytest.mark.parametrize("kind", ["ngram", "eagle-chain", "eagle-tree"])
def test_seeded_sampling_is_identical_with_and_without_speculation(target_and_drafter, kind):
    """Seeded requests draw each position with a uniform keyed by (seed, position): verification
    makes the same draws, so speculative output equals plain output token for token."""
    target, drafter = target_and_drafter
    prompts = _prompts(24, seed=13)
    params = [SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=100 + i, max_tokens=14, ignore_eos=True)
              for i in range(24)]
    plain = Engine(target, num_blocks=256, block_size=4).generate(prompts, params)
    proposer = None if kind == "ngram" else EagleProposer(drafter, target, topk=3 if kind == "eagle-tree" else 1,
                                                          depth=3, total=6 if kind == "eagle-tree" else 3)
    # Fixed depth: every decode verifies a draft, however rarely this random drafter hits.
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, max_batch=64, dynamic_depth=False,
                             num_draft_tokens=6 if kind == "eagle-tree" else None)
    eng = Engine(target, num_blocks=256, block_size=4, max_num_seqs=8, speculative=spec, proposer=proposer)
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    s = eng.stats()
    assert s["spec_verifies"] > 0 and s["spec_accepted"] > 0


def test_keyed_draws_follow_the_target_distribution():
    """Across seeds, the keyed draw of one position is distributed as the processed target."""
    from reclaim.engine.sampling import keyed_uniform, probs, sample
    from test_speculative import CHI2_CRITICAL_5DF, V, _chi2

    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(5)) * 1.5
    params = SamplingParams(temperature=0.8, top_p=0.9)
    counts = torch.zeros(V, dtype=torch.float64)
    for seed in range(5000):
        counts[sample(logits, [params], [keyed_uniform(seed, 17)])[0]] += 1
    assert _chi2(counts, probs(logits, [params])[0]) < CHI2_CRITICAL_5DF


def _drive(proposer, propose, gens, budgets):
    """Several steps of observe + propose over sequences of different lengths, asking for
    different numbers of tokens with greedy, seeded and generator-sampled params (plus a sequence
    not ready yet, a recomputed one and a shared prefix); the drafts and states of each step."""
    target = proposer.target
    g = torch.Generator().manual_seed(21)
    seqs = {f"s{i}": torch.randint(2, 96, (n,), generator=g).tolist() for i, n in enumerate([30, 44, 12, 38, 25, 50])}
    seqs["s0"][:11] = seqs["s1"][:11]  # a shared prompt (pairs up to (f_9, x_10) alike)
    with torch.no_grad():
        hidden = {s: target(torch.tensor([ids]), return_hidden=True, compute_logits=False).hidden[0]
                  for s, ids in seqs.items()}
    kinds = [SamplingParams(temperature=0), SamplingParams(temperature=0.9, top_k=20, seed=7),
             SamplingParams(temperature=0.8, top_p=0.9)]
    seen = dict.fromkeys(seqs, 0)
    out = []
    for step, ends in enumerate([[9, 17, 5, 23, 12, 3], [12, 18, 8, 25, 12, 7], [13, 21, 11, 29, 16, 8]]):
        if step == 2:  # s1 recomputed from position 6 (as after a preemption); s0 restarts on s1's prompt
            seen["s1"] = 6
            proposer.share("s1", "s0", 10)
            seen["s0"] = 10
        asks = []
        for i, (s, n) in enumerate(zip(seqs, ends)):
            upto = n if s != "s4" or step else n - 2  # s4 is one step behind the first time: not ready
            if upto > seen[s]:
                proposer.observe(s, seen[s], seqs[s][seen[s]:upto], hidden[s][seen[s]:upto])
                seen[s] = upto
            params = kinds[(i + step) % 3]
            asks.append(DraftRequest(s, seqs[s][: n + 1], budgets[(i + step) % 6], params,
                                     gens[s] if params.seed is None and not params.greedy else None))
        drafts = propose(asks)
        states = {s: (st.length, len(st.feats), {layer: (st.cache.keys[layer].clone(), st.cache.values[layer].clone())
                                                  for layer in st.cache.keys}) for s, st in proposer._states.items()}
        out.append((drafts, states))
    return out


@pytest.mark.parametrize("topk,vocab", [(1, None), (3, None), (1, 40), (3, 40)])
def test_batched_proposals_equal_proposing_one_sequence_at_a_time(target_and_drafter, topk, vocab):
    """One drafter forward per depth for every sequence gives each sequence the draft (tokens,
    q, tree) and the drafter cache it would get proposing alone, with the same random draws."""
    from eagle_reference import propose_one
    from reclaim.models.drafter import EagleDrafter

    target, _ = target_and_drafter
    torch.manual_seed(5)  # a reduced draft vocabulary (its q still over all 96 tokens) or the whole one
    drafter = EagleDrafter(target.config, None if vocab is None else torch.arange(0, 2 * vocab, 2))
    with torch.no_grad():  # sharp weights: attention moves the drafts, so a wrong mask shows
        for p in drafter.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    make = lambda: EagleProposer(drafter, target, topk=topk, depth=4, total=30)
    budgets = [4, 1, 3, 0, 2, 4] if topk == 1 else [30, 1, 12, 0, 6, 30]  # a whole tree: 3 + 3 * 9 nodes
    gens = lambda: {f"s{i}": torch.Generator().manual_seed(i) for i in range(6)}
    batched, one = make(), make()
    got = _drive(batched, batched.propose, gens(), budgets)
    want = _drive(one, lambda asks: [propose_one(one, r) for r in asks], gens(), budgets)
    assert any(d.q is not None for d in got[0][0]) == (topk == 1)  # sampled chains carry q
    assert got[0][0][4].tokens == [] and got[1][0][4].tokens  # s4 is not ready the first time
    for (drafts, states), (ref, ref_states) in zip(got, want):
        assert [d.tokens for d in drafts] == [d.tokens for d in ref] and any(d.tokens for d in ref)
        assert [d.parents for d in drafts] == [d.parents for d in ref]
        for d, r in zip(drafts, ref):
            assert (d.q is None) == (r.q is None)
            if d.q is not None:
                torch.testing.assert_close(d.q, r.q, atol=1e-5, rtol=0)
        assert states.keys() == ref_states.keys()
        for s, (length, feats, kv) in states.items():
            assert (length, feats) == ref_states[s][:2] and kv.keys() == ref_states[s][2].keys()
            for layer, (k, v) in kv.items():
                torch.testing.assert_close(k, ref_states[s][2][layer][0], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(v, ref_states[s][2][layer][1], atol=1e-5, rtol=1e-5)
