"""Choose the next token for a batch of rows, each with its own SamplingParams and generator.

Filters (top-k, then top-p on what top-k kept, then min-p) and the draw are vectorised over the
batch; the only per-row work is one uniform number from the row's own generator, so a seeded
request draws the same numbers whatever else shares its batch. `probs` exposes the processed
distribution itself (what speculative decoding's rejection rule compares). Logprobs are those of
the model's raw distribution (log_softmax of the logits), as vLLM reports them.

Numerics: NaN logits count as impossible and +inf as the largest float; the temperature divides
logits after the row's maximum is subtracted, so a tiny temperature cannot overflow into NaN; the
most likely token always survives the filters, so no distribution is ever empty.
"""

from __future__ import annotations

import torch

from reclaim.engine.request import SamplingParams, TokenLogprob


def sanitize(logits: torch.Tensor) -> torch.Tensor:
    """Float32 logits with NaN as -inf and +inf as the largest finite float; raises if a row has
    no finite logit at all (nothing could be sampled from it)."""
    x = logits.float()
    x = torch.nan_to_num(x, nan=float("-inf"), posinf=torch.finfo(x.dtype).max, neginf=float("-inf"))
    if x.numel() and not torch.isfinite(x.max(-1).values).all():
        raise ValueError("the model produced no finite logit for a row; nothing can be sampled")
    return x


def process_logits(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int],
                   stop_ids: set[int]) -> torch.Tensor:
    """One row's logits [V] after logit_bias, repetition, presence and frequency penalties,
    min_tokens (stop_ids masked), allowed_token_ids, bad_words_token_ids and the constraint's
    mask; a new tensor, logits untouched. Raises ValueError when a token id is outside [0, V) or
    the masks together leave no token."""
    x = logits.float().clone()
    v = x.shape[-1]
    if params.logit_bias:
        ids = [t for t in params.logit_bias if t < v]
        x[ids] += torch.tensor([float(params.logit_bias[t]) for t in ids], device=x.device)
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(output)), device=x.device, dtype=torch.long)
        if seen.numel():
            vals = x[seen]
            x[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and output:
        counts = torch.bincount(torch.tensor(output, device=x.device), minlength=v)[:v].to(x.dtype)
        x -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(x.dtype)
    if len(output) < params.min_tokens:
        ids = [t for t in stop_ids if t < v]
        x[ids] = float("-inf")
    if params.allowed_token_ids is not None:
        ids = torch.tensor(params.allowed_token_ids, device=x.device, dtype=torch.long)
        if ids.numel() and int(ids.max()) >= v:
            raise ValueError(f"allowed_token_ids has token id {int(ids.max())}; allowed: 0 to {v - 1}")
        keep = torch.zeros(v, dtype=torch.bool, device=x.device)
        keep[ids] = True
        x = x.masked_fill(~keep, float("-inf"))
    if params.bad_words_token_ids:
        # vLLM's rule: a word's last token is banned when the output ends with the rest of it
        # (always, for a one-token word); only output tokens count, not the prompt.
        banned = [w[-1] for w in params.bad_words_token_ids
                  if len(w) - 1 <= len(output) and output[len(output) - len(w) + 1:] == w[:-1]]
        bad = next((t for t in banned if t >= v), None)
        if bad is not None:
            raise ValueError(f"bad_words has token id {bad}; allowed: 0 to {v - 1}")
        x[banned] = float("-inf")
    if params.constraint is not None:
        mask = params.constraint.allowed(v)
        if mask is not None:
            mask = mask.to(x.device)[:v]
            if not mask.any():
                raise ValueError("the constraint allows no token at all")
            x = x.masked_fill(~mask, float("-inf"))
    if (params.allowed_token_ids is not None or params.bad_words_token_ids) and not torch.isfinite(x.max()):
        raise ValueError("allowed_token_ids, bad_words, min_tokens and the output format together "
                         "leave no token to sample")
    return x


def filter_sorted(
    sorted_logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
    lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mask (-inf) the filtered entries of logits sorted descending, [B, K]; returns new logits.

    top_k [B] (<= 0: off), top_p [B] (1: off), min_p [B] (0: off). The most likely token always stays.
    lse [B, 1]: the log-normaliser of each row's probabilities when the K columns are only its
    most likely tokens (default: the columns' own).
    """
    v = sorted_logits.shape[-1]
    rank = torch.arange(v, device=sorted_logits.device)
    k = torch.where(top_k > 0, top_k.clamp(max=v), v)
    x = sorted_logits.masked_fill(rank >= k[:, None], float("-inf"))
    # top-k rows keep only columns, so their own softmax; others are relative to the whole row.
    probs = x.softmax(-1) if lse is None else torch.where((top_k > 0)[:, None], x.softmax(-1), (x - lse).exp())
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


def _needs_sorting(p: SamplingParams) -> bool:
    return p.top_k > 0 or p.top_p < 1 or p.min_p > 0


def _candidates(x: torch.Tensor, p: SamplingParams) -> int:
    """How many of a row's most likely tokens its filters can keep at most (x: its logits after
    temperature, [V]): top-k's k, else what top-p's mass or min-p's threshold reaches, else V."""
    v = x.shape[-1]
    if p.top_k > 0:
        return min(p.top_k, v)
    k = v
    if p.min_p > 0:  # tokens with prob >= min_p * p_max, i.e. logit >= max + log(min_p)
        k = int((x >= x.max() + torch.log(torch.tensor(p.min_p, dtype=x.dtype))).sum())
    if p.top_p < 1:  # the smallest power-of-4 multiple of 64 whose mass reaches top_p
        lse, k_p = x.logsumexp(-1), 64
        while k_p < v // 4:
            if float((x.topk(k_p).values - lse).exp().sum()) >= p.top_p:
                return min(k, k_p)
            k_p *= 4
    return k


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]
                   ) -> list[tuple[list[int], torch.Tensor, torch.Tensor | None]]:
    """The distributions of sampled (non-greedy) rows after temperature, top-k, top-p and min-p,
    as groups (rows, probs float64 [R, K], ids [R, K]): with a filter, each row's K most likely
    tokens in descending order, K covering everything its filters keep; without one, the whole
    vocabulary in its own order (ids None), so the common case sorts nothing. A row's group
    depends on its own logits and params only, so its draw does not depend on its batch."""
    dev = logits.device
    x = sanitize(logits)
    x = x - x.max(-1, keepdim=True).values
    temp = torch.tensor([p.temperature for p in params], device=dev, dtype=x.dtype)
    x = x / temp[:, None]
    v = x.shape[-1]
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault(_candidates(x[i], p) if _needs_sorting(p) else -1, []).append(i)
    out = []
    for k, rows in groups.items():
        xs, ps = x[rows], [params[i] for i in rows]
        if k < 0:
            out.append((rows, xs.double().softmax(-1), None))
            continue
        # The candidates' probabilities are relative to the whole row (top-k's kept set is all there).
        lse = xs.logsumexp(-1, keepdim=True)
        xs, ids = xs.topk(k, dim=-1) if k < v else xs.sort(dim=-1, descending=True, stable=True)
        xs = filter_sorted(
            xs,
            torch.tensor([p.top_k for p in ps], device=dev, dtype=torch.int64),
            torch.tensor([p.top_p for p in ps], device=dev, dtype=xs.dtype),
            torch.tensor([p.min_p for p in ps], device=dev, dtype=xs.dtype),
            lse=lse,
        )
        out.append((rows, xs.double().softmax(-1), ids))
    return out


def probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from after temperature, top-k, top-p and min-p, in
    vocabulary order, float64 [B, V]; a greedy row is one-hot at its argmax."""
    out = torch.zeros(logits.shape, dtype=torch.float64, device=logits.device)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        top = sanitize(logits[greedy]).argmax(-1)
        out[greedy, top] = 1.0
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        for group, sp, ids in filtered_probs(logits[rows], [params[i] for i in rows]):
            where = [rows[j] for j in group]
            out[where] = sp if ids is None else torch.zeros_like(out[where]).scatter_(1, ids, sp)
    return out


MASK64 = (1 << 64) - 1


def keyed_uniform(seed: int, position: int) -> float:
    """A uniform in [0, 1) that depends only on (seed, position) (splitmix64 of both).

    A seeded request draws the token at position i with keyed_uniform(seed, i), so its output
    does not depend on how many numbers were drawn before: speculative decoding, which verifies
    several positions at once, then reproduces plain sampling exactly (see speculative.py).
    """
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return ((x ^ (x >> 31)) >> 11) / float(1 << 53)


def uniforms(rows: list[int], sources: list, fallback: torch.Generator | None,
             device: torch.device) -> torch.Tensor:
    """One uniform in [0, 1) per row: the row's own float if it has one, else a draw from its
    generator (or the fallback)."""
    return torch.tensor([s if isinstance(s, float) else torch.rand((), generator=s or fallback).item()
                         for s in (sources[i] for i in rows)], device=device, dtype=torch.float64)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list,
    fallback: torch.Generator | None = None,
) -> list[int]:
    """Next token per row of `logits` [B, V]. `generators[i]` is row i's randomness: a
    generator, a fixed uniform (float, e.g. `keyed_uniform`) or None for `fallback`."""
    tokens = sanitize(logits).argmax(-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        groups = filtered_probs(logits[rows], [params[i] for i in rows])
        us = uniforms(rows, generators, fallback, logits.device)  # after what can fail: none drawn then
        for group, sp, ids in groups:
            picked = draw(sp, us[group])
            tokens[[rows[j] for j in group]] = picked if ids is None else ids.gather(1, picked[:, None]).squeeze(1)
    return tokens.tolist()


def sample_each(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list,
    fallback: torch.Generator | None = None,
) -> list[int | Exception]:
    """`sample`, but a row whose sampling fails gets its exception instead of a token, and the
    other rows are sampled as if it were not there (one bad request fails alone)."""
    try:
        return list(sample(logits, params, generators, fallback))
    except Exception:  # find the failing rows; the others draw exactly what they would have
        out: list[int | Exception] = []
        for i in range(len(params)):
            try:
                out.append(sample(logits[i:i + 1], params[i:i + 1], generators[i:i + 1], fallback)[0])
            except Exception as exc:  # noqa: BLE001 - reported on that request alone
                out.append(exc)
        return out


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: list[int]) -> list[TokenLogprob]:
    """Logprob of each row's chosen token and its `num_top[i]` most likely alternatives."""
    lp = torch.nan_to_num(logits.float(), nan=float("-inf")).log_softmax(-1)
    chosen_t = lp.gather(1, torch.tensor(token_ids, device=lp.device)[:, None])
    ranks = ((lp > chosen_t).sum(-1) + 1).tolist()
    chosen = chosen_t.squeeze(1).tolist()
    k = max(num_top)
    top_v, top_i = lp.topk(k, -1) if k else (None, None)
    out = []
    for row, (tok, val, n) in enumerate(zip(token_ids, chosen, num_top)):
        top = list(zip(top_i[row, :n].tolist(), top_v[row, :n].tolist())) if n else []
        out.append(TokenLogprob(tok, val, top, ranks[row]))
    return out


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator for a seeded request, or None (the engine's shared generator is used)."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)
