"""Fixtures of tests/online; the helpers its tests import are in online_helpers.py (a module name
no other test directory has: every directory's conftest.py is the module `conftest`, so
`from conftest import ...` found another directory's when several ran together)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny tensors gain nothing from a second thread (see tests/conftest.py)."""
