"""The drafter a speculative config names, and the hybrid one that merges two drafters' drafts.

`HybridProposer` asks the history drafter (suffix) for its draft and the EAGLE drafter for a
chain (or tree) of its most likely tokens, and merges them into one tree per sequence: shared
prefixes once, the history draft's branches first. The model drafter is EAGLE-1/2 or
EAGLE-3 (whichever layout the directory holds). Every token is deterministic (EAGLE's are its
argmax choices), so the tree path's recursive rejection keeps the output exactly the target's.
Where the history draft is confident on its own, EAGLE is not run for that sequence (its state
catches up at its next draft). `mode` picks per step which of the two draft: "suffix",
"eagle" or "hybrid" (the engine's gate chooses it per batch size by measured tokens/s).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from reclaim.engine.history import SuffixProposer, read_history
from reclaim.engine.request import SamplingParams
from reclaim.engine.speculative import Draft, Proposer, DraftRequest, NgramProposer, SpeculativeConfig

HYBRID_MODES = ("suffix", "eagle", "hybrid")
_GREEDY = SamplingParams(temperature=0.0)


def merge(first: Draft, second: Draft, budget: int) -> Draft:
    """One tree holding both drafts' paths (chains or trees), shared prefixes once, at most
    `budget` tokens (the first draft's kept whole, the second's nodes while they fit)."""
    tokens, parents = list(first.tokens), list(first.parents or range(-1, len(first.tokens) - 1))
    where = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens))}
    own = second.parents or list(range(-1, len(second.tokens) - 1))
    mapped: list[int | None] = []
    for t, p in zip(second.tokens, own):
        parent = -1 if p < 0 else mapped[p]
        if parent is None:  # its parent did not fit
            mapped.append(None)
            continue
        node = where.get((parent, t))
        if node is None and len(tokens) < budget:
            node = where[(parent, t)] = len(tokens)
            tokens.append(t)
            parents.append(parent)
        mapped.append(node)
    chain = all(p == i - 1 for i, p in enumerate(parents))
    return Draft(tokens[:budget], None, None if chain else parents[:budget])


class HybridProposer:
    """History and EAGLE drafts merged into one verify tree per sequence (see module docstring)."""

    def __init__(self, history: SuffixProposer, model: Any, *, model_tokens: int, confident: float = 0.7) -> None:
        self.history, self.model, self.model_tokens, self.confident = history, model, model_tokens, confident
        self.aux_layers = getattr(model, "aux_layers", None)  # EAGLE-3 observes these layers' input states
        self.mode = "hybrid"
        self.stats = {"model_skipped": 0, "model_drafts": 0}

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        if self.mode not in HYBRID_MODES:
            raise ValueError(f"hybrid mode {self.mode!r} is unknown; allowed: {list(HYBRID_MODES)}")
        if self.mode == "eagle":
            self.history.sync(requests)  # the history follows every sequence whichever drafts
            return self.model.propose([self._model_ask(r, r.max_tokens) for r in requests])
        trees = self.history.trees(requests)
        drafts = [Draft() if t is None else t.as_draft() for t in trees]
        if self.mode == "suffix":
            return drafts
        ask = [i for i, t in enumerate(trees)
               if t is None or len(t.tokens) < self.model_tokens or t.probs[min(self.model_tokens, len(t.probs)) - 1]
               < self.confident]
        self.stats["model_skipped"] += len(requests) - len(ask)
        self.stats["model_drafts"] += len(ask)
        if ask:
            got = self.model.propose([self._model_ask(requests[i], self.model_tokens) for i in ask])
            for i, d in zip(ask, got):
                drafts[i] = merge(drafts[i], d, requests[i].max_tokens)
        return drafts

    def _model_ask(self, r: DraftRequest, tokens: int) -> DraftRequest:
        """The EAGLE drafter's argmax tokens (deterministic, so they merge into one tree)."""
        return dataclasses.replace(r, max_tokens=min(tokens, r.max_tokens), params=_GREEDY)

    def observe(self, seq_id: str, start: int, token_ids: list[int], hidden: torch.Tensor) -> None:
        self.model.observe(seq_id, start, token_ids, hidden)

    def share(self, src: str, dst: str, num_tokens: int) -> None:
        share = getattr(self.model, "share", None)
        if share is not None:
            share(src, dst, num_tokens)

    def finish(self, seq_id: str, token_ids: list[int], num_prompt_tokens: int) -> None:
        self.history.finish(seq_id, token_ids, num_prompt_tokens)

    def release(self, seq_id: str) -> None:
        self.history.release(seq_id)
        self.model.release(seq_id)

    def next_round(self) -> None:
        self.history.next_round()

    def memory(self) -> dict[str, float]:
        return self.history.memory()

    def recent_outputs(self) -> list[list[int]]:
        return self.history.recent_outputs()


def history_proposer(cfg: SpeculativeConfig, target: torch.nn.Module | None = None,
                     encode: Callable[[str], list[int]] | None = None) -> SuffixProposer:
    """The history drafter a config names, started from its `suffix_history` file if it has one
    (its token ids checked against `target`'s vocabulary; its text lines encoded by `encode`)."""
    proposer = SuffixProposer(cache_tokens=cfg.suffix_cache_tokens, max_depth=cfg.suffix_max_tree_depth,
                              history_steps=cfg.suffix_history_steps, branch=cfg.suffix_topk,
                              spec_factor=cfg.suffix_max_spec_factor, min_prob=cfg.suffix_min_token_prob)
    if cfg.suffix_history is not None:
        vocab = target.config.vocab_size if target is not None else None
        proposer.warm(read_history(cfg.suffix_history, encode, vocab))
    return proposer


def make_proposer(cfg: SpeculativeConfig, target: torch.nn.Module | None = None,
                  encode: Callable[[str], list[int]] | None = None) -> Proposer:
    """The drafter a config names (eagle and hybrid load their EAGLE drafter for `target`; a
    history drafter's `suffix_history` file is read with `encode` for its text lines)."""
    if cfg.method == "ngram":
        return NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
    if cfg.method == "suffix":
        return history_proposer(cfg, target, encode)
    if cfg.method in ("eagle", "eagle3"):
        return model_proposer(cfg.model, target, cfg.method, topk=cfg.eagle_topk, depth=cfg.num_speculative_tokens,
                              total=cfg.lookahead)
    from reclaim.models.drafter import drafter_layout

    model = model_proposer(cfg.model, target, drafter_layout(cfg.model), topk=cfg.eagle_topk,
                           depth=cfg.hybrid_eagle_tokens, total=cfg.hybrid_eagle_tokens * cfg.eagle_topk)
    return HybridProposer(history_proposer(cfg, target, encode), model, model_tokens=cfg.hybrid_eagle_tokens)


def model_proposer(path: str, target: torch.nn.Module, layout: str, **tree: int) -> Any:
    """The engine's EAGLE (layout 'eagle') or EAGLE-3 ('eagle3') proposer for the drafter at `path`."""
    if layout == "eagle3":
        from reclaim.engine.eagle3 import Eagle3Proposer

        return Eagle3Proposer.load(path, target, **tree)
    from reclaim.engine.eagle import EagleProposer

    return EagleProposer.load(path, target, **tree)
