"""The bundled model's EAGLE drafter: cached under $RECLAIM_CACHE/drafters/, trained on first use."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from reclaim.drafter.train import DrafterTrainConfig, train
from reclaim.paths import cache_root

DEFAULT_DRAFTER_CONFIG = "drafter-smollm2"
TRAIN_INFO = "train_info.json"


def default_drafter_path() -> Path:
    """Where the bundled model's drafter is cached (it may not be there yet)."""
    from reclaim.models.loading import default_model_dir

    return cache_root() / "drafters" / default_model_dir().name


def default_drafter_dir(log: Callable[[str], None] = print, progress: bool = True) -> Path:
    """The bundled model's EAGLE drafter, `$RECLAIM_CACHE/drafters/<model>`: trained on first use
    with the bundled drafter-smollm2 config (its train_info.json says how long that took and the
    held-out tau), found there afterwards."""
    import tempfile

    from reclaim.config import load_config
    from reclaim.models.loading import default_model_dir
    from reclaim.storage import build_once

    model_dir = default_model_dir()
    where = default_drafter_path()

    def build(out: Path) -> None:
        log(f"training an EAGLE drafter for {model_dir.name} on first use ({DEFAULT_DRAFTER_CONFIG}); "
            f"it is cached in {where}")
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            cfg = load_config(DrafterTrainConfig, DEFAULT_DRAFTER_CONFIG,
                              {"model": str(model_dir), "output_dir": tmp, "save_steps": 0})
            summary = train(cfg, progress=progress, log=log)
            for name in sorted(os.listdir(tmp), key=lambda n: n == "config.json"):
                if name in ("config.json", "model.safetensors", "log.jsonl"):
                    shutil.copy2(Path(tmp) / name, out / name)
        (out / TRAIN_INFO).write_text(json.dumps({**summary, "config": DEFAULT_DRAFTER_CONFIG}, indent=2) + "\n")
        ev = summary.get("eval", {})
        log(f"drafter trained in {summary['total_s']:.0f} s (held-out greedy tau {ev.get('tau', float('nan')):.2f})")

    return build_once(where, build)
