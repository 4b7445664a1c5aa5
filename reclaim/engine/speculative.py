"""Speculative decoding: drafters propose, one target forward verifies, a lossless rule accepts.

A step with speculation gives each chosen decode a row of [pending token, d_1, ..., d_L]; the
target's logits at those L + 1 positions verify the draft. `accept` keeps d_i with probability
min(1, p_i(d_i) / q_i(d_i)) and on the first rejection draws from norm(max(0, p_i - q_i)); if all
L pass it draws a bonus token from p_{L+1}. p is the target's processed distribution (after
temperature, top-k, top-p, min-p), q the drafter's (one-hot for a deterministic drafter), so the
output is distributed exactly as plain sampling of the target (Leviathan et al. 2023, Chen et al.
2023). Greedy rows accept while d_i is the target's argmax, so their output equals plain greedy.

Seeded requests go further: plain sampling draws the token at position i with a uniform keyed by
(seed, i) (sampling.keyed_uniform), and `accept_keyed` draws each verified position exactly so,
accepting d_i while it equals that draw. The output is then not just distributed as plain
sampling but identical to it, whatever was drafted (RL rollouts stay reproducible with
speculation on or off, on any number of workers).

Drafters share one small interface: `propose` returns each sequence's draft tokens (and q),
`observe` is handed the target's final hidden states of every position it computed and kept
(EAGLE drafts from them), `release` forgets a sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from reclaim.engine.request import SamplingParams
from reclaim.engine.sampling import keyed_uniform, probs, sanitize

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
    hybrid_eagle_tokens: int = 4  # hybrid: the EAGLE chain's depth beside the suffix draft
    # Per-request depth from its measured acceptance (DepthController): a sequence the drafter
    # keeps missing decodes plainly (re-probed now and then) instead of paying for drafts.
    dynamic_depth: bool = True
    draft_overhead: float = 0.05  # a speculative step's fixed extra cost, in plain decode steps
    draft_token_cost: float = 0.05  # drafting and verifying one more token, in plain decode steps

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


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a verification commits on average when each draft token is accepted with
    probability alpha, independently, up to the first rejection: 1 + alpha + ... + alpha^k."""
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


class StepCosts:
    """What a decode step costs, measured on the engine's own steps: seconds as a line in its
    sequences B, verified draft tokens X and sequences that verified a draft V,
    s = a + b * B + c * X + d * V, fit by least squares over decayed sums (the last few hundred
    steps count). d is what verifying costs a sequence beyond its tokens (its tree mask, the
    acceptance rule, rolling its cache back); while the steps seen do not tell it from c (every
    draft as long), the line without it is fit, and while they do not determine that either,
    `token_cost` answers None and the caller keeps its prior."""

    def __init__(self, decay: float = 0.99, min_steps: int = 8) -> None:
        self.decay, self.min_steps = decay, min_steps
        self._xtx = torch.zeros(4, 4, dtype=torch.float64)
        self._xty = torch.zeros(4, dtype=torch.float64)
        self.steps = 0
        self._fit: tuple[float, float, float, float] | None = None
        self._solved_at = -1  # steps seen when fit() last solved (determined or not)

    def observe(self, batch: int, drafted: int, seconds: float, verified: int | None = None) -> None:
        """One decode-only step: `batch` sequences, `drafted` draft tokens verified with them by
        `verified` of the sequences (default: all of them if any token was drafted)."""
        verified = (batch if drafted else 0) if verified is None else verified
        x = torch.tensor([1.0, batch, drafted, verified], dtype=torch.float64)
        self._xtx = self.decay * self._xtx + torch.outer(x, x)
        self._xty = self.decay * self._xty + x * seconds
        self.steps += 1

    def fit(self) -> tuple[float, float, float, float] | None:
        """(a, b, c, d) in seconds (d = 0 where the steps seen do not tell it apart), or None
        while they do not determine a, b and c (solved once per new step: every speculating
        sequence asks each step)."""
        if self._solved_at != self.steps and self.steps >= self.min_steps:
            self._solved_at, self._fit = self.steps, None
            for n in (4, 3):
                xtx, xty = self._xtx[:n, :n], self._xty[:n]
                scale = xtx.diagonal().sqrt().clamp_min(1e-12)
                m = xtx / torch.outer(scale, scale)  # unit diagonal: a fair condition number
                if torch.linalg.cond(m) < 1e6:
                    coef = (torch.linalg.solve(m, xty / scale) / scale).tolist()
                    self._fit = tuple(coef + [0.0] * (4 - n))
                    break
        return self._fit

    def _share(self, batch: int, coef: int) -> float | None:
        """Fit coefficient `coef` (seconds) in plain steps of one of `batch` sequences (its
        1/batch share of a plain step): seconds * batch / (a + b * batch); None if unknown."""
        fit = self.fit()
        if fit is None:
            return None
        plain = fit[0] + fit[1] * batch
        return max(fit[coef], 0.0) * batch / plain if plain > 0 else None

    def token_cost(self, batch: int) -> float | None:
        """One more draft token of one of `batch` sequences, in plain steps of that sequence."""
        return self._share(batch, 2)

    def verify_cost(self, batch: int) -> float | None:
        """Verifying a draft at all, beyond its tokens, for one of `batch` sequences, in plain
        steps of that sequence."""
        return self._share(batch, 3)


class SpecGate:
    """Which way of decoding pays at a batch size, judged by what each yields: per batch size, a
    decayed mean of tokens committed per second over the decode steps of each arm ("plain", or
    a drafter's mode). The best arm runs (speculative arms not measured yet first); one step in
    `probe_every` goes to another arm in turn, so a change (a drafter that starts hitting, a
    batch that empties) is noticed. What TLT's bandit does per batch bucket, inside the engine."""

    def __init__(self, arms: tuple[str, ...] = ("plain", "spec"), probe_every: int = 16, decay: float = 0.8) -> None:
        if "plain" not in arms or len(arms) < 2:
            raise ValueError(f"gate arms {arms}: need 'plain' and at least one speculative arm")
        self.arms, self.probe_every, self.decay = arms, probe_every, decay
        self._rate: dict[tuple[int, str], float] = {}  # (batch, arm) -> tokens/s
        self._steps: dict[int, int] = {}

    def choose(self, batch: int) -> str:
        """The arm this step runs at `batch` running sequences."""
        n = self._steps[batch] = self._steps.get(batch, 0) + 1

        def rate(arm: str) -> float:
            got = self._rate.get((batch, arm))
            return got if got is not None else (float("-inf") if arm == "plain" else float("inf"))
        best = max(self.arms, key=rate)
        if n % self.probe_every:
            return best
        others = [a for a in self.arms if a != best]
        return others[(n // self.probe_every) % len(others)]

    def update(self, batch: int, arm: str, tokens: int, seconds: float) -> None:
        """A decode-only step's outcome: `tokens` committed in `seconds` by `arm`."""
        if seconds <= 0:
            return
        key, rate = (batch, arm), tokens / seconds
        old = self._rate.get(key)
        self._rate[key] = rate if old is None else self.decay * old + (1 - self.decay) * rate


class DepthController:
    """Each running request's draft depth from its own acceptance: the k in 0..max_depth that
    maximises expected tokens per step cost, E(k) / (1 + overhead + k * token_cost) (k = 0:
    plain decoding, cost 1). token_cost and overhead are measured (`costs`, a StepCosts the
    engine feeds) at the batch size the step runs at, the priors until measured: verifying costs more
    of a step as the batch grows, so depths shrink with it. The acceptance estimate counts
    accepted tokens and first rejections (the geometric model's maximum likelihood), decayed so
    it follows the text, with half a prior acceptance and half a prior rejection. A request
    decoding plainly is probed with a one-token draft every `probe_every` steps, so a drafter
    that starts hitting is noticed."""

    def __init__(self, max_depth: int, overhead: float, token_cost: float, *, decay: float = 0.9,
                 probe_every: int = 8, costs: StepCosts | None = None) -> None:
        self.max_depth, self.overhead, self.token_cost = max_depth, overhead, token_cost
        self.decay, self.probe_every, self.costs = decay, probe_every, costs
        self._stats: dict[str, list[float]] = {}  # request id -> [accepted, rejections, plain steps]

    def alpha(self, request_id: str) -> float:
        a, r, _ = self._stats.get(request_id, (0.0, 0.0, 0))
        return (a + 0.5) / (a + r + 1)

    def cost_per_token(self, batch: int = 1) -> float:
        """A draft token's cost in plain steps at `batch` sequences: measured, else the prior."""
        measured = self.costs.token_cost(batch) if self.costs is not None else None
        return self.token_cost if measured is None else measured

    def overhead_per_verify(self, batch: int = 1) -> float:
        """Verifying a draft at all, in plain steps at `batch` sequences: measured, else the prior."""
        measured = self.costs.verify_cost(batch) if self.costs is not None else None
        return self.overhead if measured is None else measured

    def best_depth(self, alpha: float, batch: int = 1) -> int:
        """The depth with the most expected tokens per unit of cost (0 when none beats plain)."""
        per_token, overhead = self.cost_per_token(batch), self.overhead_per_verify(batch)

        def rate(k: int) -> float:
            return expected_tokens(alpha, k) / (1 + (overhead + k * per_token if k else 0))
        return max(range(self.max_depth + 1), key=lambda k: (rate(k), -k))

    def depth(self, request_id: str, batch: int = 1) -> int:
        """This step's depth for the request at `batch` running sequences (counts plain steps
        towards the next probe)."""
        k = self.best_depth(self.alpha(request_id), batch)
        if k:
            return k
        st = self._stats.setdefault(request_id, [0.0, 0.0, 0])
        st[2] += 1
        if st[2] >= self.probe_every:
            st[2] = 0
            return 1
        return 0

    def update(self, request_id: str, drafted: int, accepted: int) -> None:
        """A verification's outcome: `accepted` of `drafted` chain tokens (or tree path length)."""
        st = self._stats.setdefault(request_id, [0.0, 0.0, 0])
        st[0] = self.decay * st[0] + accepted
        st[1] = self.decay * st[1] + (1 if accepted < drafted else 0)

    def release(self, request_id: str) -> None:
        self._stats.pop(request_id, None)


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


class Drafter(Protocol):
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


class NgramDrafter:
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


def _uniform(generator: torch.Generator | None, fallback: torch.Generator | None) -> float:
    return torch.rand((), generator=generator or fallback, dtype=torch.float64).item()


def _draw(dist: torch.Tensor, generator: torch.Generator | None, fallback: torch.Generator | None) -> int:
    """One token from a distribution [V] (float64, sums to ~1)."""
    cdf = dist.cumsum(0)
    u = _uniform(generator, fallback) * cdf[-1].item()
    idx = int(torch.searchsorted(cdf, torch.tensor([u], dtype=cdf.dtype), right=True).item())
    return min(idx, int((dist > 0).nonzero().max()))


def _follow(draft: list[int], target: list[int]) -> list[int]:
    """The draft's tokens while they equal the target's choices, then the target's next choice."""
    n = 0
    while n < len(draft) and draft[n] == target[n]:
        n += 1
    return draft[:n] + [target[n]]


def accept(
    logits: torch.Tensor,
    draft: Draft,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    fallback: torch.Generator | None = None,
) -> list[int]:
    """Tokens to commit after verifying `draft` with the target's logits [L + 1, V] at the pending
    token and each draft token: the accepted prefix of the draft plus one token from the target."""
    n = len(draft.tokens)
    if params.greedy:
        return _follow(draft.tokens, sanitize(logits[: n + 1]).argmax(-1).tolist())
    p = probs(logits[: n + 1], [params] * (n + 1))
    out = []
    for i, d in enumerate(draft.tokens):
        q_d = 1.0 if draft.q is None else float(draft.q[i, d])
        p_d = float(p[i, d])
        if q_d > 0 and _uniform(generator, fallback) < min(1.0, p_d / q_d):
            out.append(d)
            continue
        if draft.q is None:
            residual = p[i].clone()
            residual[d] = 0.0
        else:
            residual = (p[i] - draft.q[i].to(p.dtype)).clamp(min=0)
        if residual.sum() <= 0:  # p == q: nothing to correct towards; p itself is the answer
            residual = p[i]
        return out + [_draw(residual / residual.sum(), generator, fallback)]
    return out + [_draw(p[n], generator, fallback)]


def _keyed_draws(logits: torch.Tensor, params: SamplingParams, first_position: int) -> list[int]:
    """The tokens plain sampling draws from each row of `logits` ([K, V]) for a seeded request,
    row k being the token at first_position + k."""
    from reclaim.engine.sampling import sample

    k = logits.shape[0]
    us = [keyed_uniform(params.seed, first_position + i) for i in range(k)]
    return sample(logits, [params] * k, us)


def accept_keyed(logits: torch.Tensor, draft: Draft, params: SamplingParams, position: int) -> list[int]:
    """Verify a chain for a seeded request: the tokens plain sampling draws at each position
    (keyed uniforms), kept while the draft agrees; identical to plain decoding's output."""
    return _follow(draft.tokens, _keyed_draws(logits[: len(draft.tokens) + 1], params, position))


def accept_tree_keyed(logits: torch.Tensor, draft: Draft, params: SamplingParams,
                      position: int) -> tuple[list[int], list[int]]:
    """Verify a tree for a seeded request: at each node the token plain sampling draws there;
    follow the child that drafted it, else stop with it. Identical to plain decoding's output."""
    children = draft.children()
    node, row, path, out = -1, 0, [], []
    while True:
        tok = _keyed_draws(logits[row: row + 1], params, position + len(out))[0]
        nxt = next((k for k in children.get(node, []) if draft.tokens[k] == tok), None)
        out.append(tok)
        if nxt is None:
            return out, path
        path.append(nxt)
        node, row = nxt, nxt + 1


def accept_tree(
    logits: torch.Tensor,
    draft: Draft,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    fallback: torch.Generator | None = None,
) -> tuple[list[int], list[int]]:
    """Verify a tree of deterministic draft tokens with the target's logits [1 + N, V] (row 0 at
    the pending token, row 1 + i at draft token i). Returns the tokens to commit and the draft
    indices of the accepted path.

    At each node the children are tried in order: greedy takes the child equal to the target's
    argmax; sampling accepts child c with probability p(c) and otherwise removes c from p and
    renormalises before the next child (recursive rejection for deterministic drafts), drawing
    from what is left when every child fails, so the output is distributed as p.
    """
    children = draft.children()
    node, row, path, out = -1, 0, [], []
    while True:
        kids = children.get(node, [])
        if params.greedy:
            best = int(sanitize(logits[row: row + 1]).argmax())
            nxt = next((k for k in kids if draft.tokens[k] == best), None)
            if nxt is None:
                return out + [best], path
        else:
            p = probs(logits[row: row + 1], [params])[0]
            nxt = None
            for k in kids:
                tok = draft.tokens[k]
                mass = float(p[tok] / p.sum())
                if mass > 0 and _uniform(generator, fallback) < mass:
                    nxt = k
                    break
                p[tok] = 0.0
            if nxt is None and float(p.sum()) > 0:
                return out + [_draw(p / p.sum(), generator, fallback)], path
            nxt = kids[-1] if nxt is None else nxt  # rounding left no mass: the last child had it all
        path.append(nxt)
        out.append(draft.tokens[nxt])
        node, row = nxt, nxt + 1
