"""The history drafter's suffix trie against brute force on random token streams: the same counts
of every substring, the same longest match and continuations, incremental updates equal to a
rebuild, removal leaving what was never inserted, and memory bounded."""

import random

import pytest

from reclaim.engine.history import SuffixProposer
from reclaim.engine.request import SamplingParams
from reclaim.engine.speculative import DraftRequest
from reclaim.engine.suffix import SuffixIndex

D = 6


def _streams(seed, n=5, vocab=4, length=(5, 40)):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(*length))] for _ in range(n)]


def _brute_counts(streams, depth):
    counts = {}
    for s in streams:
        for i in range(len(s)):
            for j in range(i + 1, min(i + depth, len(s)) + 1):
                counts[tuple(s[i:j])] = counts.get(tuple(s[i:j]), 0) + 1
    return counts


def _trie_counts(index):
    """Every node's string and count, by walking the trie from the root."""
    out, stack = {}, [((), 0)]
    while stack:
        prefix, node = stack.pop()
        for tok, _ in index.continuations(node).items():
            child = index.find(list(prefix) + [tok])
            out[prefix + (tok,)] = index.count(child)
            assert index.depth(child) == len(prefix) + 1
            link = index.link(child)  # the string without its first token
            assert link == (index.find(list(prefix[1:]) + [tok]) if len(prefix) else 0)
            stack.append((prefix + (tok,), child))
    return out


def _brute_match(streams, context, max_len):
    """The longest suffix of context (<= max_len tokens) occurring in any stream."""
    for n in range(min(max_len, len(context)), 0, -1):
        suf = context[len(context) - n:]
        if any(s[i:i + n] == suf for s in streams for i in range(len(s) - n + 1)):
            return suf
    return []


def _brute_next(streams, string):
    nxt = {}
    n = len(string)
    for s in streams:
        for i in range(len(s) - n):
            if s[i:i + n] == string:
                nxt[s[i + n]] = nxt.get(s[i + n], 0) + 1
    return nxt


@pytest.mark.parametrize("seed", range(6))
def test_counts_longest_match_and_continuations_equal_brute_force(seed):
    streams = _streams(seed)
    index = SuffixIndex(D)
    for i, s in enumerate(streams):
        index.extend(i, s)
    assert _trie_counts(index) == _brute_counts(streams, D)
    rng = random.Random(100 + seed)
    for _ in range(50):
        context = [rng.randrange(5) for _ in range(rng.randrange(1, 12))]  # token 4 never occurs
        node = index.match(context)
        want = _brute_match(streams, context, D - 1)
        assert index.depth(node) == len(want) and (not want or node == index.find(want))
        assert index.continuations(node) == (_brute_next(streams, want) if want else
                                             {t: c for (t,), c in _brute_counts(streams, 1).items()})
        for m in index.matches(context):  # every suffix with continuations, longest first
            string = context[len(context) - index.depth(m):]
            assert index.continuations(m) == _brute_next(streams, string) != {}


@pytest.mark.parametrize("seed", range(4))
def test_incremental_updates_in_any_interleaving_equal_a_rebuild(seed):
    streams = _streams(seed, n=4)
    whole = SuffixIndex(D)
    for i, s in enumerate(streams):
        whole.extend(i, s)
    pieces = SuffixIndex(D)
    rng = random.Random(seed)
    done = [0] * len(streams)
    while any(d < len(s) for d, s in zip(done, streams)):
        i = rng.choice([k for k, s in enumerate(streams) if done[k] < len(s)])
        n = rng.randrange(1, 5)
        pieces.extend(i, streams[i][done[i]:done[i] + n])
        done[i] += n
    assert _trie_counts(pieces) == _trie_counts(whole)
    assert pieces.num_nodes == whole.num_nodes and pieces.num_tokens == whole.num_tokens == sum(map(len, streams))


def test_removing_streams_leaves_the_index_of_the_rest_and_frees_their_nodes():
    streams = _streams(7, n=6)
    index = SuffixIndex(D)
    for i, s in enumerate(streams):
        index.extend(i, s)
        index.close(i)
    for i in (1, 4):
        index.remove(i)
    rest = [s for i, s in enumerate(streams) if i not in (1, 4)]
    assert _trie_counts(index) == _brute_counts(rest, D)
    for i in (0, 2, 3, 5):
        index.remove(i)
    assert index.num_nodes == 1 and index.num_tokens == 0 and index.continuations(0) == {}
    index.extend(9, streams[0])  # freed nodes are reused
    assert _trie_counts(index) == _brute_counts(streams[:1], D)


def test_a_closed_stream_cannot_grow():
    index = SuffixIndex(D)
    index.extend(0, [1, 2])
    index.close(0)
    with pytest.raises(ValueError, match="stream 0 is closed"):
        index.extend(0, [3])


def test_grow_drafts_best_first_and_carries_on_past_the_trie_depth():
    index = SuffixIndex(4)
    index.extend(0, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    index.extend(1, [1, 2, 3, 9])
    node = index.match([0, 1, 2])
    chain = index.grow(node, 8)
    assert chain.tokens == [3, 4, 5, 6, 7, 8, 9]  # 4 of 5 counts, then on by suffix links past depth 4
    assert chain.probs[0] == pytest.approx(1.0) and chain.probs[1] == pytest.approx(0.5)
    tree = index.grow(index.match([1, 2, 3]), 4, branch=2)
    assert sorted(tree.tokens[:2]) == [4, 9] and tree.parents[:2] == [-1, -1]
    assert index.grow(node, 8, min_prob=0.6).tokens == [3]


def _ask(seq_id, ids, prompt, k=8, cost=0.0):
    return DraftRequest(seq_id, ids, k, SamplingParams(temperature=0), num_prompt_tokens=prompt, token_cost=cost)


def test_drafter_drafts_a_finished_siblings_continuation_and_earlier_rounds_until_the_window():
    prompt = [7, 7, 1]
    done = prompt + [2, 3, 4, 5, 6, 8, 9]
    d = SuffixProposer(history_steps=1, max_depth=8)
    d.finish("a", done, len(prompt))
    d.release("a")
    got = d.propose([_ask("b", prompt + [2, 3], len(prompt))])[0]
    assert got.tokens[:4] == [4, 5, 6, 8]
    d.next_round()
    assert d.propose([_ask("c", prompt + [2, 3], len(prompt))])[0].tokens[:1] == [4]
    d.next_round()  # two rounds on: out of a one-round window
    assert d.memory()["kept_tokens"] == 0
    assert d.propose([_ask("e", prompt + [2, 3], len(prompt))])[0].tokens[:4] != [4, 5, 6, 8]


def test_drafter_keeps_at_most_cache_tokens_of_finished_sequences_oldest_prompt_first():
    d = SuffixProposer(cache_tokens=100, max_depth=8)
    rng = random.Random(0)
    for i in range(30):
        ids = [rng.randrange(50) for _ in range(20)]
        d.finish(f"r{i}", ids, 5)
        d.release(f"r{i}")
        mem = d.memory()
        assert mem["kept_tokens"] <= 100 and mem["tokens"] <= 100
    assert d.memory()["prompts"] <= 5 and d.stats["evicted_tokens"] == 30 * 40 - d.memory()["kept_tokens"]
    with pytest.raises(ValueError, match="cache_tokens=0; allowed: >= 1"):
        SuffixProposer(cache_tokens=0)


def test_drafter_costs_cut_drafts_that_do_not_pay():
    d = SuffixProposer(max_depth=8)
    d.finish("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], 1)
    d.finish("b", [1, 2, 3, 9, 9, 9], 1)
    cheap = d.propose([_ask("c", [1, 2, 3], 1, cost=0.01)])[0]
    dear = d.propose([_ask("d", [1, 2, 3], 1, cost=0.9)])[0]
    assert len(cheap.tokens) > len(dear.tokens) == 0
