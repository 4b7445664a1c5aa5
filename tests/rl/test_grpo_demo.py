"""The GRPO part of `reclaim demo` on a tiny model: two steps with speculative rollouts, printed,
and the caller's model left as it was."""

import io

import torch

from reclaim.models.loading import load_model
from reclaim.rl.demo import demo_grpo


def test_demo_grpo_runs_two_steps_and_leaves_the_model_alone(tiny_model_dir, one_thread):
    model, tok = load_model(tiny_model_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = io.StringIO()
    # Threshold 6: every sequence of the tiny model's rollout is "tail", so each step speculates.
    result = demo_grpo(model, tok, out, speculative="suffix", steps=2, threshold=6)
    text = out.getvalue()
    assert text.count("step ") >= 2 and "tokens/s" in text and "long tail" in text and "reward" in text
    assert result["steps"] == 2 and result["rollout_tokens_per_s"] > 0 and result["rollout_spec_decisions"] > 0
    assert 0 <= result["reward"] <= 1.5 and result["rollout_tail_s"] > 0
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, msg=k)
