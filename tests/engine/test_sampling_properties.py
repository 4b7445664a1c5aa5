"""Property test: whatever the sampling parameters and however extreme the logits, the processed
distribution is a real distribution (finite, sums to 1, never empty) and a draw lands on a token
it gives mass to."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reclaim.engine.request import SamplingParams
from reclaim.engine.sampling import probs, sample

V = 16
FLOATS = st.one_of(
    st.floats(-1e4, 1e4, allow_nan=False),
    st.sampled_from([float("inf"), float("-inf"), float("nan"), 3.4e38, -3.4e38, 1e-45, 0.0]),
)


@settings(max_examples=300, deadline=None)
@given(
    logits=st.lists(FLOATS, min_size=V, max_size=V).filter(
        lambda xs: any(not math.isnan(x) and x != float("-inf") for x in xs)),
    temperature=st.one_of(st.just(0.0), st.floats(1e-45, 100.0)),
    top_p=st.floats(1e-9, 1.0, exclude_min=False),
    top_k=st.integers(-1, 2**31 - 1),
    min_p=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**32),
)
def test_processed_distribution_is_never_empty_or_nan(logits, temperature, top_p, top_k, min_p, seed):
    p = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
    x = torch.tensor([logits], dtype=torch.float32)
    dist = probs(x, [p])[0]
    assert torch.isfinite(dist).all() and (dist >= 0).all()
    assert abs(dist.sum().item() - 1.0) < 1e-9
    token = sample(x, [p], [torch.Generator().manual_seed(seed)])[0]
    assert dist[token] > 0
