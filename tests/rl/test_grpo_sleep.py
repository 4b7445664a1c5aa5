"""GRPO with enable_sleep_mode (TRL's vllm_enable_sleep_mode): the rollout engine frees its weights
and K/V pool through training and wakes for the weight update. The run must be the run without it:
the same rewards, losses, grad norms and final weights, with several iterations per rollout (steps
that do not roll out sleep too) and the moments offloaded (they leave before the engine wakes)."""

from __future__ import annotations

import json

from safetensors.torch import load_file

from reclaim.config import load_config
from reclaim.rl.grpo import train
from reclaim.rl.grpo_config import GRPOConfig


def test_a_run_with_sleep_mode_is_the_run_without(tiny_model_dir, tmp_path, one_thread):
    (tmp_path / "even.py").write_text("def even(prompts, completions, completion_ids, **kw):\n"
                                      "    return [sum(t % 2 == 0 for t in c) / len(c) for c in completion_ids]\n")
    fields = {"model": str(tiny_model_dir), "reward_funcs": [f"{tmp_path / 'even.py'}:even"], "max_steps": 4,
              "num_iterations": 2, "optimizer_offload": True, "log_completions": True}
    for name, kw in (("plain", {}), ("sleep", {"enable_sleep_mode": True})):
        train(load_config(GRPOConfig, "grpo-tiny", {**fields, **kw, "output_dir": str(tmp_path / name)}),
              progress=False)
    plain, slept = ([json.loads(x) for x in (tmp_path / n / "log.jsonl").read_text().splitlines()]
                    for n in ("plain", "sleep"))
    for a, b in zip(plain, slept, strict=True):
        assert (a["loss"], a["reward"], a["grad_norm"]) == (b["loss"], b["reward"], b["grad_norm"])
        assert b["memory/sleep_freed_bytes"] >= b["memory/rollout_weights_bytes"] + b["memory/kv_cache_bytes"] > 0
    assert "memory/sleep_freed_bytes" not in plain[0]
    assert ((tmp_path / "plain" / "completions.jsonl").read_text() ==
            (tmp_path / "sleep" / "completions.jsonl").read_text())
    a, b = (load_file(tmp_path / n / "checkpoint-4" / "model.safetensors") for n in ("plain", "sleep"))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
