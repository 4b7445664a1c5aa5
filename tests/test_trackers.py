"""report_to (TRL's field): the trackers it names get the numbers of the JSON-lines log, offline;
an unknown tracker or one not installed is refused in one line. TensorBoard's event files are
read back with TensorBoard's own reader (the oracle)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import shutil
import sys
import types

import pytest
import torch

from reclaim.config import ConfigError, load_config
from reclaim.trackers import RunLog, progress_bar, report_to_list


def tensorboard_scalars(out) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} of the TensorBoard events under out/runs, as TensorBoard shows
    them (points an earlier attempt logged past a resume's purge step are dropped)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "runs"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def logged(out, name: str = "log.jsonl") -> list[dict]:
    return [json.loads(line) for line in (out / name).read_text().splitlines()]


def assert_log_in_tensorboard(out, keys, name: str = "log.jsonl") -> None:
    """Each key of every JSON-lines record is a TensorBoard point at the record's step, once."""
    got, records = tensorboard_scalars(out), logged(out, name)
    for key in keys:
        want = [(r["step"], r[key]) for r in records]
        assert [s for s, _ in got[key]] == [s for s, _ in want], key
        assert [v for _, v in got[key]] == pytest.approx([v for _, v in want], rel=1e-6), key


def test_report_to_takes_trls_values_a_list_or_commas():
    assert report_to_list("none") == [] and report_to_list(["none"]) == []
    assert report_to_list("tensorboard") == ["tensorboard"]
    assert report_to_list(["tensorboard", "tensorboard"]) == ["tensorboard"]
    assert report_to_list("none,tensorboard") == ["tensorboard"]
    with pytest.raises(ValueError, match=r"^report_to 'mlflow' is not a tracker reclaim reports to; allowed: "
                                         r"\['none', 'tensorboard', 'wandb', 'trackio'\]"):
        report_to_list(["tensorboard", "mlflow"])


@pytest.mark.parametrize("config", ["reclaim.rl.grpo_config:GRPOConfig", "reclaim.ssm.train:SSMTrainConfig",
                                    "reclaim.drafter.train:DrafterTrainConfig",
                                    "reclaim.online.trainer:OnlineTrainConfig"])
@pytest.mark.parametrize("tracker", ["wandb", "trackio"])
def test_a_tracker_not_installed_is_one_line_naming_the_package(config, tracker, monkeypatch):
    import importlib

    module, name = config.split(":")
    cls = getattr(importlib.import_module(module), name)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == tracker else real(n, *a))
    with pytest.raises(ConfigError) as e:
        load_config(cls, None, ["--report_to", tracker])
    assert str(e.value) == (f"report_to {tracker!r} needs the {tracker} package, which is not installed: "
                            f"pip install {tracker}")


def test_the_log_keeps_every_value_and_tensorboard_gets_the_numbers(tmp_path):
    run_log = RunLog(["tensorboard"], tmp_path, config={"lr": 1e-3})
    run_log.log({"step": 1, "loss": 2.5, "tokens": 7, "ids": [1, 2], "ok": True, "reason": "x"})
    run_log.log({"step": 2, "loss": 1.5, "tokens": 9, "ids": [], "ok": False, "reason": "y"})
    run_log.close()
    assert logged(tmp_path)[0] == {"step": 1, "loss": 2.5, "tokens": 7, "ids": [1, 2], "ok": True, "reason": "x"}
    assert tensorboard_scalars(tmp_path) == {"loss": [(1, 2.5), (2, 1.5)], "tokens": [(1, 7.0), (2, 9.0)]}
    quiet = RunLog(["tensorboard"], tmp_path / "other", main=False)  # not the rank that logs
    quiet.log({"step": 1, "loss": 1.0})
    assert not (tmp_path / "other").exists()


class FakeTracker(types.ModuleType):
    """A stand-in for wandb or trackio (neither is a test dependency) that records the calls."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__spec__ = importlib.machinery.ModuleSpec(name, None)
        self.calls: list[tuple] = []

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))
        return self

    def log(self, numbers, step):
        self.calls.append(("log", numbers, step))

    def finish(self):
        self.calls.append(("finish",))


def test_wandb_runs_offline_and_trackio_locally(tmp_path, monkeypatch):
    fakes = {name: FakeTracker(name) for name in ("wandb", "trackio")}
    for name, fake in fakes.items():
        monkeypatch.setitem(sys.modules, name, fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    monkeypatch.setenv("TRACKIO_PROJECT", "mine")
    run_log = RunLog("wandb,trackio", tmp_path, config={"lr": 1e-3})
    run_log.log({"step": 5, "loss": 0.5, "ids": [1]})
    run_log.close()
    assert fakes["wandb"].calls == [
        ("init", {"project": "reclaim", "name": str(tmp_path), "dir": str(tmp_path), "config": {"lr": 1e-3},
                  "mode": "offline"}),
        ("log", {"loss": 0.5}, 5), ("finish",)]
    init = fakes["trackio"].calls[0][1]
    assert init == {"project": "mine", "name": str(tmp_path), "config": {"lr": 1e-3}}  # no space_id: local
    assert fakes["trackio"].calls[1:] == [("log", {"loss": 0.5}, 5), ("finish",)]


def test_no_bar_without_a_terminal():
    assert progress_bar(10, desc="x").disable  # pytest's stderr is not a terminal
    assert progress_bar(10, show=False).disable


def test_ssm_train_reports_to_tensorboard_and_a_resume_replaces_the_lost_steps(tmp_path):
    from reclaim.ssm import train as T

    tokens = torch.randint(0, 40, (2000,), generator=torch.Generator().manual_seed(0)).repeat_interleave(2)
    fields = dict(d_model=16, n_layer=2, d_state=4, context_length=48, chunk_size=10, loss_chunk=16,
                  learning_rate=1e-2, max_steps=4, logging_steps=1, save_steps=2, report_to="tensorboard")
    a = tmp_path / "a"
    T.train(load_config(T.SSMTrainConfig, None, {**fields, "output_dir": str(a)}), tokens=tokens, progress=False)
    keys = ("loss", "learning_rate", "grad_norm", "tokens_per_s", "memory/params_bytes")
    assert_log_in_tensorboard(a, keys)
    # A crash after checkpoint-2 whose log and event file ran on to step 4: the resumed run's
    # steps 3 and 4 replace them in TensorBoard as in log.jsonl, each step shown once.
    b = tmp_path / "b"
    shutil.copytree(a, b)
    shutil.rmtree(b / "checkpoint-4")
    T.train(load_config(T.SSMTrainConfig, None, {**fields, "output_dir": str(b), "resume_from_checkpoint": True,
                                                 "seed": 7}), tokens=tokens, progress=False)
    assert_log_in_tensorboard(b, keys)
    assert [r["step"] for r in logged(b)] == [1, 2, 3, 4]
    assert logged(b)[2]["loss"] != logged(a)[2]["loss"]  # other batches after the resume: other points
