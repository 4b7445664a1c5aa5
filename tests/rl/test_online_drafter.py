"""The drafter trained online (TLT): it learns the rollouts' hidden states as the engine records
them (accepted draft positions included), the engine drafts with its new weights at once, and
greedy rollouts stay identical to plain decoding."""

from __future__ import annotations

import pytest
import torch
from rl_helpers import fixed_depth, tiny_target

from reclaim.engine.engine import Engine
from reclaim.engine.request import SamplingParams
from reclaim.models.drafter import new_drafter, save_drafter
from reclaim.drafter.acceptance import greedy_acceptance
from reclaim.drafter.data import collect
from reclaim.drafter.online import OnlineDrafterTrainer


def test_the_online_drafter_learns_a_fixed_target_and_the_engine_drafts_with_it(tmp_path, one_thread):
    """Three greedy rollouts of the same prompts, 25 drafter steps after each (measured: the
    engine's tau 1.02, 1.38, 1.85)."""
    target = tiny_target(64)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 64, (6,), generator=g).tolist() for _ in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = [o.token_ids for o in Engine(target, None, max_num_seqs=16, max_model_len=64).generate(prompts, params)]
    torch.manual_seed(0)
    drafter = new_drafter(target)
    start = {k: v.clone() for k, v in drafter.state_dict().items()}
    online = OnlineDrafterTrainer(drafter, buffer_tokens=100_000, lr=3e-3, max_steps=25, seed=0, eval_samples=4)
    spec = fixed_depth(method="eagle", model=str(save_drafter(drafter, tmp_path / "d")),
                             num_speculative_tokens=4, max_batch=16)
    engine = Engine(target, None, max_num_seqs=16, max_model_len=64, speculative=spec,
                    proposer=online.proposer(target))
    losses, taus = [], []
    for _ in range(3):
        before = dict(engine.spec_stats)
        online.begin_rollout()
        outs = engine.generate(prompts, params)
        assert [o.token_ids for o in outs] == plain  # lossless with whatever drafter it has
        st = {k: engine.spec_stats[k] - before[k] for k in ("verifies", "accepted")}
        samples = online.collect(outs)
        # The recorder saw every position, draft-accepted ones included: the states are the target's.
        assert [s.hidden.shape[0] for s in samples] == [len(p) + 15 for p in prompts]
        want = collect(target, [samples[0].token_ids[:6].tolist()], [samples[0].token_ids[6:].tolist()])[0]
        torch.testing.assert_close(samples[0].hidden, want.hidden, atol=1e-4, rtol=1e-4)
        # What the engine accepted is what the drafter in use gets on replay: it drafts with the new weights.
        replay = online.evaluate(samples, target)
        assert replay["drafter/tau_online"] == pytest.approx(greedy_acceptance(online.rolled, target, samples[:4], 4)["tau"])
        taus.append((st["accepted"] + st["verifies"]) / st["verifies"])
        assert taus[-1] == pytest.approx(greedy_acceptance(online.rolled, target, samples, 4)["tau"], rel=0.03)
        losses.append([r["loss"] for r in online.train(samples, target)])
    assert online.steps == sum(map(len, losses)) == 75
    assert not all(torch.equal(start[k], v) for k, v in drafter.state_dict().items())
    assert sum(losses[-1][-5:]) < 0.7 * sum(losses[0][:5])
    assert taus[-1] > taus[0]
    assert online.buffer.num_tokens == 3 * sum(len(p) + 15 for p in prompts)


def test_grpo_with_the_online_drafter_trains_the_plain_policy_and_resumes_the_drafter(tiny_model_dir, tmp_path,
                                                                                    one_thread):
    """One process: the drafter trains after each rollout (its budget of steps), the completions
    and the policy are plain rollouts' (seeded sampling, lossless speculation), and a resumed run
    continues from the checkpoint's drafter and its step count."""
    import json
    import shutil

    from test_grpo import REWARD_FILE, _assert_same_run

    from reclaim.config import load_config
    from reclaim.models.loading import load_model
    from reclaim.rl.grpo import train
    from reclaim.rl.grpo_config import GRPOConfig

    (tmp_path / "even.py").write_text(REWARD_FILE)
    torch.manual_seed(0)
    save_drafter(new_drafter(load_model(tiny_model_dir)[0]), tmp_path / "drafter")
    base = {"model": str(tiny_model_dir), "reward_funcs": [f"{tmp_path / 'even.py'}:even"], "max_steps": 3,
            "log_completions": True}
    online = {**base, "speculative": f"eagle:{tmp_path / 'drafter'}", "spec_threshold": 64, "drafter_online": True,
              "drafter_max_steps_per_rollout": 3, "drafter_learning_rate": 1e-3}
    train(load_config(GRPOConfig, "grpo-tiny", {**base, "output_dir": str(tmp_path / "plain")}), progress=False)
    train(load_config(GRPOConfig, "grpo-tiny", {**online, "output_dir": str(tmp_path / "online")}), progress=False)
    _assert_same_run(tmp_path / "plain", tmp_path / "online", 3)
    assert (tmp_path / "plain" / "completions.jsonl").read_text() == \
        (tmp_path / "online" / "completions.jsonl").read_text()
    recs = [json.loads(line) for line in (tmp_path / "online" / "log.jsonl").read_text().splitlines()]
    assert [r["drafter/steps"] for r in recs] == [3, 3, 3] and recs[-1]["drafter/total_steps"] == 9
    assert all(r["drafter/tau_online"] >= 1 and r["drafter/tau_frozen"] >= 1 for r in recs)
    assert recs[0]["drafter/tau_online"] == recs[0]["drafter/tau_frozen"]  # the first rollout drafts with the start
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "online", resumed)
    shutil.rmtree(resumed / "checkpoint-3")
    shutil.rmtree(resumed / "checkpoint-2")
    train(load_config(GRPOConfig, "grpo-tiny", {**online, "output_dir": str(resumed), "resume_from_checkpoint": True}),
          progress=False)
    again = [json.loads(line) for line in (resumed / "log.jsonl").read_text().splitlines()]
    assert [r["drafter/total_steps"] for r in again] == [3, 6, 9]
    # The second rollout drafts with the checkpoint's drafter, as the uninterrupted run's did.
    assert again[1]["drafter/tau_online"] == pytest.approx(recs[1]["drafter/tau_online"])
    _assert_same_run(tmp_path / "plain", resumed, 3)
