"""The EAGLE-3 drafter in the engine's place: the runner hands it the target's aux states from the
verify forward itself, greedy speculation (chains and trees) gives plain decoding's output, its
drafts follow the target's states step by step (the replayed tau is what the loop gets), and an
engine that hands it final hidden states is refused rather than drafting from the wrong features.

`speculate` plays the engine's role with the engine's parts (ModelRunner, the lossless accept
rules): what engine.py does once it asks the runner for the drafter's `aux_layers`."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import make_pair
from reclaim.engine.eagle3 import Eagle3Proposer
from reclaim.engine.kv_cache import BlockManager
from reclaim.engine.request import SamplingParams
from reclaim.engine.runner import ModelRunner, Row
from reclaim.engine.speculative import Draft, DraftRequest, parse_speculative
from reclaim.engine.rejection import accept, accept_tree
from reclaim.models.eagle3 import new_eagle3, save_eagle3
from reclaim.drafter.data import DrafterBuffer, collect
from reclaim.drafter.eagle3 import eagle3_acceptance, eagle3_loss, with_aux
from reclaim.drafter.loss import train_drafter

GREEDY = SamplingParams(temperature=0.0)
AUX = (1, 2, 3)


@torch.no_grad()
def plain(target, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(target(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def prompts(n: int, seed: int, vocab: int = 96) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (int(torch.randint(4, 9, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.fixture(scope="module")
def trained():
    """A 4-layer target and an EAGLE-3 drafter trained briefly on its greedy answers (so drafts land)."""
    torch.set_num_threads(1)
    target, _ = make_pair(seed=3, num_hidden_layers=4)
    ps = prompts(24, seed=1)
    samples = with_aux(target, collect(target, ps, [plain(target, p, 16) for p in ps]), AUX)
    buf = DrafterBuffer(100_000)
    buf.add(samples)
    torch.manual_seed(0)
    drafter = new_eagle3(target, AUX)
    train_drafter(drafter, target, buf, steps=40, lr=3e-3, batch_size=8,
                  loss_fn=lambda b: eagle3_loss(drafter, target, b, ttt_steps=3))
    return target, drafter.eval()


@torch.no_grad()
def speculate(target, proposer, ps: list[list[int]], max_tokens: int, k: int):
    """Greedy speculative decoding of all prompts at once, as the engine runs it: prefill rows, then
    verify rows [pending, draft...] in one forward, the lossless accept rule, the accepted path's
    K/V moved into place, and `observe` handed what run_features returns for the drafter's
    aux_layers at the kept positions. Returns the outputs and (verifies, accepted)."""
    blocks = BlockManager(256, 4)
    runner = ModelRunner(target, blocks, torch.device("cpu"))
    seqs = {f"s{i}": list(p) for i, p in enumerate(ps)}
    for sid, toks in seqs.items():
        blocks.allocate(sid, len(toks) + max_tokens + k + 1)
    rows = [Row(sid, 0, toks) for sid, toks in seqs.items()]
    for r, (h, f) in zip(rows, runner.run_features(rows, proposer.aux_layers)):
        proposer.observe(r.seq_id, 0, r.token_ids, f)
        seqs[r.seq_id].append(int(runner.logits(h[-1:])[0].argmax()))
    done = {sid: len(toks) - len(ps[i]) for i, (sid, toks) in enumerate(seqs.items())}
    verifies = accepted = 0
    while any(n < max_tokens for n in done.values()):
        live = [sid for sid in seqs if done[sid] < max_tokens]
        asks = [DraftRequest(seq_id=sid, token_ids=seqs[sid], max_tokens=min(k, max_tokens - done[sid] - 1),
                             params=GREEDY) for sid in live]
        drafts = [d if a.max_tokens > 0 else Draft() for a, d in zip(asks, proposer.propose(asks))]
        rows = [Row(sid, len(seqs[sid]) - 1, [seqs[sid][-1]] + d.tokens,
                    None if d.parents is None else [-1] + [p + 1 for p in d.parents]) for sid, d in zip(live, drafts)]
        for r, d, (h, f) in zip(rows, drafts, runner.run_features(rows, proposer.aux_layers)):
            logits = runner.logits(h)
            if d.parents is None:
                tokens, path = accept(logits, d, GREEDY), list(range(len(accept(logits, d, GREEDY)) - 1))
            else:
                tokens, path = accept_tree(logits, d, GREEDY)
                runner.move_kv(r.seq_id, [r.start + 1 + i for i in path], [r.start + 1 + j for j in range(len(path))])
            if d.tokens:
                verifies, accepted = verifies + 1, accepted + len(tokens) - 1
            proposer.observe(r.seq_id, r.start, [seqs[r.seq_id][-1]] + tokens[:-1], f[[0] + [1 + i for i in path]])
            tokens = tokens[: max_tokens - done[r.seq_id]]
            seqs[r.seq_id] += tokens
            done[r.seq_id] += len(tokens)
    outs = [toks[len(p):] for p, toks in zip(ps, seqs.values())]
    for sid in seqs:
        proposer.release(sid)
    return outs, (verifies, accepted)


def test_run_features_are_the_targets_aux_states():
    target, _ = make_pair(seed=4, num_hidden_layers=4)
    blocks = BlockManager(32, 4)
    runner = ModelRunner(target, blocks, torch.device("cpu"))
    a, b = [5, 9, 33, 70, 12], [7, 8]
    blocks.allocate("a", 8)
    blocks.allocate("b", 4)
    with torch.no_grad():
        first = runner.run_features([Row("a", 0, a[:3]), Row("b", 0, b)], AUX)
        (h, f), = runner.run_features([Row("a", 3, a[3:])], AUX)
        want = target(torch.tensor([a]), return_hidden=True, aux_layers=AUX)
        torch.testing.assert_close(torch.cat([first[0][1], f]), want.aux[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(h, want.hidden[0, 3:], atol=1e-5, rtol=1e-5)
        plain_rows = runner.run([Row("b", 0, b)])  # without aux_layers: the final states, as before
        torch.testing.assert_close(plain_rows[0], first[1][0])
        assert runner.run_features([Row("b", 0, b)])[0][1] is not None


@pytest.mark.parametrize("topk", [1, 3])
def test_greedy_eagle3_equals_plain_decoding(trained, topk):
    """Chains and trees (3 branches, 3 levels, 6 tokens verified), 5 sequences verified together."""
    target, drafter = trained
    ps = prompts(10, seed=9) + prompts(5, seed=1)  # held out and trained-on
    proposer = Eagle3Proposer(drafter, target, topk=topk, depth=3, total=6 if topk > 1 else 3)
    outs = []
    for i in range(0, len(ps), 5):
        got, (verifies, accepted) = speculate(target, proposer, ps[i:i + 5], 12, 6 if topk > 1 else 3)
        outs += got
    assert outs == [plain(target, p, 12) for p in ps]
    assert accepted > 0 and not proposer._states  # drafts landed; every sequence released its state


def test_the_replayed_tau_is_what_speculation_gets(trained):
    """The EAGLE-3 replay (eagle3_acceptance) drafts exactly what the proposer does in the loop."""
    target, drafter = trained
    ps = prompts(6, seed=11)
    outs, (verifies, accepted) = speculate(target, Eagle3Proposer(drafter, target, depth=4), ps, 14, 4)
    samples = with_aux(target, collect(target, ps, [o[:-1] for o in outs]), AUX)  # the last token: never run
    got = eagle3_acceptance(drafter, target, samples, 4)
    assert (got["verifies"], got["accepted"]) == (verifies, accepted) and accepted > 0


def test_final_hidden_states_are_refused(trained):
    """An engine still handing the drafter its final states would draft from the wrong features."""
    target, drafter = trained
    proposer = Eagle3Proposer(drafter, target)
    with pytest.raises(ValueError, match=r"width 64.*layers \[1, 2, 3\].*width 192"):
        proposer.observe("s", 0, [3, 4], torch.zeros(2, 64))


def test_sampled_drafts_carry_q_over_the_whole_vocabulary(trained):
    target, _ = trained
    drafter = new_eagle3(target, AUX, draft_ids=torch.arange(10, 40)).eval()
    proposer = Eagle3Proposer(drafter, target, depth=3)
    ids = [5, 9, 33, 70]
    with torch.no_grad():
        proposer.observe("s", 0, ids[:-1], target(torch.tensor([ids[:-1]]), aux_layers=AUX).aux[0])
    d, = proposer.propose([DraftRequest(seq_id="s", token_ids=ids, max_tokens=3, params=SamplingParams(temperature=1.0),
                                        generator=torch.Generator().manual_seed(0))])
    assert len(d.tokens) == 3 and all(10 <= t < 40 for t in d.tokens)
    assert d.q.shape == (3, 96) and float(d.q[:, :10].sum() + d.q[:, 40:].sum()) == 0.0
    torch.testing.assert_close(d.q.sum(-1), torch.ones(3, dtype=d.q.dtype))


@pytest.mark.parametrize("method,topk", [("eagle3", 1), ("eagle3", 3), ("hybrid", 1)])
def test_the_engine_speculating_with_eagle3_equals_plain(trained, tmp_path, method, topk):
    """`--speculative eagle3:PATH` end to end (and hybrid:PATH with an EAGLE-3 directory: the
    history drafter's tree merged with EAGLE-3's chain)."""
    from reclaim.engine.proposers import HybridProposer
    from reclaim.engine.engine import Engine

    target, drafter = trained
    path = save_eagle3(drafter, tmp_path / "eagle3")
    ps = prompts(12, seed=9) + prompts(4, seed=1)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.token_ids for o in Engine(target, num_blocks=128, block_size=4).generate(ps, params)]
    spec = parse_speculative(f"{method}:{path}", num_speculative_tokens=3, max_batch=64, eagle_topk=topk,
                             num_draft_tokens=6 if topk > 1 or method == "hybrid" else None, dynamic_depth=False)
    eng = Engine(target, num_blocks=256, block_size=4, max_num_seqs=4, speculative=spec)
    proposer = eng.proposer.model if method == "hybrid" else eng.proposer
    assert isinstance(proposer, Eagle3Proposer) and isinstance(eng.proposer, (HybridProposer, Eagle3Proposer))
    assert [o.token_ids for o in eng.generate(ps, params)] == want
    assert eng.stats()["spec_accepted"] > 0
