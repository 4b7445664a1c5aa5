"""The run directory: what a save killed mid-write leaves is cleaned up at the next start-up, and
a run that fails at once leaves no directory behind."""

from __future__ import annotations

import subprocess
import sys

import pytest

from reclaim.checkpoints import checkpoints, remove_partial_saves, run_dir

KILLED_MID_SAVE = """
import os, signal, sys
from pathlib import Path
import torch
from reclaim.checkpoints import save_checkpoint

def write_model(tmp):
    (tmp / "model.safetensors").write_bytes(b"w" * 4096)
    os.kill(os.getpid(), signal.SIGKILL)  # the crash, with the weights half written

opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
save_checkpoint(Path(sys.argv[1]), 7, write_model, opt, None, {})
"""


def killed_mid_save(out) -> None:
    """A process killed (SIGKILL) while save_checkpoint writes checkpoint-7 into `out`."""
    r = subprocess.run([sys.executable, "-c", KILLED_MID_SAVE, str(out)], capture_output=True, text=True)
    assert r.returncode == -9, r.stderr
    assert [p.name.split(".tmp-")[0] for p in out.glob(".checkpoint-*")] == [".checkpoint-7"]


def half_written_save(out) -> None:
    """What killed_mid_save leaves, made without the subprocess (the trainers' tests use it)."""
    (out / ".checkpoint-7.tmp-0badf00d").mkdir()
    (out / ".checkpoint-7.tmp-0badf00d" / "model.safetensors").write_bytes(b"w" * 4096)


def test_a_killed_save_leaves_a_temp_dir_that_the_next_start_removes(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    killed_mid_save(out)
    assert checkpoints(out) == []  # never renamed into place: not taken for a checkpoint
    with run_dir(out) as got:
        assert got == out
    assert list(out.iterdir()) == []


def test_an_old_dir_moved_aside_comes_back_when_its_replacement_never_arrived(tmp_path):
    (tmp_path / ".checkpoint-3.old-1234abcd").mkdir()  # killed between the two renames of a replace
    (tmp_path / ".checkpoint-3.old-1234abcd" / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoint-4").mkdir()
    (tmp_path / ".checkpoint-4.old-5678abcd").mkdir()  # killed after them: the new one is in place
    removed = remove_partial_saves(tmp_path)
    assert [p.name for p in removed] == [".checkpoint-4.old-5678abcd"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3", "checkpoint-4"]
    assert (tmp_path / "checkpoint-3" / "trainer_state.json").read_text() == "{}"


def test_a_run_that_fails_at_once_leaves_no_directory_it_made(tmp_path):
    with pytest.raises(FileNotFoundError), run_dir(tmp_path / "runs" / "a") as out:
        (out / "train_config.json").write_text("{}")
        (out / "log.jsonl").touch()
        raise FileNotFoundError("no such model")
    assert list(tmp_path.iterdir()) == []  # runs/ too: this run made it
    (tmp_path / "kept").mkdir()
    with pytest.raises(ValueError), run_dir(tmp_path / "kept"):
        raise ValueError("bad")
    assert (tmp_path / "kept").is_dir()  # the user's directory stays
    with pytest.raises(ValueError), run_dir(tmp_path / "b") as out:
        (out / "log.jsonl").write_text('{"step": 1}\n')  # a step ran: its log is kept
        raise ValueError("step 2 failed")
    assert (tmp_path / "b" / "log.jsonl").exists()
