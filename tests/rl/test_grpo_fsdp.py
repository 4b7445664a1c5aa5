"""GRPO with `parallelism: fsdp` on 2 gloo ranks (started as torchrun starts them: tests/ranks.py)
equals one process (float64).

The policy is sharded by FSDP2 (reclaim/fsdp.py): each rank holds half of every parameter, its
gradients and AdamW state, and gathers the full weights into its rollout engine after each step.
Two ranks, each rolling out and training on half of every step, must give the completions,
rewards, losses, grad norms and final weights of one process accumulating both halves: without
the reference model, and with it (beta > 0, the reference sharded too) plus gradient
checkpointing and two micro-batches per rank (no reduce-scatter until the last). A checkpoint
written by the two FSDP ranks resumes in one process, and one written by one process resumes on
two FSDP ranks, each reproducing the uninterrupted run. With bfloat16 rollouts (the engine's copy
refreshed from the shards) two ranks equal one process too.

Tolerance: 1e-9 relative (float64). The ranks' partial gradient sums are added in another order
than one process adds its micro-batches, which moves the last bits (~1e-16 relative per step,
grown by three AdamW steps at lr 1e-3 on a random model); a real difference is many orders larger.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from rl_helpers import rank_main, torchrun
from test_grpo_distributed import ACCUM, _same_run, one_process_runs, run_tiny
from reclaim.rl.grpo_config import GRPOConfig

pytestmark = pytest.mark.launches  # torchrun ranks: run first (tests/conftest.py)

FSDP = {"parallelism": "fsdp"}
REF = {"beta": 0.04, "gradient_checkpointing": True}
BF16_ROLLOUT = {"rollout_dtype": "bfloat16"}
OFFLOAD = {"param_offload": True, "optimizer_offload": True}


def _worker(root: Path) -> None:
    """One torchrun rank: the FSDP run, the FSDP run with the reference model (two micro-batches
    per rank), and the one-process run resumed from its step-2 checkpoint."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    run_tiny(root, "fsdp", 2, **FSDP)
    run_tiny(root, "fsdp-ref", 2, **FSDP, **REF, **{**ACCUM, "gradient_accumulation_steps": 2})
    run_tiny(root, "one-to-fsdp", 2, **FSDP, resume_from_checkpoint=True)
    run_tiny(root, "fsdp-bf16", 2, **FSDP, **BF16_ROLLOUT)
    run_tiny(root, "fsdp-offload", 2, **FSDP, **OFFLOAD)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(built_once) -> Path:
    return built_once("grpo-fsdp", _build)


def _build(root: Path) -> None:
    """The tiny float64 model, the one-process runs (with and without the reference model) and the
    two-rank FSDP runs."""
    one_process_runs(root, {"one": {}, "one-ref": {**REF, **ACCUM}, "one-bf16": BF16_ROLLOUT})
    shutil.copytree(root / "one", root / "one-to-fsdp")
    shutil.rmtree(root / "one-to-fsdp" / "checkpoint-3")
    torchrun(__file__, str(root))


def test_two_fsdp_ranks_equal_one_process(runs) -> None:
    _same_run(runs / "one", runs / "fsdp")
    assert (runs / "one" / "completions.jsonl").read_text() == (runs / "fsdp" / "completions.jsonl").read_text()
    state = json.loads((runs / "fsdp" / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["config"]["parallelism"] == "fsdp"
    # Rank 0 holds its half (dim-0 chunks: the odd rows to rank 0) of the weights, gradients and AdamW state.
    one, two = (json.loads((runs / r / "log.jsonl").read_text().splitlines()[-1]) for r in ("one", "fsdp"))
    for k in ("params_bytes", "grads_bytes", "optimizer_bytes"):
        assert 0.5 <= two[f"memory/{k}"] / one[f"memory/{k}"] < 0.52, k
    assert one["memory/optimizer_bytes"] == 2 * one["memory/params_bytes"]  # AdamW: two moments


def test_bfloat16_rollouts_refreshed_from_the_shards_equal_one_process(runs) -> None:
    """rollout_dtype bfloat16: the engine's copy is the float64 policy cast tensor by tensor on
    each rank's shard, then gathered; two ranks roll out and train as one process does, the
    checkpoint's HF weights stay float64 (the training dtype, _same_run checks it), the copy is a
    quarter of the policy's bytes, and the rollouts differ from float64 ones (the copy is used)."""
    _same_run(runs / "one-bf16", runs / "fsdp-bf16")
    bf16 = (runs / "one-bf16" / "completions.jsonl").read_text()
    assert bf16 == (runs / "fsdp-bf16" / "completions.jsonl").read_text()
    assert bf16 != (runs / "one" / "completions.jsonl").read_text()
    one, two = (json.loads((runs / r / "log.jsonl").read_text().splitlines()[-1]) for r in ("one-bf16", "fsdp-bf16"))
    assert one["memory/rollout_weights_bytes"] == two["memory/rollout_weights_bytes"] \
        == one["memory/params_bytes"] // 4


def test_offloading_the_shards_and_moments_while_rolling_out_changes_nothing(runs) -> None:
    """param_offload and optimizer_offload: the shards move with module.to, which FSDP2 follows
    (a no-op on this CPU); the run equals one process's, and each step moves this rank's shards
    and moments out and back."""
    _same_run(runs / "one", runs / "fsdp-offload")
    for line in (runs / "fsdp-offload" / "log.jsonl").read_text().splitlines():
        r = json.loads(line)
        assert r["offload/bytes"] == 2 * (r["memory/params_bytes"] + r["memory/optimizer_bytes"]) > 0


def test_with_the_sharded_reference_model_and_checkpointed_layers(runs) -> None:
    _same_run(runs / "one-ref", runs / "fsdp-ref")
    kl = [json.loads(line)["kl"] for line in (runs / "fsdp-ref" / "log.jsonl").read_text().splitlines()]
    assert kl[0] == pytest.approx(0.0, abs=1e-12) and kl[-1] > 0  # the policy leaves the reference


def test_an_fsdp_checkpoint_resumes_in_one_process(runs, one_thread) -> None:
    moved = runs / "fsdp-to-one"
    shutil.copytree(runs / "fsdp", moved)
    shutil.rmtree(moved / "checkpoint-3")
    run_tiny(runs, "fsdp-to-one", 1, resume_from_checkpoint=True)
    _same_run(runs / "one", moved)


def test_a_one_process_checkpoint_resumes_on_two_fsdp_ranks(runs) -> None:
    _same_run(runs / "one", runs / "one-to-fsdp")
    states = [json.loads((runs / "one-to-fsdp" / f"checkpoint-{s}" / "trainer_state.json").read_text())
              for s in (2, 3)]
    assert [s["world_size"] for s in states] == [1, 2]


def test_fsdp_options_are_checked_by_name() -> None:
    with pytest.raises(ValueError, match=r"parallelism='zero3' is not one of \['ddp', 'fsdp'\]"):
        GRPOConfig(parallelism="zero3")
    with pytest.raises(ValueError, match="fsdp_cpu_offload .* needs parallelism 'fsdp'"):
        GRPOConfig(fsdp_cpu_offload=True)


if __name__ == "__main__":
    rank_main(_worker, sys.argv[1])
