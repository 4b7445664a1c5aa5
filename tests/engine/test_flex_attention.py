"""The engine with FlexAttention reading a head-major K/V pool (the path off the CPU, asked for
here with RECLAIM_ATTENTION_BACKEND=flex): greedy output equal to the C kernel's engine and to
transformers', through prefill chunks after a cached prefix, decodes of several rows at once and
a speculative tree's verify rows."""

import pytest
import torch

from engine_helpers import make_pair
from reclaim.engine.engine import Engine
from reclaim.engine.request import SamplingParams
from reclaim.engine.speculative import SpeculativeConfig
from reclaim.models.hf import hf_generate
from reclaim.models.kernels import flex_paged

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SHARED = list(range(10, 30))
PROMPTS = [SHARED + [5, 9], SHARED + [7], [3, 4] * 5]  # a shared 20-token prefix: chunks after it
SUFFIX = SpeculativeConfig(method="suffix", num_speculative_tokens=4, suffix_topk=2, max_batch=64,
                           measured_costs=False)


def _run(model, **kw):
    eng = Engine(model, num_blocks=64, block_size=16, max_num_batched_tokens=24, **kw)
    return [o.token_ids for o in eng.generate(PROMPTS, GREEDY)], eng


@pytest.mark.slow  # FlexAttention compiles each step's shapes on a CPU: ~25 s cold
def test_flex_engine_equals_the_kernel_engine_and_transformers(monkeypatch):
    model, hf = make_pair(seed=3)
    want, _ = _run(model)
    monkeypatch.setenv("RECLAIM_ATTENTION_BACKEND", "flex")
    got, eng = _run(model)
    assert eng.runner.pool.layout == "heads" and flex_paged.failed is None
    assert got == want
    for p, tokens in zip(PROMPTS, got):
        assert tokens == hf_generate(hf, torch.tensor([p]), max_new_tokens=6, ignore_eos=True)[0].tolist()
    spec, eng = _run(model, speculative=SUFFIX)  # tree verify rows through FlexAttention
    assert spec == want and eng.stats()["spec_verifies"] > 0 and flex_paged.failed is None


def test_an_unknown_backend_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("RECLAIM_ATTENTION_BACKEND", "flash")
    with pytest.raises(ValueError, match=r"RECLAIM_ATTENTION_BACKEND='flash'; allowed: \['auto', 'flex', 'flashinfer'\]"):
        _run(make_pair(seed=3)[0])
