"""The per-sequence EAGLE proposal the batched EagleProposer.propose must equal: reclaim's earlier
code path, one sequence at a time with its own DenseCache (the test oracle)."""

from __future__ import annotations

import torch

from reclaim.engine.eagle import EagleProposer, _State, _truncate
from reclaim.engine.sampling import keyed_uniform, probs, sample
from reclaim.engine.speculative import Draft, DraftRequest
from reclaim.models.cache import DenseCache


class _BranchCache:
    """The sequence's K/V shared by every tree branch, plus each branch's ancestors' K/V."""

    def __init__(self, prefix: DenseCache) -> None:
        self.prefix, self.own, self.sliding_window = prefix, {}, None

    def select(self, rows: torch.Tensor) -> None:
        self.own = {layer: (k[rows], v[rows]) for layer, (k, v) in self.own.items()}

    def update(self, layer, k, v):
        if layer in self.own:
            k = torch.cat([self.own[layer][0], k], dim=2)
            v = torch.cat([self.own[layer][1], v], dim=2)
        self.own[layer] = (k, v)
        b = k.shape[0]
        pk, pv = self.prefix.keys[layer], self.prefix.values[layer]
        return (torch.cat([pk.expand(b, -1, -1, -1), k], dim=2),
                torch.cat([pv.expand(b, -1, -1, -1), v], dim=2), None)


def _step(p: EagleProposer, st: _State, tokens: list[int], feats: torch.Tensor, start: int) -> torch.Tensor:
    ids = torch.tensor([tokens])
    pos = torch.arange(start, start + len(tokens))[None]
    return p.drafter(p.embed(ids), feats[None], pos, st.cache)[0]


@torch.inference_mode()
def propose_one(p: EagleProposer, r: DraftRequest) -> Draft:
    """One request's draft, as reclaim proposed before batching."""
    st = p._states.get(r.seq_id)
    n = len(r.token_ids) - 1
    if st is None or st.length + len(st.feats) < n or n < 1 or st.length >= n:
        return Draft()
    feed = n - st.length
    g = _step(p, st, r.token_ids[st.length + 1: n + 1], torch.stack(st.feats[:feed]), st.length)[-1]
    st.length, st.feats = n, st.feats[feed:]
    if p.topk > 1:
        return _tree(p, st, g, n, r.max_tokens)
    tokens, qs = [], []
    for j in range(r.max_tokens):
        logits, ids = p._logits(g[None])
        if r.params.greedy:
            tok = int(logits[0].argmax())
        elif r.params.seed is not None:
            tok = sample(logits, [r.params], [keyed_uniform(r.params.seed, len(r.token_ids) + j)])[0]
        else:
            q = probs(logits, [r.params])[0]
            tok = int(torch.multinomial(q.float(), 1, generator=r.generator).item())
            if ids is not None:
                q = torch.zeros(p.head.weight.shape[0], dtype=q.dtype).index_copy_(0, ids, q)
            qs.append(q)
        tok = tok if ids is None else int(ids[tok])
        tokens.append(tok)
        if j + 1 < r.max_tokens:
            g = _step(p, st, [tok], g[None], n + j)[-1]
    _truncate(st.cache, n)
    return Draft(tokens, torch.stack(qs) if qs else None)


def _tree(p: EagleProposer, st: _State, g: torch.Tensor, n: int, budget: int) -> Draft:
    k = p.topk
    logits, vocab = p._logits(g[None])
    to_target = (lambda t: t) if vocab is None else (lambda t: vocab[t])
    top = torch.log_softmax(logits, -1)[0].topk(k)
    tokens, parents, scores = to_target(top.indices).tolist(), [-1] * k, top.values.tolist()
    frontier = list(range(k))
    feats = g[None].expand(k, -1)
    cache = _BranchCache(st.cache)
    for d in range(1, p.depth):
        inp = torch.tensor([[tokens[i]] for i in frontier])
        pos = torch.full((len(frontier), 1), n + d - 1)
        out = p.drafter(p.embed(inp), feats[:, None], pos, cache)[:, 0]
        lp = torch.log_softmax(p._logits(out)[0], -1)
        cand = torch.tensor([scores[i] for i in frontier])[:, None] + lp
        val, idx = cand.topk(k, -1)
        first = len(tokens)
        for b, node in enumerate(frontier):
            tokens += to_target(idx[b]).tolist()
            parents += [node] * k
            scores += val[b].tolist()
        best = val.flatten().topk(k).indices
        frontier = [first + int(i) for i in best]
        rows = best // k
        feats = out[rows]
        cache.select(rows)
    keep = sorted(range(len(tokens)), key=lambda i: (-scores[i], i))[: min(p.total, budget)]
    keep.sort()
    where = {old: new for new, old in enumerate(keep)}
    return Draft([tokens[i] for i in keep], None, [where[parents[i]] if parents[i] >= 0 else -1 for i in keep])
