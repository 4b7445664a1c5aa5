"""Lossless acceptance of a draft (rejection sampling), beside the sampler.

A verified row is [pending token, d_1, ..., d_L]; the target's logits at those L + 1 positions
verify the draft. `accept` keeps d_i with probability min(1, p_i(d_i) / q_i(d_i)) and on the first
rejection draws from norm(max(0, p_i - q_i)); if all L pass it draws a bonus token from p_{L+1}.
p is the target's processed distribution (after temperature, top-k, top-p, min-p), q the
drafter's (one-hot for a deterministic drafter), so the output is distributed exactly as plain
sampling of the target (Leviathan et al. 2023, Chen et al. 2023). Greedy rows accept while d_i is
the target's argmax, so their output equals plain greedy. `accept_tree` walks a tree of
deterministic draft tokens, trying each node's children in order (recursive rejection).

Seeded requests go further: plain sampling draws the token at position i with a uniform keyed by
(seed, i) (sampling.keyed_uniform), and `accept_keyed` draws each verified position exactly so,
accepting d_i while it equals that draw. The output is then not just distributed as plain
sampling but identical to it, whatever was drafted (RL rollouts stay reproducible with
speculation on or off, on any number of workers).
"""

from __future__ import annotations

import torch

from reclaim.engine.request import SamplingParams
from reclaim.engine.sampling import keyed_uniform, process_logits, probs, sanitize
from reclaim.engine.speculative import Draft


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


def processed_chain(logits: torch.Tensor, draft: Draft, params: SamplingParams, prompt: list[int],
                    output: list[int], stop: set[int]) -> tuple[torch.Tensor, Draft]:
    """A chain's verification logits [L + 1, V] processed position by position, as plain
    decoding would process them had the draft tokens before each been committed (penalties,
    min_tokens, bad words, the grammar advanced over them and rolled back after). The draft
    ends before a token its position's processing forbids or one that completes the grammar
    (the commit path stops the request there)."""
    rows, advanced, n = [], 0, len(draft.tokens)
    try:
        for j in range(len(draft.tokens) + 1):
            rows.append(process_logits(logits[j], params, prompt, output + draft.tokens[:j], stop))
            if j == len(draft.tokens):
                break
            d = draft.tokens[j]
            if rows[-1][d] == float("-inf"):
                n = j
                break
            if params.constraint is not None:
                params.constraint.accept(d)
                advanced += 1
                if params.constraint.finished():
                    n = j
                    break
    finally:
        if advanced:
            params.constraint.rollback(advanced)
    return torch.stack(rows[: n + 1]), draft.truncate(n)
