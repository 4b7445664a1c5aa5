"""History drafting: a suffix trie over token streams (SuffixDecoding, arXiv 2411.04975; DAS,
arXiv 2511.13841). No model runs: what followed the current context elsewhere is the draft.

`SuffixIndex` holds every substring of at most `max_depth` tokens of its streams as a trie node
with its number of occurrences, and a suffix link (the node of the string without its first
token; the trie holds every suffix of every node, so the link always exists). Appending a token
to a stream touches one node per depth (the stream keeps the nodes of its last tokens), removing
a stream replays it the same way, so both cost O(max_depth) a token and nothing is ever rebuilt.
The longest suffix of a context that occurs anywhere is found by walking the trie with the
context and falling back along suffix links (Aho-Corasick's walk): O(max_depth) per lookup.

From the matched node, the next token's probability is its child's share of the children's
counts; a draft grows best first by path probability (a tree, or a chain with `branch` 1).
When a path reaches `max_depth`, the suffix link of its node (the same context one token
shorter) carries it on, so drafts are not bounded by the trie's depth.
"""

from __future__ import annotations

import heapq
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from reclaim.engine.speculative import Draft


@dataclass
class DraftTree:
    """Draft tokens best first (parents before children), each with its parent (-1: the pending
    token) and the probability its path is right, as the counts estimate it."""

    tokens: list[int]
    parents: list[int]
    probs: list[float]
    conds: list[float] = field(default_factory=list)  # each token's count share among its siblings
    contexts: list[int] = field(default_factory=list)  # the length of the context that predicted it

    def cut(self, n: int) -> "DraftTree":
        """The first n tokens (parents come first, so it is a tree)."""
        return DraftTree(self.tokens[:n], self.parents[:n], self.probs[:n], self.conds[:n], self.contexts[:n])

    def as_draft(self) -> Draft:
        """The engine's draft: a chain when every token follows the one before, else a tree."""
        chain = all(p == i - 1 for i, p in enumerate(self.parents))
        return Draft(self.tokens, None, None if chain else self.parents)


class SuffixIndex:
    """Substrings of up to `max_depth` tokens of a set of streams, with counts and suffix links."""

    def __init__(self, max_depth: int = 24) -> None:
        if max_depth < 2:
            raise ValueError(f"max_depth={max_depth}; allowed: >= 2 tokens")
        self.max_depth = max_depth
        # Node 0 is the root (the empty string). Parallel lists keep a node at ~100 bytes.
        self._kids: list[dict[int, int] | None] = [None]
        self._count = [0]
        self._link = [0]
        self._depth = [0]
        self._parent = [0]
        self._token = [-1]
        self._free: list[int] = []
        self._streams: dict[int, list[int]] = {}
        self._tails: dict[int, list[int]] = {}  # open streams: nodes of their last 1..max_depth tokens
        self.num_tokens = 0

    # ---- size ----

    @property
    def num_nodes(self) -> int:
        return len(self._count) - len(self._free)

    def nbytes(self) -> int:
        """Memory held, estimated from the containers' sizes (CPython)."""
        per_slot = 6 * 8  # one pointer in each of the six parallel lists
        dicts = sum(sys.getsizeof(k) for k in self._kids if k is not None)
        ints = 28 * (self.num_nodes * 2 + self.num_tokens)  # counts / depths not small-int cached, tokens
        tails = sum(8 * len(t) for t in self._tails.values())
        return per_slot * len(self._count) + dicts + ints + 8 * self.num_tokens + tails

    # ---- streams ----

    def streams(self) -> dict[int, list[int]]:
        return self._streams

    def extend(self, stream: int, tokens: list[int]) -> None:
        """Append tokens to a stream (a new one if unknown); its substrings ending there count once."""
        seq = self._streams.setdefault(stream, [])
        if stream not in self._tails:
            if seq:
                raise ValueError(f"stream {stream} is closed; extend an open stream or start a new one")
            self._tails[stream] = []
        tail = self._tails[stream]
        kids, count, depth_cap = self._kids, self._count, self.max_depth
        for t in tokens:
            new: list[int] = []
            for k in range(min(len(tail) + 1, depth_cap)):  # the node of the last k + 1 tokens
                parent = tail[k - 1] if k else 0
                children = kids[parent]
                if children is None:
                    children = kids[parent] = {}
                child = children.get(t)
                if child is None:
                    child = children[t] = self._new(parent, t, new[k - 1] if k else 0)
                count[child] += 1
                new.append(child)
            tail[:] = new
            seq.append(t)
        self.num_tokens += len(tokens)

    def close(self, stream: int) -> None:
        """No more tokens come to this stream (its tail nodes are forgotten; it stays indexed)."""
        self._tails.pop(stream, None)

    def remove(self, stream: int) -> None:
        """Forget a stream: its occurrences uncounted, nodes left with none freed."""
        seq = self._streams.pop(stream)
        self._tails.pop(stream, None)
        dead = []
        tail: list[int] = []
        for t in seq:  # the same walk as extend, uncounting; nodes freed after (children are reached through them)
            new = []
            for k in range(min(len(tail) + 1, self.max_depth)):
                child = self._kids[tail[k - 1] if k else 0][t]
                self._count[child] -= 1
                if self._count[child] == 0:
                    dead.append(child)
                new.append(child)
            tail = new
        for node in dead:
            parent = self._parent[node]
            siblings = self._kids[parent]
            if siblings is not None:
                del siblings[self._token[node]]
                if not siblings:
                    self._kids[parent] = None
            self._kids[node] = None
        self._free.extend(dead)
        self.num_tokens -= len(seq)

    def _new(self, parent: int, token: int, link: int) -> int:
        depth = self._depth[parent] + 1
        if self._free:
            node = self._free.pop()
            self._kids[node], self._count[node], self._link[node] = None, 0, link
            self._depth[node], self._parent[node], self._token[node] = depth, parent, token
            return node
        self._kids.append(None)
        self._count.append(0)
        self._link.append(link)
        self._depth.append(depth)
        self._parent.append(parent)
        self._token.append(token)
        return len(self._count) - 1

    # ---- lookups ----

    def count(self, node: int) -> int:
        return self._count[node]

    def depth(self, node: int) -> int:
        return self._depth[node]

    def link(self, node: int) -> int:
        return self._link[node]

    def find(self, tokens: list[int]) -> int | None:
        """The node of exactly this string, or None if it does not occur (or is too long)."""
        node = 0
        for t in tokens:
            kids = self._kids[node]
            node = kids.get(t) if kids is not None else None
            if node is None:
                return None
        return node

    def match(self, context: list[int], max_len: int | None = None) -> int:
        """The node of the longest suffix of `context`, at most `max_len` (default max_depth - 1)
        tokens, that occurs in the index (0, the root, when none does)."""
        n = self.max_depth - 1 if max_len is None else min(max_len, self.max_depth)
        node, kids, link = 0, self._kids, self._link
        for t in context[len(context) - n:] if n < len(context) else context:
            while True:
                children = kids[node]
                nxt = children.get(t) if children is not None else None
                if nxt is not None:
                    node = nxt
                    break
                if node == 0:
                    break
                node = link[node]
        return node

    def continuations(self, node: int) -> dict[int, int]:
        """What followed the node's string: next token -> occurrences."""
        kids = self._kids[node]
        return {t: self._count[c] for t, c in kids.items()} if kids else {}

    def matches(self, context: list[int]) -> list[int]:
        """Nodes of the context's suffixes that have continuations, longest first."""
        node, out = self.match(context), []
        while node:
            if self._kids[node]:
                out.append(node)
            node = self._link[node]
        return out

    def grow(self, node: int, budget: int, *, branch: int = 1, max_path: int | None = None,
             min_prob: float = 0.0, scale: Callable[[int], float] | None = None) -> DraftTree:
        """A draft continuing `node`'s string: up to `budget` tokens best first by path probability
        (the product of each token's share of its siblings' counts, times scale(context length)
        when given, a calibration), at most `branch` children a node and `max_path` tokens a
        path, none below `min_prob`."""
        max_path = budget if max_path is None else max_path
        out = DraftTree([], [], [])
        heap: list[tuple[float, int, int, int, int, float, int]] = []  # (-prob, order, parent, node, path, cond, context)
        order = 0

        def push(parent: int, trie_node: int, prob: float, path_depth: int) -> None:
            nonlocal order
            if trie_node and self._depth[trie_node] >= self.max_depth:
                trie_node = self._link[trie_node]  # the same context one token shorter carries on
            kids = self._kids[trie_node]
            if not kids or path_depth >= max_path:
                return
            context = self._depth[trie_node]
            factor = 1.0 if scale is None else scale(context)
            total = sum(self._count[c] for c in kids.values())
            best = heapq.nlargest(branch, kids.items(), key=lambda kv: (self._count[kv[1]], -kv[0]))
            for _, c in best:
                cond = self._count[c] / total
                p = prob * min(1.0, factor * cond)
                if p >= min_prob:
                    heapq.heappush(heap, (-p, order, parent, c, path_depth + 1, cond, context))
                    order += 1

        push(-1, node, 1.0, 0)
        while heap and len(out.tokens) < budget:
            neg, _, parent, c, d, cond, context = heapq.heappop(heap)
            out.tokens.append(self._token[c])
            out.parents.append(parent)
            out.probs.append(-neg)
            out.conds.append(cond)
            out.contexts.append(context)
            push(len(out.tokens) - 1, c, -neg, d)
        return out
