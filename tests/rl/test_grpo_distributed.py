"""GRPO on 2 gloo ranks (started as torchrun starts them: tests/ranks.py) equals one process
taking the same steps (float64).

Each rank rolls out half of every step's prompts on its own engine with the seeds of their
places in the whole rollout, and trains on half of the micro-batches under DDP; one process
accumulating all of them (gradient_accumulation_steps doubled) must give the same completions,
rewards, losses and weights, and DDP must reduce once per optimizer step however many
micro-batches a rank accumulates. The plain run is cut after its step-2 checkpoint and resumed
by the two ranks, and by one process; a one-process run is resumed by two ranks (the trainer
state is a torch.distributed.checkpoint, read at any world size); a crash mid-save leaves the
previous checkpoint to resume from. The drafter_online run (EAGLE speculation in the tail, the
drafter trained on the ranks that finish early) must leave the policy exactly as plain rollouts
do: the drafter may differ.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch

from rl_helpers import make_tokenizer, rank_main, tiny_target, torchrun
from reclaim.config import load_config
from reclaim.rl.grpo import train
from reclaim.rl.grpo_config import GRPOConfig

pytestmark = pytest.mark.launches  # torchrun ranks: run first (tests/conftest.py)

EVEN = "def even(prompts, completions, completion_ids, **kw):\n" \
       "    return [sum(t % 2 == 0 for t in c) / len(c) for c in completion_ids]\n"
COMPARED = ("loss", "reward", "reward_std", "rewards/even/mean", "completions/mean_length", "grad_norm",
            "entropy")


def fields(root: Path, name: str, world: int, **kw) -> dict:
    """grpo-tiny on the float64 model: 3 steps of 8 completions (4 prompts x 2), 4 per micro-batch;
    float64 rollouts too, so the runs compare exactly."""
    return {"model": str(root / "tiny"), "dtype": "auto", "rollout_dtype": "auto", "output_dir": str(root / name), "max_steps": 3,
            "reward_funcs": [f"{root / 'even.py'}:even"], "max_completion_length": 12, "log_completions": True,
            "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2 // world, "save_steps": 1, **kw}


def run_tiny(root: Path, name: str, world: int, **kw) -> None:
    """grpo-tiny with `fields` (and `kw`) at world size `world`: this process is one of its ranks."""
    train(load_config(GRPOConfig, "grpo-tiny", {**fields(root, name, world), **kw}), progress=False)


def one_process_runs(root: Path, runs: dict[str, dict]) -> None:
    """The tiny float64 model and the reward file in `root`, then one process's runs (name: their
    fields), one thread each: what the torchrun ranks must equal."""
    from reclaim.models.loading import save_model

    tok = make_tokenizer()
    save_model(tiny_target(len(tok)).double(), tok, root / "tiny")
    (root / "even.py").write_text(EVEN)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, kw in runs.items():
            run_tiny(root, name, 1, **kw)
    finally:
        torch.set_num_threads(threads)


ONLINE = {"speculative": "eagle:{root}/drafter", "spec_threshold": 64, "spec_depths": [2, 3],
          "drafter_online": True, "drafter_max_steps_per_rollout": 4, "drafter_eval_samples": 2}


def online(root: Path) -> dict:
    return {k: v.format(root=root) if isinstance(v, str) else v for k, v in ONLINE.items()}


ACCUM = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4}  # one process; per rank: 2


def _worker(root: Path) -> None:
    """One torchrun rank: the plain run to the end (counting DDP's gradient reductions), then again
    from its step-2 checkpoint; the run of two micro-batches per rank and step; the one-process
    run from its step-2 checkpoint; the online-drafter run."""
    import torch.distributed as dist

    import reclaim.rl.distributed as distributed

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    reductions, hook = {}, distributed._sum_hook

    def counted(run: str):
        def count(group, bucket):  # noqa: ANN001 - DDP refuses string annotations
            reductions[run] = reductions.get(run, 0) + 1
            return hook(group, bucket)
        return count

    distributed._sum_hook = counted("plain")
    cfg = load_config(GRPOConfig, "grpo-tiny", fields(root, "plain", 2))
    train(cfg, progress=False)
    distributed._sum_hook = counted("accum")
    train(load_config(GRPOConfig, "grpo-tiny", {**fields(root, "accum", 2), **ACCUM,
                                                "gradient_accumulation_steps": 2}), progress=False)
    distributed._sum_hook = hook
    (root / f"reductions-rank{dist.get_rank()}.json").write_text(json.dumps(reductions))
    train(load_config(GRPOConfig, "grpo-tiny", {**fields(root, "one-to-two", 2), "resume_from_checkpoint": True}),
          progress=False)
    if dist.get_rank() == 0:
        shutil.copy(root / "plain" / "log.jsonl", root / "plain-uninterrupted.jsonl")
        shutil.rmtree(root / "plain" / "checkpoint-3")
    dist.barrier()
    train(load_config(GRPOConfig, "grpo-tiny", {**fields(root, "plain", 2), "resume_from_checkpoint": True}),
          progress=False)
    train(load_config(GRPOConfig, "grpo-tiny", {**fields(root, "online", 2), **online(root)}), progress=False)
    _idle_drafter(root, dist.get_rank())
    dist.destroy_process_group()


def _idle_drafter(root: Path, rank: int) -> None:
    """Rank 1 is slow (it finishes its share a second late): rank 0 trains the drafter meanwhile,
    stops when rank 1 is done, and both then hold rank 0's drafter and the samples of both."""
    from reclaim.models.drafter import load_drafter
    from reclaim.models.loading import load_model
    from reclaim.rl.distributed import World
    from reclaim.drafter.data import collect
    from reclaim.drafter.online import OnlineDrafterTrainer

    world = World(rank, 2)
    target = load_model(root / "tiny", dtype=None)[0].requires_grad_(False)
    online = OnlineDrafterTrainer(load_drafter(root / "drafter", target), buffer_tokens=100_000, lr=3e-3,
                           max_steps=10_000, seed=0, eval_samples=0)
    g = torch.Generator().manual_seed(rank)
    samples = collect(target, *[[torch.randint(3, 200, (n,), generator=g).tolist() for _ in range(4)]
                                for n in (5, 12)])
    if rank == 1:
        time.sleep(1.0)
    t = time.perf_counter()
    signal = world.signal_done()
    records = online.train(samples, target, stop=signal.all_done)
    signal.wait()
    waited = time.perf_counter() - t
    got = world.gather((samples, len(records)))
    src = online.sync(world, [s for s, _ in got], [n for _, n in got])
    torch.save({"steps": len(records), "src": src, "total": online.steps, "waited": waited,
                "buffer": online.buffer.num_tokens, "loss": [r["loss"] for r in records],
                "drafter": online.drafter.state_dict()}, root / f"idle-rank{rank}.pt")


def _log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(run / "checkpoint-3" / "model.safetensors")


def _same_run(a: Path, b: Path, log_b: Path | None = None) -> None:
    ra, rb = _log(a / "log.jsonl"), _log(log_b or b / "log.jsonl")
    assert [r["step"] for r in rb] == [1, 2, 3]
    for x, y in zip(ra, rb, strict=True):
        for k in COMPARED:
            assert x[k] == pytest.approx(y[k], rel=1e-9, abs=1e-12), (k, x[k], y[k])
    wa, wb = _weights(a), _weights(b)
    assert set(wa) == set(wb)
    for k in wa:
        assert wa[k].dtype == torch.float64
        assert (wa[k] - wb[k]).abs().max() <= 1e-9 * wa[k].abs().max(), k


@pytest.fixture(scope="module")
def runs(built_once) -> Path:
    return built_once("grpo-dist", _build)


def _build(root: Path) -> None:
    """The tiny float64 model, an untrained drafter for it, and the two-rank runs."""
    from reclaim.models.drafter import new_drafter, save_drafter
    from reclaim.models.loading import save_model

    tok = make_tokenizer()
    model = tiny_target(len(tok)).double()
    save_model(model, tok, root / "tiny")
    torch.manual_seed(1)
    save_drafter(new_drafter(model), root / "drafter")
    (root / "even.py").write_text(EVEN)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:  # one process: the run the ranks must equal; a copy cut after its step-2 checkpoint is theirs to resume
        train(load_config(GRPOConfig, "grpo-tiny", fields(root, "solo", 1)), progress=False)
    finally:
        torch.set_num_threads(threads)
    shutil.copytree(root / "solo", root / "one-to-two")
    shutil.rmtree(root / "one-to-two" / "checkpoint-3")
    torchrun(__file__, str(root))


def test_two_ranks_equal_one_process_and_resume_reproduces(runs, one_thread) -> None:
    one, two = runs / "solo", runs / "plain"
    _same_run(one, two)
    _same_run(one, two, runs / "plain-uninterrupted.jsonl")
    assert (one / "completions.jsonl").read_text() == (two / "completions.jsonl").read_text()
    assert _log(one / "log.jsonl")[0]["grad_norm"] > 0  # it trains
    state = json.loads((two / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["global_step"] == 3
    # A two-rank checkpoint resumes in one process (it holds the whole state).
    moved = runs / "plain-to-one"
    shutil.copytree(two, moved)
    shutil.rmtree(moved / "checkpoint-3")
    train(load_config(GRPOConfig, "grpo-tiny", {**fields(runs, "plain-to-one", 1), "resume_from_checkpoint": True}),
          progress=False)
    _same_run(one, moved)


def test_two_ranks_with_the_online_drafter_train_the_same_policy(runs, one_thread) -> None:
    """Speculation with a drafter trained on idle ranks changes the rollout's speed, not its
    tokens: the policy equals one process with plain rollouts. Each step logs the drafter's
    training and its replayed tau against the frozen starting drafter."""
    _same_run(runs / "solo", runs / "online")
    assert (runs / "solo" / "completions.jsonl").read_text() == (runs / "online" / "completions.jsonl").read_text()
    recs = _log(runs / "online" / "log.jsonl")
    assert all(r["rollout_spec_decisions"] > 0 for r in recs)
    assert [r["drafter/total_steps"] for r in recs] == sorted(r["drafter/total_steps"] for r in recs)
    for r in recs:
        assert r["drafter/steps"] <= ONLINE["drafter_max_steps_per_rollout"] and r["drafter/tau_frozen"] >= 1
        assert r["drafter/tau_online"] >= 1 and r["drafter/buffer_tokens"] > 0
    ck = runs / "online" / "checkpoint-3"
    assert (ck / "drafter" / "model.safetensors").exists() and (ck / "drafter_state.pt").exists()


def test_an_idle_rank_trains_the_drafter_until_the_slowest_is_done(runs) -> None:
    fast, slow = (torch.load(runs / f"idle-rank{r}.pt") for r in (0, 1))
    assert slow["steps"] == 0 and 1 <= fast["steps"] < 10_000  # stopped by the signal, not the budget
    assert fast["waited"] >= 0.9 and slow["waited"] < 0.5  # trained through rank 1's second, no longer
    assert fast["src"] == slow["src"] == 0 and fast["total"] == slow["total"] == fast["steps"]
    assert fast["buffer"] == slow["buffer"] > 0  # each added the other's samples
    for k, v in fast["drafter"].items():
        assert torch.equal(v, slow["drafter"][k]), k  # rank 1 drafts with rank 0's drafter next
    n = min(5, fast["steps"] // 2)
    if n:
        assert sum(fast["loss"][-n:]) < sum(fast["loss"][:n])


def test_a_one_process_checkpoint_resumes_at_two_ranks(runs) -> None:
    _same_run(runs / "solo", runs / "one-to-two")
    assert (runs / "solo" / "completions.jsonl").read_text() == (runs / "one-to-two" / "completions.jsonl").read_text()
    states = [json.loads((runs / "one-to-two" / f"checkpoint-{s}" / "trainer_state.json").read_text()) for s in (2, 3)]
    assert [s["world_size"] for s in states] == [1, 2]


def test_ddp_reduces_once_per_optimizer_step_however_many_micro_batches(runs, one_thread) -> None:
    """Two micro-batches per rank (no_sync for the first) train as one process with four, and
    DDP reduces as often as with one micro-batch per rank: once per step."""
    train(load_config(GRPOConfig, "grpo-tiny", {**fields(runs, "accum-one", 1), **ACCUM}), progress=False)
    _same_run(runs / "accum-one", runs / "accum")
    for rank in (0, 1):
        counts = json.loads((runs / f"reductions-rank{rank}.json").read_text())
        assert counts["accum"] == counts["plain"] >= 3, counts  # 3 steps, each a bucket or more


def test_a_checkpoint_holds_a_dcp_trainer_state_beside_an_hf_model(runs) -> None:
    """checkpoint-{step}/ is an HF directory transformers loads, and dcp/ a torch.distributed
    checkpoint (both ranks wrote a share) whose model is those same weights and whose optimizer
    and scheduler are at the step."""
    import warnings

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM

    ck = runs / "plain" / "checkpoint-3"
    assert (ck / "dcp" / ".metadata").is_file() and len(list((ck / "dcp").glob("*.distcp"))) == 2
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*single process")
        dcp_to_torch_save(ck / "dcp", runs / "plain-trainer.pt")
    trainer = torch.load(runs / "plain-trainer.pt", weights_only=False)["trainer"]
    hf = AutoModelForCausalLM.from_pretrained(ck, dtype=torch.float64).state_dict()
    assert set(trainer["model"]) == set(hf)
    for k, v in hf.items():
        assert torch.equal(trainer["model"][k], v), k
    assert set(trainer["optimizer"]["state"]) == set(hf)
    assert {int(s["step"]) for s in trainer["optimizer"]["state"].values()} == {3}
    assert trainer["scheduler"]["last_epoch"] == 3


def test_a_crash_mid_save_leaves_the_previous_checkpoint_to_resume(runs, one_thread, monkeypatch) -> None:
    """The step-2 save dies after DCP wrote its files: checkpoint-1 stays the latest, and resuming
    from it reproduces the uninterrupted run."""
    import torch.distributed.checkpoint as dcp

    from reclaim.checkpoints import TRAINER_STATE, checkpoints

    save, calls = dcp.save, []

    def dies_on_the_second(*args, **kw):
        calls.append(1)
        save(*args, **kw)
        if len(calls) == 2:
            raise OSError("disk full")

    monkeypatch.setattr(dcp, "save", dies_on_the_second)
    run = runs / "crash"
    with pytest.raises(OSError, match="disk full"):
        train(load_config(GRPOConfig, "grpo-tiny", fields(runs, "crash", 1)), progress=False)
    monkeypatch.setattr(dcp, "save", save)
    assert [p.name for p in run.iterdir() if p.name.startswith((".checkpoint", "checkpoint"))] == ["checkpoint-1"]
    train(load_config(GRPOConfig, "grpo-tiny", {**fields(runs, "crash", 1), "resume_from_checkpoint": True}),
          progress=False)
    assert [p.name for p in checkpoints(run, require=TRAINER_STATE)] == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    _same_run(runs / "solo", run)


def test_a_checkpoint_without_its_dcp_trainer_state_is_refused_by_name(runs) -> None:
    old = runs / "no-dcp"
    shutil.copytree(runs / "solo", old)
    shutil.rmtree(old / "checkpoint-3" / "dcp")
    with pytest.raises(ValueError, match=r"checkpoint-3' has no dcp/\.metadata"):
        train(load_config(GRPOConfig, "grpo-tiny", {**fields(runs, "no-dcp", 1), "resume_from_checkpoint": True}),
              progress=False)


if __name__ == "__main__":
    rank_main(_worker, sys.argv[1])
