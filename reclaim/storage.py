"""Writing to disk safely: directories that appear whole or not at all, built once across
processes, and sizes in bytes ('5GB').

The bottom layer: models, kernels, checkpoints and caches all write through here, and this file
imports nothing from reclaim.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write a file whole or not at all: a temp file beside it, flushed to disk, then renamed."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_dir(path: Path, write: Callable[[Path], None]) -> Path:
    """Run `write` into a temp dir beside `path`, then rename it into place (replacing a model dir)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and (not path.is_dir() or (any(path.iterdir()) and not (path / "config.json").exists())):
        raise FileExistsError(f"{str(path)!r} exists and is not a model directory; refusing to replace it")
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        write(tmp)
        if path.exists():  # replace: move the old one aside first, since rename can't replace a full dir
            old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
            path.rename(old)
            tmp.rename(path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def remove_partial(parent: Path, name: str) -> list[Path]:
    """Clean up what atomic_dir left beside `parent/name` (a glob pattern) when its process died
    mid-write: temp directories are deleted; an old directory moved aside is put back if its
    replacement never arrived (it is the last complete copy), deleted otherwise. Returns what was
    deleted."""
    removed = []
    for stale in sorted(Path(parent).glob(f".{name}.tmp-*")):
        shutil.rmtree(stale, ignore_errors=True)
        removed.append(stale)
    for old in sorted(Path(parent).glob(f".{name}.old-*")):
        target = old.parent / old.name[1:].rpartition(".old-")[0]
        if target.exists():
            shutil.rmtree(old, ignore_errors=True)
            removed.append(old)
        else:
            old.rename(target)
    return removed


@contextmanager
def _locked(lock: Path) -> Iterator[None]:
    with open(lock, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """Create `target` with `build(dir)` unless it exists; atomic, and run once across racing processes."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{target.name}.lock"):
        if not target.exists():  # another process may have finished while we waited for the lock
            remove_partial(target.parent, target.name)  # left by a killed process
            atomic_dir(target, build)
    return target


def parse_size(size: int | str) -> int:
    """Bytes in `size`: an int, or a string like '5GB', '500MB', '2GiB' (HF's spelling)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)\s*", size, re.IGNORECASE)
    if not m:
        raise ValueError(f"bad size {size!r}; use bytes or e.g. '500MB', '5GB', '2GiB'")
    unit = m.group(2).upper()
    power = "BKMGT".index(unit[0]) if unit != "B" else 0
    base = 1024 if "I" in unit else 1000
    return int(float(m.group(1)) * base**power)
