"""Choose the next token for a batch of rows, each with its own SamplingParams and generator.

Filters (top-k, then top-p on what top-k kept, then min-p), the uniforms and the draw are tensor
ops over the batch, with no host sync until the caller reads the tokens (`sample_tensor`; one
more only when a top-p or min-p row's filter reaches past the first CANDIDATES tokens). A seeded
request draws the uniform keyed by (seed, position), so it draws the same whatever else shares
its batch. `probs` exposes the processed
distribution itself (what speculative decoding's rejection rule compares). Logprobs are those of
the model's raw distribution (log_softmax of the logits), as vLLM reports them.

Numerics: NaN logits count as impossible and +inf as the largest float; the temperature divides
logits after the row's maximum is subtracted, so a tiny temperature cannot overflow into NaN; the
most likely token always survives the filters, so no distribution is ever empty.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from reclaim.engine.request import SamplingParams, TokenLogprob


def clean(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 logits with NaN as -inf and +inf as the largest finite float, and per row whether
    it has a finite logit at all (a bool tensor: nothing is read on the host here)."""
    x = logits.float()
    x = torch.nan_to_num(x, nan=float("-inf"), posinf=torch.finfo(x.dtype).max, neginf=float("-inf"))
    return x, torch.isfinite(x.max(-1).values) if x.numel() else torch.ones(x.shape[:-1], dtype=torch.bool)


NO_FINITE_LOGIT = "the model produced no finite logit for a row; nothing can be sampled"


def sanitize(logits: torch.Tensor) -> torch.Tensor:
    """Float32 logits with NaN as -inf and +inf as the largest finite float; raises if a row has
    no finite logit at all (nothing could be sampled from it)."""
    x, ok = clean(logits)
    if not bool(ok.all()):
        raise ValueError(NO_FINITE_LOGIT)
    return x


def penalize(logits: torch.Tensor, params: list[SamplingParams], prompts: list[list[int]],
             outputs: list[list[int]], stops: list[set[int]]) -> torch.Tensor:
    """Rows' logits [B, V] after logit_bias, repetition, presence and frequency penalties and
    min_tokens (stop ids masked), in that order; a new float32 tensor, logits untouched.

    Tensor ops over the batch: each kind's (row, token) pairs are listed on the host and copied
    to the device in one tensor, so a step's ops do not grow with the rows that ask. Token ids
    outside [0, V) are skipped (logit_bias keys are checked when the request is made)."""
    x = logits.float().clone()
    v = x.shape[-1]
    bias: list[tuple[int, int, float]] = []  # (row, token, bias)
    rep: list[tuple[int, int, float]] = []  # (row, token, repetition_penalty)
    pen: list[tuple[int, int, int, float, float]] = []  # (row, token, count, frequency, presence)
    ban: list[tuple[int, int]] = []  # (row, stop token) while min_tokens is not reached
    for i, (p, prompt, output, stop) in enumerate(zip(params, prompts, outputs, stops)):
        if p.logit_bias:
            bias += [(i, t, float(b)) for t, b in p.logit_bias.items() if 0 <= t < v]
        if p.repetition_penalty != 1.0:
            rep += [(i, t, p.repetition_penalty) for t in sorted(set(prompt) | set(output)) if 0 <= t < v]
        if (p.presence_penalty or p.frequency_penalty) and output:
            counts: dict[int, int] = {}
            for t in output:
                counts[t] = counts.get(t, 0) + 1
            pen += [(i, t, c, p.frequency_penalty, p.presence_penalty) for t, c in counts.items() if 0 <= t < v]
        if len(output) < p.min_tokens:
            ban += [(i, t) for t in sorted(stop) if 0 <= t < v]
    if bias:
        at, b = _pairs(bias, x.device)
        x.index_put_(at, b[0], accumulate=True)
    if rep:
        at, r = _pairs(rep, x.device)
        vals = x[at]
        x[at] = torch.where(vals > 0, vals / r[0], vals * r[0])
    if pen:  # as OpenAI's rule over the whole row: frequency * count + presence * (count > 0)
        at, c = _pairs(pen, x.device)
        x.index_put_(at, -(c[1] * c[0] + c[2]), accumulate=True)
    if ban:
        x[_pairs(ban, x.device)[0]] = float("-inf")
    return x


def _pairs(items: list[tuple], device: torch.device) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """(rows, tokens) index tensors and the float32 columns after them [k, n] (k may be 0), from
    host tuples (row, token, *values): one copy each to the device."""
    idx = torch.tensor([it[:2] for it in items], dtype=torch.long).T.to(device)
    vals = torch.tensor([it[2:] for it in items], dtype=torch.float32).T
    return (idx[0], idx[1]), vals.to(device) if vals.numel() else vals


def mask_logits(x: torch.Tensor, params: SamplingParams, output: list[int]) -> torch.Tensor:
    """One row's logits [V] (float32, owned by the caller: may be written in place) after
    allowed_token_ids, bad_words_token_ids and the constraint's mask. Raises ValueError when a
    token id is outside [0, V) or the masks together leave no token."""
    v = x.shape[-1]
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


# Most likely tokens a top-p or min-p row's filters are first tried on: one top-k over the batch
# instead of sorting the vocabulary (49k tokens: ~2 ms a row on a CPU). A row whose kept set may
# reach past them (a flat distribution) is filtered over the whole sorted vocabulary instead.
CANDIDATES = 1024


def _covered(vals: torch.Tensor, lse: torch.Tensor, ps: list[SamplingParams]) -> torch.Tensor:
    """Per row of the K most likely logits `vals` [R, K] (row max 0, descending), whether its
    filters keep only tokens among them: a top-k within K, a top-p whose mass they reach, or a
    min-p whose threshold falls inside them."""
    dev, k = vals.device, vals.shape[-1]
    top_k = torch.tensor([0 < p.top_k <= k for p in ps], device=dev)
    top_p = torch.tensor([p.top_p for p in ps], device=dev, dtype=vals.dtype)
    min_p = torch.tensor([p.min_p for p in ps], device=dev, dtype=vals.dtype)
    mass = (vals - lse).exp().cumsum(-1)[:, -1]
    return top_k | ((top_p < 1) & (mass >= top_p)) | ((min_p > 0) & (vals[:, -1] < min_p.log()))


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]
                   ) -> list[tuple[list[int], torch.Tensor, torch.Tensor | None]]:
    """The distributions of sampled (non-greedy) rows after temperature, top-k, top-p and min-p,
    as groups (rows, probs float64 [R, K], ids [R, K]): rows with a filter over their K most
    likely tokens in descending order (K covering everything any of their filters keeps), rows
    without over the whole vocabulary in its own order (ids None), so the common case sorts
    nothing. A row's probabilities do not depend on the rows beside it. Reads one bool on the
    host only when a top-p or min-p row is present."""
    dev = logits.device
    x, _ = clean(logits)
    x = x - x.max(-1, keepdim=True).values
    temp = torch.tensor([p.temperature for p in params], device=dev, dtype=x.dtype)
    x = x / temp[:, None]
    v = x.shape[-1]
    plain = [i for i, p in enumerate(params) if not _needs_sorting(p)]
    filt = [i for i, p in enumerate(params) if _needs_sorting(p)]
    out = []
    if plain:
        out.append((plain, x[plain].double().softmax(-1), None))
    if filt:
        xs, ps = x[filt], [params[i] for i in filt]
        # The candidates' probabilities are relative to the whole row (top-k's kept set is all there).
        lse = xs.logsumexp(-1, keepdim=True)
        k = min(v, max([p.top_k for p in ps if p.top_k > 0] +
                       [CANDIDATES for p in ps if p.top_p < 1 or p.min_p > 0]))
        vals = ids = None
        if k < v:
            vals, ids = xs.topk(k, dim=-1)
            if any(p.top_p < 1 or p.min_p > 0 for p in ps) and not bool(_covered(vals, lse, ps).all()):
                vals = None
        if vals is None:
            vals, ids = xs.sort(dim=-1, descending=True, stable=True)
        vals = filter_sorted(
            vals,
            torch.tensor([p.top_k for p in ps], device=dev, dtype=torch.int64),
            torch.tensor([p.top_p for p in ps], device=dev, dtype=vals.dtype),
            torch.tensor([p.min_p for p in ps], device=dev, dtype=vals.dtype),
            lse=lse,
        )
        out.append((filt, vals.double().softmax(-1), ids))
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


class Keyed(NamedTuple):
    """A row's randomness as its (seed, position) key: its uniform is keyed_uniform(seed,
    position), computed with the batch's other keyed rows as tensor ops (`keyed_uniforms`)."""

    seed: int
    position: int


def _i64(x: int) -> int:
    """An unsigned 64-bit value as the int64 with the same bits."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> keeps the sign)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def keyed_uniforms(seeds: list[int], positions: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """keyed_uniform of each (seed, position), float64 [n], as int64 tensor ops (splitmix64:
    multiplications wrap modulo 2**64 as the bits of unsigned ones do)."""
    s = torch.tensor([_i64(x) for x in seeds], dtype=torch.int64, device=device)
    p = torch.tensor([_i64(x & MASK64) for x in positions], dtype=torch.int64, device=device)
    x = s * _i64(0x9E3779B97F4A7C15) + p * _i64(0xD1B54A32D192ED03) + _i64(0x632BE59BD9B4E019)
    x = (x ^ _shr(x, 30)) * _i64(0xBF58476D1CE4E5B9)
    x = (x ^ _shr(x, 27)) * _i64(0x94D049BB133111EB)
    return _shr(x ^ _shr(x, 31), 11).double() / float(1 << 53)


def uniforms(rows: list[int], sources: list, fallback: torch.Generator | None,
             device: torch.device) -> torch.Tensor:
    """One uniform in [0, 1) per row, float64 [len(rows)] on `device`: the row's own float, its
    Keyed (seed, position), a draw from its own generator, or (None) from `fallback`. Keyed rows
    and fallback rows are each one tensor op for the whole batch."""
    srcs = [sources[i] for i in rows]
    out = torch.empty(len(rows), dtype=torch.float64, device=device)
    fixed = [j for j, s in enumerate(srcs) if isinstance(s, float)]
    if fixed:
        out[fixed] = torch.tensor([srcs[j] for j in fixed], dtype=torch.float64, device=device)
    keyed = [j for j, s in enumerate(srcs) if isinstance(s, Keyed)]
    if keyed:
        out[keyed] = keyed_uniforms([srcs[j].seed for j in keyed], [srcs[j].position for j in keyed], device)
    shared = [j for j, s in enumerate(srcs) if s is None]
    if shared:
        if fallback is None:
            raise ValueError("a row without its own randomness needs a fallback generator")
        out[shared] = draws(len(shared), fallback).to(device)
    for j, s in enumerate(srcs):
        if isinstance(s, torch.Generator):
            out[j] = draws(1, s).to(device)[0]
    return out


def draws(n: int, generator: torch.Generator) -> torch.Tensor:
    """n uniforms in [0, 1), float64, from `generator` on its own device (a generator only
    draws on the device it belongs to)."""
    return torch.rand(n, generator=generator, dtype=torch.float64, device=generator.device)


def sample_tensor(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list,
    fallback: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token per row of `logits` [B, V] and whether the row had a finite logit (both
    tensors: nothing read on the host but, with a top-p or min-p row, one bool). `generators[i]`
    is row i's randomness: a Generator, a fixed uniform (float), a Keyed, or None for `fallback`."""
    x, ok = clean(logits)
    tokens = x.argmax(-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        groups = filtered_probs(x[rows], [params[i] for i in rows])
        us = uniforms(rows, generators, fallback, logits.device)  # after what can fail: none drawn then
        for group, sp, ids in groups:
            picked = draw(sp, us[group])
            where = torch.tensor([rows[j] for j in group], device=logits.device)
            tokens[where] = picked if ids is None else ids.gather(1, picked[:, None]).squeeze(1)
    return tokens, ok


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list,
    fallback: torch.Generator | None = None,
) -> list[int]:
    """Next token per row of `logits` [B, V] (see `sample_tensor`); raises ValueError when a row
    has no finite logit."""
    tokens, ok = sample_tensor(logits, params, generators, fallback)
    got = torch.stack([tokens, ok.long()]).tolist()
    if not all(got[1]):
        raise ValueError(NO_FINITE_LOGIT)
    return got[0]


class Deferred(NamedTuple):
    """Integers computed on the device (`values`, int64 [n]) and what turns them, once read on
    the host, into the result (`finish`). A step concatenates every Deferred's values and reads
    them all with one host sync."""

    values: torch.Tensor
    finish: Callable[[list[int]], Any]


def read(parts: list[Deferred]) -> list[Any]:
    """Every part's result, its values read on the host together (one sync)."""
    parts = [d for d in parts if d is not None]
    got = torch.cat([d.values.reshape(-1).long() for d in parts]).tolist() if parts else []
    out, at = [], 0
    for d in parts:
        n = d.values.numel()
        out.append(d.finish(got[at:at + n]))
        at += n
    return out


def sample_deferred(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list,
    fallback: torch.Generator | None = None,
) -> Deferred:
    """`sample_each` with the tokens left on the device until `read`: its result is, per row, a
    token or the exception that fails that row alone."""
    try:
        tokens, ok = sample_tensor(logits, params, generators, fallback)
    except Exception:  # some row's params fail the batch: sample row by row now (rare)
        done = sample_each(logits, params, generators, fallback)
        return Deferred(torch.zeros(0, dtype=torch.long, device=logits.device), lambda _: done)
    n = len(params)
    return Deferred(torch.cat([tokens, ok.long()]),
                    lambda got: [t if good else ValueError(NO_FINITE_LOGIT) for t, good in zip(got[:n], got[n:])])


def sample_each(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list,
    fallback: torch.Generator | None = None,
) -> list[int | Exception]:
    """`sample`, but a row whose sampling fails gets its exception instead of a token, and the
    other rows are sampled as if it were not there (one bad request fails alone). One host read
    for the batch (two with a top-p or min-p row) unless some row's params fail the batch."""
    try:
        tokens, ok = sample_tensor(logits, params, generators, fallback)
    except Exception:  # find the failing rows; the others draw exactly what they would have
        out: list[int | Exception] = []
        for i in range(len(params)):
            try:
                out.append(sample(logits[i:i + 1], params[i:i + 1], generators[i:i + 1], fallback)[0])
            except Exception as exc:  # noqa: BLE001 - reported on that request alone
                out.append(exc)
        return out
    got = torch.stack([tokens, ok.long()]).tolist()
    return [t if good else ValueError(NO_FINITE_LOGIT) for t, good in zip(*got)]


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: list[int]) -> list[TokenLogprob]:
    """Logprob of each row's chosen token and its `num_top[i]` most likely alternatives (one
    read on the host)."""
    lp = torch.nan_to_num(logits.float(), nan=float("-inf")).log_softmax(-1)
    chosen = lp.gather(1, torch.tensor(token_ids, device=lp.device)[:, None])
    ranks = (lp > chosen).sum(-1, keepdim=True) + 1
    k = max(num_top)
    parts = [chosen.double(), ranks.double()]
    if k:
        top_v, top_i = lp.topk(k, -1)
        parts += [top_v.double(), top_i.double()]  # ids below 2**53: exact as float64
    got = torch.cat(parts, 1).tolist()
    out = []
    for row, (tok, n) in enumerate(zip(token_ids, num_top)):
        g = got[row]
        top = [(int(i), v) for i, v in zip(g[2 + k: 2 + k + n], g[2: 2 + n])]
        out.append(TokenLogprob(tok, g[0], top, int(g[1])))
    return out


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator for a seeded request, or None (the engine's shared generator is used)."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)
