"""Where reclaim keeps what it builds once: converted models, tokenized corpora."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$RECLAIM_CACHE`, default ~/.cache/reclaim."""
    return Path(os.environ.get("RECLAIM_CACHE") or Path.home() / ".cache" / "reclaim").expanduser()
