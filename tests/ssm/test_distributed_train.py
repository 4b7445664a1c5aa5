"""ssm-train on 2 gloo ranks (started as torchrun starts them: tests/ranks.py) equals one process
taking the same steps (float64).

Layer and time sharding (exact and truncated adjoint; by time also a Mamba-2 LM and a hybrid with
attention) read the same batches as a single process;
data parallel, plain and fully sharded (`sharding: fsdp`, backprop and the exact adjoint), equals
one process accumulating both ranks' batches. Every distributed run is cut after its step-2
checkpoint and resumed, so the compared log and weights also show that resume reproduces the
uninterrupted run; a fully sharded checkpoint resumes in one process and a one-process
checkpoint on two fully sharded ranks. Tolerance 1e-9 relative: the ranks' gradient sums are
added in another order than one process adds its micro-batches.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from reclaim.config import load_config
from reclaim.ssm import train as T

pytestmark = pytest.mark.launches  # torchrun ranks: run first (tests/conftest.py)

# 3 layers: blocks of 1 and 2 layers; 48 tokens in chunks of 10: segments of 20 and 28 tokens.
TINY = dict(d_model=16, n_layer=3, d_state=4, context_length=48, chunk_size=10, loss_chunk=16,
            learning_rate=1e-2, max_steps=4, save_steps=2, logging_steps=1, dtype="float64",
            warmup_steps=1, max_grad_norm=0.3)
# Small models of the other families (as the bundled ssm-mamba2-small and ssm-hybrid-small).
MAMBA2 = {"architecture": "Mamba2ForCausalLM",
          "model_config": dict(hidden_size=16, num_hidden_layers=3, num_heads=4, head_dim=8, state_size=4,
                               n_groups=2)}
HYBRID = {"architecture": "NemotronHForCausalLM",
          "model_config": dict(hidden_size=16, hybrid_override_pattern="M*-M", num_attention_heads=4,
                               num_key_value_heads=2, head_dim=4, intermediate_size=24, mamba_num_heads=4,
                               mamba_head_dim=8, ssm_state_size=4, n_groups=2)}
# name: (distributed overrides, single-process overrides). Windows: 7 < a segment, 25 > one.
RUNS = {
    "time-mamba2-truncated": ({"sharding": "time", "grad_mode": "truncated", "window": 12, **MAMBA2},
                              {"grad_mode": "truncated", "window": 12, **MAMBA2}),
    "time-hybrid-adjoint": ({"sharding": "time", "grad_mode": "adjoint", "per_device_train_batch_size": 2,
                             **HYBRID},
                            {"grad_mode": "adjoint", "per_device_train_batch_size": 2, **HYBRID}),
    "layer-adjoint": ({"sharding": "layer", "grad_mode": "adjoint"}, {"grad_mode": "adjoint"}),
    "layer-truncated": ({"sharding": "layer", "grad_mode": "truncated", "window": 7,
                         "gradient_accumulation_steps": 2},
                        {"grad_mode": "truncated", "window": 7, "gradient_accumulation_steps": 2}),
    "time-adjoint": ({"sharding": "time", "grad_mode": "adjoint", "per_device_train_batch_size": 2},
                     {"grad_mode": "adjoint", "per_device_train_batch_size": 2}),
    "time-truncated": ({"sharding": "time", "grad_mode": "truncated", "window": 25},
                       {"grad_mode": "truncated", "window": 25}),
    # Rank r takes batch 2i + r of accumulation step i: one process accumulating 4 per step.
    "data-parallel": ({"grad_mode": "backprop", "gradient_accumulation_steps": 2},
                      {"grad_mode": "backprop", "gradient_accumulation_steps": 4}),
    "fsdp-backprop": ({"sharding": "fsdp", "grad_mode": "backprop", "gradient_accumulation_steps": 2},
                      {"grad_mode": "backprop", "gradient_accumulation_steps": 4}),
    "fsdp-hybrid-adjoint": ({"sharding": "fsdp", "grad_mode": "adjoint", **HYBRID},
                            {"grad_mode": "adjoint", "gradient_accumulation_steps": 2, **HYBRID}),
    "fsdp-adjoint": ({"sharding": "fsdp", "grad_mode": "adjoint", "weight_decay": 0.1},
                     {"grad_mode": "adjoint", "gradient_accumulation_steps": 2, "weight_decay": 0.1}),
}
# A one-process run the two fully sharded ranks resume from its step-2 checkpoint.
ONE_TO_FSDP = {"grad_mode": "adjoint", "gradient_accumulation_steps": 2, "weight_decay": 0.1}


def stream() -> torch.Tensor:
    return torch.randint(0, 40, (2000,), generator=torch.Generator().manual_seed(0),
                         dtype=torch.int32).repeat_interleave(2)


def _log(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / "log.jsonl").read_text().splitlines()]


def _worker(root: Path) -> None:
    """One torchrun rank: every run to the end, then again from its step-2 checkpoint."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    tokens = stream()
    for name, (overrides, _) in RUNS.items():
        cfg = T.SSMTrainConfig(output_dir=str(root / name), **{**TINY, **overrides})
        T.train(cfg, tokens=tokens, progress=False)
        if dist.get_rank() == 0:
            shutil.copy(root / name / "log.jsonl", root / f"{name}-uninterrupted.jsonl")
            shutil.rmtree(root / name / "checkpoint-4")
        dist.barrier()
        T.train(load_config(T.SSMTrainConfig, None, {**dataclasses.asdict(cfg), "resume_from_checkpoint": True}),
                tokens=tokens, progress=False)
    T.train(T.SSMTrainConfig(output_dir=str(root / "one-to-fsdp"), **{**TINY, **RUNS["fsdp-adjoint"][0]},
                             resume_from_checkpoint=True), tokens=tokens, progress=False)
    dist.destroy_process_group()


def _weights(run: Path) -> dict[str, torch.Tensor]:
    from reclaim.models.ssm import load_ssm

    return load_ssm(run / "checkpoint-4").state_dict()


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * abs(b)


@pytest.fixture(scope="module")
def distributed_runs(built_once) -> Path:
    def build(root: Path) -> None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            T.train(T.SSMTrainConfig(output_dir=str(root / "one"), **{**TINY, **ONE_TO_FSDP}), tokens=stream(),
                    progress=False)
        finally:
            torch.set_num_threads(threads)
        shutil.copytree(root / "one", root / "one-to-fsdp")
        shutil.rmtree(root / "one-to-fsdp" / "checkpoint-4")
        from ranks import ranks  # tests/ranks.py: the script's ranks as torchrun starts them

        ranks(__file__, str(root))

    return built_once("ssm-dist", build)


@pytest.mark.parametrize("name", list(RUNS))
def test_torchrun_equals_one_process_and_resume_reproduces(name, distributed_runs, tmp_path,
                                                           one_thread) -> None:
    run = distributed_runs / name
    cfg = T.SSMTrainConfig(output_dir=str(tmp_path), **{**TINY, **RUNS[name][1]})
    T.train(cfg, tokens=stream(), progress=False)
    ref, got = _log(tmp_path), _log(run)
    uninterrupted = [json.loads(ln) for ln in
                     (distributed_runs / f"{name}-uninterrupted.jsonl").read_text().splitlines()]
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for log in (got, uninterrupted):
        for a, b in zip(log, ref, strict=True):
            assert _close(a["loss"], b["loss"]) and _close(a["grad_norm"], b["grad_norm"]), (a, b)
    assert ref[0]["grad_norm"] > TINY["max_grad_norm"]  # clipping is exercised
    want, have = _weights(tmp_path), _weights(run)
    assert set(want) == set(have)
    for k in want:
        assert (have[k] - want[k]).abs().max() <= 1e-9 * want[k].abs().max(), k
    files = {p.name for p in (run / "checkpoint-4").iterdir()}
    per_rank = {"optimizer-rank0.pt", "optimizer-rank1.pt"}
    assert per_rank <= files if "layer" in name else "optimizer.pt" in files
    assert not list(run.glob(".optimizer-*"))  # staged optimizer files all moved in




def _same(a: Path, b: Path) -> None:
    for x, y in zip(_log(a), _log(b), strict=True):
        assert x["step"] == y["step"] and _close(x["loss"], y["loss"]) and _close(x["grad_norm"], y["grad_norm"])
    want, have = _weights(a), _weights(b)
    for k in want:
        assert (have[k] - want[k]).abs().max() <= 1e-9 * want[k].abs().max(), k


def test_fully_sharded_checkpoints_resume_in_one_process_and_the_other_way(distributed_runs, tmp_path,
                                                                          one_thread) -> None:
    _same(distributed_runs / "one", distributed_runs / "one-to-fsdp")  # one process -> 2 sharded ranks
    moved = tmp_path / "fsdp-to-one"
    shutil.copytree(distributed_runs / "fsdp-adjoint", moved)
    shutil.rmtree(moved / "checkpoint-4")
    T.train(T.SSMTrainConfig(output_dir=str(moved), **{**TINY, **ONE_TO_FSDP}, resume_from_checkpoint=True),
            tokens=stream(), progress=False)
    _same(distributed_runs / "one", moved)  # 2 sharded ranks -> one process


def test_a_fully_sharded_rank_holds_half_the_parameters_and_optimizer_state(distributed_runs) -> None:
    one, sharded = _log(distributed_runs / "one")[-1], _log(distributed_runs / "fsdp-adjoint")[-1]
    for key in ("memory/params_bytes", "memory/optimizer_bytes"):
        assert 0.5 <= sharded[key] / one[key] < 0.52, key  # odd sizes pad the last slice
    assert one["memory/optimizer_bytes"] == 2 * one["memory/params_bytes"]  # AdamW: two moments


def test_fsdp_needs_torchrun_and_takes_every_grad_mode() -> None:
    for mode in ("backprop", "checkpoint", "adjoint"):
        T.SSMTrainConfig(sharding="fsdp", grad_mode=mode)
    with pytest.raises(ValueError, match="sharding 'fsdp' splits the model over torchrun processes, but "
                                         "WORLD_SIZE is 1"):
        T.train(T.SSMTrainConfig(sharding="fsdp", **TINY), tokens=stream(), progress=False)


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
