"""Choose the next token for a batch of rows, each with its own SamplingParams and generator.

Filters (top-k, then top-p on what top-k kept, then min-p) and the draw are vectorised over the
batch; the only per-row work is one uniform number from the row's own generator, so a seeded
request draws the same numbers whatever else shares its batch. Logprobs are those of the model's
raw distribution (log_softmax of the logits), as vLLM reports them.
"""

from __future__ import annotations

import torch

from reclaim.engine.request import SamplingParams, TokenLogprob


def filter_sorted(
    sorted_logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Mask (-inf) the filtered entries of logits sorted descending, [B, V]; returns new logits.

    top_k [B] (<= 0: off), top_p [B] (1: off), min_p [B] (0: off). The most likely token always stays.
    """
    v = sorted_logits.shape[-1]
    rank = torch.arange(v, device=sorted_logits.device)
    k = torch.where(top_k > 0, top_k, v)
    x = sorted_logits.masked_fill(rank >= k[:, None], float("-inf"))
    probs = x.softmax(-1)
    # Drop a token when the mass before it already reaches top_p (so the first always stays).
    drop = (probs.cumsum(-1) - probs) >= top_p[:, None]
    drop |= probs < min_p[:, None] * probs[:, :1]
    drop[:, 0] = False
    return x.masked_fill(drop, float("-inf"))


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: index per row of `probs` [B, V] for `uniforms` [B] in [0, 1)."""
    cdf = probs.cumsum(-1)
    u = (uniforms * cdf[:, -1]).unsqueeze(1)
    idx = torch.searchsorted(cdf, u, right=True).squeeze(1)
    # Rounding can put u at the very top of the cdf; step back to the last token with mass.
    last = (probs > 0).cumsum(-1).argmax(-1)
    return torch.minimum(idx, last)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    fallback: torch.Generator | None = None,
) -> list[int]:
    """Next token per row of `logits` [B, V] (float32). Rows without a generator use `fallback`."""
    tokens = logits.argmax(-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        dev = logits.device
        sel = [params[i] for i in rows]
        temp = torch.tensor([p.temperature for p in sel], device=dev, dtype=logits.dtype)
        x = logits[rows] / temp[:, None]
        # Always draw in sorted order, so a row's token depends only on its own logits and uniform.
        x, order = x.sort(dim=-1, descending=True, stable=True)
        x = filter_sorted(
            x,
            torch.tensor([p.top_k for p in sel], device=dev),
            torch.tensor([p.top_p for p in sel], device=dev, dtype=x.dtype),
            torch.tensor([p.min_p for p in sel], device=dev, dtype=x.dtype),
        )
        u = torch.tensor(
            [torch.rand((), generator=generators[i] or fallback).item() for i in rows],
            device=dev, dtype=torch.float64,
        )
        picked = draw(x.softmax(-1).double(), u)
        tokens[rows] = order.gather(1, picked[:, None]).squeeze(1)
    return tokens.tolist()


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: list[int]) -> list[TokenLogprob]:
    """Logprob of each row's chosen token and its `num_top[i]` most likely alternatives."""
    lp = logits.log_softmax(-1)
    chosen = lp.gather(1, torch.tensor(token_ids, device=lp.device)[:, None]).squeeze(1).tolist()
    k = max(num_top)
    top_v, top_i = lp.topk(k, -1) if k else (None, None)
    out = []
    for row, (tok, val, n) in enumerate(zip(token_ids, chosen, num_top)):
        top = list(zip(top_i[row, :n].tolist(), top_v[row, :n].tolist())) if n else []
        out.append(TokenLogprob(tok, val, top))
    return out


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator for a seeded request, or None (the engine's shared generator is used)."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)
