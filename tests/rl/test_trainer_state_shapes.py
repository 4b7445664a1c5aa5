"""A trainer-state checkpoint (dcp/) resumes only into a model of its shapes: another model's is
refused with the parameter and both shapes named, from the metadata file alone (every rank reads
it, so every rank raises and none waits in dcp.load's collective)."""

from __future__ import annotations

import pytest
import torch
from rl_helpers import tiny_target

from reclaim.checkpoints import TrainerState, _dcp, load_trainer_state
from reclaim.rl.distributed import World


def _state(model: torch.nn.Module) -> TrainerState:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    return TrainerState(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))


def test_the_same_shapes_load_and_another_models_are_refused(tmp_path) -> None:
    import torch.distributed.checkpoint as dcp

    world = World()
    saved = _state(tiny_target(300))
    _dcp(dcp.save, {"trainer": saved}, tmp_path / "dcp", world)

    same = _state(tiny_target(300, seed=1))
    load_trainer_state(tmp_path, same.model, same.optimizer, same.scheduler, world)
    for (name, a), b in zip(saved.model.state_dict().items(), same.model.state_dict().values()):
        assert torch.equal(a, b), name

    wider = _state(tiny_target(300, intermediate_size=96))
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.gate_proj.weight' was saved with shape \(64, 32\), "
                                         r"the model's is \(96, 32\)"):
        load_trainer_state(tmp_path, wider.model, wider.optimizer, wider.scheduler, world)
