"""A client that hangs up mid-request frees its sequence and cache blocks."""

from __future__ import annotations

import re
import time

import httpx
import pytest
from live_server import start_server

# Long enough that the tiny model is still generating when the client leaves: each engine step
# is held 5 ms (below), so 2000 tokens take 10 s or more however the machine's load delays the
# client's reads (unthrottled, 2000 tokens sometimes finished first).
LONG = {"max_tokens": 2000, "temperature": 0.0, "ignore_eos": True}
STEP_DELAY_S = 0.005


@pytest.fixture(scope="module")
def server():
    live = start_server(max_model_len=2048, num_blocks=4 * 2048 // 16 + 64)
    engine = live.runner.engine
    step = engine.step

    def slow_step(*args, **kwargs):
        out = step(*args, **kwargs)
        if engine.has_unfinished():
            time.sleep(STEP_DELAY_S)
        return out

    engine.step = slow_step
    yield live
    live.stop()


def aborted(http: httpx.Client) -> float:
    m = re.search(r'^reclaim_requests_finished_total\{finish_reason="abort"\} (\S+)$',
                  http.get("/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def wait_for(predicate, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_stream_disconnect_frees_blocks(server, http):
    before = aborted(http)
    body = {"prompt": "Hello, world!", "stream": True, **LONG}
    with httpx.Client(base_url=server.url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = 0
            for line in r.iter_lines():
                events += line.startswith("data: ")
                if events == 3:
                    break
            assert server.stats()["kv_blocks_used"] > 0, (events, line)  # still generating when we leave
    assert wait_for(lambda: aborted(http) == before + 1)
    assert server.wait_idle()["kv_blocks_used"] == 0
    assert server.healthy()


def test_non_stream_disconnect_frees_blocks(server, http):
    before = aborted(http)
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 4, **LONG}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(30, read=0.1))
    assert wait_for(lambda: aborted(http) == before + 4)
    assert server.wait_idle()["kv_blocks_used"] == 0
    assert server.healthy()
