"""The run directory every trainer shares: `checkpoint-{step}/` directories and a JSON-lines log.

ssm-train, grpo and drafter train list their checkpoints and, on resume, drop the log lines
written after the checkpoint they continue from, the same way; this is that one way.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

CHECKPOINT_PREFIX = "checkpoint-"


def checkpoints(output_dir: str | os.PathLike, require: str | None = None) -> list[Path]:
    """The run's checkpoint-{step} directories, oldest first (only those holding `require`, if given)."""
    found = [p for p in Path(output_dir).glob(f"{CHECKPOINT_PREFIX}*")
             if p.is_dir() and p.name[len(CHECKPOINT_PREFIX):].isdigit()
             and (require is None or (p / require).is_file())]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX):]))


def trim_log(path: Path, step: int) -> None:
    """Drop JSON-lines log records past `step` (written after the checkpoint a run resumes from)."""
    if path.exists():
        keep = [ln for ln in path.read_text().splitlines() if ln and json.loads(ln)["step"] <= step]
        path.write_text("".join(ln + "\n" for ln in keep))
