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

from typing import Any

import torch

from reclaim.engine.request import SamplingParams
from reclaim.engine.sampling import (NO_FINITE_LOGIT, Deferred, Keyed, clean, draw, keyed_uniform, mask_logits, penalize,
                                     probs, sample_tensor, sanitize, uniforms)
from reclaim.engine.speculative import Draft


def _uniform(generator: torch.Generator | None, fallback: torch.Generator | None) -> float:
    g = generator or fallback
    return torch.rand((), generator=g, dtype=torch.float64, device=g.device).item()


def _draw(dist: torch.Tensor, generator: torch.Generator | None, fallback: torch.Generator | None) -> int:
    """One token from a distribution [V] (float64, sums to ~1)."""
    cdf = dist.cumsum(0)
    u = _uniform(generator, fallback) * cdf[-1].item()
    idx = int(torch.searchsorted(cdf, torch.tensor([u], dtype=cdf.dtype, device=cdf.device), right=True).item())
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
    seen = [output + draft.tokens[:j] for j in range(n + 1)]
    penalized = penalize(logits[: n + 1], [params] * (n + 1), [prompt] * (n + 1), seen, [stop] * (n + 1)) \
        if params.penalizes else logits[: n + 1].float()
    try:
        for j in range(len(draft.tokens) + 1):
            rows.append(mask_logits(penalized[j].clone(), params, seen[j]) if params.masks else penalized[j])
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


# ---- a batch of drafts verified with tensor ops, read on the host once ----

def _walk(draft: Draft, choice: list[int]) -> tuple[list[int], list[int]]:
    """Follow a draft while each position's chosen token (`choice[row]`, row 0 at the pending
    token, row 1 + i at draft token i) is a child drafted there: the tokens to commit and the
    accepted path of draft indices. A chain is a tree whose node i's only child is i + 1."""
    parents = draft.parents if draft.parents is not None else list(range(-1, len(draft.tokens) - 1))
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    node, row, path, out = -1, 0, [], []
    while True:
        tok = choice[row]
        out.append(tok)
        nxt = next((k for k in children.get(node, []) if draft.tokens[k] == tok), None)
        if nxt is None:
            return out, path
        path.append(nxt)
        node, row = nxt, nxt + 1


def _positions_of(draft: Draft) -> list[int]:
    """Per verify row (the pending token, then each draft token), how many tokens precede the
    one chosen there on its path: 0 at the pending token, the draft token's depth after it."""
    return [0] + draft.depths()


def verify_batch(logits: list[torch.Tensor], drafts: list[Draft], params: list[SamplingParams],
                 positions: list[int], generators: list, fallback: torch.Generator | None) -> Deferred:
    """Verify each row's draft with the target's logits there ([1 + len(draft), V]: the pending
    token, then each draft token), as `accept`, `accept_tree` and the keyed variants do, for the
    whole batch at once: greedy rows and seeded rows (keyed draws at every node) choose every
    node's token in one op and walk their drafts on the host; sampled chains are accepted or
    rejected with tensor ops (`_chains`); sampled trees run every node's recursive rejection at
    once (`_trees`) and walk the outcomes on the host. `positions[r]`: the position of the first
    token row r chooses. The result: per row (tokens to commit, accepted draft path), or the exception that
    fails it alone."""
    dev = logits[0].device if logits else torch.device("cpu")
    greedy = [r for r, p in enumerate(params) if p.greedy]
    keyed = [r for r, p in enumerate(params) if not p.greedy and p.seed is not None]
    chains = [r for r, p in enumerate(params) if not p.greedy and p.seed is None and drafts[r].parents is None]
    trees = [r for r, p in enumerate(params) if not p.greedy and p.seed is None and drafts[r].parents is not None]
    results: dict[int, Any] = {}
    values, parts = [], []  # (kind, rows, count)
    nodes = greedy + keyed  # every node's token chosen up front
    if nodes:
        x = torch.cat([logits[r] for r in nodes])
        rows_params = [params[r] for r in nodes for _ in range(logits[r].shape[0])]
        sources = [None if params[r].greedy else Keyed(params[r].seed, positions[r] + k)
                   for r in nodes for k in _positions_of(drafts[r])]
        tokens, ok = sample_tensor(x, rows_params, sources, fallback)
        values += [tokens, ok.long()]
        parts.append(("nodes", x.shape[0]))
    if chains:
        values.append(_chains([logits[r] for r in chains], [drafts[r] for r in chains],
                              [params[r] for r in chains], [generators[r] for r in chains], fallback))
        parts.append(("chains", 3 * len(chains)))
    if trees:
        got = _trees([logits[r] for r in trees], [drafts[r] for r in trees], [params[r] for r in trees],
                     [generators[r] for r in trees], fallback)
        values.append(got)
        parts.append(("trees", got.shape[0]))

    def finish(got: list[int]) -> list[Any]:
        at = 0
        for kind, n in parts:
            seg = got[at:at + (2 * n if kind == "nodes" else n)]
            at += len(seg)
            if kind == "nodes":
                toks, oks, i = seg[:n], seg[n:], 0
                for r in nodes:
                    m = logits[r].shape[0]
                    results[r] = _walk(drafts[r], toks[i:i + m]) if all(oks[i:i + m]) else ValueError(NO_FINITE_LOGIT)
                    i += m
            elif kind == "chains":
                for j, r in enumerate(chains):
                    n_acc, tok, good = seg[3 * j: 3 * j + 3]
                    results[r] = ((drafts[r].tokens[:n_acc] + [tok], list(range(n_acc))) if good
                                  else ValueError(NO_FINITE_LOGIT))
            else:
                i = 0
                for r in trees:  # per node: the child it accepted (-1: none), the token drawn, finite
                    m = logits[r].shape[0]
                    child, tok, good = seg[3 * i:3 * (i + m):3], seg[3 * i + 1:3 * (i + m):3], seg[3 * i + 2:3 * (i + m):3]
                    results[r] = _walk_tree(drafts[r], child, tok) if all(good) else ValueError(NO_FINITE_LOGIT)
                    i += m
        return [results[r] for r in range(len(params))]

    return Deferred(torch.cat(values) if values else torch.zeros(0, dtype=torch.long, device=dev), finish)


def _trees(logits: list[torch.Tensor], drafts: list[Draft], params: list[SamplingParams], generators: list,
           fallback: torch.Generator | None) -> torch.Tensor:
    """`accept_tree`'s recursive rejection for sampled trees, every node of every tree at once:
    per node (a verify row) its children are tried in order, child c accepted with probability
    p(c) over the mass its rejected elder siblings left, and when all fail a token is drawn from
    p without them. A node's outcome depends on its own p and uniforms only (the walk decides
    which nodes count), so all are computed up front with independent uniforms, distributed as
    the walk's. Per node [accepted child (-1: none), drawn token, logits finite], int64 [3 * N]."""
    dev = logits[0].device
    x = torch.cat(logits)
    n = x.shape[0]
    p = probs(x, [pp for pp, lg in zip(params, logits) for _ in range(lg.shape[0])])  # [N, V] float64
    _, ok = clean(x)
    kids: list[list[int]] = []  # per node, its children's draft indices in the order they are tried
    toks: list[list[int]] = []
    for dr, lg in zip(drafts, logits):
        children = dr.children()
        for row in range(lg.shape[0]):
            ks = children.get(row - 1, [])
            kids.append(ks)
            toks.append([dr.tokens[k] for k in ks])
    width = max(1, max(len(k) for k in kids))
    tok = torch.tensor([t + [0] * (width - len(t)) for t in toks], device=dev)  # [N, W]
    valid = torch.tensor([[j < len(t) for j in range(width)] for t in toks], device=dev)
    pc = p.gather(1, tok) * valid  # each child's mass
    left = p.sum(-1, keepdim=True) - (pc.cumsum(1) - pc)  # what its elder siblings' rejections left
    us = uniforms(list(range(n * (width + 1))), [g for g, lg in zip(generators, logits)
                                                 for _ in range(lg.shape[0] * (width + 1))], fallback,
                  dev).view(n, width + 1)
    take = valid & (pc > 0) & (us[:, :width] * left < pc)
    first = torch.where(take.any(1), take.long().argmax(1), -1)  # the first child accepted
    is_child = torch.zeros_like(p).scatter_add_(1, tok, valid.to(p.dtype)) > 0  # (padding adds nothing)
    rest = p.masked_fill(is_child, 0.0)  # p without the children
    has = rest.sum(-1) > 0
    src = torch.where(has[:, None], rest, p)
    drawn = draw(src / src.sum(-1, keepdim=True), us[:, width])
    # rounding left no mass outside the children: the last child had it all (as accept_tree)
    last = valid.long().sum(1) - 1
    first = torch.where((first < 0) & ~has & (last >= 0), last, first)
    slot = torch.tensor([k + [0] * (width - len(k)) for k in kids], device=dev)
    child = torch.where(first >= 0, slot.gather(1, first.clamp(min=0)[:, None]).squeeze(1), -1)
    return torch.stack([child, drawn, ok.long()], 1).reshape(-1)


def _walk_tree(draft: Draft, child: list[int], token: list[int]) -> tuple[list[int], list[int]]:
    """Follow a tree through each node's accepted child (`child[row]`, -1: none, then the token
    drawn there ends it): the tokens to commit and the accepted path of draft indices."""
    row, path, out = 0, [], []
    while child[row] >= 0:
        k = child[row]
        path.append(k)
        out.append(draft.tokens[k])
        row = k + 1
    return out + [token[row]], path


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(0, p - q), unnormalised: what a rejected draft token's replacement is drawn from."""
    return (p - q).clamp(min=0)


def _chains(logits: list[torch.Tensor], drafts: list[Draft], params: list[SamplingParams], generators: list,
            fallback: torch.Generator | None) -> torch.Tensor:
    """`accept` for sampled chains, as tensor ops over the batch: per row [accepted draft
    tokens, the token drawn after them, whether its logits were finite], int64 [3 * R]. Each
    draft token d_i is kept with probability min(1, p_i(d_i) / q_i(d_i)) while all before it
    were; at the first rejection the token is drawn from norm(max(0, p_i - q_i)), after a full
    acceptance from p_(L+1). q one-hot where the drafter gave none. Every uniform a row could
    use is drawn up front (its draws are independent of each other, so the output is
    distributed as `accept`'s)."""
    dev = logits[0].device
    lens = [len(d.tokens) for d in drafts]
    big = max(lens)
    x = torch.cat(logits)
    p = probs(x, [pp for pp, n in zip(params, lens) for _ in range(n + 1)])  # [sum(L + 1), V] float64
    _, ok = clean(x)
    v = p.shape[-1]
    base = torch.tensor([sum(lens[:r]) + r for r in range(len(lens))], device=dev)
    idx = torch.arange(big + 1, device=dev)
    length = torch.tensor(lens, device=dev)
    flat = (base[:, None] + idx.clamp(max=big)[None, :]).clamp(max=p.shape[0] - 1)  # [R, big + 1] rows of p
    d = torch.tensor([dr.tokens + [0] * (big - len(dr.tokens)) for dr in drafts], device=dev)  # [R, big]
    q = torch.zeros(len(drafts), big, v, dtype=torch.float64, device=dev)
    for r, dr in enumerate(drafts):
        if dr.q is None:
            q[r, torch.arange(len(dr.tokens), device=dev), d[r, :len(dr.tokens)]] = 1.0
        else:
            q[r, :len(dr.tokens)] = dr.q.to(dev, torch.float64)
    p_d = p[flat[:, :big], d]  # [R, big]
    q_d = q.gather(2, d[:, :, None]).squeeze(2)
    us = uniforms(list(range(len(drafts) * (big + 1))),
                  [g for g in generators for _ in range(big + 1)], fallback, dev).view(len(drafts), big + 1)
    keep = (q_d > 0) & (us[:, :big] < (p_d / q_d.clamp(min=1e-300)).clamp(max=1.0)) & (idx[None, :big] < length[:, None])
    n_acc = keep.long().cumprod(1).sum(1)  # [R]
    at = p[base + n_acc]  # [R, V]: p at the first rejection, or after the last draft token
    rejected = n_acc < length
    q_at = q[torch.arange(len(drafts), device=dev), n_acc.clamp(max=max(big - 1, 0))] if big else torch.zeros_like(at)
    resid = torch.where(rejected[:, None], residual(at, q_at), at)
    resid = torch.where((resid.sum(-1, keepdim=True) <= 0), at, resid)  # p == q: p itself is the answer
    tok = draw(resid / resid.sum(-1, keepdim=True), us[:, big])
    good = ok[(base[:, None] + idx[None, :]).clamp(max=ok.shape[0] - 1)].masked_fill(idx[None, :] > length[:, None], True).all(1)
    return torch.stack([n_acc, tok, good.long()], 1).reshape(-1)
