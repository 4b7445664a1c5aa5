"""Our decoder against transformers: same logits, same hidden states, same incremental decoding."""

import torch

from reclaim.models.cache import DenseCache
from reclaim.models.hf import hf_forward, hf_logits
from reclaim.models.loading import load_checkpoint

TOL = 1e-4  # fp32 max abs diff the design asks for


def test_logits_and_hidden_match_transformers(tiny_dir):
    path, hf = tiny_dir
    model = load_checkpoint(path)
    ids = torch.randint(0, hf.config.vocab_size, (2, 24))
    with torch.no_grad():
        out = model(ids, return_hidden=True)
        ref = hf(input_ids=ids, output_hidden_states=True)
    assert (out.logits - ref.logits).abs().max() <= TOL
    assert (out.hidden - ref.hidden_states[-1]).abs().max() <= TOL  # final-norm states


def test_logit_positions_select_rows_of_the_full_logits(tiny_dir):
    path, hf = tiny_dir
    model = load_checkpoint(path)
    ids = torch.randint(0, hf.config.vocab_size, (2, 12))
    pick = torch.tensor([[11, 3], [0, 7]])
    with torch.no_grad():
        full = model(ids).logits
        some = model(ids, logit_positions=pick).logits
    assert torch.allclose(some, torch.stack([full[b, pick[b]] for b in range(2)]), atol=1e-6)


def test_incremental_decoding_matches_full_forward(tiny_dir):
    """Prefill, a chunk of several tokens, then one token at a time, through DenseCache."""
    path, hf = tiny_dir
    model = load_checkpoint(path)
    ids = torch.randint(0, hf.config.vocab_size, (2, 20))
    full = hf_logits(hf, ids)
    cache, steps, hf_cache = DenseCache(), [(0, 9), (9, 13)] + [(t, t + 1) for t in range(13, 20)], None
    for a, b in steps:
        pos = torch.arange(a, b).expand(2, -1)
        with torch.no_grad():
            got = model(ids[:, a:b], pos, cache).logits
        theirs, hf_cache = hf_forward(hf, ids[:, a:b], cache=hf_cache)
        assert (got - full[:, a:b]).abs().max() <= TOL, (a, b)
        assert (theirs - full[:, a:b]).abs().max() <= TOL, (a, b)  # the adapter's cache path
    assert cache.length == 20
