"""The online-learning demo on a tiny model: every training step reuses the served prefill, the
reused gradient equals recomputing's, the correction gains log-probability (the model's own
forward before and after is the oracle), and the weights are given back unchanged."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))

from live_server import make_model, make_tokenizer  # noqa: E402

from reclaim.online.demo import demo_online  # noqa: E402


def test_demo_online_learns_the_correction_reusing_the_prefill():
    tokenizer = make_tokenizer()
    model = make_model(tokenizer, max_position_embeddings=512)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = io.StringIO()
    result = demo_online(model, tokenizer, out, rounds=3, max_tokens=4, learning_rate=1e-3)
    assert result["grad_rel_err"] <= 1e-5
    assert [s["reason"] for s in result["steps"]] == ["record"] * 3  # each step reused its prefill
    assert result["logprob_after"]["trained"] > result["logprob_before"]["trained"]
    text = out.getvalue()
    assert "relative error" in text and "held out" in text and "round 3" in text
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    assert not model.training and all(p.grad is None for p in model.parameters())
