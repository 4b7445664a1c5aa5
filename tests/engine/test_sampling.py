"""Sampling: greedy is argmax, filters never let a filtered token through, draws follow the
filtered softmax, seeded rows are reproducible whatever shares the batch, logprobs are log_softmax."""

import pytest
import torch

from reclaim.engine.request import SamplingParams
from reclaim.engine.sampling import make_generator, sample, token_logprobs

V = 12


def _logits(rows=1, seed=0):
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 2


def _expected(logits, p: SamplingParams) -> torch.Tensor:
    """The filtered distribution written out the slow, obvious way (one row)."""
    probs = (logits / p.temperature).softmax(-1)
    order = probs.argsort(descending=True).tolist()
    keep = order[: p.top_k] if p.top_k > 0 else order
    kept = probs[keep] / probs[keep].sum()
    mass, chosen = 0.0, []
    for tok, q in zip(keep, kept.tolist()):
        if mass >= p.top_p:
            break
        chosen.append(tok)
        mass += q
    chosen = [t for t in chosen if probs[t] >= p.min_p * probs.max()]
    out = torch.zeros(V)
    out[chosen] = probs[chosen] / probs[chosen].sum()
    return out


def test_greedy_is_argmax_per_row():
    x = _logits(5)
    assert sample(x, [SamplingParams(temperature=0)] * 5, [None] * 5) == x.argmax(-1).tolist()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=4),
    SamplingParams(temperature=1.0, top_p=0.6),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=0.9, top_k=6, top_p=0.8, min_p=0.05),
])
def test_draws_follow_filtered_softmax(params):
    n = 20000
    x = _logits()
    want = _expected(x[0], params)
    toks = sample(x.expand(n, V).contiguous(), [params] * n, [None] * n, torch.Generator().manual_seed(3))
    freq = torch.bincount(torch.tensor(toks), minlength=V).float() / n
    assert set(torch.nonzero(freq).flatten().tolist()) <= set(torch.nonzero(want).flatten().tolist())
    # 4 standard errors of a frequency estimate from 20000 draws is below 0.015
    assert (freq - want).abs().max() < 0.015, (freq, want)


def test_seeded_rows_reproducible_and_independent_of_batch():
    x = _logits(4, seed=1)
    p_seeded = SamplingParams(temperature=1.0, seed=42)
    other = SamplingParams(temperature=1.0, top_k=3)
    alone = [sample(x[:1], [p_seeded], [g])[0] for g in [make_generator(42)] for _ in range(30)]
    g = make_generator(42)
    shared = torch.Generator().manual_seed(7)
    mixed = [sample(x[[1, 0, 2]], [other, p_seeded, other], [None, g, None], shared)[1] for _ in range(30)]
    assert alone == mixed
    assert len(set(alone)) > 1  # it really sampled


def test_logprobs_are_log_softmax_with_top_alternatives():
    x = _logits(3)
    lps = token_logprobs(x, [4, 0, 7], [2, 0, 5])
    ref = x.log_softmax(-1)
    for row, (lp, tok, k) in enumerate(zip(lps, [4, 0, 7], [2, 0, 5])):
        assert lp.token_id == tok and lp.logprob == pytest.approx(ref[row, tok].item(), abs=1e-6)
        assert [t for t, _ in lp.top] == ref[row].topk(k).indices.tolist() if k else lp.top == []
        assert all(v == pytest.approx(ref[row, t].item(), abs=1e-6) for t, v in lp.top)


def test_tiny_temperatures_are_greedy():
    x = _logits(4, seed=5)
    for t in (1e-40, 1e-39, 1e-20, 1e-6):
        p = SamplingParams(temperature=t)
        assert p.greedy and sample(x, [p] * 4, [None] * 4) == x.argmax(-1).tolist()


def test_out_of_range_params_are_refused_naming_the_field():
    for kw, name in [({"top_k": 2**63}, "top_k"), ({"temperature": float("nan")}, "temperature"),
                     ({"temperature": 1e9}, "temperature"), ({"max_tokens": 2**40}, "max_tokens"),
                     ({"stop": ["x"] * 1000}, "stop"), ({"seed": 2**64}, "seed")]:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kw)


def test_one_failing_row_fails_alone():
    from reclaim.engine.sampling import sample_each

    x = _logits(3, seed=2)
    good = SamplingParams(temperature=0.8, seed=11)
    bad = SamplingParams(temperature=0.8)
    bad.top_k = 2**63  # past validation: what an unchecked caller could hand the sampler
    alone = [sample(x[i:i + 1], [good], [make_generator(11)])[0] for i in (0, 2)]
    out = sample_each(x, [good, bad, good], [make_generator(11), None, make_generator(11)])
    assert isinstance(out[1], Exception) and [out[0], out[2]] == alone


def _reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The filters on the whole sorted vocabulary, step by step (what `probs` may shortcut)."""
    x = logits.double() / p.temperature
    order = x.argsort(descending=True)
    xs = x[order]
    if p.top_k > 0:
        xs[p.top_k:] = float("-inf")
    q = xs.softmax(-1)
    keep = (q.cumsum(-1) - q) < p.top_p
    keep &= q >= p.min_p * q[0]
    keep[0] = True
    q = torch.where(keep, q, 0.0)
    return torch.zeros_like(q).scatter_(0, order, q / q.sum())


@pytest.mark.parametrize("kw", [{}, {"top_p": 0.9}, {"top_p": 0.3}, {"top_k": 5}, {"top_k": 50, "top_p": 0.8},
                                {"min_p": 0.05}, {"min_p": 0.2, "top_p": 0.95}, {"top_p": 0.999}])
def test_filtered_probs_equal_filtering_the_whole_sorted_vocabulary(kw):
    """The sampler sorts only the candidates a filter can keep (or nothing, without a filter);
    the distribution is that of filtering the whole sorted vocabulary, row by row in any batch."""
    from reclaim.engine.sampling import probs

    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 5000, generator=g) * torch.tensor([1.0, 3.0, 6.0, 0.3])[:, None]
    params = [SamplingParams(temperature=0.7, **kw), SamplingParams(temperature=1.0, top_k=3),
              SamplingParams(temperature=0.7, **kw), SamplingParams(temperature=1.3, **kw)]
    got = probs(x, params)
    for i, p in enumerate(params):
        assert torch.allclose(got[i], _reference_probs(x[i], p), atol=1e-9), (i, kw)
        assert torch.allclose(probs(x[i:i + 1], [p])[0], got[i], atol=1e-12)
