"""`reclaim serve` as a process: SIGTERM lets in-flight streams finish, admits nothing new, exits 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

from live_server import make_model, make_tokenizer
from reclaim.models.loading import save_model


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


def test_sigterm_drains_and_exits_zero(tmp_path):
    tokenizer = make_tokenizer()
    model_dir = save_model(make_model(tokenizer), tokenizer, tmp_path / "tiny")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "reclaim.cli", "serve", str(model_dir), "--port", str(port),
         "--max-num-seqs", "4", "--num-blocks", "64", "--max-model-len", "256",
         "--shutdown-timeout", "20", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        wait_healthy(url, proc)
        first_event, frames = threading.Event(), []

        def stream() -> None:
            body = {"prompt": "Hello", "max_tokens": 120, "temperature": 0.0, "stream": True,
                    "ignore_eos": True}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        frames.append(line)
                        first_event.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first_event.wait(30)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        try:  # admits nothing new: the port is closed, or the gate answers 503
            late = httpx.post(url + "/v1/completions", json={"prompt": "a"}, timeout=5)
            assert late.status_code == 503
        except httpx.TransportError:
            pass
        reader.join(60)
        assert proc.wait(60) == 0, proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # The in-flight stream ran to completion rather than being cut off.
    assert frames[-1] == "data: [DONE]"
    chunks = [json.loads(f.removeprefix("data: ")) for f in frames[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(len(c["choices"][0]["text"]) > 0 for c in chunks) > 0


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
