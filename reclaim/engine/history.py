"""The history drafter (`--speculative suffix`): drafts what followed the current context in the
prompt, in the other completions of the same prompt, and in recent outputs. No model runs.

Two kinds of `SuffixIndex` (suffix.py) are kept:
- one per prompt: the prompt and every sequence of it, streamed in as its tokens are committed
  (GRPO's group siblings still decoding, the ones that finished, and, across rounds, earlier
  steps' completions of the prompt within `history_steps` rounds, so it follows the policy);
- one over finished sequences of every prompt (serving's recent outputs).
Finished sequences are kept until their tokens exceed `cache_tokens` (least recently used
prompt's first) or their round falls out of the window; sequences in flight are never dropped.

A draft comes from the longest suffixes of the context with continuations in either index (a
few candidates, the best kept by expected accepted tokens). Its size follows its confidence:
tokens are added best first while one's probability (its count share, scaled by the acceptance
measured so far) pays for verifying it at the step's `token_cost` (and the whole draft for the
step's `overhead` of verifying one at all), a path is at most
`spec_factor` times the match length, and a sequence's tokens count `1 + length / length_scale`
times (DAS's length-aware budget: the long sequences that set a rollout's makespan draft deeper).
"""

from __future__ import annotations

import itertools
import json
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from reclaim.engine.speculative import Draft, DraftRequest
from reclaim.engine.suffix import DraftTree, SuffixIndex

_ALL = None  # the index over every prompt's finished sequences
_BUCKETS = 6
_DECAY = 0.995


def _bucket(context: int) -> int:
    return min(_BUCKETS - 1, max(0, context - 1).bit_length())


@dataclass
class _Seq:
    group: tuple[int, ...]
    stream: int
    synced: int = 0  # tokens of the sequence in its stream
    draft: DraftTree | None = None  # the last draft, scored against what was committed after it
    at: int = 0  # sequence length when it was drafted


class SuffixProposer:
    """Drafts from per-prompt and recent-output suffix tries (see the module docstring)."""

    def __init__(self, *, cache_tokens: int = 1 << 18, max_depth: int = 24, history_steps: int | None = None,
                 branch: int = 1, spec_factor: float = 1.0, min_prob: float = 0.05, length_scale: int = 256,
                 candidates: int = 3) -> None:
        if cache_tokens < 1:
            raise ValueError(f"suffix cache_tokens={cache_tokens}; allowed: >= 1 (tokens of finished sequences kept)")
        if history_steps is not None and history_steps < 0:
            raise ValueError(f"suffix_history_steps={history_steps}; allowed: >= 0 rounds, or None (no window)")
        if branch < 1 or spec_factor <= 0 or not 0 <= min_prob < 1 or length_scale < 1:
            raise ValueError(f"branch={branch}, spec_factor={spec_factor}, min_prob={min_prob}, length_scale="
                             f"{length_scale}; need branch >= 1, spec_factor > 0, 0 <= min_prob < 1, length_scale >= 1")
        self.cache_tokens, self.max_depth, self.history_steps = cache_tokens, max_depth, history_steps
        self.branch, self.spec_factor, self.min_prob = branch, spec_factor, min_prob
        self.length_scale, self.candidates = length_scale, candidates
        self._indices: dict[tuple[int, ...] | None, SuffixIndex] = {_ALL: SuffixIndex(max_depth)}
        self._seqs: dict[str, _Seq] = {}
        self._kept: OrderedDict[tuple[tuple[int, ...] | None, int], tuple[int, int]] = OrderedDict()  # -> (tokens, round)
        self._kept_tokens = 0
        self._ids = itertools.count()
        self.round = 0
        # Calibration, per length of the predicting context (buckets 1, 2, 3-4, 5-8, 9-16, 17+):
        # decayed sums of the count shares of the draft tokens the target reached, and of those
        # it accepted. A share of 1 from one earlier occurrence is not a certainty.
        self._predicted = [1.5] * _BUCKETS
        self._accepted = [1.0] * _BUCKETS
        self.stats = {"drafts": 0, "drafted": 0, "accepted": 0, "evicted_tokens": 0}

    # ---- the Proposer interface ----

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return [Draft() if t is None else t.as_draft() for t in self.trees(requests)]

    def trees(self, requests: list[DraftRequest]) -> list[DraftTree | None]:
        """Each request's draft with its tokens' probabilities (None: nothing worth drafting)."""
        return [self._tree(self._sync(r), r) for r in requests]

    def sync(self, requests: list[DraftRequest]) -> None:
        """Take in the requests' committed tokens without drafting."""
        for r in requests:
            self._sync(r)

    def observe(self, seq_id: str, start: int, token_ids: list[int], hidden: torch.Tensor) -> None:
        pass  # tokens arrive with propose and finish; hidden states are not needed

    def finish(self, seq_id: str, token_ids: list[int], num_prompt_tokens: int) -> None:
        """A sequence ended (finished or aborted): its whole stream is kept as history."""
        seq = self._seqs.get(seq_id) or self._open(seq_id, token_ids, num_prompt_tokens)
        del self._seqs[seq_id]
        self._score_last(seq, token_ids)
        index = self._indices[seq.group]
        index.extend(seq.stream, list(token_ids[seq.synced:]))
        index.close(seq.stream)
        self._keep(seq.group, seq.stream, len(token_ids))
        self.warm([token_ids])

    def warm(self, sequences: list[list[int]]) -> None:
        """Start the recent-outputs history with earlier outputs (`--suffix-history`): kept and
        evicted like the sequences this engine finishes, the oldest first."""
        for tokens in sequences:
            stream = next(self._ids)
            self._indices[_ALL].extend(stream, list(tokens))
            self._indices[_ALL].close(stream)
            self._keep(_ALL, stream, len(tokens))
        self._evict()

    def recent_outputs(self) -> list[list[int]]:
        """The recent-outputs history's sequences, oldest first (what `warm` takes back)."""
        streams = self._indices[_ALL].streams()
        return [list(streams[s]) for g, s in self._kept if g is _ALL]

    def release(self, seq_id: str) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:  # never finished (the engine finishes every sequence it releases)
            self._indices[seq.group].close(seq.stream)
            self._keep(seq.group, seq.stream, seq.synced)

    def next_round(self) -> None:
        """A new rollout begins (GRPO: the next step): rounds older than the window are dropped."""
        self.round += 1
        if self.history_steps is None:
            return
        old = [k for k, (_, r) in self._kept.items() if r < self.round - self.history_steps]
        for key in old:
            self._drop(key)

    # ---- memory ----

    def memory(self) -> dict[str, float]:
        """What the history holds: tokens, trie nodes and bytes, in all and per prompt."""
        groups = [ix for key, ix in self._indices.items() if key is not _ALL]
        per = [ix.nbytes() for ix in groups]
        every = self._indices[_ALL]
        return {"prompts": len(groups), "tokens": sum(ix.num_tokens for ix in self._indices.values()),
                "kept_tokens": self._kept_tokens, "nodes": sum(ix.num_nodes for ix in self._indices.values()),
                "bytes": sum(per) + every.nbytes(), "recent_outputs_bytes": every.nbytes(),
                "per_prompt_bytes_mean": sum(per) / len(per) if per else 0.0,
                "per_prompt_bytes_max": max(per, default=0)}

    # ---- drafting ----

    def _open(self, seq_id: str, token_ids: list[int], num_prompt_tokens: int) -> _Seq:
        group = tuple(token_ids[:num_prompt_tokens])
        if group not in self._indices:
            self._indices[group] = SuffixIndex(self.max_depth)
        else:  # the prompt is in use again: its history is the most recently used
            for key in [k for k in self._kept if k[0] == group]:
                self._kept.move_to_end(key)
        seq = self._seqs[seq_id] = _Seq(group, next(self._ids))
        return seq

    def _sync(self, r: DraftRequest) -> _Seq:
        seq = self._seqs.get(r.seq_id) or self._open(r.seq_id, r.token_ids, r.num_prompt_tokens)
        self._score_last(seq, r.token_ids)
        self._indices[seq.group].extend(seq.stream, r.token_ids[seq.synced:])
        seq.synced = len(r.token_ids)
        return seq

    def _tree(self, seq: _Seq, r: DraftRequest) -> DraftTree | None:
        if r.max_tokens < 1:
            return None
        own = self._indices[seq.group]
        value = 1 + max(0, len(r.token_ids) - r.num_prompt_tokens) / self.length_scale
        cost, overhead = r.token_cost / value, r.overhead / value
        best, best_gain = None, 0.0
        for index in (own, self._indices[_ALL]):
            for node in index.matches(r.token_ids)[: self.candidates]:
                m = index.depth(node)
                tree = index.grow(node, r.max_tokens, branch=self.branch, min_prob=self.min_prob, scale=self.scale,
                                  max_path=max(1, min(r.max_tokens, math.ceil(self.spec_factor * m))))
                tree, gain = _worth(tree, cost, overhead)
                if gain > best_gain:
                    best, best_gain = tree, gain
        seq.draft, seq.at = best, len(r.token_ids)
        if best is not None:
            self.stats["drafts"] += 1
            self.stats["drafted"] += len(best.tokens)
        return best

    def scale(self, context: int) -> float:
        """Measured acceptance over predicted, for a token predicted from `context` tokens."""
        b = _bucket(context)
        return self._accepted[b] / self._predicted[b]

    def _score_last(self, seq: _Seq, token_ids: list[int]) -> None:
        """Score the last draft against what the target committed after it: every token it
        reached (the children of the root and of each accepted token), accepted or not."""
        tree, seq.draft = seq.draft, None
        if tree is None or len(token_ids) <= seq.at:
            return
        children: dict[int, list[int]] = {}
        for i, p in enumerate(tree.parents):
            children.setdefault(p, []).append(i)
        node = -1
        for t in token_ids[seq.at: seq.at + len(tree.tokens)]:
            nxt = None
            for i in children.get(node, []):
                b = _bucket(tree.contexts[i])
                hit = tree.tokens[i] == t
                self._predicted[b] = _DECAY * self._predicted[b] + tree.conds[i]
                self._accepted[b] = _DECAY * self._accepted[b] + hit
                nxt = i if hit else nxt
            if nxt is None:
                break
            node = nxt
            self.stats["accepted"] += 1

    # ---- what is kept ----

    def _keep(self, group: tuple[int, ...] | None, stream: int, tokens: int) -> None:
        assert (group, stream) not in self._kept, "a stream is kept once"
        self._kept[(group, stream)] = (tokens, self.round)
        self._kept_tokens += tokens

    def _evict(self) -> None:
        while self._kept_tokens > self.cache_tokens and self._kept:
            self._drop(next(iter(self._kept)))

    def _drop(self, key: tuple[tuple[int, ...] | None, int]) -> None:
        tokens, _ = self._kept.pop(key)
        self._kept_tokens -= tokens
        self.stats["evicted_tokens"] += tokens
        group, stream = key
        index = self._indices[group]
        index.remove(stream)
        if group is not _ALL and not index.streams():
            del self._indices[group]


def _worth(tree: DraftTree, cost: float, overhead: float) -> tuple[DraftTree | None, float]:
    """The draft cut where tokens stop paying: the best-first prefix with the most expected tokens
    per cost, (1 + sum p) / (1 + overhead + n * cost) (a token's path probability p is the chance
    the target accepts it); None when no prefix beats plain decoding. Returns it and its gain
    over plain decoding (rate - 1)."""
    best_n, best_rate, mass = 0, 1.0, 0.0
    for n, p in enumerate(tree.probs, 1):
        mass += p
        rate = (1 + mass) / (1 + overhead + n * cost)
        if rate > best_rate:
            best_n, best_rate = n, rate
    if best_n == 0:
        return None, 0.0
    return tree.cut(best_n), best_rate - 1


def read_history(path: str, encode: Callable[[str], list[int]] | None, vocab_size: int | None) -> list[list[int]]:
    """Earlier outputs for `SuffixProposer.warm` from a JSON-lines file: per line {"token_ids":
    [...]} (the target's own tokens, as `write_history` saves them) or {"text": "..."} (encoded
    with `encode`). A token id outside the vocabulary (None: not checked), a text line without
    `encode`, or a line of neither form, is refused by line."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"suffix history {path} line {n} is not JSON ({e.msg})") from None
            if isinstance(row, dict) and isinstance(row.get("text"), str):
                if encode is None:
                    raise ValueError(f"suffix history {path} line {n} is text, and no tokenizer was given")
                out.append(encode(row["text"]))
                continue
            ids = row.get("token_ids") if isinstance(row, dict) else None
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError(f"suffix history {path} line {n}: allowed per line are {{\"token_ids\": [int, ...]}} "
                                 f"or {{\"text\": str}}")
            bad = None if vocab_size is None else next((t for t in ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise ValueError(f"suffix history {path} line {n} has token id {bad}; allowed: 0 to {vocab_size - 1} "
                                 "(a history of another tokenizer?)")
            out.append(ids)
    return out


def write_history(path: str, sequences: list[list[int]]) -> None:
    """Sequences as `read_history` reads them, one {"token_ids": [...]} per line, written whole
    (a crash leaves the old file)."""
    from reclaim.storage import atomic_write_text

    atomic_write_text(path, "".join(json.dumps({"token_ids": list(s)}) + "\n" for s in sequences))
