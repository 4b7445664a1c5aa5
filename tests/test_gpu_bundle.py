"""scripts/gpu_bundle.py: what it would carry to a lent GPU machine, from the installed metadata
(no download here)."""

import re
import sys
from importlib.metadata import requires, version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import gpu_bundle  # noqa: E402


def test_every_dependency_the_image_lacks_is_carried_at_the_installed_version():
    pins = dict(p.split("==") for p in gpu_bundle.closure("reclaim"))
    direct = {gpu_bundle.canon(re.match(r"[A-Za-z0-9_.\-]+", r).group(0))
              for r in requires("reclaim") if "extra ==" not in r}
    assert direct - gpu_bundle.DEVICE_HAS <= set(pins)  # transformers, fastapi, uvicorn, gguf, ...
    assert {"transformers", "huggingface-hub", "fastapi", "pydantic", "pydantic-core"} <= set(pins)
    assert not set(pins) & gpu_bundle.DEVICE_HAS and "reclaim" not in pins
    for name, pinned in pins.items():
        assert version(name) == pinned, name
