"""The EAGLE drafter inside the engine: keeps each sequence's drafter cache in step with the
target and proposes chain or tree drafts from the target's hidden states.

For a sequence x_0..x_n (x_n not yet run by the target) the drafter has consumed the pairs
(f_i, x_{i+1}) for i < `length`. `propose` first feeds the pairs the target has produced since
(true hidden states, as `observe` handed them over), which also yields g_{n-1}, the prediction
of f_n; then it drafts d_1 = head(g_{n-1}), feeds (g, d_1) to get the next prediction, and so
on. The draft steps' cache entries are dropped afterwards: once the target has verified the
draft, the pairs are fed again with the target's true hidden states. A sequence recomputed
from an earlier position (preemption, new weights) truncates its drafter cache there.

All sequences of a step draft together: one forward feeds every sequence's pairs (rows of
different lengths, padded under a mask), then one forward per draft depth or tree level."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from reclaim.engine.sampling import keyed_uniform, probs, sample
from reclaim.engine.speculative import Draft, DraftRequest
from reclaim.models.cache import DenseCache, MaskedCache
from reclaim.models.drafter import EagleDrafter, draft_head, load_drafter
from reclaim.models.kernels.linear import SMALL_ROWS, linear


@dataclass
class _State:
    cache: DenseCache = field(default_factory=DenseCache)
    length: int = 0  # pairs (f_i, x_{i+1}) consumed: i < length
    feats: list[torch.Tensor] = field(default_factory=list)  # f_length, f_length+1, ... not consumed yet


def _truncate(cache: DenseCache, n: int) -> None:
    for d in (cache.keys, cache.values):
        for layer in list(d):
            d[layer] = d[layer][:, :, :n]


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
            with torch.inference_mode(False), torch.no_grad():  # a tensor with a version: the kernel packs it once
                rows, ids = draft_head(self.drafter, self.target)
                self._head_rows = (w._version, rows.contiguous() if ids is not None else rows, ids)
        _, rows, ids = self._head_rows
        # In rows of at most SMALL_ROWS: past that the head leaves linear's small-row kernel for
        # torch's, which here took 64 ms for 32 rows of SmolLM2's head against 41 ms in two halves.
        parts = [linear(x, rows) for x in g.reshape(-1, g.shape[-1]).split(SMALL_ROWS)]
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out.float().reshape(*g.shape[:-1], -1), ids

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

    def finish(self, seq_id: str, token_ids: list[int], num_prompt_tokens: int) -> None:
        pass  # drafts come from hidden states, not from finished text

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
        """Drafts for every request whose drafter state is ready (others get an empty Draft): one
        forward feeds all their pending pairs, then one forward per chain depth or tree level."""
        out = [Draft() for _ in requests]
        ready = [i for i, r in enumerate(requests) if self._ready(r)]
        if not ready:
            return out
        if self.topk == 1:  # longest chains first: a row that has drafted enough leaves from the end
            ready.sort(key=lambda i: -requests[i].max_tokens)
        reqs = [requests[i] for i in ready]
        room = reqs[0].max_tokens - 1 if self.topk == 1 else (self.depth - 1) * self.topk
        cache, valid, g = self._catch_up(reqs, max(room, 0))
        drafts = self._chain(reqs, cache, valid, g) if self.topk == 1 else self._tree(reqs, cache, valid, g)
        for i, d in zip(ready, drafts):
            out[i] = d
        return out

    def _ready(self, r: DraftRequest) -> bool:
        """Whether the drafter has seen the target's states up to x_n and has pairs to feed."""
        st, n = self._states.get(r.seq_id), len(r.token_ids) - 1  # x_n is the pending token
        return st is not None and n >= 1 and st.length < n <= st.length + len(st.feats)

    def _catch_up(self, reqs: list[DraftRequest], room: int) -> tuple[MaskedCache, torch.Tensor, torch.Tensor]:
        """Feed every row's pairs since its last proposal in one forward, each row laid out as
        [pad | cached | new | pad] so that what a state keeps is one slice of it.

        Returns the batch's cache (with `room` more keys a row), the keys each row may see [B, S]
        and each row's prediction of f_n [B, H]."""
        dev, cfg, w = self.head.weight.device, self.drafter.config, self.drafter.fc.weight
        states = [self._states[r.seq_id] for r in reqs]
        past = [st.length for st in states]
        new = [len(r.token_ids) - 1 - st.length for r, st in zip(reqs, states)]
        b, p, t = len(reqs), max(past), max(new)
        shape = (b, cfg.num_key_value_heads, p + t + room, cfg.head_dim)
        keys = {layer: w.new_empty(shape) for layer in range(len(self.drafter.layers))}
        values = {layer: w.new_empty(shape) for layer in keys}
        ids = torch.zeros(b, t, dtype=torch.long, device=dev)
        feats = torch.zeros(b, t, cfg.hidden_size, dtype=states[0].feats[0].dtype, device=dev)
        for i, (r, st) in enumerate(zip(reqs, states)):
            for buf, mine in ((keys, st.cache.keys), (values, st.cache.values)):
                for layer in buf:
                    buf[layer][i, :, : p - past[i]] = 0  # never attended, but 0 * NaN would be NaN
                    if past[i]:
                        buf[layer][i, :, p - past[i]: p] = mine[layer][0]
            ids[i, : new[i]] = torch.tensor(r.token_ids[past[i] + 1: past[i] + new[i] + 1])
            feats[i, : new[i]] = torch.stack(st.feats[: new[i]])
        lo, hi = torch.tensor(past, device=dev), torch.tensor(new, device=dev)
        col = torch.arange(p + t, device=dev)
        valid = (col >= p - lo[:, None]) & (col < p + hi[:, None])
        causal = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
        cache = MaskedCache(keys, values, p)
        cache.mask = torch.cat([valid[:, None, :p].expand(b, t, p), causal.expand(b, t, t)], -1)[:, None]
        pos = lo[:, None] + torch.arange(t, device=dev)
        out = self.drafter(self.embed(ids), feats, pos, cache)
        for i, st in enumerate(states):  # the pairs are kept: a copy, so the batch's buffers can go
            span = slice(p - past[i], p + new[i])
            for layer in keys:
                st.cache.keys[layer] = keys[layer][i: i + 1, :, span].clone()
                st.cache.values[layer] = values[layer][i: i + 1, :, span].clone()
            st.length, st.feats = past[i] + new[i], st.feats[new[i]:]
        return cache, valid, out[torch.arange(b, device=dev), hi - 1]

    def _chain(self, reqs: list[DraftRequest], cache: MaskedCache, valid: torch.Tensor,
               g: torch.Tensor) -> list[Draft]:
        """Chains from g (each row's prediction of f_n), one forward per depth for the rows still
        drafting (reqs ordered by max_tokens, longest first)."""
        n = torch.tensor([len(r.token_ids) - 1 for r in reqs], device=g.device)
        tokens: list[list[int]] = [[] for _ in reqs]
        qs: list[list[torch.Tensor]] = [[] for _ in reqs]
        for j in range(reqs[0].max_tokens):
            picked = self._pick(reqs[: sum(r.max_tokens > j for r in reqs)], g, j, qs)
            for row, tok in zip(tokens, picked):
                row.append(tok)
            m = sum(r.max_tokens > j + 1 for r in reqs)  # rows that draft one more
            if m:
                cache.mask = torch.cat([valid[:m], valid.new_ones(m, j + 1)], -1)[:, None, None]
                ids = torch.tensor(picked[:m], device=g.device)[:, None]
                g = self.drafter(self.embed(ids), g[:m, None], (n[:m] + j)[:, None], cache)[:, 0]
        return [Draft(t, torch.stack(q) if q else None) for t, q in zip(tokens, qs)]

    def _pick(self, reqs: list[DraftRequest], g: torch.Tensor, j: int, qs: list[list[torch.Tensor]]) -> list[int]:
        """Draft token j of each request from g[:len(reqs)], sampled as the request samples; a
        generator-sampled request's q (over the whole vocabulary) is appended to its qs."""
        logits, ids = self._logits(g[: len(reqs)])
        out = logits.argmax(-1).tolist()
        seeded = [i for i, r in enumerate(reqs) if not r.params.greedy and r.params.seed is not None]
        if seeded:  # coupled with the keyed draw the target will make
            us = [keyed_uniform(reqs[i].params.seed, len(reqs[i].token_ids) + j) for i in seeded]
            for i, tok in zip(seeded, sample(logits[seeded], [reqs[i].params for i in seeded], us)):
                out[i] = tok
        drawn = [i for i, r in enumerate(reqs) if not r.params.greedy and r.params.seed is None]
        if drawn:
            q = probs(logits[drawn], [reqs[i].params for i in drawn])
            for i, qi in zip(drawn, q):
                out[i] = int(torch.multinomial(qi.float(), 1, generator=reqs[i].generator).item())
            if ids is not None:  # q over the whole vocabulary: zero outside the draft's
                q = q.new_zeros(len(drawn), self.head.weight.shape[0]).index_copy_(1, ids, q)
            for i, qi in zip(drawn, q):
                qs[i].append(qi)
        return out if ids is None else ids[torch.tensor(out, device=ids.device)].tolist()

    def _tree(self, reqs: list[DraftRequest], cache: MaskedCache, valid: torch.Tensor,
              g: torch.Tensor) -> list[Draft]:
        """EAGLE-2's dynamic trees from g (each row's prediction of f_n); deterministic tokens.
        A row's k frontier nodes run as k tokens of it, each seeing its own ancestors' keys."""
        k, b, dev = self.topk, len(reqs), g.device
        logits, vocab = self._logits(g)
        top = torch.log_softmax(logits, -1).topk(k)
        front_tok, front_score = top.indices, top.values  # [b, k]: draft-vocabulary ids, log-probs
        tokens, scores, parents = [front_tok], [front_score], [torch.full((b, k), -1, device=dev)]
        frontier = torch.arange(k, device=dev).expand(b, k)  # node ids (creation order)
        feats = g[:, None].expand(b, k, -1)  # each frontier node's input feature (its parent's prediction)
        seen = valid[:, None].expand(b, k, -1)  # keys each frontier node sees: the row's and its ancestors'
        eye = torch.eye(k, dtype=torch.bool, device=dev).expand(b, k, k)
        n = torch.tensor([len(r.token_ids) - 1 for r in reqs], device=dev)
        to_target = (lambda x: x) if vocab is None else (lambda x: vocab[x])
        for d in range(1, self.depth):
            seen = torch.cat([seen, eye], -1)
            cache.mask = seen[:, None]
            pos = (n + d - 1)[:, None].expand(b, k)
            out = self.drafter(self.embed(to_target(front_tok)), feats, pos, cache)  # [b, k, H]
            cand = front_score[..., None] + torch.log_softmax(self._logits(out)[0], -1)
            val, idx = cand.topk(k, -1)  # [b, k, k] best children of each frontier node
            val, idx = val.flatten(1), idx.flatten(1)
            tokens.append(idx)
            scores.append(val)
            parents.append(frontier.repeat_interleave(k, 1))
            best = val.topk(k).indices  # the next frontier: best children overall
            rows = best // k
            frontier = k + (d - 1) * k * k + best
            front_tok, front_score = idx.gather(1, best), val.gather(1, best)
            feats = out.gather(1, rows[..., None].expand(-1, -1, out.shape[-1]))
            seen = seen.gather(1, rows[..., None].expand(-1, -1, seen.shape[-1]))
        tok = to_target(torch.cat(tokens, 1)).tolist()
        par = torch.cat(parents, 1).tolist()
        order = torch.cat(scores, 1).sort(dim=-1, descending=True, stable=True).indices.tolist()
        drafts = []
        for i, r in enumerate(reqs):
            keep = sorted(order[i][: min(self.total, r.max_tokens)])  # creation order: parents first
            where = {old: new for new, old in enumerate(keep)}
            drafts.append(Draft([tok[i][j] for j in keep], None,
                                [where[par[i][j]] if par[i][j] >= 0 else -1 for j in keep]))
        return drafts
