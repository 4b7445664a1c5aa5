"""`reclaim plan`: per-rank bytes from a config.json on the meta device.

Its parameter bytes are what `fully_shard` really holds on each rank at that world size (PyTorch's
fake process group, meta tensors: nothing is allocated), for an even and an uneven world size;
TLT's 7B GRPO run fits 8 x 141 GB with FSDP and not with DDP (the engine awake through training);
with the engine asleep through training Qwen2.5-32B fits 16 x 80 GB; the rollout's tensor-parallel shard is
what torch's `parallelize_module` holds; the logits row is the chunk's measured peak; the issue's
goals (Qwen2.5-32B on 8 x 141 GB, Qwen2.5-7B under 70 GB a rank); bad input is refused by name.
Per-rank bytes of real gloo ranks: tests/rl/test_plan_ranks.py.
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

    cfg = load_config(GRPOConfig, "grpo-qwen2.5-7b-tlt", ["--rollout_tensor_parallel_size", "1"])  # divides 1 and 3
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
    ddp = json.loads(runner.invoke(app, [*TLT, "--parallelism", "ddp", "--enable_sleep_mode", "false"]).output)
    assert fsdp["fits"] is True and ddp["fits"] is False
    rows_f, rows_d = fsdp["per_rank_bytes"], ddp["per_rank_bytes"]
    assert rows_d["parameters"] == 8 * rows_f["parameters"]  # 7.62e9 rows of 4 bytes divide by 8
    for k in ("gradients", "optimizer"):
        assert rows_d[k] == 8 * rows_f[k]
    assert rows_f["optimizer"] == 2 * rows_f["parameters"]  # AdamW's two moments
    # bfloat16 rollout weights, a tensor-parallel shard of 4 (the same under either parallelism)
    assert rows_f["rollout_weights"] == rows_d["rollout_weights"] < 2 * 7_615_616_512 / 4 * 1.01
    assert fsdp["min_kv_bytes"] <= rows_f["kv_cache"]


def test_sleep_mode_frees_the_engine_through_training_and_fits_32b_on_sixteen_80gb() -> None:
    runner = CliRunner()
    big = ["--model-config", "qwen2.5-32b", "--world-size", "16", "--device-memory", "80GB"]
    asleep = json.loads(runner.invoke(app, [*TLT, *big]).output)
    awake = json.loads(runner.invoke(app, [*TLT, *big, "--enable_sleep_mode", "false"]).output)
    rows, phases = asleep["per_rank_bytes"], asleep["phase_bytes"]
    engine = rows["rollout_weights"] + rows["kv_cache"]
    for name in ("training", "optimizer_step"):
        assert awake["phase_bytes"][name] - phases[name] == engine
    # the weight update holds the engine again, with the moments back in host memory
    assert phases["weight_update"] == rows["parameters"] + engine
    assert asleep["fits"] is True and awake["fits"] is False
    assert asleep["total_bytes"] == max(phases.values()) < 80e9


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
    (["--rollout_tensor_parallel_size", "3"], "rollout_tensor_parallel_size=3 does not divide world_size=1"),
    (["--world-size", "6", "--rollout_tensor_parallel_size", "6"],
     "num_attention_heads=28 (each rank takes an equal share)"),
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


@pytest.mark.parametrize("tp", [2, 4])
def test_the_rollout_shard_is_what_tensor_parallel_holds(tp) -> None:
    """Megatron's split by torch's DTensor tensor parallelism on a fake process group (meta
    tensors): q/k/v, gate, up and the head by output rows, o and down by input columns, the
    embeddings by vocabulary rows (Qwen2.5's q/k/v biases with their rows)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    path = model_config_path("qwen2.5-7b")
    cfg = load_config(GRPOConfig, "grpo-qwen2.5-7b-tlt", ["--rollout_tensor_parallel_size", str(tp)])
    want = plan(cfg, path, 8, "fsdp").rows["rollout_weights"]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        model = meta_model(path)
        layout = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()), "lm_head": ColwiseParallel()}
        for i in range(len(model.model.layers)):
            at = f"model.layers.{i}"
            layout |= {f"{at}.self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")}
            layout |= {f"{at}.mlp.{n}": ColwiseParallel() for n in ("gate_proj", "up_proj")}
            layout |= {f"{at}.self_attn.o_proj": RowwiseParallel(), f"{at}.mlp.down_proj": RowwiseParallel()}
        parallelize_module(model, init_device_mesh("cpu", (tp,)), layout)
        held = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * 2 for p in model.parameters())
    finally:
        dist.destroy_process_group()
    assert want == held


def test_the_logits_row_is_the_chunks_measured_peak() -> None:
    """The peak bytes of [positions, vocabulary] tensors alive at once in a chunked forward and
    backward (each storage counted from its creation to its release), float32 and bf16 autocast:
    16 bytes per position and vocabulary entry in both."""
    import sys
    import weakref
    from pathlib import Path

    import torch

    from reclaim.plan import LOGITS_BYTES
    from reclaim.rl.logps import completion_logps

    sys.path.insert(0, str(Path(__file__).parent / "rl"))
    from rl_helpers import tiny_target

    vocab, chunk = 997, 16

    class Live(torch.utils._python_dispatch.TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.live, self.peak, self.seen = 0, 0, set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[-1] == vocab and t.shape[0] != hidden:
                    st = t.untyped_storage()
                    if st.data_ptr() not in self.seen:
                        self.seen.add(st.data_ptr())
                        self.live += st.nbytes()
                        self.peak = max(self.peak, self.live)
                        weakref.finalize(st, self._free, st.data_ptr(), st.nbytes())
            return out

        def _free(self, ptr: int, n: int) -> None:
            self.live -= n
            self.seen.discard(ptr)

    model = tiny_target(vocab)
    hidden = model.config.hidden_size  # the head's weight, transposed, is [hidden, vocab]: not logits
    for autocast in (False, True):
        spy = Live()
        with spy, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logps, _ = completion_logps(model, [[3, 4, 5]] * 4, [list(range(10, 50))] * 4, entropy=True,
                                        chunk_size=chunk)
            logps.sum().backward()
        assert spy.peak == pytest.approx(chunk * vocab * LOGITS_BYTES, rel=0.10), autocast


def test_the_goals_qwen_32b_on_eight_h200s_and_7b_under_70_gb() -> None:
    """TLT's config (bf16 rollouts at tensor parallel 4, logits in chunks, AdamW's moments offloaded)."""
    runner = CliRunner()
    big = json.loads(runner.invoke(app, [*TLT[:-1], "--json", "--model-config", "qwen2.5-32b"]).output)
    assert big["fits"] is True and big["total_bytes"] == max(big["phase_bytes"].values())
    seven = json.loads(runner.invoke(app, TLT).output)
    assert seven["total_bytes"] <= 70e9
    assert seven["offload_bytes_each_way"] == seven["per_rank_bytes"]["optimizer"]
    off = json.loads(runner.invoke(app, [*TLT, "--optimizer_offload", "false"]).output)
    assert off["phase_bytes"]["training"] - seven["phase_bytes"]["training"] == seven["per_rank_bytes"]["optimizer"]
