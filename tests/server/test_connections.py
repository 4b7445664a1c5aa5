"""No client can hold the server: half-sent requests are closed on a deadline, connections over the
cap get 503 with Retry-After, and running out of descriptors logs a line, not a flood."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import selectors
import socket
import time

import httpx
import pytest

from live_server import start_server
from reclaim.server.connections import ACCEPT_ERROR, ConnectionLimits, quiet_accept_errors

PARTIAL = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: applic"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture(autouse=True)
def enough_descriptors():
    """Both ends of every test connection live in this process."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4096 and (hard == resource.RLIM_INFINITY or hard > soft):
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard) if hard > 0 else 4096, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def half_open(port: int, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(PARTIAL)
        socks.append(s)
    return socks


def wait_closed(socks: list[socket.socket], timeout: float) -> tuple[int, float]:
    """(how many the server closed, seconds until the last of them) within `timeout`."""
    sel = selectors.DefaultSelector()
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    start, closed, last = time.monotonic(), 0, 0.0
    while closed < len(socks) and time.monotonic() - start < timeout:
        for key, _ in sel.select(timeout=0.1):
            try:
                data = key.fileobj.recv(65536)
            except ConnectionError:
                data = b""
            if data:
                continue  # the 408 answer; the close follows
            sel.unregister(key.fileobj)
            closed, last = closed + 1, time.monotonic() - start
    sel.close()
    return closed, last


def test_500_half_open_connections_do_not_block_the_server(server):
    """With the default limits (the `server` fixture's), health and chat still answer."""
    socks = half_open(server.port, 500)
    try:
        with httpx.Client(base_url=server.url, timeout=10) as http:
            t = time.perf_counter()
            assert http.get("/health").status_code == 200
            health_s = time.perf_counter() - t
            r = http.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
        assert health_s < 2.0
    finally:
        for s in socks:
            s.close()


def test_half_open_connections_are_closed_within_the_header_timeout():
    live = start_server(connections=ConnectionLimits(header_timeout=1.5))
    try:
        opened = time.monotonic()
        socks = half_open(live.port, 500)
        closed, last = wait_closed(socks, timeout=10)
        elapsed = time.monotonic() - opened
        assert closed == 500, f"{closed} of 500 closed in {elapsed:.1f} s"
        assert elapsed < 1.5 + 3.0  # the deadline plus slack for a loaded 2-core machine
        assert live.healthy()
        assert 'reclaim_connections_closed_total{reason="header_timeout"} 500' in \
            httpx.get(live.url + "/metrics").text
    finally:
        for s in socks:
            s.close()
        live.stop()


def test_trickled_headers_do_not_extend_the_deadline():
    live = start_server(connections=ConnectionLimits(header_timeout=1.0))
    try:
        s = socket.create_connection(("127.0.0.1", live.port))
        start = time.monotonic()
        s.settimeout(0.3)
        closed_at = None
        for byte in PARTIAL:  # a slowloris client: one byte every 0.1 s
            try:
                s.sendall(bytes([byte]))
                if s.recv(65536) == b"":
                    closed_at = time.monotonic() - start
                    break
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionError):
                closed_at = time.monotonic() - start
                break
        assert closed_at is not None and closed_at < 1.0 + 2.0
        s.close()
    finally:
        live.stop()


def test_slow_body_is_closed_within_the_body_timeout():
    live = start_server(connections=ConnectionLimits(body_timeout=1.0))
    try:
        with socket.create_connection(("127.0.0.1", live.port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
            start = time.monotonic()
            while s.recv(65536):
                pass
            assert time.monotonic() - start < 1.0 + 3.0
        assert live.healthy()
    finally:
        live.stop()


def test_over_the_cap_is_503_with_retry_after():
    live = start_server(connections=ConnectionLimits(max_connections=4))
    idle = [socket.create_connection(("127.0.0.1", live.port)) for _ in range(4)]
    try:
        time.sleep(0.3)  # let the server accept them
        r = httpx.get(live.url + "/health", timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        err = r.json()["error"]
        assert err["code"] == "service_unavailable" and "--limit-concurrency" in err["message"]
        for s in idle:
            s.close()
        deadline = time.monotonic() + 10
        while httpx.get(live.url + "/health", timeout=10).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        for s in idle:
            s.close()
        live.stop()


def test_accept_errors_are_logged_once_per_interval(caplog):
    loop = asyncio.new_event_loop()
    try:
        quiet_accept_errors(loop, every_s=60)
        caplog.set_level(logging.DEBUG)
        for _ in range(1000):
            loop.call_exception_handler({"message": ACCEPT_ERROR,
                                         "exception": OSError(24, "Too many open files")})
        mine = [r for r in caplog.records if ACCEPT_ERROR in r.getMessage()
                or "cannot accept" in r.getMessage()]
        assert len(mine) == 1 and mine[0].exc_info is None
        loop.call_exception_handler({"message": "something else"})  # still logged as before
        assert any(r.getMessage() == "something else" for r in caplog.records)
    finally:
        loop.close()


def test_out_of_descriptors_logs_one_line_not_a_flood(caplog):
    """With the process's descriptors used up, the server's accept keeps failing; that is logged
    once, without a traceback (asyncio alone logged about 2,400 records a second)."""
    live = start_server()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    clients = []
    try:
        caplog.set_level(logging.INFO)
        in_use = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + 40, hard))
        try:
            while True:  # clients take every descriptor left; the server cannot accept them
                clients.append(socket.create_connection(("127.0.0.1", live.port), timeout=1))
        except OSError:
            pass
        time.sleep(1.3)  # asyncio retries the accept every second: two failures at least
    finally:
        for s in clients:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        floods = [r for r in caplog.records if ACCEPT_ERROR in r.getMessage()
                  or "cannot accept" in r.getMessage()]
        assert len(floods) == 1, [(r.name, r.getMessage()) for r in floods]
        assert floods[0].name == "reclaim.server" and floods[0].exc_info is None
        assert live.healthy()
    finally:
        live.stop()


def test_malformed_request_flood_logs_one_line(server, uvicorn_log):
    for _ in range(50):
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
            reply = b""
            while chunk := s.recv(65536):
                reply += chunk
            assert reply.startswith(b"HTTP/1.1 400") and b'"error"' in reply
    warnings = [r for r in uvicorn_log.records if "Invalid HTTP request" in r.getMessage()]
    assert len(warnings) <= 1, len(warnings)  # one per 10 s (none if one went out just before)


def test_idle_connection_closes_silently_a_partial_request_gets_408():
    live = start_server(connections=ConnectionLimits(header_timeout=0.5, keep_alive=30))
    try:
        with socket.create_connection(("127.0.0.1", live.port), timeout=10) as idle, \
                socket.create_connection(("127.0.0.1", live.port), timeout=10) as partial:
            partial.sendall(PARTIAL)
            assert idle.recv(65536) == b""  # nothing a pooled client could mistake for a reply
            reply = b""  # to the server's close: the head and body may arrive in separate segments
            while chunk := partial.recv(65536):
                reply += chunk
            assert reply.startswith(b"HTTP/1.1 408")
            assert json.loads(reply.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"
    finally:
        live.stop()
