"""The EAGLE drafter inside the engine: keeps each sequence's drafter cache in step with the
target and proposes chain drafts from the target's hidden states.

For a sequence x_0..x_n (x_n not yet run by the target) the drafter has consumed the pairs
(f_i, x_{i+1}) for i < `length`. `propose` first feeds the pairs the target has produced since
(true hidden states, as `observe` handed them over), which also yields g_{n-1}, the prediction
of f_n; then it drafts d_1 = head(g_{n-1}), feeds (g, d_1) to get the next prediction, and so
on. The draft steps' cache entries are dropped afterwards: once the target has verified the
draft, the pairs are fed again with the target's true hidden states. A sequence recomputed
from an earlier position (preemption, new weights) truncates its drafter cache there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from reclaim.engine.sampling import keyed_uniform, probs, sample
from reclaim.engine.speculative import Draft, DraftRequest
from reclaim.models.cache import DenseCache
from reclaim.models.drafter import EagleDrafter, draft_head, load_drafter
from reclaim.models.kernels.linear import linear


@dataclass
class _State:
    cache: DenseCache = field(default_factory=DenseCache)
    length: int = 0  # pairs (f_i, x_{i+1}) consumed: i < length
    feats: list[torch.Tensor] = field(default_factory=list)  # f_length, f_length+1, ... not consumed yet


def _truncate(cache: DenseCache, n: int) -> None:
    for d in (cache.keys, cache.values):
        for layer in list(d):
            d[layer] = d[layer][:, :, :n]


class _BranchCache:
    """Tree drafting's attention cache: the sequence's K/V shared by every branch, plus each
    branch's own ancestors' K/V [B, Hkv, depth, D]. One new token per branch sees all of them."""

    def __init__(self, prefix: DenseCache) -> None:
        self.prefix = prefix
        self.own: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def select(self, rows: torch.Tensor) -> None:
        """Branch i continues branch rows[i] (children inherit their parent's ancestors)."""
        self.own = {layer: (k[rows], v[rows]) for layer, (k, v) in self.own.items()}

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        if layer in self.own:
            k = torch.cat([self.own[layer][0], k], dim=2)
            v = torch.cat([self.own[layer][1], v], dim=2)
        self.own[layer] = (k, v)
        b = k.shape[0]
        pk, pv = self.prefix.keys[layer], self.prefix.values[layer]
        return (torch.cat([pk.expand(b, -1, -1, -1), k], dim=2),
                torch.cat([pv.expand(b, -1, -1, -1), v], dim=2), None)


class EagleProposer:
    """Chain or tree drafts from an EAGLE drafter sharing the target's embeddings and LM head.

    topk > 1 drafts a tree as EAGLE-2 does: each level expands the `topk` best nodes so far (by
    the drafter's cumulative log-probability) into their `topk` most likely children, for `depth`
    levels; the `total` best nodes are verified.
    """

    def __init__(self, drafter: EagleDrafter, target: torch.nn.Module, *, topk: int = 1,
                 depth: int = 4, total: int | None = None) -> None:
        self.drafter = drafter.eval()
        self.topk, self.depth, self.total = topk, depth, total or depth * topk
        self.embed = target.model.embed_tokens
        self.head = target.lm_head
        self.target = target
        self._states: dict[str, _State] = {}
        self._head_rows: tuple[int, torch.Tensor, torch.Tensor | None] | None = None

    def _logits(self, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft logits [..., N] over the draft vocabulary and its target ids (None: all V). The
        head rows are copied once per version of the target's head (it changes with RL steps)."""
        w = self.head.weight
        if self._head_rows is None or self._head_rows[0] != w._version:
            rows, ids = draft_head(self.drafter, self.target)
            self._head_rows = (w._version, rows.contiguous() if ids is not None else rows, ids)
        _, rows, ids = self._head_rows
        return linear(g, rows).float(), ids

    @classmethod
    def load(cls, path: str | os.PathLike, target: torch.nn.Module, **tree: int) -> "EagleProposer":
        return cls(load_drafter(path, target), target, **tree)

    def observe(self, seq_id: str, start: int, token_ids: list[int], hidden: torch.Tensor) -> None:
        st = self._states.setdefault(seq_id, _State())
        have = st.length + len(st.feats)
        if start < st.length:  # recomputed from an earlier position: forget what followed
            _truncate(st.cache, start)
            st.length, st.feats = start, []
        elif start < have:
            st.feats = st.feats[: start - st.length]
        elif start > have:  # a gap (should not happen): start over from here on is impossible
            self.release(seq_id)
            return
        st.feats.extend(hidden.detach())

    def release(self, seq_id: str) -> None:
        self._states.pop(seq_id, None)

    def share(self, src: str, dst: str, num_tokens: int) -> None:
        """`dst` starts with `src`'s first num_tokens tokens (a shared prompt prefix): take src's
        drafter state up to there (tensors are never modified in place, so sharing them is safe)."""
        st = self._states.get(src)
        if st is None:
            return
        n = min(st.length, num_tokens)
        new = _State(length=n, feats=list(st.feats[: max(0, num_tokens - st.length)]) if st.length <= num_tokens else [])
        for layer in st.cache.keys:
            new.cache.keys[layer] = st.cache.keys[layer][:, :, :n]
            new.cache.values[layer] = st.cache.values[layer][:, :, :n]
        self._states[dst] = new

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return [self._propose(r) for r in requests]

    def _step(self, st: _State, tokens: list[int], feats: torch.Tensor, start: int) -> torch.Tensor:
        """Feed pairs (feats[j], tokens[j]) at positions start + j; the drafter's outputs [T, H]."""
        dev = self.head.weight.device
        ids = torch.tensor([tokens], device=dev)
        pos = torch.arange(start, start + len(tokens), device=dev)[None]
        return self.drafter(self.embed(ids), feats[None].to(dev), pos, st.cache)[0]

    def _propose(self, r: DraftRequest) -> Draft:
        st = self._states.get(r.seq_id)
        n = len(r.token_ids) - 1  # x_n is the pending token
        if st is None or st.length + len(st.feats) < n or n < 1 or st.length >= n:
            return Draft()  # the drafter has not seen the target's states up to x_n yet
        feed = n - st.length
        g = self._step(st, r.token_ids[st.length + 1: n + 1], torch.stack(st.feats[:feed]), st.length)[-1]
        st.length, st.feats = n, st.feats[feed:]
        if self.topk > 1:
            return self._tree(st, g, n, r.max_tokens)
        tokens, qs = [], []
        for j in range(r.max_tokens):
            logits, ids = self._logits(g[None])
            if r.params.greedy:
                tok = int(logits[0].argmax())
            elif r.params.seed is not None:  # coupled with the keyed draw the target will make
                tok = sample(logits, [r.params], [keyed_uniform(r.params.seed, len(r.token_ids) + j)])[0]
            else:
                q = probs(logits, [r.params])[0]
                tok = int(torch.multinomial(q.float(), 1, generator=r.generator).item())
                if ids is not None:  # q over the whole vocabulary: zero outside the draft's
                    q = torch.zeros(self.head.weight.shape[0], dtype=q.dtype, device=q.device).index_copy_(0, ids, q)
                qs.append(q)
            tok = tok if ids is None else int(ids[tok])
            tokens.append(tok)
            if j + 1 < r.max_tokens:
                g = self._step(st, [tok], g[None], n + j)[-1]
        _truncate(st.cache, n)
        return Draft(tokens, torch.stack(qs) if qs else None)

    def _tree(self, st: _State, g: torch.Tensor, n: int, budget: int) -> Draft:
        """EAGLE-2's dynamic tree from g (the prediction of f_n); deterministic tokens."""
        k = self.topk
        logits, vocab = self._logits(g[None])
        to_target = (lambda t: t) if vocab is None else (lambda t: vocab[t])
        lp = torch.log_softmax(logits, -1)[0]
        top = lp.topk(k)
        tokens, parents, scores = to_target(top.indices).tolist(), [-1] * k, top.values.tolist()
        frontier = list(range(k))  # nodes to expand next
        feats = g[None].expand(k, -1)  # each frontier node's input feature (its parent's prediction)
        cache = _BranchCache(st.cache)
        emb = self.embed
        for d in range(1, self.depth):
            dev = g.device
            inp = torch.tensor([[tokens[i]] for i in frontier], device=dev)
            pos = torch.full((len(frontier), 1), n + d - 1, device=dev)
            out = self.drafter(emb(inp), feats[:, None], pos, cache)[:, 0]  # [B, H]
            lp = torch.log_softmax(self._logits(out)[0], -1)
            cand = torch.tensor([scores[i] for i in frontier], device=dev)[:, None] + lp
            val, idx = cand.topk(k, -1)  # [B, k] best children of each frontier node
            first = len(tokens)
            for b, node in enumerate(frontier):
                tokens += to_target(idx[b]).tolist()
                parents += [node] * k
                scores += val[b].tolist()
            best = val.flatten().topk(k).indices  # the next frontier: best children overall
            frontier = [first + int(i) for i in best]
            rows = best // k
            feats = out[rows]
            cache.select(rows)
        keep = sorted(range(len(tokens)), key=lambda i: (-scores[i], i))[: min(self.total, budget)]
        keep.sort()  # creation order: parents before children, siblings best first
        where = {old: new for new, old in enumerate(keep)}
        return Draft([tokens[i] for i in keep], None,
                     [where[parents[i]] if parents[i] >= 0 else -1 for i in keep])
