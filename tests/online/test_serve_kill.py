"""kill -9 of a real `reclaim serve --learn` process while it trains, then a restart on the same
run directory: no acknowledged feedback is lost and each is trained exactly once (the feedback
log's marks and the train log's lines agree, steps numbered without a gap or a repeat)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))

from live_server import make_model, make_tokenizer  # noqa: E402
from test_sigterm import free_port, wait_healthy  # noqa: E402

from reclaim.checkpoints import CHECKPOINT_PREFIX, checkpoints  # noqa: E402
from reclaim.models.loading import save_model  # noqa: E402
from reclaim.online.feedback import FeedbackLog  # noqa: E402

CONFIG = """output_dir: {out}
per_device_train_batch_size: 1
learning_rate: 1.0e-3
save_steps: 3
save_total_limit: 2
record: all
cost_model: reuse
"""


def start(model_dir: Path, config: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "reclaim.cli", "serve", str(model_dir), "--port", str(port),
         "--max-model-len", "256", "--num-blocks", "128", "--learn", "--config", str(config),
         "--log-level", "warning", "--disable-access-log"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc)
    return proc, url


def online_metric(metrics: str, name: str) -> float:
    m = re.search(rf'^reclaim_online\{{name="{name}"\}} (\S+)$', metrics, re.M)
    return float(m.group(1)) if m else 0.0


def serve_and_correct(http: httpx.Client, n: int, acked: dict[int, str]) -> list[str]:
    """n chat requests; feedback with a correction on each (acknowledged ids into `acked`)."""
    ids = []
    for i in range(n):
        r = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": f"Question number {i}?"}], "max_tokens": 4,
            "temperature": 0.0})
        assert r.status_code == 200, r.text
        ids.append(r.json()["id"])
    for i, rid in enumerate(ids):
        fb = http.post("/v1/feedback", json={"response_id": rid, "rating": 1,
                                             "correction": f"The answer is {i}."})
        assert fb.status_code == 200, fb.text
        acked[fb.json()["id"]] = rid
    return ids


@pytest.mark.slow
def test_kill_9_while_training_loses_no_feedback_and_trains_each_once(tmp_path):
    tokenizer = make_tokenizer()
    model_dir = save_model(make_model(tokenizer), tokenizer, tmp_path / "tiny")
    out = tmp_path / "online"
    config = tmp_path / "online.yaml"
    config.write_text(CONFIG.format(out=out))
    acked: dict[int, str] = {}

    proc, url = start(model_dir, config)
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            serve_and_correct(http, 24, acked)
            deadline = time.monotonic() + 60
            while True:  # kill past the checkpoint at step 3, with feedback still to train
                text = http.get("/metrics").text
                version, pending = online_metric(text, "version"), online_metric(text, "pending_feedback")
                if version >= 4:
                    break
                assert time.monotonic() < deadline, "no training happened"
                time.sleep(0.005)
            os.kill(proc.pid, signal.SIGKILL)
            assert pending > 0, "training finished before the kill: nothing was interrupted"
            proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    log = FeedbackLog(out / "feedback.db")
    assert {f.id: f.response_id for f in log.all()} == acked  # everything acknowledged is there
    last = int(checkpoints(out)[-1].name.removeprefix(CHECKPOINT_PREFIX))
    assert last >= 3 and last % 3 == 0
    # what the restart must (re)train: pending feedback and feedback of steps past the checkpoint
    redo = [f.id for f in log.all() if f.trained_at_step is None or f.trained_at_step > last]
    assert redo
    log.close()

    proc, url = start(model_dir, config)  # resumes from the last checkpoint, reopens later steps
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            serve_and_correct(http, 4, acked)  # serving and learning go on after the restart
            deadline = time.monotonic() + 120
            while online_metric(http.get("/metrics").text, "pending_feedback") > 0:
                assert time.monotonic() < deadline, "feedback left untrained"
                time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)

    lines = [json.loads(ln) for ln in (out / "train_log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in lines] == list(range(1, len(lines) + 1))  # no step lost or repeated
    trained = [fid for e in lines for fid in e["feedback_ids"]]
    assert sorted(trained) == sorted(acked)  # each acknowledged feedback exactly once
    log = FeedbackLog(out / "feedback.db")
    assert {f.id: f.response_id for f in log.all()} == acked
    assert log.pending() == []
    assert {f.id: f.trained_at_step for f in log.all()} == {
        fid: e["step"] for e in lines for fid in e["feedback_ids"]}
    assert all(log.get(fid).trained_at_step > last for fid in redo)  # retrained after the restart
    log.close()
