"""The GRPO part of `reclaim demo`: two RL steps on the given model with adaptive speculative rollouts.

The same pieces as `reclaim grpo` (rollout.py's rollout and adaptive runner, grpo.py's training
step), sized to take seconds: one add_word prompt (data/tasks.py) with 4 sampled completions of at
most 64 tokens per step, speculation whenever at most 2 are still decoding, the bandit choosing
plain or a draft depth there. It prints each step's rewards, rollout tokens/s, the time spent in
the long tail and the drafts' acceptance, and leaves the caller's model unchanged.
"""

from __future__ import annotations

import copy
import sys
import time
from typing import Any, TextIO

import torch


def demo_config(speculative: str = "suffix", steps: int = 2, threshold: int = 2) -> Any:
    """The demo's GRPOConfig; speculative 'suffix' (the default) drafts from the group's other
    completions, nothing to train ('auto': the default model's cached EAGLE drafter, else suffix)."""
    from reclaim.rl.grpo_config import GRPOConfig

    if speculative == "auto":
        from reclaim.drafter.bundled import default_drafter_path

        speculative = "eagle" if (default_drafter_path() / "config.json").is_file() else "suffix"
    return GRPOConfig(task="add_word", num_prompts=8, num_generations=4, per_device_train_batch_size=4,
                      gradient_accumulation_steps=1, max_completion_length=64, temperature=0.7,
                      prompt_template="{question}\nEnd with the final answer as <answer>NUMBER</answer>.",
                      reward_weights=[1.0, 0.5], learning_rate=1e-5, lr_scheduler_type="constant",
                      max_steps=steps, seed=3, speculative=speculative, spec_threshold=threshold, spec_depths=[2, 4],
                      output_dir="unused")


def demo_grpo(model: torch.nn.Module, tokenizer: Any, out: TextIO | None = None, *, speculative: str = "suffix",
              steps: int = 2, threshold: int = 2) -> dict[str, Any]:
    """`steps` GRPO steps on a copy of `model` with adaptive speculative rollouts, printed to `out`
    (stdout); returns the last step's metrics and the run's seconds."""
    from reclaim.engine.proposers import make_proposer
    from reclaim.engine.engine import Engine
    from reclaim.models.tokenizer import encode_chat
    from reclaim.optim import adamw
    from reclaim.rl.data import build_dataset, prompt_rows
    from reclaim.rl.distributed import World
    from reclaim.rl.grpo import backward_step
    from reclaim.rl.rollout import rollout, rollout_runner, spec_arms
    from reclaim.rl.rewards import load_reward

    out = out or sys.stdout
    t0 = time.perf_counter()
    cfg = demo_config(speculative, steps, threshold)
    rows = build_dataset(cfg)
    prompts = [encode_chat(tokenizer, r["prompt"]) for r in rows]
    funcs = [load_reward(name) for name in cfg.reward_funcs]
    policy = copy.deepcopy(model).train()  # trained here; the caller's model stays as it was
    runner = rollout_runner(cfg)
    # The drafter is built with the engine so that it sees every sequence from its prefill on: one
    # first made in the tail has no hidden states of the sequences running and cannot draft for them.
    served = copy.deepcopy(model).eval()
    engine = Engine(served, tokenizer, max_num_seqs=cfg.num_generations, seed=cfg.seed,
                    max_model_len=max(map(len, prompts)) + cfg.max_completion_length,
                    proposer=make_proposer(spec_arms(cfg)[-1], served))
    opt = adamw(list(policy.parameters()), lr=cfg.learning_rate)
    eos = set(engine.eos_token_ids)
    spec = {"eagle": "eagle, the default model's drafter", "suffix": "suffix, drafted from the group's other "
            "completions"}.get(cfg.speculative, cfg.speculative)
    out.write(f"GRPO: {cfg.num_generations} completions per prompt, speculative rollouts ({spec}) while at most "
              f"{cfg.spec_threshold} are decoding, plain or a draft arm chosen by a bandit\n")
    metrics: dict[str, Any] = {}
    for step in range(cfg.max_steps):
        t = time.perf_counter()
        idx = prompt_rows(len(rows), 1, step, cfg.seed)
        batch = rollout(engine, [rows[i] for i in idx], [prompts[i] for i in idx], step, cfg, funcs,
                        cfg.reward_funcs, eos, runner=runner)
        opt.zero_grad(set_to_none=True)
        metrics = {**batch.metrics, "loss": backward_step(policy, batch, cfg, World())["loss"]}
        metrics["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm))
        opt.step()
        engine.update_weights(policy.state_dict())
        metrics["step_time"] = time.perf_counter() - t
        m = metrics
        spec_line = (f", {m['rollout_spec_tau']:.2f} tokens per verify (acceptance "
                     f"{m['rollout_spec_acceptance']:.0%})" if "rollout_spec_tau" in m else ", no drafts verified")
        out.write(f"step {step + 1}: {rows[idx[0]]['question']!r} (answer {rows[idx[0]]['answer']})\n"
                  f"  reward {m['reward']:.2f} (accuracy {m['rewards/accuracy/mean']:.2f}, format "
                  f"{m['rewards/format/mean']:.2f}); completions {m['completions/min_length']:.0f}-"
                  f"{m['completions/max_length']:.0f} tokens\n"
                  f"  rollout {m['rollout_tokens_per_s']:.1f} tokens/s, {m['rollout_tail_s']:.1f} of "
                  f"{m['rollout_s']:.1f} s in the long tail{spec_line}; step {m['step_time']:.1f} s\n")
    out.flush()
    return {**metrics, "steps": cfg.max_steps, "seconds": time.perf_counter() - t0}
