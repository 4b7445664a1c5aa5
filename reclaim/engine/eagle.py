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

from reclaim.engine.sampling import probs
from reclaim.engine.speculative import Draft, DraftRequest
from reclaim.models.cache import DenseCache
from reclaim.models.drafter import EagleDrafter, load_drafter


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
    """Chain drafts from an EAGLE drafter sharing the target's embeddings and LM head."""

    def __init__(self, drafter: EagleDrafter, target: torch.nn.Module) -> None:
        self.drafter = drafter.eval()
        self.embed = target.model.embed_tokens
        self.head = target.lm_head
        self._states: dict[str, _State] = {}

    @classmethod
    def load(cls, path: str | os.PathLike, target: torch.nn.Module) -> "EagleProposer":
        return cls(load_drafter(path, target), target)

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
        tokens, qs = [], []
        for j in range(r.max_tokens):
            logits = self.head(g[None]).float()
            if r.params.greedy:
                tok = int(logits[0].argmax())
            else:
                q = probs(logits, [r.params])[0]
                tok = int(torch.multinomial(q.float(), 1, generator=r.generator).item())
                qs.append(q)
            tokens.append(tok)
            if j + 1 < r.max_tokens:
                g = self._step(st, [tok], g[None], n + j)[-1]
        _truncate(st.cache, n)
        return Draft(tokens, torch.stack(qs) if qs else None)
