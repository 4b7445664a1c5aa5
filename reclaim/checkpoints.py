"""The run directory every trainer shares: `checkpoint-{step}/` directories and a JSON-lines log;
made by `run_dir`, which removes what a crashed save left and what a run that failed at once made.

ssm-train, grpo and drafter train write and list their checkpoints and, on resume, drop the log lines
written after the checkpoint they continue from, the same way; this is that one way. GRPO's
checkpoint (the policy, its trainer state as a torch.distributed.checkpoint, RNG, the pending
rollout, the online drafter) is written and read here too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from reclaim.storage import atomic_dir, remove_partial

CHECKPOINT_PREFIX = "checkpoint-"
TRAINER_STATE = "trainer_state.json"  # written last: a checkpoint with one is complete


def checkpoints(output_dir: str | os.PathLike, require: str | None = None) -> list[Path]:
    """The run's checkpoint-{step} directories, oldest first (only those holding `require`, if given)."""
    found = [p for p in Path(output_dir).glob(f"{CHECKPOINT_PREFIX}*")
             if p.is_dir() and p.name[len(CHECKPOINT_PREFIX):].isdigit()
             and (require is None or (p / require).is_file())]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX):]))


def remove_partial_saves(output_dir: str | os.PathLike) -> list[Path]:
    """Delete the checkpoint temp directories a save killed mid-write left in output_dir (atomic_dir
    writes `.checkpoint-{step}.tmp-*` and renames it into place when complete); returns them."""
    return remove_partial(Path(output_dir), f"{CHECKPOINT_PREFIX}*")


@contextmanager
def run_dir(output_dir: str | os.PathLike, main: bool = True) -> Iterator[Path]:
    """A run's output_dir, made if missing and cleared (by `main`, the rank that saves) of the temp
    directories a save killed mid-write left. A run that fails having written nothing but empty
    files and train_config.json leaves no directory it made."""
    out = Path(output_dir)
    made = next((p for p in reversed([out, *out.parents]) if not p.exists()), None)
    out.mkdir(parents=True, exist_ok=True)
    if main:
        remove_partial_saves(out)
    try:
        yield out
    except BaseException:
        if main and made is not None and _untouched(out):
            shutil.rmtree(made, ignore_errors=True)
        raise


def _untouched(out: Path) -> bool:
    """Nothing in `out` a user would keep: only empty files or folders, and the run's config."""
    return all(p.is_dir() or p.name == "train_config.json" or p.stat().st_size == 0 for p in out.rglob("*"))


def save_checkpoint(output_dir: Path, step: int, save_model: Callable[[Path], Any], optimizer: Any, scheduler: Any,
                    state: dict[str, Any], *, optimizer_file: str = "optimizer.pt",
                    moved: dict[str, Path] | None = None) -> Path:
    """checkpoint-{step}/ written atomically: save_model(dir) (the model in its layout, first, while
    the directory is empty: saving may replace it), the optimizer, the scheduler and
    trainer_state.json. moved: files written elsewhere (other ranks' optimizer states) to move in,
    by their name there. ssm-train and drafter train save through this; GRPO's is below."""
    def write(tmp: Path) -> None:
        save_model(tmp)
        torch.save(optimizer.state_dict(), tmp / optimizer_file)
        for name, src in (moved or {}).items():
            os.replace(src, tmp / name)
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        (tmp / TRAINER_STATE).write_text(json.dumps(state, indent=2) + "\n")

    return atomic_dir(Path(output_dir) / f"{CHECKPOINT_PREFIX}{step}", write)


def trim_log(path: Path, step: int) -> None:
    """Drop JSON-lines log records past `step` (written after the checkpoint a run resumes from)."""
    if path.exists():
        keep = [ln for ln in path.read_text().splitlines() if ln and json.loads(ln)["step"] <= step]
        path.write_text("".join(ln + "\n" for ln in keep))


# ---- GRPO's checkpoint ------------------------------------------------------------------------

DCP_DIR = "dcp"  # checkpoint-{step}/dcp: the torch.distributed.checkpoint of model, optimizer, scheduler


class TrainerState:
    """What DCP saves and loads (torch.distributed.checkpoint's Stateful): the policy, the optimizer
    (state dicts keyed by parameter name, as get_state_dict gives them, so any world size reads
    them) and the LR scheduler."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optimizer": optim_sd, "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
        self.scheduler.load_state_dict(sd["scheduler"])


def save_grpo_checkpoint(out: Path, step: int, model: torch.nn.Module, full: torch.nn.Module, tokenizer: Any,
                         optimizer, scheduler, state: dict[str, Any], batch: Any | None, online: Any | None,
                         world: Any) -> Path:
    """checkpoint-{step}/: the policy in HF layout (from `full`, a plain module with the policy's
    full weights, as the rollout engine's copy is: `model` may be sharded), dcp/ (TrainerState of
    `model`, every rank writing its share),
    RNG states, the rollout still being trained on (num_iterations > 1), the online drafter
    (drafter/, drafter_state.pt) and trainer_state.json (last). Every rank calls it; rank 0 builds
    the directory under a temp name and renames it into place once all is written, so a crash
    mid-save leaves the previous checkpoint the latest. `world`: rl.distributed.World; `online`: an
    OnlineDrafterTrainer; `batch`: a RolloutBatch."""
    import torch.distributed.checkpoint as dcp

    from reclaim.models.loading import save_model

    trainer = {"trainer": TrainerState(model, optimizer, scheduler)}
    path = out / f"{CHECKPOINT_PREFIX}{step}"
    if not world.is_main:
        _dcp(dcp.save, trainer, world.broadcast(None, src=0), world)
        return path

    def write(tmp: Path) -> None:
        save_model(full, tokenizer, tmp)  # first, while tmp is empty (it replaces the directory)
        _dcp(dcp.save, trainer, world.broadcast(tmp / DCP_DIR, src=0), world)
        torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, tmp / "rng_state.pt")
        if batch is not None:
            torch.save(dataclasses.asdict(batch), tmp / "rollout.pt")
        if online is not None:
            online.save(tmp)
        (tmp / TRAINER_STATE).write_text(json.dumps(state, indent=2) + "\n")

    return atomic_dir(path, write)


def load_trainer_state(checkpoint: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                       scheduler: Any, world: Any) -> None:
    """Load the checkpoint's dcp/ into the policy, optimizer and scheduler (every rank calls it; the
    world size may differ from the one that saved)."""
    import torch.distributed.checkpoint as dcp

    if not (checkpoint / DCP_DIR / ".metadata").is_file():
        raise ValueError(f"{str(checkpoint)!r} has no {DCP_DIR}/.metadata (the torch.distributed.checkpoint of the "
                         f"model, optimizer and scheduler); it was not written by this version of reclaim grpo, so "
                         f"it cannot be resumed: start a fresh run (model: {str(checkpoint)!r} starts from its weights)")
    check_shapes(checkpoint, model)
    _dcp(dcp.load, {"trainer": TrainerState(model, optimizer, scheduler)}, checkpoint / DCP_DIR, world)


def check_shapes(checkpoint: Path, model: torch.nn.Module) -> None:
    """Refuse a dcp/ whose parameters' full shapes are not the model's, naming the first that
    differs. Each rank reads the metadata file itself, so every rank raises, none in a collective."""
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(str(checkpoint / DCP_DIR)).read_metadata().state_dict_metadata
    prefix = "trainer.model."
    for name, tensor in model.state_dict().items():  # checkpoint-wrapped layers keep their names here
        meta = saved.get(prefix + name)  # a name it lacks (a tied weight saved once) is dcp.load's to judge
        if meta is not None and tuple(meta.size) != tuple(tensor.shape):
            raise ValueError(f"checkpoint {str(checkpoint)!r}: parameter {name!r} was saved with shape "
                             f"{tuple(meta.size)}, the model's is {tuple(tensor.shape)} (sharding does not change a "
                             f"full shape, so it is another model's checkpoint)")


def _dcp(op: Callable, state: dict[str, Any], path: Path, world: Any) -> None:
    """dcp.save or dcp.load at `path`: collective over the ranks; one process runs it without a
    process group, as it says in a warning silenced here, since that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*single process")
        op(state, checkpoint_id=path, no_dist=world.size == 1)
