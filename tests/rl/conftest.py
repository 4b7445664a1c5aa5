"""Fixtures of tests/rl; the helpers its tests import are in rl_helpers.py (a module name no
other test directory has: every directory's conftest.py is the module `conftest`)."""

from __future__ import annotations

import pytest
from rl_helpers import make_tokenizer, tiny_target


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer):
    from reclaim.models.loading import save_model

    return save_model(tiny_target(len(tokenizer)), tokenizer, tmp_path_factory.mktemp("target") / "tiny")
