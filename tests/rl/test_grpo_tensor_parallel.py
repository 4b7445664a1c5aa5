"""GRPO with tensor-parallel rollouts (`rollout_tensor_parallel_size: 2`) on 2 gloo ranks equals
one process (float64).

The two ranks form one rollout group: each holds half of the rollout engine's weights and K/V
(models/tensor_parallel.py's split), rank 0 drives the engine and scores the step's completions,
rank 1 runs its forwards; both train as before (FSDP2 or DDP). The completions, rewards, losses,
grad norms and final weights must be one process's: under fsdp and under ddp, with the history
drafter speculating on the leader (lossless: still one process's plain completions), and resumed
from a checkpoint written under TP rollouts (its HF weights gathered from the trainer, since the
engine holds a shard), with a fixed EAGLE drafter on the leader, and with the online drafter trained
there. Sizes that do not divide the world or the model are refused by name before any weights load
(in-process, no torchrun).

Tolerance: 1e-9 relative, as tests/rl/test_grpo_fsdp.py documents (the ranks' partial sums are
added in another order; the TP engine's split sums round otherwise too, but in float64 no sampled
token moves: the completions are compared exactly).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from rl_helpers import rank_main, tiny_target, torchrun
from test_grpo_distributed import _same_run, one_process_runs, online, run_tiny
from reclaim.config import load_config
from reclaim.rl.distributed import World
from reclaim.rl.grpo import train
from reclaim.rl.grpo_config import GRPOConfig

pytestmark = pytest.mark.launches  # torchrun ranks: run first (tests/conftest.py)

TP = {"rollout_tensor_parallel_size": 2}
FSDP = {"parallelism": "fsdp", **TP}
COLD = {"temperature": 0.05}  # a group's completions repeat each other: the history drafter's drafts hit
SUFFIX = {"speculative": "suffix", "spec_threshold": 64, **COLD}


def _worker(root: Path) -> None:
    """One torchrun rank: TP rollouts under fsdp, then again from its step-2 checkpoint; under ddp;
    with the history drafter (held on drafting at the cost priors' depths, as
    tests/rl/test_grpo.py holds it: on a tiny model plain steps are cheaper and it would stop)."""
    import torch.distributed as dist

    from reclaim.engine.spec_policy import SpecGate, StepCosts

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    _shards(root, dist.get_rank())
    run_tiny(root, "tp-fsdp", 2, **FSDP)
    if dist.get_rank() == 0:
        shutil.copytree(root / "tp-fsdp", root / "tp-resumed")
        shutil.rmtree(root / "tp-resumed" / "checkpoint-3")
    dist.barrier()
    run_tiny(root, "tp-resumed", 2, **FSDP, resume_from_checkpoint=True)
    run_tiny(root, "tp-ddp", 2, **TP)
    SpecGate.choose = lambda self, batch: self.arms[-1]
    StepCosts.fit = lambda self: None
    run_tiny(root, "tp-suffix", 2, **FSDP, **SUFFIX)
    # The online drafter: the leader trains every step's full budget (the group has no idle rank to
    # wait for, so "train until the slowest is done" is held open), the follower takes its weights.
    from reclaim.rl.distributed import DoneSignal

    DoneSignal.all_done = lambda self, grace_s=0.05: False
    run_tiny(root, "tp-online", 2, **FSDP, **online(root), enable_sleep_mode=True)
    dist.destroy_process_group()


def _shards(root: Path, rank: int) -> None:
    """A tied model's bfloat16 rollout shard, made on the meta device and filled slice by slice,
    against the whole copy cut afterwards (as a serving engine shards a loaded model)."""
    import torch.distributed as dist

    from reclaim.models.tensor_parallel import shard_llama
    from reclaim.rl.rollout_weights import rollout_copy

    model = tiny_target(64, tie_word_embeddings=True).double()
    shard = rollout_copy(model, torch.bfloat16, dist.group.WORLD)
    whole = rollout_copy(model, torch.bfloat16)
    shard_llama(whole, dist.group.WORLD)
    torch.save({"tied": shard.lm_head.weight is shard.model.embed_tokens.weight,
                "shard": shard.state_dict(), "whole": whole.state_dict()}, root / f"shard-rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(built_once) -> Path:
    return built_once("grpo-tp", _build)


def _build(root: Path) -> None:
    """The tiny float64 model (4 heads, 2 K/V heads: 2 and 1 per rank), one process's runs and the
    two-rank TP runs."""
    from reclaim.models.drafter import new_drafter, save_drafter
    from reclaim.models.loading import load_model

    one_process_runs(root, {"one": {}, "one-cold": COLD})
    torch.manual_seed(0)
    save_drafter(new_drafter(load_model(root / "tiny", dtype=None)[0]), root / "drafter")
    torchrun(__file__, str(root))


def _last(run: Path) -> dict:
    return json.loads((run / "log.jsonl").read_text().splitlines()[-1])


def _completions(run: Path) -> str:
    return (run / "completions.jsonl").read_text()


@pytest.mark.parametrize("run", ["tp-fsdp", "tp-ddp"])
def test_tp2_rollouts_equal_one_process(runs, run) -> None:
    _same_run(runs / "one", runs / run)
    assert _completions(runs / run) == _completions(runs / "one")
    state = json.loads((runs / run / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["config"]["rollout_tensor_parallel_size"] == 2


def test_each_rank_holds_its_shard_of_the_rollout_weights(runs) -> None:
    """memory/rollout_weights_bytes is rank 0's shard: what `reclaim plan` prices for TP 2, a bit
    over half the whole copy (the norms are whole on every rank)."""
    from reclaim.models.loading import load_model
    from reclaim.plan import tp_shard_bytes

    model = load_model(runs / "tiny", dtype=None)[0]
    one, two = _last(runs / "one"), _last(runs / "tp-fsdp")
    assert two["memory/rollout_weights_bytes"] == tp_shard_bytes(model, 2, 8)
    assert 0.5 < two["memory/rollout_weights_bytes"] / one["memory/rollout_weights_bytes"] < 0.55


def test_the_rollout_shard_is_cut_before_it_is_filled(runs) -> None:
    for rank in (0, 1):
        got = torch.load(runs / f"shard-rank{rank}.pt")
        assert got["tied"] and set(got["shard"]) == set(got["whole"])
        for name, t in got["whole"].items():
            assert got["shard"][name].dtype == t.dtype and torch.equal(got["shard"][name], t), (rank, name)
        assert got["shard"]["model.layers.0.mlp.down_proj.weight"].shape == (32, 32)  # 64 // 2 input columns


def test_a_checkpoint_written_under_tp_rollouts_resumes_and_reproduces(runs) -> None:
    _same_run(runs / "one", runs / "tp-resumed")
    assert _completions(runs / "tp-resumed") == _completions(runs / "one")


def test_the_history_drafter_speculates_on_the_leader_losslessly(runs) -> None:
    """speculative suffix: the proposer lives on the leader; its drafts are verified through the
    TP engine and accepted, and the run is one process's plain run."""
    _same_run(runs / "one-cold", runs / "tp-suffix")
    assert _completions(runs / "tp-suffix") == _completions(runs / "one-cold")
    recs = [json.loads(line) for line in (runs / "tp-suffix" / "log.jsonl").read_text().splitlines()]
    assert all(r["rollout_spec_decisions"] > 0 and r["suffix/tokens"] > 0 for r in recs)
    assert all(r["rollout_spec_tau"] > 1 for r in recs), [r["rollout_spec_tau"] for r in recs]


def test_the_online_drafter_trains_on_the_leader(runs) -> None:
    """drafter_online (and the engine asleep through training): every rank builds the EAGLE
    drafter, the engine gathers the whole embedding and head onto the leader, which drafts there
    (lossless: the policy is one process's plain run) and trains the drafter on them; the follower
    trains nothing and takes the leader's drafter; rank 0 replays the rollout for tau with the
    whole head."""
    import safetensors.torch

    _same_run(runs / "one", runs / "tp-online")
    assert _completions(runs / "tp-online") == _completions(runs / "one")
    recs = [json.loads(line) for line in (runs / "tp-online" / "log.jsonl").read_text().splitlines()]
    from reclaim.models.loading import load_model
    from reclaim.plan import leader_target_bytes, tp_shard_bytes

    model = load_model(runs / "tiny", dtype=None)[0]
    cfg = GRPOConfig(speculative="eagle:d", rollout_tensor_parallel_size=2)
    # rank 0's rollout bytes: its shard and the whole embedding and head, as `reclaim plan` prices them
    assert leader_target_bytes(model, 2, cfg, 8) > 0
    assert recs[-1]["memory/rollout_weights_bytes"] == tp_shard_bytes(model, 2, 8) + leader_target_bytes(model, 2, cfg, 8)
    for r in recs:  # asleep through training: the shard, the whole embedding and head, the K/V pool freed
        assert r["memory/sleep_freed_bytes"] >= r["memory/rollout_weights_bytes"] + r["memory/kv_cache_bytes"]
        assert r["drafter/steps"] == r["drafter/steps_all_ranks"] == 4  # the leader's, all of them
        assert r["drafter/buffer_tokens"] > 0 and r["drafter/tau_online"] >= 1 and r["rollout_spec_decisions"] > 0
    saved = runs / "tp-online" / "checkpoint-3" / "drafter"
    start = safetensors.torch.load_file(runs / "drafter" / "model.safetensors")
    trained = safetensors.torch.load_file(saved / "model.safetensors")
    assert any(not torch.equal(start[k], trained[k]) for k in start)


# ---- refused by name, in one process, before any weights load ------------------------------------

@pytest.fixture
def no_weights(monkeypatch):
    """Loading weights fails the test: a refusal must come first."""
    import reclaim.models.loading as loading

    def refuse(*args, **kw):
        raise AssertionError("weights were loaded before the refusal")

    monkeypatch.setattr(loading, "load_model", refuse)


def _config(model: Path, out: Path, **kw) -> GRPOConfig:
    return load_config(GRPOConfig, "grpo-tiny", {"model": str(model), "output_dir": str(out), **kw})


def _fake_world(monkeypatch, size: int) -> None:
    """train() as rank 0 of `size` (no process group: the refusal comes before any collective)."""
    monkeypatch.setattr(World, "start", classmethod(lambda cls, device="cpu": cls(0, size)))


def test_a_size_that_does_not_divide_the_world_is_refused_by_name(tiny_model_dir, tmp_path, no_weights,
                                                                  monkeypatch) -> None:
    with pytest.raises(ValueError, match=r"rollout_tensor_parallel_size=2 does not divide world_size=1 "
                                         r"\(groups of consecutive ranks tile the world\); allowed for this "
                                         r"model at world size 1: \[1\]"):
        train(_config(tiny_model_dir, tmp_path / "a", **TP), progress=False)
    _fake_world(monkeypatch, 4)
    with pytest.raises(ValueError, match=r"rollout_tensor_parallel_size=3 does not divide world_size=4 .*"
                                         r"allowed for this model at world size 4: \[1, 2\]"):
        train(_config(tiny_model_dir, tmp_path / "b", rollout_tensor_parallel_size=3), progress=False)
    with pytest.raises(ValueError, match="rollout_tensor_parallel_size must be >= 1, got 0"):
        GRPOConfig(rollout_tensor_parallel_size=0)


def test_a_size_that_does_not_divide_the_heads_is_refused_by_name(tmp_path, no_weights, monkeypatch) -> None:
    """Only config.json is read: the directory has no weights at all."""
    from reclaim.models.llama import LlamaConfig

    model = tmp_path / "three-heads"
    model.mkdir()
    cfg = LlamaConfig(vocab_size=300, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=512)
    (model / "config.json").write_text(json.dumps(cfg.to_hf()))
    _fake_world(monkeypatch, 2)
    with pytest.raises(ValueError, match=r"rollout_tensor_parallel_size=2 does not divide num_attention_heads=3 "
                                         r"\(each rank takes an equal share\); allowed for this model at world "
                                         r"size 2: \[1\]"):
        train(_config(model, tmp_path / "out", **TP), progress=False)


def test_every_drafter_is_allowed_with_tp_rollouts() -> None:
    for method in ("none", "ngram", "suffix", "eagle", "hybrid:/drafters/d"):
        GRPOConfig(**TP, speculative=method)
    GRPOConfig(**TP, speculative="eagle:/drafters/d", drafter_online=True)


def test_rollout_groups_split_the_prompts_in_rank_order() -> None:
    """W / N groups of N consecutive ranks: each group's leader takes its group's contiguous share
    (the shares in rank order are the prompts in order), its followers none."""
    n = 7
    for size, tp in ((4, 2), (6, 3), (4, 4), (3, 1)):
        worlds = [World(rank, size, rollout_tp=tp) for rank in range(size)]
        assert [w.is_rollout_leader for w in worlds] == [r % tp == 0 for r in range(size)]
        shares = [w.share(n) for w in worlds]
        assert [i for s in shares for i in s] == list(range(n))
        assert all(len(s) == 0 for w, s in zip(worlds, shares) if not w.is_rollout_leader)


if __name__ == "__main__":
    rank_main(_worker, sys.argv[1])
