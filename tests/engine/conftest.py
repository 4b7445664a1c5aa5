"""Fixtures of tests/engine; the helpers its tests import are in engine_helpers.py (a module name
no other test directory has: every directory's conftest.py is the module `conftest`)."""

from __future__ import annotations

import pytest
from engine_helpers import TINY, ToyTokenizer, make_pair


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every engine test runs its tiny models on one thread (see tests/conftest.py)."""


@pytest.fixture(scope="module")
def tiny():
    return make_pair()


@pytest.fixture(scope="module")
def toy_tokenizer():
    return ToyTokenizer(TINY["vocab_size"])


@pytest.fixture(scope="session")
def smol(default_model_dir):
    """The embedded default model (SmolLM2-135M-Instruct), its tokenizer, and transformers' twin."""
    from reclaim.models.hf import load_hf_model
    from reclaim.models.loading import load_model

    model, tokenizer = load_model(default_model_dir)
    return model.eval(), tokenizer, load_hf_model(default_model_dir)


@pytest.fixture(scope="session")
def smol_tokenizer(default_model_dir):
    from reclaim.models.tokenizer import load_tokenizer

    return load_tokenizer(default_model_dir)
