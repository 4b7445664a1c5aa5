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
from array import array
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
    """Substrings of up to `max_depth` tokens of a set of streams, with counts and suffix links.

    A node is a slot in typed arrays (its count, suffix link, depth, parent, token and first
    child inline: ~30 bytes); only nodes with several children hold a dict for the others. In a
    suffix trie of text most nodes have one child, so this is several times smaller than a dict
    per node."""

    def __init__(self, max_depth: int = 24) -> None:
        if max_depth < 2:
            raise ValueError(f"max_depth={max_depth}; allowed: >= 2 tokens")
        self.max_depth = max_depth
        # Node 0 is the root (the empty string).
        self._count = array("i", [0])
        self._link = array("i", [0])
        self._depth = array("i", [0])
        self._parent = array("i", [0])
        self._token = array("i", [-1])
        self._first = array("i", [-1])  # the first child's token (-1: no children)
        self._first_node = array("i", [0])
        self._more: dict[int, dict[int, int]] = {}  # node -> {token: child} beyond the first
        self._free: list[int] = []
        self._streams: dict[int, array] = {}
        self._tails: dict[int, list[int]] = {}  # open streams: nodes of their last 1..max_depth tokens
        self.num_tokens = 0

    # ---- size ----

    @property
    def num_nodes(self) -> int:
        return len(self._count) - len(self._free)

    def nbytes(self) -> int:
        """Memory held, estimated from the containers' sizes (CPython)."""
        arrays = 7 * 4 * len(self._count) + 8 * len(self._free)
        more = sys.getsizeof(self._more) + sum(sys.getsizeof(d) + 2 * 28 * len(d) for d in self._more.values())
        streams = sum(4 * len(t) + 64 for t in self._streams.values())
        tails = sum(8 * len(t) + 56 for t in self._tails.values())
        return arrays + more + streams + tails

    # ---- nodes ----

    def _child(self, node: int, token: int) -> int:
        """The child of `node` by `token` (0 when there is none)."""
        if self._first[node] == token:
            return self._first_node[node]
        more = self._more.get(node)
        return more.get(token, 0) if more else 0

    def _children(self, node: int) -> list[tuple[int, int]]:
        first = self._first[node]
        if first < 0:
            return []
        out = [(first, self._first_node[node])]
        more = self._more.get(node)
        return out + list(more.items()) if more else out

    def _new(self, parent: int, token: int, link: int) -> int:
        depth = self._depth[parent] + 1
        if self._free:
            node = self._free.pop()
            self._count[node], self._link[node], self._depth[node] = 0, link, depth
            self._parent[node], self._token[node], self._first[node] = parent, token, -1
        else:
            node = len(self._count)
            for arr, v in ((self._count, 0), (self._link, link), (self._depth, depth), (self._parent, parent),
                           (self._token, token), (self._first, -1), (self._first_node, 0)):
                arr.append(v)
        if self._first[parent] < 0:
            self._first[parent], self._first_node[parent] = token, node
        else:
            self._more.setdefault(parent, {})[token] = node
        return node

    def _unlink(self, node: int) -> None:
        """Take a node out of its parent's children."""
        parent, token = self._parent[node], self._token[node]
        more = self._more.get(parent)
        if self._first[parent] == token:
            if more:
                t, c = more.popitem()
                self._first[parent], self._first_node[parent] = t, c
            else:
                self._first[parent] = -1
        elif more is not None:
            del more[token]
        if more is not None and not more:
            del self._more[parent]

    # ---- streams ----

    def streams(self) -> dict[int, array]:
        return self._streams

    def extend(self, stream: int, tokens: list[int]) -> None:
        """Append tokens to a stream (a new one if unknown); its substrings ending there count once."""
        seq = self._streams.get(stream)
        if seq is None:
            seq = self._streams[stream] = array("i")
            self._tails[stream] = []
        elif stream not in self._tails:
            raise ValueError(f"stream {stream} is closed; extend an open stream or start a new one")
        tail = self._tails[stream]
        count, depth_cap, child_of = self._count, self.max_depth, self._child
        for t in tokens:
            new: list[int] = []
            for k in range(min(len(tail) + 1, depth_cap)):  # the node of the last k + 1 tokens
                parent = tail[k - 1] if k else 0
                child = child_of(parent, t)
                if not child:
                    child = self._new(parent, t, new[k - 1] if k else 0)
                count[child] += 1
                new.append(child)
            tail[:] = new
        seq.extend(tokens)
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
                child = self._child(tail[k - 1] if k else 0, t)
                self._count[child] -= 1
                if self._count[child] == 0:
                    dead.append(child)
                new.append(child)
            tail = new
        for node in reversed(dead):  # children first: each unlinks from a parent still in place
            self._unlink(node)
            self._more.pop(node, None)
        self._free.extend(dead)
        self.num_tokens -= len(seq)

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
            node = self._child(node, t)
            if not node:
                return None
        return node

    def match(self, context: list[int], max_len: int | None = None) -> int:
        """The node of the longest suffix of `context`, at most `max_len` (default max_depth - 1)
        tokens, that occurs in the index (0, the root, when none does)."""
        n = self.max_depth - 1 if max_len is None else min(max_len, self.max_depth)
        node, link, child_of = 0, self._link, self._child
        for t in context[len(context) - n:] if n < len(context) else context:
            while True:
                nxt = child_of(node, t)
                if nxt:
                    node = nxt
                    break
                if node == 0:
                    break
                node = link[node]
        return node

    def continuations(self, node: int) -> dict[int, int]:
        """What followed the node's string: next token -> occurrences."""
        return {t: self._count[c] for t, c in self._children(node)}

    def matches(self, context: list[int]) -> list[int]:
        """Nodes of the context's suffixes that have continuations, longest first."""
        node, out = self.match(context), []
        while node:
            if self._first[node] >= 0:
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
            if path_depth >= max_path:
                return
            kids = self._children(trie_node)
            if not kids:
                return
            context = self._depth[trie_node]
            factor = 1.0 if scale is None else scale(context)
            total = sum(self._count[c] for _, c in kids)
            best = kids if branch == 1 and len(kids) == 1 else \
                heapq.nlargest(branch, kids, key=lambda kv: (self._count[kv[1]], -kv[0]))
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
