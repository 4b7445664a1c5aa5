"""Weights versions: every optimizer step a numbered version; a rollback restores one bit for bit
(from host memory or a checkpoint), rejects the feedback trained after it, durably (a restart does
not reopen it), and never reuses a version number; a version not kept is refused naming those
kept; at start-up (`--rollback-to`) the same; a checkpoint of another model is refused by name."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from online_helpers import tiny_model, token_lists

from reclaim.online.feedback import FeedbackLog
from reclaim.online.store import RecordStore
from reclaim.online.trainer import OnlineTrainConfig, OnlineTrainer, VersionNotKept


def tokenize(text: str) -> list[int]:
    return [2 + ord(c) % 90 for c in text]


def run(tmp_path, n=8, model_name="tiny", **cfg) -> OnlineTrainer:
    cfg = OnlineTrainConfig(**{"output_dir": str(tmp_path / "run"), "save_steps": 2,
                               "save_total_limit": None, "cost_model": "recompute",
                               "learning_rate": 1e-2, "per_device_train_batch_size": 1,
                               "keep_versions": 2, **cfg})
    log = FeedbackLog(cfg.feedback_path)
    for i, (p, r) in enumerate(zip(token_lists([6] * n, seed=3), token_lists([4] * n, seed=4))):
        log.add_response(f"r{i}", p, r, version=0)
        log.append(f"r{i}", 1)
    t = OnlineTrainer(tiny_model(), cfg, log, RecordStore(), tokenize=tokenize, model_name=model_name)
    t.resume()
    return t


def weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_bit_identical(model, expected: dict[str, torch.Tensor]) -> None:
    got = dict(model.named_parameters())
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name  # every bit, not a tolerance


def test_rollback_restores_a_version_bit_for_bit_and_rejects_what_trained_after_it(tmp_path):
    t = run(tmp_path)
    seen = {0: weights(t.model)}
    for _ in range(5):
        step = t.train_step()["step"]
        seen[step] = weights(t.model)
    assert t.version == 5 and t.kept_versions() == {2: "checkpoint", 4: "memory", 5: "memory"}
    assert [v["version"] for v in t.versions()] == [0, 1, 2, 3, 4, 5]

    assert t.rollback(4) == [5]  # from memory
    assert_bit_identical(t.model, seen[4])
    assert t.rollback(2) == [4, 3]  # from a checkpoint on disk
    assert_bit_identical(t.model, seen[2])
    assert not (tmp_path / "run" / "checkpoint-4").exists()  # an undone version's checkpoint goes
    with pytest.raises(VersionNotKept, match=r"version 5 is not kept; kept: \[2\]"):
        t.rollback(5)
    with pytest.raises(VersionNotKept, match=r"kept: \[2\]"):
        t.rollback(1)
    rejected = {f.id for f in t.feedback.all() if f.rejected == "rollback"}
    assert rejected == {3, 4, 5}  # feedback of steps 3, 4 and 5 (one each)
    assert [f.id for f in t.feedback.pending(limit=2)] == [6, 7]  # rejected is not pending

    entry = t.train_step()  # a new version: never a number an undone one had
    assert entry["step"] == 6 and entry["parent"] == 2
    assert [v["version"] for v in t.versions()] == [0, 1, 2, 6]
    seen[6] = weights(t.model)

    again = OnlineTrainer(tiny_model(seed=5), t.cfg, FeedbackLog(t.cfg.feedback_path), RecordStore(),
                          tokenize=tokenize, model_name="tiny")
    assert again.resume() == 6  # checkpoint-6 (save_steps 2), made from version 2
    assert_bit_identical(again.model, seen[6])
    assert [f.id for f in again.feedback.pending()] == [7, 8]  # not 3, 4, 5: they stay rejected
    assert {f.id for f in again.feedback.all() if f.rejected} == rejected
    assert again.train_step()["step"] == 7
    steps = [json.loads(ln)["step"] for ln in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6, 7]  # the undone steps' lines stay, as history


def test_rollback_restores_the_optimizer_state_too(tmp_path):
    """Adam's moments and step count come back with the weights, so training on from a restored
    version is training on from that version."""
    t = run(tmp_path, keep_versions=3)
    t.train_step()
    after_1 = copy.deepcopy(t.optimizer.state_dict())
    t.train_step(), t.train_step()
    t.rollback(1)
    state = t.optimizer.state_dict()["state"]
    assert state.keys() == after_1["state"].keys()
    for i, moments in after_1["state"].items():
        for k, v in moments.items():
            assert torch.equal(state[i][k], v), (i, k)
    t.train_step()  # the optimizer steps on, and the snapshot it came from is untouched
    t.rollback(1)
    assert torch.equal(t.optimizer.state_dict()["state"][0]["exp_avg"], after_1["state"][0]["exp_avg"])


def test_rollback_at_start_up(tmp_path):
    t = run(tmp_path)
    seen = {0: weights(t.model)}
    for _ in range(5):
        step = t.train_step()["step"]
        seen[step] = weights(t.model)

    def restart(version):
        return OnlineTrainer(tiny_model(), t.cfg, FeedbackLog(t.cfg.feedback_path), RecordStore(),
                             tokenize=tokenize, model_name="tiny"), version

    again, _ = restart(2)
    with pytest.raises(VersionNotKept, match=r"--rollback-to 3: .* kept: \[0, 2, 4\]"):
        again.resume(rollback_to=3)
    assert again.resume(rollback_to=2) == 2  # steps 3, 4 and 5 (5 never saved) undone
    assert_bit_identical(again.model, seen[2])
    assert {f.id for f in again.feedback.all() if f.rejected == "rollback"} == {3, 4, 5}
    assert [p.name for p in again.checkpoints()] == ["checkpoint-2"]
    third, _ = restart(0)
    assert third.resume(rollback_to=0) == 0  # the model as given
    assert_bit_identical(third.model, seen[0])
    assert third.feedback.pending_count() == 3 and third.feedback.rejected_count() == 5
    assert third.checkpoints() == []


def test_a_checkpoint_of_another_model_is_refused_by_name(tmp_path):
    t = run(tmp_path, model_name="tiny-a")
    t.train_step(), t.train_step()
    other = OnlineTrainer(tiny_model(), t.cfg, t.feedback, RecordStore(), model_name="tiny-b")
    with pytest.raises(ValueError, match=r"checkpoint-2' is of model 'tiny-a' .* not of the served 'tiny-b'"):
        other.resume()
    wider = OnlineTrainer(tiny_model(hidden_size=32), t.cfg, t.feedback, RecordStore(), model_name="tiny-a")
    with pytest.raises(ValueError, match=r"is of model 'tiny-a' \(.*'hidden_size': 64"):
        wider.resume()


def test_the_output_dir_is_keyed_by_the_served_model():
    cfg = OnlineTrainConfig()
    assert cfg.for_model("SmolLM2-135M-Instruct").output_dir == "runs/online/SmolLM2-135M-Instruct"
    assert cfg.for_model("/models/qwen2/").output_dir == "runs/online/qwen2"  # a path: its name
    assert Path(cfg.for_model("x").feedback_path) == Path("runs/online/x/feedback.db")
    assert OnlineTrainConfig(output_dir="mine").for_model("x").output_dir == "mine"
    from reclaim.config import load_config

    assert load_config(OnlineTrainConfig, "online-smollm2").for_model("m").output_dir == "runs/online/m"
