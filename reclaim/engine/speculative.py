"""Speculative decoding's vocabulary: the config (`--speculative`), a draft, the proposer interface.

A step with speculation gives each chosen decode a row of [pending token, d_1, ..., d_L]; one
target forward verifies the draft and a lossless rule (engine/rejection.py) accepts a prefix, so
outputs are those of plain decoding. The policy that decides when and how deep to draft is
engine/spec_policy.py; the proposers are engine/proposers.py (which builds them), eagle.py,
eagle3.py, suffix.py and history.py, and `NgramProposer` here.

Names: a *Proposer is what the engine asks for drafts (this interface); a *Drafter is a model
(an nn.Module, models/drafter.py, models/eagle3.py) that an EAGLE proposer runs. Proposers share
one small interface: `propose` returns each sequence's draft tokens (and q),
`observe` is handed the target's final hidden states of every position it computed and kept
(EAGLE drafts from them), `release` forgets a sequence.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Protocol

import torch

from reclaim.engine.request import SamplingParams

SPECULATIVE_METHODS = ("ngram", "suffix", "eagle", "eagle3", "hybrid")
MODEL_METHODS = ("eagle", "eagle3", "hybrid")  # the methods that need a drafter directory


@dataclass
class SpeculativeConfig:
    """What speculates and how much; names follow vLLM's `speculative_config`.

    Methods: ngram (prompt lookup), suffix (history: the prompt, the other completions of the
    same prompt and recent outputs, history.py), eagle (a drafter model), hybrid (suffix and
    eagle drafts merged into one tree per sequence, verified together).
    """

    method: str = "ngram"
    # Draft depth: at most this many tokens accepted a step (default 4; suffix 16: history drafts
    # cost nothing to make, and their size follows their confidence).
    num_speculative_tokens: int | None = None
    max_batch: int = 4  # speculation turns off while more sequences than this are running
    eagle_topk: int = 1  # eagle: branches per node; 1 drafts a chain, > 1 a tree
    num_draft_tokens: int | None = None  # trees: tokens verified per step (default depth x branches)
    prompt_lookup_min: int = 1  # ngram: shortest suffix to look up
    prompt_lookup_max: int = 4  # ngram: longest suffix to look up
    model: str | None = None  # eagle, hybrid: drafter directory
    suffix_topk: int = 1  # suffix: branches per node; > 1 drafts a tree
    suffix_cache_tokens: int = 1 << 18  # suffix: tokens of finished sequences kept (least recently used out)
    suffix_max_tree_depth: int = 24  # suffix: longest substring indexed (vLLM's suffix_decoding_max_tree_depth)
    suffix_max_spec_factor: float = 1.0  # suffix: a draft path is at most this times the match length
    suffix_min_token_prob: float = 0.05  # suffix: tokens less likely than this are not drafted
    suffix_history_steps: int | None = None  # suffix: rounds (GRPO steps) of finished sequences kept; None: all
    suffix_history: str | None = None  # suffix, hybrid: a JSON-lines file of earlier outputs to start from
    hybrid_eagle_tokens: int = 4  # hybrid: the EAGLE chain's depth beside the suffix draft
    # Per-request depth from its measured acceptance (DepthController): a sequence the drafter
    # keeps missing decodes plainly (re-probed now and then) instead of paying for drafts.
    dynamic_depth: bool = True
    draft_overhead: float = 0.05  # a speculative step's fixed extra cost, in plain decode steps
    draft_token_cost: float = 0.05  # drafting and verifying one more token, in plain decode steps
    # Price drafts with the step costs measured on this engine's own steps (False: the two priors
    # above always, so draft sizes follow acceptance only and not the machine's timings).
    measured_costs: bool = True

    @property
    def tree(self) -> bool:
        """Drafts are trees (verified through the tree path) rather than chains."""
        return self.method == "hybrid" or (self.eagle_topk > 1 if self.method in ("eagle", "eagle3") else self.suffix_topk > 1)

    @property
    def lookahead(self) -> int:
        """Draft tokens a decode verifies per step (what the scheduler reserves)."""
        if not self.tree:
            return self.num_speculative_tokens
        if self.method == "hybrid":
            return self.num_draft_tokens or self.num_speculative_tokens + self.hybrid_eagle_tokens
        branches = self.eagle_topk if self.method in ("eagle", "eagle3") else self.suffix_topk
        return self.num_draft_tokens or self.num_speculative_tokens * branches

    @property
    def history(self) -> bool:
        """A history drafter takes part (its draft size follows its own confidence)."""
        return self.method in ("suffix", "hybrid")

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method {self.method!r} is unknown; allowed: {list(SPECULATIVE_METHODS)}")
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = 16 if self.history else 4
        if not 1 <= self.num_speculative_tokens <= 64:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens}; allowed: 1 to 64")
        if self.max_batch < 1:
            raise ValueError(f"max_batch={self.max_batch}; allowed: >= 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min={self.prompt_lookup_min}, prompt_lookup_max="
                             f"{self.prompt_lookup_max}; need 1 <= min <= max")
        if not 1 <= self.eagle_topk <= 16:
            raise ValueError(f"eagle_topk={self.eagle_topk}; allowed: 1 (a chain) to 16")
        if self.eagle_topk > 1 and self.method not in MODEL_METHODS:
            raise ValueError(f"eagle_topk={self.eagle_topk} drafts an EAGLE tree, which only methods "
                             f"{list(MODEL_METHODS)} do")
        if not 1 <= self.suffix_topk <= 16:
            raise ValueError(f"suffix_topk={self.suffix_topk}; allowed: 1 (a chain) to 16")
        if self.num_draft_tokens is not None and not self.num_speculative_tokens <= self.num_draft_tokens <= 256:
            raise ValueError(f"num_draft_tokens={self.num_draft_tokens}; allowed: "
                             f"num_speculative_tokens ({self.num_speculative_tokens}) to 256")
        if self.draft_overhead < 0 or self.draft_token_cost < 0:
            raise ValueError(f"draft_overhead={self.draft_overhead}, draft_token_cost={self.draft_token_cost}; "
                             "allowed: >= 0 (costs in plain decode steps)")
        if self.suffix_cache_tokens < 1:
            raise ValueError(f"suffix_cache_tokens={self.suffix_cache_tokens}; allowed: >= 1 (tokens of "
                             "finished sequences the history drafter keeps)")
        if not 2 <= self.suffix_max_tree_depth <= 256:
            raise ValueError(f"suffix_max_tree_depth={self.suffix_max_tree_depth}; allowed: 2 to 256")
        if self.suffix_max_spec_factor <= 0 or not 0 <= self.suffix_min_token_prob < 1:
            raise ValueError(f"suffix_max_spec_factor={self.suffix_max_spec_factor}, suffix_min_token_prob="
                             f"{self.suffix_min_token_prob}; need a factor > 0 and 0 <= prob < 1")
        if self.suffix_history_steps is not None and self.suffix_history_steps < 0:
            raise ValueError(f"suffix_history_steps={self.suffix_history_steps}; allowed: >= 0, or None (all)")
        if self.suffix_history is not None and not self.history:
            raise ValueError(f"suffix_history={self.suffix_history!r} is for methods suffix and hybrid, "
                             f"not {self.method!r}")
        if self.suffix_history is not None and not os.path.isfile(self.suffix_history):
            raise ValueError(f"suffix_history={self.suffix_history!r} is not a file; allowed: a JSON-lines "
                             "file of earlier outputs")
        if not 1 <= self.hybrid_eagle_tokens <= 64:
            raise ValueError(f"hybrid_eagle_tokens={self.hybrid_eagle_tokens}; allowed: 1 to 64")
        if self.method in MODEL_METHODS and not self.model:
            raise ValueError(f"speculative method {self.method!r} needs a drafter directory (model=PATH)")


SPEC_FORMS = ("none, ngram, suffix, eagle:PATH (an EAGLE-1/2 drafter directory), eagle3:PATH (an EAGLE-3 one), "
              "hybrid:PATH or suffix+eagle:PATH (suffix and either EAGLE drafter)")


def parse_speculative(spec: str | None, **fields: int | float | None) -> SpeculativeConfig | None:
    """`--speculative` as a config: None or 'none' (off), 'ngram', 'suffix', 'eagle:PATH',
    'hybrid:PATH' or 'suffix+eagle:PATH'; `fields` are SpeculativeConfig's other fields (None
    keeps the default)."""
    if spec is None or spec == "none":
        return None
    method, _, path = spec.partition(":")
    method = "hybrid" if method == "suffix+eagle" else method
    if method not in SPECULATIVE_METHODS or (method in MODEL_METHODS) != bool(path):
        raise ValueError(f"--speculative {spec!r} is unknown; allowed: {SPEC_FORMS}")
    return SpeculativeConfig(method=method, model=path or None, **{k: v for k, v in fields.items() if v is not None})




@dataclass
class DraftRequest:
    """One sequence asking for a draft: its tokens so far (the last one not yet run by the target)."""

    seq_id: str
    token_ids: list[int]
    max_tokens: int
    params: SamplingParams
    generator: torch.Generator | None = None
    num_prompt_tokens: int = 0  # token_ids[:num_prompt_tokens] is the prompt
    token_cost: float = 0.05  # one more draft token's cost at this step's batch, in plain decode steps
    overhead: float = 0.05  # verifying a draft at all (beyond its tokens) at this step's batch, likewise


@dataclass
class Draft:
    """Proposed tokens and the drafter's distribution for each, [len(tokens), V] (None: one-hot).

    A tree draft also gives each token's parent (-1: the pending token), parents before children,
    siblings in the drafter's order of preference; its tokens are deterministic (q is None).
    """

    tokens: list[int] = field(default_factory=list)
    q: torch.Tensor | None = None
    parents: list[int] | None = None

    def depths(self) -> list[int]:
        """Each token's distance from the pending token (1 for its children)."""
        if self.parents is None:
            return list(range(1, len(self.tokens) + 1))
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def children(self) -> dict[int, list[int]]:
        """Each node's children in order (-1: the pending token's)."""
        out: dict[int, list[int]] = {}
        for i, parent in enumerate(self.parents or []):
            out.setdefault(parent, []).append(i)
        return out

    def truncate(self, n: int) -> "Draft":
        """The first n tokens (a tree keeps the nodes whose ancestors all stay: parents come first)."""
        return Draft(self.tokens[:n], None if self.q is None else self.q[:n],
                     None if self.parents is None else self.parents[:n])


class Proposer(Protocol):
    """What the engine needs from a drafter."""

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        """A draft of at most `max_tokens` tokens per request."""
        ...

    def observe(self, seq_id: str, start: int, token_ids: list[int], hidden: torch.Tensor) -> None:
        """The target's final hidden states [len(token_ids), H] at positions start, start + 1, ..."""
        ...

    def finish(self, seq_id: str, token_ids: list[int], num_prompt_tokens: int) -> None:
        """The sequence ended (finished, aborted or failed) with these tokens, prompt first;
        release follows. A history drafter keeps them."""
        ...

    def release(self, seq_id: str) -> None:
        """Forget the sequence."""
        ...


class NgramProposer:
    """Prompt lookup: the longest recent suffix (prompt_lookup_max down to _min tokens) that occurred
    earlier in the sequence proposes what followed its latest earlier occurrence. No model."""

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return [Draft(self._lookup(r.token_ids, r.max_tokens)) for r in requests]

    def _lookup(self, ids: list[int], k: int) -> list[int]:
        n_ids = len(ids)
        for n in range(min(self.max_n, n_ids - 1), self.min_n - 1, -1):
            suffix = ids[n_ids - n:]
            for start in range(n_ids - n - 1, -1, -1):  # latest earlier occurrence first
                if ids[start:start + n] == suffix:
                    return ids[start + n:start + n + k]
        return []

    def observe(self, seq_id: str, start: int, token_ids: list[int], hidden: torch.Tensor) -> None:
        pass

    def finish(self, seq_id: str, token_ids: list[int], num_prompt_tokens: int) -> None:
        pass

    def release(self, seq_id: str) -> None:
        pass
