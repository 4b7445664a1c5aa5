"""A tiny random Llama with a real byte-level BPE tokenizer and chat template, saved as an HF
directory that both reclaim and transformers load (the server tests' model, reused)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))

from live_server import make_model, make_tokenizer  # noqa: E402

from reclaim.models.loading import save_model  # noqa: E402


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    tokenizer = make_tokenizer()
    return save_model(make_model(tokenizer), tokenizer, tmp_path_factory.mktemp("bench") / "tiny")


@pytest.fixture(scope="module")
def tiny_tokenizer():
    return make_tokenizer()
