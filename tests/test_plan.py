"""`reclaim plan`: per-rank bytes from a config.json on the meta device.

Its parameter bytes are what `fully_shard` really holds on each rank at that world size (PyTorch's
fake process group, meta tensors: nothing is allocated), for an even and an uneven world size;
TLT's 7B GRPO run fits 8 x 141 GB with FSDP and not with DDP; bad input is refused by name.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from reclaim.cli import app
from reclaim.config import load_config
from reclaim.plan import meta_model, model_config_path, plan
from reclaim.rl.grpo_config import GRPOConfig

TLT = ["plan", "--config", "grpo-qwen2.5-7b-tlt", "--world-size", "8", "--model-config", "qwen2.5-7b",
       "--device-memory", "141GB", "--json"]


@pytest.mark.parametrize("world_size", [8, 3])
def test_parameter_bytes_equal_what_fully_shard_holds(world_size) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from reclaim.fsdp import parallelize

    cfg = load_config(GRPOConfig, "grpo-qwen2.5-7b-tlt", [])
    path = model_config_path("qwen2.5-7b")
    want = plan(cfg, path, world_size, "fsdp").rows["parameters"]
    held = []
    for rank in range(world_size):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        try:
            model = meta_model(path)
            parallelize(model, init_device_mesh("cpu", (world_size,)), bf16=True)
            held.append(sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters()))
        finally:
            dist.destroy_process_group()
    assert want == max(held) == held[0]  # rank 0 holds the most (torch.chunk's split)
    assert sum(held) == plan(cfg, path, 1, "fsdp").rows["parameters"] == 4 * 7_615_616_512


def test_tlt_7b_fits_eight_h200s_with_fsdp_not_with_ddp() -> None:
    runner = CliRunner()
    fsdp = json.loads(runner.invoke(app, TLT).output)
    ddp = json.loads(runner.invoke(app, [*TLT, "--parallelism", "ddp"]).output)
    assert fsdp["fits"] is True and ddp["fits"] is False
    rows_f, rows_d = fsdp["per_rank_bytes"], ddp["per_rank_bytes"]
    assert rows_d["parameters"] == 8 * rows_f["parameters"]  # 7.62e9 rows of 4 bytes divide by 8
    for k in ("gradients", "optimizer"):
        assert rows_d[k] == 8 * rows_f[k]
    assert rows_f["optimizer"] == 2 * rows_f["parameters"]  # AdamW's two moments
    assert rows_f["rollout_weights"] == rows_d["rollout_weights"] == 4 * 7_615_616_512  # the full model per rank
    assert fsdp["min_kv_bytes"] <= rows_f["kv_cache"]


def test_a_reference_model_is_planned_sharded_without_gradients() -> None:
    path = model_config_path("qwen2.5-7b")
    cfg = load_config(GRPOConfig, "grpo-qwen2.5-7b-tlt", ["--beta", "0.04"])
    rows = plan(cfg, path, 8, "fsdp").rows
    assert rows["reference_model"] == rows["parameters"] == rows["gradients"]


@pytest.mark.parametrize("args, message", [
    (["--world-size", "0"], "world size 0: need >= 1"),
    (["--parallelism", "zero3"], "parallelism 'zero3' is not one of"),
    (["--device-memory", "lots"], "bad size 'lots'"),
    (["--model-config", "gpt-5"], "model config 'gpt-5' is neither"),
])
def test_bad_input_is_named(args, message) -> None:
    base = ["plan", "--config", "grpo-qwen2.5-7b-tlt", "--model-config", "qwen2.5-7b"]
    res = CliRunner().invoke(app, [*base, *args])
    assert res.exit_code != 0 and message in " ".join(res.output.split()), res.output
    assert "Traceback" not in res.output


def test_a_model_the_trainer_cannot_build_is_refused_by_type(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba", "hidden_size": 8}))
    with pytest.raises(ValueError, match="unsupported model_type 'mamba'; supported: "):
        plan(load_config(GRPOConfig, "grpo-qwen2.5-7b-tlt", []), model_config_path(str(tmp_path)), 2, "fsdp")
