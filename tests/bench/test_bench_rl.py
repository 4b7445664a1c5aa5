"""`reclaim bench rl` on a tiny model and drafter: every reclaim arm runs the same GRPO steps, the
seeded sampled completions and the greedy rollouts of the speculating arms equal plain decoding's,
and the JSON and PNG are written; held-out accuracy scores prompts the run never trained on."""

from __future__ import annotations

import dataclasses
import json

import pytest

from reclaim.bench.rl import RLBenchSpec, main, quick_spec
from reclaim.bench.rl_accuracy import held_out_accuracy, held_out_rows
from reclaim.models.drafter import new_drafter, save_drafter
from reclaim.models.loading import load_model


@pytest.fixture(scope="module")
def tiny_drafter(tiny_model_dir, tmp_path_factory):
    target, _ = load_model(tiny_model_dir)
    return save_drafter(new_drafter(target), tmp_path_factory.mktemp("drafter") / "drafter")


def _check(result, arms):
    assert set(result["arms"]) == set(arms)
    steps = result["spec"]["steps"]
    for name in arms:
        rows = result["arms"][name]["steps"]
        assert [r["step"] for r in rows] == list(range(1, steps + 1))
        for r in rows:
            assert r["rollout_tokens_per_s"] > 0 and r["step_time"] > 0 and "reward" in r
    for name in set(arms) - {"plain", "trl"}:
        # Per-request seeds + lossless speculation: the same sampled completions in every reclaim arm.
        assert all(a == a.split("/")[0] + "/" + a.split("/")[0] for a in result["arms"][name]["identical_completions"])
        assert result["greedy_identical_to_plain"][name] == "2/2"
        assert result["greedy_identical_to_plain"]["verifies"][name] > 0  # drafts were verified
    s = result["summary"]
    assert s["plain"]["step_speedup_vs_plain"] == pytest.approx(1.0)
    assert {"tail_throughput_2x_vs_plain", "step_time_1.5x_vs_plain", "step_time_3x_vs_trl"} <= set(s["goals"])
    if result["arm_settings"]["adaptive"]["drafter_online"]:  # the online drafter's held-out tau beside the frozen one
        assert len(s["adaptive"]["tau_online"]) == len(s["adaptive"]["tau_frozen"]) == steps
        assert "online_tau_within_10pct_of_start" in s["goals"]


def test_bench_rl_reclaim_arms_agree_and_write_json_and_png(tiny_model_dir, tiny_drafter, tmp_path):
    arms = ["plain", "static", "adaptive", "suffix", "hybrid"]
    spec = quick_spec(model=str(tiny_model_dir), config="grpo-tiny", drafter=str(tiny_drafter), arms=arms,
                      out_dir=str(tmp_path))
    main(spec)
    result = json.loads((tmp_path / "rl.json").read_text())
    assert (tmp_path / "rl.png").stat().st_size > 0
    _check(result, arms)
    assert result["arm_settings"]["static"]["spec_depths"] == [2]
    assert result["arm_settings"]["adaptive"]["speculative"].startswith("eagle:")
    assert result["arm_settings"]["hybrid"]["speculative"] == f"hybrid:{tiny_drafter}"
    # The tail (at most 4 sequences in flight: all of a quick run) is where the speculating arms verified drafts.
    assert any(r.get("rollout_spec_tau") for r in result["arms"]["static"]["steps"])
    assert result["meta"]["git"]["commit"] and result["meta"]["machine"]["torch_threads"] == 1


@pytest.mark.slow
def test_bench_rl_with_trl(tiny_model_dir, tmp_path):
    arms = ["plain", "static", "adaptive", "trl"]
    spec = quick_spec(model=str(tiny_model_dir), config="grpo-tiny", drafter="ngram", arms=arms,
                      out_dir=str(tmp_path))
    result = main(spec)
    _check(result, arms)
    assert result["summary"]["adaptive"]["step_speedup_vs_trl"] > 0


def test_bench_rl_refuses_bad_arms():
    with pytest.raises(ValueError, match="allowed"):
        RLBenchSpec(arms=["plain", "vllm"])
    with pytest.raises(ValueError, match="'plain'"):
        RLBenchSpec(arms=["adaptive"])
    with pytest.raises(ValueError, match="num_prompts must be >= 1"):
        RLBenchSpec(num_prompts=0)


def test_held_out_accuracy_before_and_after_a_run(tiny_model_dir, tmp_path):
    from reclaim.config import load_config
    from reclaim.rl.data import build_dataset
    from reclaim.rl.grpo import train
    from reclaim.rl.grpo_config import GRPOConfig

    cfg = load_config(GRPOConfig, "grpo-tiny", {"model": str(tiny_model_dir), "output_dir": str(tmp_path / "run"),
                                                "max_steps": 1, "task": "add_word"})
    train(cfg, progress=False)
    rows = held_out_rows(cfg, 6)
    assert not {r["question"] for r in rows} & {r["question"] for r in build_dataset(cfg)}
    r = held_out_accuracy(tmp_path / "run", 6, out_dir=tmp_path / "out")
    assert json.loads((tmp_path / "out" / "rl-accuracy.json").read_text())["steps"] == r["steps"] == 1
    for side in ("before", "after"):
        assert r[side]["prompts"] == 6 and 0 <= r[side]["accuracy"] <= 1
    with pytest.raises(ValueError, match="not a `reclaim grpo` output_dir"):
        held_out_accuracy(tmp_path, 6)
    with pytest.raises(ValueError, match="procedural task"):
        held_out_rows(dataclasses.replace(cfg, dataset=str(tmp_path / "run" / "log.jsonl")), 2)


def test_summary_compares_step_time_per_completion_token():
    """TRL samples its own completions: at equal step times, twice the tokens is twice the speed."""
    from reclaim.bench.rl import summarize

    def step(seconds, tokens):
        return {"step_time": seconds, "rollout_s": 1.0, "rollout_tokens_per_s": float(tokens), "reward": 0.0}

    arms = {"plain": {"steps": [step(10.0, 400), step(12.0, 400)]},
            "trl": {"steps": [step(10.0, 800), step(12.0, 800)]}}
    s = summarize(arms, goals=False)
    assert s["plain"]["step_speedup_vs_trl"] == pytest.approx(1.0)
    assert s["plain"]["step_seconds_per_token"] == pytest.approx(22.0 / 800)
    assert s["plain"]["step_per_token_speedup_vs_trl"] == pytest.approx(0.5)


def test_step_goal_reports_the_bound_the_tail_allows():
    """Speculation speeds the tail only: with plain's tail a quarter of its step, no arm's step can
    beat plain's by more than 4/3, and the summary says so beside the 1.5x goal."""
    from reclaim.bench.rl import goal_lines, summarize

    def step(seconds, tail, tail_rate):
        return {"step_time": seconds, "rollout_s": 4.0, "rollout_tokens_per_s": 100.0, "reward": 0.0,
                "rollout_tail_s": tail, "rollout_tail_tokens_per_s": tail_rate}

    arms = {"plain": {"steps": [step(8.0, 2.0, 40.0), step(8.0, 2.0, 40.0)]},
            "adaptive": {"steps": [step(7.0, 1.0, 80.0), step(7.0, 1.0, 80.0)]}}
    s = summarize(arms)
    assert s["plain"]["tail_share_of_step"] == pytest.approx(0.25)
    assert s["goals"]["step_time_1.5x_vs_plain"]["bound_if_tail_free"] == pytest.approx(4 / 3)
    assert s["goals"]["step_time_1.5x_vs_plain"]["measured"] == pytest.approx(8 / 7)
    lines = goal_lines(s)
    assert ("goal step_time_1.5x_vs_plain (adaptive): 1.14x against 1.5x, not met (a free tail would give at most "
            "1.33x)") in lines
    assert "goal tail_throughput_2x_vs_plain (adaptive): 2.00x against 2.0x, met" in lines
    # the step against what a free tail allows: 8/7 of at most 4/3
    assert s["goals"]["step_90pct_of_the_tail_free_bound"]["measured"] == pytest.approx((8 / 7) / (4 / 3))


def test_the_goals_are_the_best_arms():
    """With several speculating arms the goals report the one whose tail is fastest."""
    from reclaim.bench.rl import summarize

    def step(tail_rate, tau):
        return {"step_time": 8.0, "rollout_s": 4.0, "rollout_tokens_per_s": 100.0, "reward": 0.0,
                "rollout_tail_s": 2.0, "rollout_tail_tokens_per_s": tail_rate, "rollout_spec_tau": tau}

    arms = {"plain": {"steps": [step(40.0, None)]}, "adaptive": {"steps": [step(50.0, 1.5)]},
            "suffix": {"steps": [step(70.0, 2.5)]}}
    s = summarize(arms)
    assert s["best_arm"] == "suffix" and s["goals"]["tail_tau_3"]["measured"] == pytest.approx(2.5)
    assert s["goals"]["tail_throughput_2x_vs_plain"]["measured"] == pytest.approx(70 / 40)


def test_rollouts_only_runs_every_arm_on_the_same_prompts(tiny_model_dir, tiny_drafter, tmp_path):
    """`--rollouts-only`: each step's rollout through every reclaim arm back to back, the same
    seeded completions everywhere, the history drafter's memory reported."""
    from reclaim.bench.rl import main_rollouts

    spec = quick_spec(model=str(tiny_model_dir), config="grpo-tiny", drafter=str(tiny_drafter),
                      arms=["plain", "suffix", "hybrid"], out_dir=str(tmp_path), steps=3, num_prompts=1)
    result = main_rollouts(spec)
    assert (tmp_path / "rl-rollouts.json").exists() and (tmp_path / "rl-rollouts.png").stat().st_size > 0
    s = result["summary"]
    for name in ("suffix", "hybrid"):
        assert s[name]["identical_completions"] == ["4/4"] * 3 and s[name]["rollout_speedup_vs_plain"] > 0
    assert s["suffix"]["history"]["tokens"] > 0 and s["suffix"]["mean_tau"] is not None
