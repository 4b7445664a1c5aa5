"""A step that raises fails only the requests in flight; the server keeps serving."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from live_server import start_server

BODY = {"prompt": "Hello", "max_tokens": 8, "temperature": 0.0}


@pytest.fixture
def failing(monkeypatch):
    """A server whose engine raises in step() while `broken["on"]` is true."""
    live = start_server()
    broken = {"on": False}
    real_step = live.runner.engine.step

    def step():
        if broken["on"]:
            raise RuntimeError("injected fault")
        return real_step()

    monkeypatch.setattr(live.runner.engine, "step", step)
    yield live, broken
    live.stop()


def test_failed_step_is_an_error_not_a_dead_server(failing, caplog):
    live, broken = failing
    caplog.set_level(logging.CRITICAL, logger="reclaim.server")  # the traceback is expected
    with httpx.Client(base_url=live.url, timeout=30) as http:
        broken["on"] = True
        r = http.post("/v1/completions", json=BODY)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        frames = [f for f in http.post("/v1/completions", json={**BODY, "stream": True}).text
                  .split("\n\n") if f]
        assert frames[-1] == "data: [DONE]"
        assert "injected fault" in json.loads(frames[-2].removeprefix("data: "))["error"]["message"]
        broken["on"] = False
        assert live.healthy()
        ok = http.post("/v1/completions", json=BODY)
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
        metrics = http.get("/metrics").text
        assert 'reclaim_requests_finished_total{finish_reason="error"} 2' in metrics
        # The stream answered 200 before its error event; it still counts as a failed request.
        assert 'reclaim_http_requests_total{route="/v1/completions",code="500"} 2' in metrics
        assert 'reclaim_http_requests_total{route="/v1/completions",code="200"} 1' in metrics
    assert live.wait_idle()["kv_blocks_used"] == 0
