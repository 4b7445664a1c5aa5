"""`reclaim bench fsdp` end to end (two torchrun launches of two gloo ranks on the bundled model,
~80 s: slow). What a rank holds of the policy's training state halves under FSDP2, peak RSS falls,
and the step is the same step (the grad norm within float32's reduction-order rounding)."""

from __future__ import annotations

import json

import pytest

from reclaim.bench.fsdp import distinct_reward, main


def test_distinct_reward_differs_within_a_group() -> None:
    assert distinct_reward([], [], [[1, 2, 3, 4], [5, 5, 5, 5], []]) == [1.0, 0.25, 0.0]


@pytest.mark.slow
def test_bench_fsdp_halves_the_training_state_per_rank(tmp_path) -> None:
    result = main(tmp_path, max_completion_length=8, log=lambda *_: None)
    s = json.loads((tmp_path / "fsdp.json").read_text())["summary"]
    assert s == result["summary"] and (tmp_path / "fsdp.png").stat().st_size > 0
    assert 0.49 < s["training_state_ratio_fsdp_vs_ddp"] <= 0.51  # each rank holds half, and no more
    assert s["peak_rss_ratio_fsdp_vs_ddp"] < 0.9
    assert s["grad_norm_rel_diff"] < 1e-4
    for run in result["runs"].values():
        assert run["grad_norm"] > 0  # a step with a gradient: the comparison is not of zeros
