"""`reclaim serve --tensor-parallel-size 2` under torchrun (gloo, two CPU ranks): rank 0 serves
HTTP, rank 1 runs its half of every forward; the openai client gets the same greedy answers as
from a one-process server over the same weights, and a SIGTERM to rank 0 drains it and
ends both ranks (torchrun exits 0)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import openai
import pytest

from live_server import MODEL_NAME, make_model, make_tokenizer
from test_sigterm import free_port, wait_healthy

from reclaim.engine.config import EngineConfig
from reclaim.models.loading import load_model, save_model
from reclaim.server.serve import BackgroundServer, build_app


def _answers(url: str) -> list[str]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hello, world!"}],
                                          temperature=0, max_tokens=12)
    text = client.completions.create(model=MODEL_NAME, prompt="The quick brown", temperature=0, max_tokens=12)
    stream = client.completions.create(model=MODEL_NAME, prompt="Numbers: 0 1 2", temperature=0, max_tokens=8,
                                       stream=True, extra_body={"ignore_eos": True})
    return [chat.choices[0].message.content, text.choices[0].text, "".join(c.choices[0].text for c in stream)]


def _rank0(torchrun_pid: int) -> int:
    """The pid of torchrun's worker with RANK=0 (the one serving HTTP)."""
    children = open(f"/proc/{torchrun_pid}/task/{torchrun_pid}/children").read().split()
    return next(int(pid) for pid in children
                if b"RANK=0" in open(f"/proc/{pid}/environ", "rb").read().split(b"\0"))


@pytest.mark.launches
def test_tp2_server_answers_the_openai_client_as_one_process(tmp_path):
    tokenizer = make_tokenizer()
    model_dir = save_model(make_model(tokenizer), tokenizer, tmp_path / "tiny")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "reclaim.cli",
         "serve", str(model_dir), "--served-model-name", MODEL_NAME, "--port", str(port),
         "--tensor-parallel-size", "2", "--num-blocks", "64", "--shutdown-timeout", "2", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        wait_healthy(url, proc)
        got = _answers(url)
        os.kill(_rank0(proc.pid), signal.SIGTERM)  # the leader drains, then lets rank 1 go
        assert proc.wait(60) == 0, proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    weights, tok = load_model(model_dir)
    one = BackgroundServer(build_app(weights, tok, (MODEL_NAME,), EngineConfig(num_blocks=64))[0])
    try:
        assert got == _answers(one.url) and all(got)
    finally:
        one.stop()
