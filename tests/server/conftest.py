"""Fixtures: a live server per test module (see live_server.py)."""

from __future__ import annotations

import logging

import httpx
import pytest

from live_server import start_server


@pytest.fixture(scope="module")
def server():
    live = start_server()
    yield live
    live.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


@pytest.fixture
def uvicorn_log(caplog):
    """caplog, also seeing uvicorn's own loggers (they do not propagate to the root)."""
    logger = logging.getLogger("uvicorn")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.DEBUG)
    yield caplog
    logger.removeHandler(caplog.handler)
