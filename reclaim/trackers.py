"""Where a trainer's metrics go: its JSON-lines log, always, and the trackers `report_to` names
(TRL's field and values: none | tensorboard | wandb | trackio, or a list of them), each working
offline: TensorBoard event files in output_dir/runs, W&B in offline mode (WANDB_MODE=online to
sync), trackio's local database. And the progress bar, drawn only where a terminal is attached.

    run_log = RunLog(cfg.report_to, out, config=dataclasses.asdict(cfg), resume_step=step)
    run_log.log({"step": 3, "loss": 0.5})   # a line in out/log.jsonl, a point in each tracker
    run_log.close()
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# report_to's values -> the package that provides each tracker
TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}
PROJECT = "reclaim"  # the W&B / trackio project unless WANDB_PROJECT / TRACKIO_PROJECT names one


def report_to_list(report_to: str | Sequence[str]) -> list[str]:
    """The trackers `report_to` names ('none': none; a list, or names joined by commas); an
    unknown name, or one whose package is not installed, is refused in one line saying what to do."""
    names = [report_to] if isinstance(report_to, str) else list(report_to)
    names = [n.strip() for name in names for n in str(name).split(",") if n.strip()]
    allowed = ["none", *TRACKERS]
    for name in names:
        if name not in allowed:
            raise ValueError(f"report_to {name!r} is not a tracker reclaim reports to; allowed: {allowed} "
                             "or a list of them")
    names = [n for n in dict.fromkeys(names) if n != "none"]
    for name in names:
        if importlib.util.find_spec(TRACKERS[name]) is None:
            raise ValueError(f"report_to {name!r} needs the {TRACKERS[name]} package, which is not installed: "
                             f"pip install {TRACKERS[name]}")
    return names


def progress_bar(total: int, initial: int = 0, desc: str = "", show: bool = True) -> Any:
    """A tqdm bar over `total` steps, drawn only when `show` and stderr is a terminal (tqdm's
    disable=None), so logs of a run under nohup or CI hold no bar frames."""
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, disable=None if show else True)


class RunLog:
    """A run's metrics: log(entry) appends the entry to output_dir/`log_file` as a JSON line and
    sends its numbers to each tracker at entry['step']. `main`: this process writes (rank 0).
    `resume_step`: the step the run resumed from (0: a fresh run); TensorBoard hides the points
    a previous attempt logged after it, as the JSON-lines log drops its lines."""

    def __init__(self, report_to: str | Sequence[str], output_dir: str | os.PathLike, *,
                 log_file: str = "log.jsonl", config: dict[str, Any] | None = None, resume_step: int = 0,
                 main: bool = True) -> None:
        out = Path(output_dir)
        self.path, self.main = out / log_file, main
        names = report_to_list(report_to) if main else []
        self.trackers = [OPEN[name](out, config or {}, resume_step) for name in names]

    def log(self, entry: dict[str, Any]) -> None:
        """Append `entry` (with a 'step') to the log; its int and float values go to the trackers."""
        if not self.main:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(entry) + "\n")
        numbers = {k: float(v) for k, v in entry.items()
                   if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)}
        for tracker in self.trackers:
            tracker.log(numbers, int(entry["step"]))

    def close(self) -> None:
        """Flush and close every tracker (the log file is closed after each line)."""
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []


class _TensorBoard:
    def __init__(self, out: Path, config: dict[str, Any], resume_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: a reader drops what an earlier attempt wrote from here on
        self.writer = SummaryWriter(log_dir=str(out / "runs"), purge_step=resume_step + 1)
        if config:
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```")

    def log(self, numbers: dict[str, float], step: int) -> None:
        for key, value in numbers.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # steps are seconds apart: a dashboard (or a crash) sees each at once

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, out: Path, config: dict[str, Any], resume_step: int) -> None:
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT), name=str(out), dir=str(out),
                              config=config, mode=os.environ.get("WANDB_MODE", "offline"))

    def log(self, numbers: dict[str, float], step: int) -> None:
        self.run.log(numbers, step=step)

    def close(self) -> None:
        self.run.finish()


class _Trackio:
    def __init__(self, out: Path, config: dict[str, Any], resume_step: int) -> None:
        import trackio

        self.trackio = trackio
        trackio.init(project=os.environ.get("TRACKIO_PROJECT", PROJECT), name=str(out), config=config)

    def log(self, numbers: dict[str, float], step: int) -> None:
        self.trackio.log(numbers, step=step)

    def close(self) -> None:
        self.trackio.finish()


OPEN = {"tensorboard": _TensorBoard, "wandb": _Wandb, "trackio": _Trackio}
