"""What every benchmark JSON records about where and how it ran: machine, versions, commit, command.

A figure without the machine, the library versions, the commit and the exact command cannot be
reproduced or compared, and on a shared CPU the load average says how much to trust it.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_state(root: Path | None = None) -> dict[str, Any]:
    """HEAD's commit and whether tracked files differ from it (None where git is unavailable)."""
    root = root or Path(__file__).resolve().parents[2]

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                                 timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    changed = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit,
            "dirty": None if changed is None else bool(changed),
            "changed_files": None if changed is None else len(changed.splitlines())}


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed: `reclaim bench ...` for the console script, else argv as is."""
    argv = list(sys.argv if argv is None else argv)
    if argv and Path(argv[0]).name in ("reclaim", "cli.py"):
        argv[0] = "reclaim"
    return shlex.join(argv)


def load_average() -> list[float] | None:
    """1, 5 and 15 minute load averages (None where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def run_metadata(argv: list[str] | None = None) -> dict[str, Any]:
    """Machine, torch threads, versions, git commit, command line and load average, as JSON data."""
    import torch

    from reclaim.models.kernels.linear import status

    try:
        import transformers
        hf_version = transformers.__version__
    except ImportError:
        hf_version = None
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    return {
        "command": command_line(argv),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"cpu_model": cpu_model(), "cpu_cores": os.cpu_count(),
                    "cpus_usable": affinity, "torch_threads": torch.get_num_threads(),
                    "platform": platform.platform(),
                    "load_average_at_start": load_average()},
        "small_linear_kernel": status(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": hf_version},
        "git": git_state(),
    }


def write_result(out_dir: str | Path, name: str, result: dict[str, Any],
                 plot: Callable[[dict[str, Any], Path], None] | None = None) -> Path:
    """Write out_dir/<name>.json (and out_dir/<name>.png through `plot(result, path)`); returns the JSON's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    if plot is not None:
        plot(result, out / f"{name}.png")
    return path


def finish_metadata(meta: dict[str, Any]) -> dict[str, Any]:
    """`meta` with the end time and load average added (call when the measurements are done)."""
    meta["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    meta["machine"]["load_average_at_end"] = load_average()
    return meta
