"""`reclaim plan`'s per-rank figures against the bytes real ranks hold: GRPO with
FSDP2 at 2 and 4 gloo ranks (started as torchrun starts them: tests/ranks.py), bfloat16 rollouts
and the optimizer offloaded while rolling out.
Rank 0 (the worst rank) logs its parameters, gradients, AdamW moments, rollout copy and K/V pool
(memory/*) and the bytes it moved to host memory and back (offload/bytes); each must be within
10% of the plan for the same config and the model's config.json (they agree to the byte). The
logits chunk's peak is measured in tests/test_plan.py; activations are not measured (a CPU has no
allocator peak to read)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from rl_helpers import make_tokenizer, rank_main, tiny_target, torchrun
from reclaim.config import load_config
from reclaim.plan import plan
from reclaim.rl.grpo import train
from reclaim.rl.grpo_config import GRPOConfig

pytestmark = pytest.mark.launches  # torchrun ranks: run first (tests/conftest.py)

FIELDS = {"parallelism": "fsdp", "rollout_dtype": "bfloat16", "optimizer_offload": True, "param_offload": True,
          "max_steps": 1, "logits_chunk_size": 4,
          "engine": {"kv_cache_bytes": 1 << 19}}  # the budget binds, not max_num_seqs (as in the plan)
CHECKED = {"parameters": "params_bytes", "gradients": "grads_bytes", "optimizer": "optimizer_bytes",
           "rollout_weights": "rollout_weights_bytes", "kv_cache": "kv_cache_bytes"}


def _config(root: Path, world: int) -> GRPOConfig:
    return load_config(GRPOConfig, "grpo-tiny", {**FIELDS, "model": str(root / "tiny"),
                                                 "output_dir": str(root / f"world{world}")})


def _worker(root: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    train(_config(root, dist.get_world_size()), progress=False)
    dist.destroy_process_group()


def _build(root: Path, world: int) -> None:
    from reclaim.models.loading import save_model

    if not (root / "tiny").exists():
        tok = make_tokenizer()
        save_model(tiny_target(len(tok)), tok, root / "tiny")
    torchrun(__file__, str(root), nproc=world)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_plan_per_rank_bytes_equal_what_rank_0_holds(world, tmp_path) -> None:
    _build(tmp_path, world)
    held = json.loads((tmp_path / f"world{world}" / "log.jsonl").read_text().splitlines()[-1])
    p = plan(_config(tmp_path, world), tmp_path / "tiny" / "config.json", world, "fsdp")
    for row, key in CHECKED.items():
        assert held[f"memory/{key}"] == pytest.approx(p.rows[row], rel=0.10), (row, held[f"memory/{key}"], p.rows[row])
    assert held["offload/bytes"] == pytest.approx(2 * p.offload_bytes, rel=0.10)
    full = plan(_config(tmp_path, world), tmp_path / "tiny" / "config.json", 1, "fsdp").rows["parameters"]
    assert p.rows["parameters"] < full / (world - 0.5)  # sharded, not whole
    assert p.rows["rollout_weights"] == full // 2  # bfloat16 and whole on every rank (tensor parallel 1)


if __name__ == "__main__":
    rank_main(_worker, sys.argv[1])
