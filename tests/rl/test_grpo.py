"""GRPO: advantages and loss by hand, the trainer end to end (log, checkpoints, exact resume), bad input.

The loss against TRL's own code is in test_grpo_trl.py."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from rl_helpers import tiny_target
from typer.testing import CliRunner

from reclaim.config import ConfigError, load_config
from reclaim.checkpoints import TRAINER_STATE, checkpoints
from reclaim.rl.data import build_dataset
from reclaim.rl.grpo import train
from reclaim.rl.grpo_config import GRPOConfig
from reclaim.rl.loss import grpo_loss, group_advantages
from reclaim.rl.rewards import RewardError, accuracy_reward, extract_answer, format_reward, load_reward, score


# ---- advantages and loss, worked by hand --------------------------------------------------------

def test_group_advantages_by_hand():
    per_func = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    weights = torch.tensor([1.0, 0.5])  # rewards 1, 0 | 1.5, 1.5
    adv, rewards, std = group_advantages(per_func, weights, 2, "group")
    assert rewards.tolist() == [1.0, 0.0, 1.5, 1.5]
    s = math.sqrt(0.5)  # sample std of {1, 0}
    assert adv.tolist() == pytest.approx([0.5 / (s + 1e-4), -0.5 / (s + 1e-4), 0.0, 0.0])
    assert std.tolist() == pytest.approx([s, s, 0.0, 0.0])
    adv, _, _ = group_advantages(per_func, weights, 2, "none")
    assert adv.tolist() == pytest.approx([0.5, -0.5, 0.0, 0.0])
    adv, _, _ = group_advantages(per_func, weights, 2, "batch")  # mean per group, std over all four: sqrt(1.5/3)
    assert adv.tolist() == pytest.approx([0.5 / (s + 1e-4), -0.5 / (s + 1e-4), 0.0, 0.0])
    # A completion every function left None is out of its group's statistics and gets advantage 0.
    per_func = torch.tensor([[1.0], [math.nan], [0.0], [2.0]])
    adv, _, _ = group_advantages(per_func, torch.ones(1), 2, "none")
    assert adv.tolist() == [0.0, 0.0, -1.0, 1.0]


def _hand_batch():
    logps = torch.log(torch.tensor([[0.5, 0.25, 0.9], [0.1, 0.2, 0.3]])).requires_grad_()
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    return logps, torch.tensor([1.0, -2.0]), mask


@pytest.mark.parametrize("loss_type,expected", [
    ("grpo", (-1 + 2) / 2),  # per-sequence token means -1 and 2, averaged
    ("bnpo", (-2 + 6) / 5),  # token sum over token count
    ("dr_grpo", (-2 + 6) / (2 * 4)),  # token sum / (B * max_completion_length)
    ("dapo", (-2 + 6) / 10),  # token sum / the step's completion tokens
])
def test_loss_by_hand_on_policy(loss_type, expected):
    """num_iterations = 1: the ratio is 1, each token's loss is -advantage."""
    logps, adv, mask = _hand_batch()
    loss, sums = grpo_loss(logps, adv, mask, loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.2,
                           max_completion_length=4, num_items_in_batch=10)
    assert loss.item() == pytest.approx(expected)
    loss.backward()
    if loss_type == "grpo":  # d/dlogp of -A * ratio / len / B
        assert logps.grad.flatten().tolist() == pytest.approx([-0.25, -0.25, 0.0] + [1 / 3] * 3)
    assert sums["tokens"].item() == 5 and sums["clip_region"].item() == 0
    # gradient accumulation divides every type but dapo, whose normaliser is already the step's tokens
    half, _ = grpo_loss(logps.detach(), adv, mask, loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.2,
                        max_completion_length=4, num_items_in_batch=10, gradient_accumulation_steps=2)
    assert half.item() == pytest.approx(expected if loss_type == "dapo" else expected / 2)


def test_clipping_and_kl_by_hand():
    logps, adv, mask = _hand_batch()
    old = logps.detach() - math.log(1.5)  # ratio 1.5 everywhere
    loss, sums = grpo_loss(logps, adv, mask, loss_type="bnpo", epsilon_low=0.2, epsilon_high=0.2, old_logps=old)
    # A = 1 > 0 with ratio 1.5 > 1.2: clipped to 1.2 (no gradient); A = -2: min picks 1.5 * -2 -> 3 per token
    assert loss.item() == pytest.approx((2 * -1.2 + 3 * 3.0) / 5)
    loss.backward()
    assert logps.grad[0].tolist() == [0.0, 0.0, 0.0]
    assert logps.grad[1].tolist() == pytest.approx([1.5 * 2 / 5] * 3)
    assert sums["clip_high"].item() == 2 and sums["clip_low"].item() == 0 and sums["clip_region"].item() == 2
    # epsilon_high 0.6 lets a ratio of 1.5 through
    loss, sums = grpo_loss(logps.detach(), adv, mask, loss_type="bnpo", epsilon_low=0.2, epsilon_high=0.6,
                           old_logps=old)
    assert loss.item() == pytest.approx((2 * -1.5 + 3 * 3.0) / 5) and sums["clip_region"].item() == 0
    # k3 KL: ref - logp = log 2 -> 2 - log 2 - 1 per token, times beta
    ref = logps.detach() + math.log(2)
    loss, sums = grpo_loss(logps.detach(), adv, mask, loss_type="bnpo", epsilon_low=0.2, epsilon_high=0.2,
                           beta=0.1, ref_logps=ref)
    k3 = 1 - math.log(2)
    assert loss.item() == pytest.approx((2 * -1 + 3 * 2) / 5 + 0.1 * k3)
    assert sums["kl"].item() == pytest.approx(5 * k3)


# ---- rewards -----------------------------------------------------------------------------------

def test_builtin_rewards():
    comps = [[{"role": "assistant", "content": c}] for c in
             ["3 + 4 = 7. <answer>7</answer>", "It is 7", "<answer> 8 </answer>", "<answer>7</answer> or 8"]]
    assert accuracy_reward([], comps, [], answer=["7"] * 4) == [1.0, 1.0, 0.0, 1.0]
    assert format_reward([], comps, []) == [1.0, 0.0, 1.0, 0.0]
    assert extract_answer("nothing here") is None
    # case, runs of spaces, a trailing period, thousands separators and ".0" do not make it wrong
    assert accuracy_reward([], ["<answer>ana,  12.</answer>", "<answer>1,200.0</answer>", "<answer>Ben, 12</answer>"],
                           [], answer=["Ana, 12", "1200", "Ana, 12"]) == [1.0, 1.0, 0.0]


def test_reward_errors_name_the_function_and_the_sample(tmp_path):
    prompts = [[{"role": "user", "content": f"q{i}"}] for i in range(3)]
    comps = [[{"role": "assistant", "content": c}] for c in ("a", "bb", "ccc")]
    cols = {"answer": ["1", "2", "3"]}

    def picky(prompts, completions, completion_ids, **kw):
        return [1.0 / (len(c[0]["content"]) - 2) for c in completions]  # divides by zero on "bb"

    with pytest.raises(RewardError, match=r"'picky' raised ZeroDivisionError.*sample 1 \(prompt 'q1', completion 'bb'"):
        score([picky], ["picky"], prompts, comps, [[1], [2], [3]], cols)
    with pytest.raises(RewardError, match="'short' returned 2 values for 3 completions"):
        score([lambda **kw: [0.0, 1.0]], ["short"], prompts, comps, [[1], [2], [3]], cols)
    with pytest.raises(RewardError, match=r"'nan' returned nan for sample 0"):
        score([lambda **kw: [math.nan] * 3], ["nan"], prompts, comps, [[1], [2], [3]], cols)
    ok = score([lambda **kw: [None, 1, True]], ["ok"], prompts, comps, [[1], [2], [3]], cols)[:, 0]
    assert math.isnan(ok[0]) and ok[1:].tolist() == [1, 1]  # None is NaN (unscored); bools count as numbers
    with pytest.raises(RewardError, match="'nope' is unknown; give a built-in"):
        load_reward("nope")
    with pytest.raises(RewardError, match="file 'missing.py' does not exist"):
        load_reward("missing.py:f")
    f = tmp_path / "r.py"
    f.write_text("def length(prompts, completions, completion_ids, **kw):\n"
                 "    return [float(len(c)) for c in completion_ids]\n")
    assert load_reward(f"{f}:length")([], [], [[1, 2]]) == [2.0]
    with pytest.raises(RewardError, match="'other' is not a function"):
        load_reward(f"{f}:other")
    assert load_reward("reclaim.rl.rewards.format_reward") is format_reward


def test_bad_config_is_refused_by_name(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("num_generation: 4\n")
    with pytest.raises(ConfigError, match="'num_generation': did you mean 'num_generations'"):
        load_config(GRPOConfig, bad)
    with pytest.raises(ConfigError, match=r"unknown task \['sudoku'\]; allowed: \[.*'arithmetic'"):
        load_config(GRPOConfig, None, {"task": "arithmetic,sudoku"})
    with pytest.raises(ConfigError, match="loss_type='ppo' is not one of"):
        load_config(GRPOConfig, None, {"loss_type": "ppo"})
    with pytest.raises(ConfigError, match="must be a multiple of num_generations=3"):
        load_config(GRPOConfig, None, {"num_generations": 3, "per_device_train_batch_size": 4})
    with pytest.raises(ConfigError, match="2 reward_weights for 1 reward_funcs"):
        load_config(GRPOConfig, None, {"reward_funcs": ["accuracy"], "reward_weights": [1.0, 2.0]})
    assert load_config(GRPOConfig, None, {"scale_rewards": False}).scale_rewards == "none"
    assert load_config(GRPOConfig, None, ["--scale_rewards", "true"]).scale_rewards == "group"
    for name in ("grpo-smollm2", "grpo-tiny"):  # the bundled configs load
        assert load_config(GRPOConfig, name).max_steps >= 1
    r = CliRunner().invoke(_app(), ["grpo", "--config", str(bad)])
    assert r.exit_code == 2 and "num_generation" in r.output
    r = CliRunner().invoke(_app(), ["grpo", "--config", "grpo-tiny", "--output_dir", str(tmp_path / "none"), "--resume"])
    assert r.exit_code == 1 and "has no checkpoint-* directory" in r.output


def test_dataset_rows_carry_the_answer():
    rows = build_dataset(load_config(GRPOConfig, None, {"task": "all", "num_prompts": 10}))
    assert len({r["question"] for r in rows}) == 10 and {r["task"] for r in rows} >= {"arithmetic", "sequence"}
    assert rows[0]["prompt"][-1]["content"].startswith(rows[0]["question"]) and rows[0]["answer"]


# ---- end to end --------------------------------------------------------------------------------

def _app():
    from reclaim.cli import app

    return app


REWARD_FILE = "def even(prompts, completions, completion_ids, **kw):\n" \
              "    return [sum(t % 2 == 0 for t in c) / len(c) for c in completion_ids]\n"
DETERMINISTIC = ("loss", "reward", "rewards/even/mean", "completions/mean_length", "grad_norm", "entropy")


def _records(path):
    return [json.loads(ln) for ln in path.read_text().splitlines()]


def _weights(path):
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


def _assert_same_run(a, b, step):
    ra, rb = _records(a / "log.jsonl"), _records(b / "log.jsonl")
    assert [r["step"] for r in rb] == list(range(1, step + 1))
    for x, y in zip(ra, rb):
        assert {k: x[k] for k in DETERMINISTIC if k in x} == pytest.approx({k: y[k] for k in DETERMINISTIC if k in y},
                                                                            rel=1e-5, abs=1e-7)
    wa, wb = _weights(a / f"checkpoint-{step}"), _weights(b / f"checkpoint-{step}")
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-6, rtol=1e-5, msg=k)


def test_cli_runs_checkpoints_and_resumes_like_an_uninterrupted_run(tiny_model_dir, tmp_path, one_thread):
    (tmp_path / "even.py").write_text(REWARD_FILE)
    funcs = ["--reward_funcs", f"[{tmp_path / 'even.py'}:even, format]", "--reward_weights", "[1.0, 0.5]",
             "--log_completions"]
    base = ["grpo", "--config", "grpo-tiny", "--model", str(tiny_model_dir), *funcs]
    out = tmp_path / "run"
    r = CliRunner().invoke(_app(), base + ["--output_dir", str(out)])
    assert r.exit_code == 0, r.output
    assert "step 2: reward" in r.output
    recs = _records(out / "log.jsonl")
    assert [x["step"] for x in recs] == [1, 2]
    for key in ("reward", "reward_std", "rewards/even/mean", "rewards/format/std", "clip_ratio/region_mean",
                "completions/mean_length", "completions/min_length", "completions/max_length",
                "rollout_tokens_per_s", "rollout_s", "step_time", "loss", "grad_norm", "learning_rate"):
        assert key in recs[-1], key
    assert recs[-1]["weights_version"] == 2  # one weight push into the engine per optimizer step
    assert recs[0]["grad_norm"] > 0
    ck = out / "checkpoint-2"
    assert {"config.json", "model.safetensors", "tokenizer.json", "dcp", "rng_state.pt",
            "trainer_state.json"} <= {p.name for p in ck.iterdir()}
    assert json.loads((ck / "trainer_state.json").read_text())["global_step"] == 2
    from reclaim.models.loading import load_model

    load_model(ck)  # an HF directory reclaim (and transformers) load
    logged = _records(out / "completions.jsonl")  # 4 completions per step
    assert [x["step"] for x in logged] == [1] * 4 + [2] * 4 and set(logged[0]["rewards"]) == {"even", "format"}
    assert logged[0]["prompt"].startswith("Compute") and isinstance(logged[0]["completion"], str)
    r = CliRunner().invoke(_app(), base + ["--output_dir", str(out), "--resume", "--max_steps", "3"])
    assert r.exit_code == 0, r.output
    whole = tmp_path / "whole"
    r = CliRunner().invoke(_app(), base + ["--output_dir", str(whole), "--max_steps", "3"])
    assert r.exit_code == 0, r.output
    _assert_same_run(whole, out, 3)
    assert (out / "completions.jsonl").read_text() == (whole / "completions.jsonl").read_text()
    assert not _weights(out / "checkpoint-3")["model.embed_tokens.weight"].equal(
        _weights(out / "checkpoint-1")["model.embed_tokens.weight"])  # it trained


def test_bf16_trains_in_mixed_precision_and_leaves_rollouts_alone(tiny_model_dir, tmp_path, one_thread):
    """bf16: true (transformers' name) changes the training forward only: the same first rollout
    (float32 engine, same seeds), float32 weights after, close to the float32 run's but not equal."""
    (tmp_path / "even.py").write_text(REWARD_FILE)  # a reward with a spread, so the step has a gradient
    runs = {}
    for bf16 in ("false", "true"):
        out = tmp_path / bf16
        r = CliRunner().invoke(_app(), ["grpo", "--config", "grpo-tiny", "--model", str(tiny_model_dir),
                                        "--output_dir", str(out), "--max_steps", "1", "--bf16", bf16,
                                        "--log_completions", "true", "--reward_funcs", f"[{tmp_path}/even.py:even]"])
        assert r.exit_code == 0, r.output
        runs[bf16] = out
    assert (runs["true"] / "completions.jsonl").read_text() == (runs["false"] / "completions.jsonl").read_text()
    start, a, b = _weights(tiny_model_dir), _weights(runs["false"] / "checkpoint-1"), _weights(runs["true"] / "checkpoint-1")
    assert all(t.dtype == torch.float32 for t in b.values())
    step = sum(float((a[k] - start[k]).norm()) for k in a)
    apart = sum(float((a[k] - b[k]).norm()) for k in a)
    assert 0 < apart < 0.5 * step  # the bf16 step differs from the float32 one, by less than the step


def test_resume_inside_an_iterated_rollout_with_kl(tiny_model_dir, tmp_path, one_thread):
    """num_iterations = 2 and beta > 0: a crash after step 1 (mid-rollout) resumes to the same run."""
    (tmp_path / "even.py").write_text(REWARD_FILE)
    fields = {"model": str(tiny_model_dir), "reward_funcs": [f"{tmp_path / 'even.py'}:even"], "num_iterations": 2,
              "beta": 0.1, "max_steps": 3, "loss_type": "grpo", "epsilon": 0.05, "gradient_accumulation_steps": 2,
              "per_device_train_batch_size": 2}
    a = tmp_path / "a"
    train(load_config(GRPOConfig, "grpo-tiny", {**fields, "output_dir": str(a)}), progress=False)
    recs = _records(a / "log.jsonl")
    assert "rollout_s" in recs[0] and "rollout_s" not in recs[1] and "rollout_s" in recs[2]
    assert recs[1]["kl"] > 0 and recs[1]["clip_ratio/region_mean"] > 0  # the second pass is off-policy
    assert (a / "checkpoint-1" / "rollout.pt").exists() and not (a / "checkpoint-2" / "rollout.pt").exists()
    b = tmp_path / "b"
    shutil.copytree(a, b)
    for step in (2, 3):
        shutil.rmtree(b / f"checkpoint-{step}")
    train(load_config(GRPOConfig, "grpo-tiny", {**fields, "output_dir": str(b), "resume_from_checkpoint": True}),
          progress=False)
    assert [p.name for p in checkpoints(b, require=TRAINER_STATE)] == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    _assert_same_run(a, b, 3)


def test_a_raising_reward_stops_the_run_with_its_name_and_the_checkpoint_stays(tiny_model_dir, tmp_path, one_thread):
    """The reward raises from step 2 on: the run stops naming it and the sample; checkpoint-1 loads and resumes."""
    (tmp_path / "bad.py").write_text("def boom(prompts, completions, completion_ids, trainer_state, **kw):\n"
                                     "    return [1 / (1 - trainer_state.global_step) for _ in completions]\n")
    out = tmp_path / "run"
    base = ["grpo", "--config", "grpo-tiny", "--model", str(tiny_model_dir), "--output_dir", str(out)]
    r = CliRunner().invoke(_app(), base + ["--reward_funcs", f"[{tmp_path}/bad.py:boom]"])
    assert r.exit_code == 1
    assert "reward function 'boom' raised ZeroDivisionError: division by zero on sample 0 (prompt 'Compute" in r.output
    assert [p.name for p in checkpoints(out, require=TRAINER_STATE)] == ["checkpoint-1"]
    r = CliRunner().invoke(_app(), base + ["--resume", "--reward_funcs", "[format]"])
    assert r.exit_code == 0, r.output
    assert [p.name for p in checkpoints(out, require=TRAINER_STATE)] == ["checkpoint-1", "checkpoint-2"]


@pytest.mark.slow
def test_the_bundled_smollm2_config_runs_a_step(default_model_dir, tmp_path):
    """The documented config on the real model, shrunk to one short step."""
    r = CliRunner().invoke(_app(), ["grpo", "--config", "grpo-smollm2", "--output_dir", str(tmp_path / "run"),
                                    "--max_steps", "1", "--max_completion_length", "8", "--num_generations", "2",
                                    "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1"])
    assert r.exit_code == 0, r.output
    rec = _records(tmp_path / "run" / "log.jsonl")[0]
    assert rec["rollout_tokens"] > 0 and rec["completions/max_length"] <= 8
    assert (tmp_path / "run" / "checkpoint-1" / "model.safetensors").exists()


@pytest.mark.parametrize("adaptive", [True, False])
def test_speculative_rollouts_give_the_same_run(tiny_model_dir, tmp_path, one_thread, adaptive):
    """Adaptive (bandit) or static speculation in the tail changes only the rollout time: the
    seeded completions, rewards, losses and weights equal a run with plain rollouts."""
    (tmp_path / "even.py").write_text(REWARD_FILE)
    fields = {"model": str(tiny_model_dir), "reward_funcs": [f"{tmp_path / 'even.py'}:even"], "max_steps": 2,
              "log_completions": True}
    plain, spec = tmp_path / "plain", tmp_path / "spec"
    train(load_config(GRPOConfig, "grpo-tiny", {**fields, "output_dir": str(plain)}), progress=False)
    train(load_config(GRPOConfig, "grpo-tiny", {**fields, "output_dir": str(spec), "speculative": "ngram",
                                                "spec_threshold": 64, "spec_depths": [2, 3],
                                                "adaptive": adaptive}), progress=False)
    _assert_same_run(plain, spec, 2)
    assert (spec / "completions.jsonl").read_text() == (plain / "completions.jsonl").read_text()
    recs = _records(spec / "log.jsonl")
    assert all(r["rollout_spec_decisions"] > 0 and r["rollout_tail_s"] > 0 for r in recs)
    assert (spec / "spec_decisions.jsonl").read_text().count("\n") == sum(r["rollout_spec_decisions"] for r in recs)


@pytest.mark.parametrize("speculative", ["suffix", "hybrid:{drafter}"])
def test_history_drafted_rollouts_give_the_same_run(tiny_model_dir, tmp_path, one_thread, speculative, monkeypatch):
    """The history drafter (the group's other completions and the prompt's earlier steps; three
    steps over two prompts, so the third sees its prompt's first) and the hybrid tree change
    only the rollout time: completions, rewards, losses and weights equal plain rollouts'. (The
    gate is held on speculating and the depths on the cost priors: on a tiny model, and more so on
    a loaded machine, plain steps are cheaper and it would stop drafting.)"""
    from reclaim.engine.spec_policy import SpecGate, StepCosts
    from reclaim.models.drafter import new_drafter, save_drafter
    from reclaim.models.loading import load_model

    monkeypatch.setattr(SpecGate, "choose", lambda self, batch: self.arms[-1])
    monkeypatch.setattr(StepCosts, "fit", lambda self: None)  # the priors' depths: not this machine's load

    target, _ = load_model(tiny_model_dir)
    drafter = save_drafter(new_drafter(target), tmp_path / "drafter")
    (tmp_path / "even.py").write_text(REWARD_FILE)
    fields = {"model": str(tiny_model_dir), "reward_funcs": [f"{tmp_path / 'even.py'}:even"], "max_steps": 3,
              "log_completions": True, "num_prompts": 2, "temperature": 0.05, "num_generations": 4, "learning_rate": 1e-5,
              "max_completion_length": 16}
    plain, spec = tmp_path / "plain", tmp_path / "spec"
    train(load_config(GRPOConfig, "grpo-tiny", {**fields, "output_dir": str(plain)}), progress=False)
    train(load_config(GRPOConfig, "grpo-tiny", {**fields, "output_dir": str(spec), "spec_threshold": 64,
                                                "adaptive": False, "speculative": speculative.format(drafter=drafter)}),
          progress=False)
    _assert_same_run(plain, spec, 3)
    assert (spec / "completions.jsonl").read_text() == (plain / "completions.jsonl").read_text()
    recs = _records(spec / "log.jsonl")
    assert recs[2].get("rollout_spec_tau", 0) > 1.5, recs[2]  # step 3 drafts its prompt's earlier completions


def test_bad_speculative_setting_is_refused():
    with pytest.raises(ValueError, match="speculative='medusa'"):
        GRPOConfig(speculative="medusa")
    with pytest.raises(ValueError, match="speculative='suffix:x'"):
        GRPOConfig(speculative="suffix:x")
    with pytest.raises(ValueError, match="suffix_cache_tokens=0"):
        GRPOConfig(speculative="suffix", suffix_cache_tokens=0)


def test_the_rollout_engine_holds_its_eagle_drafter_from_the_start(tiny_model_dir, tmp_path):
    """The rollout engine is built with its EAGLE drafter, so the drafter follows every sequence
    from its prefill; one made when the tail begins could not draft for the sequences in flight."""
    from reclaim.engine.eagle import EagleProposer
    from reclaim.models.drafter import new_drafter, save_drafter
    from reclaim.models.loading import load_model
    from reclaim.rl.grpo import _open_engine

    target, tok = load_model(tiny_model_dir)
    drafter = save_drafter(new_drafter(target), tmp_path / "drafter")
    from reclaim.engine.proposers import HybridProposer
    from reclaim.engine.history import SuffixProposer

    for spec, kind in ((f"eagle:{drafter}", EagleProposer), ("none", type(None)), ("suffix", SuffixProposer),
                       (f"hybrid:{drafter}", HybridProposer)):
        cfg = GRPOConfig(model=str(tiny_model_dir), speculative=spec, spec_depths=[3], adaptive=False)
        engine, online = _open_engine(cfg, target, tok, 128, None)
        assert isinstance(engine.proposer, kind) and online is None and engine.speculative is None


def test_a_restart_removes_a_killed_save_and_a_failed_start_leaves_no_output_dir(tmp_path):
    from test_checkpoints import half_written_save

    out = tmp_path / "run"
    out.mkdir()
    half_written_save(out)
    base = ["grpo", "--config", "grpo-tiny", "--model", str(tmp_path / "no-model")]
    r = CliRunner().invoke(_app(), base + ["--output_dir", str(out)])
    assert r.exit_code == 1 and "no-model" in r.output
    assert list(out.iterdir()) == []  # the temp dir is gone; the directory was the user's, so it stays
    r = CliRunner().invoke(_app(), base + ["--output_dir", str(tmp_path / "runs" / "new")])
    assert r.exit_code == 1 and "no-model" in r.output
    assert not (tmp_path / "runs").exists()


def test_report_to_tensorboard_gets_the_logged_metrics(tiny_model_dir, tmp_path, one_thread):
    from test_trackers import assert_log_in_tensorboard

    out = tmp_path / "run"
    r = CliRunner().invoke(_app(), ["grpo", "--config", "grpo-tiny", "--model", str(tiny_model_dir), "--output_dir",
                                    str(out), "--max_steps", "2", "--report_to", "tensorboard"])
    assert r.exit_code == 0, r.output
    assert_log_in_tensorboard(out, ("reward", "loss", "grad_norm", "learning_rate", "completions/mean_length"))
