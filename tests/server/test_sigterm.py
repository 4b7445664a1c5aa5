"""`reclaim serve` as a process: SIGTERM lets in-flight streams finish, admits nothing new, ends
what is still running at the end of the grace period cleanly (finish_reason 'abort', [DONE], no
traceback) and exits 0."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from live_server import make_model, make_tokenizer
from reclaim.models.loading import save_model
from reclaim.server.connections import ConnectionLimits
from reclaim.engine.config import EngineConfig
from reclaim.server.serve import DrainingServer, build_app, uvicorn_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError("server did not come up")


class StreamReader(threading.Thread):
    """Reads one SSE completion stream into `frames`; `error` is set if the server cut it."""

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.frames: list[str] = []
        self.started = threading.Event()
        self.error: Exception | None = None

    def run(self) -> None:
        body = {"prompt": "Hello", "max_tokens": self.max_tokens, "temperature": 0.0,
                "stream": True, "ignore_eos": True}
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        self.frames.append(line)
                        self.started.set()
        except httpx.HTTPError as exc:
            self.error = exc


@pytest.mark.launches
def test_sigterm_drains_and_exits_zero(tmp_path):
    tokenizer = make_tokenizer()
    model_dir = save_model(make_model(tokenizer, max_position_embeddings=4096), tokenizer,
                           tmp_path / "tiny")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "reclaim.cli", "serve", str(model_dir), "--port", str(port),
         "--max-num-seqs", "4", "--num-blocks", "600", "--max-model-len", "4096",
         "--shutdown-timeout", "2", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    # A short stream finishes within the grace period; a long one is cancelled when it ends.
    short, long = StreamReader(url, 40), StreamReader(url, 4000)
    try:
        wait_healthy(url, proc)
        for reader in (short, long):
            reader.start()
            assert reader.started.wait(30)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        try:  # admits nothing new: the port is closed, or the gate answers 503
            late = httpx.post(url + "/v1/completions", json={"prompt": "a"}, timeout=5)
            assert late.status_code == 503
        except httpx.TransportError:
            pass
        assert proc.wait(60) == 0, proc.stdout.read()
        log = proc.stdout.read()
        short.join(10)
        long.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for reader, reason in ((short, "length"), (long, "abort")):  # long: cut at the end of grace
        assert reader.error is None and reader.frames[-1] == "data: [DONE]", reader.error
        chunks = [json.loads(f.removeprefix("data: ")) for f in reader.frames[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == reason
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert "Traceback" not in log and "CancelledError" not in log, log


def test_draining_server_refuses_new_work(server, http):
    server.state.draining = True
    try:
        for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                             ("GET", "/v1/models"), ("GET", "/health")):
            r = http.request(method, path, json={"prompt": "a", "max_tokens": 2})
            assert r.status_code == 503, (path, r.text)
            assert r.json()["error"]["code"] == "service_unavailable"
        assert http.get("/metrics").status_code == 200  # still scrapeable while draining
    finally:
        server.state.draining = False
    assert http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200


def test_stuck_engine_at_shutdown_still_ends_streams_without_traceback(uvicorn_log):
    """If the engine cannot deliver the aborts in time, uvicorn's cancel ends the stream with
    [DONE] and one INFO line instead of a CancelledError traceback."""
    tokenizer = make_tokenizer()
    app, runner, state = build_app(make_model(tokenizer), tokenizer, ("tiny",),
                                   EngineConfig(num_blocks=64, max_model_len=256))
    real_step, stuck = runner.engine.step, threading.Event()

    def step():
        if stuck.is_set():
            time.sleep(1.5)  # a step longer than the time left for shutdown (1.0 s)
        return real_step()

    runner.engine.step = step

    class QuickDrain(DrainingServer):
        END_S = 0.7

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = QuickDrain(uvicorn_config(app, ConnectionLimits(), runner.metrics,
                                       log_level="info"), state, runner, grace=0.3)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    caplog = uvicorn_log
    thread.start()
    reader = StreamReader(url, 200)
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    reader.start()
    assert reader.started.wait(30)
    stuck.set()
    server.handle_exit(signal.SIGTERM, None)
    thread.join(30)
    reader.join(10)
    assert reader.error is None and reader.frames[-1] == "data: [DONE]"
    assert not any(r.exc_info for r in caplog.records), \
        [r.getMessage() for r in caplog.records if r.exc_info]
    assert any("cancelled at shutdown" in r.getMessage() for r in caplog.records)
