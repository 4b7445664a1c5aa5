"""`reclaim serve --learn`: a response recorded at prefill, feedback logged before it is
acknowledged, a training step between engine steps that reuses the record, the weights version
moving on; and the errors: unknown response (404), bad rating (400), learning off (400)."""

from __future__ import annotations

import re
import time

import httpx

from live_server import start_server
from reclaim.online.trainer import OnlineTrainConfig


def _wait(cond, timeout=60.0):
    t = time.monotonic()
    while not cond():
        assert time.monotonic() - t < timeout, "timed out"
        time.sleep(0.05)


def test_feedback_trains_the_served_model_between_steps(tmp_path):
    cfg = OnlineTrainConfig(output_dir=str(tmp_path / "online"), per_device_train_batch_size=1,
                            learning_rate=1e-3, record="requested", cost_model="reuse", save_steps=1)
    live = start_server(learn=cfg)
    try:
        with httpx.Client(base_url=live.url, timeout=60) as http:
            r = http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "What is the secret word?"}], "max_tokens": 6,
                "temperature": 0.0, "retain_for_training": True})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["weights_version"] == 0
            assert live.stats()["num_recorded"] == 1
            rid = body["id"]
            fb = http.post("/v1/feedback", json={"response_id": rid, "rating": 1, "correction": "banana"})
            assert fb.status_code == 200 and fb.json()["status"] == "accepted", fb.text
            again = http.post("/v1/feedback", json={"response_id": rid, "rating": 1, "correction": "banana"})
            assert again.json()["id"] == fb.json()["id"]  # idempotent
            _wait(lambda: live.runner.engine.weights_version == 1)
            metrics = http.get("/metrics").text
            assert re.search(r'^reclaim_online\{name="train_steps"\} 1$', metrics, re.M), metrics
            assert re.search(r'^reclaim_online\{name="train_reuse"\} 1$', metrics, re.M), metrics
            after = http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "What is the secret word?"}], "max_tokens": 6,
                "temperature": 0.0}).json()
            assert after["weights_version"] == 1
            bad = [http.post("/v1/feedback", json={"response_id": "chatcmpl-nope", "rating": 1}),
                   http.post("/v1/feedback", json={"response_id": rid, "rating": 5}),
                   http.post("/v1/feedback", json={"response_id": rid, "rating": "1"})]
            assert [b.status_code for b in bad] == [404, 400, 400]
            assert all(b.json()["error"]["message"] for b in bad)
    finally:
        live.stop()


def test_learning_off_refuses_feedback_and_retain(http):
    r = http.post("/v1/feedback", json={"response_id": "x", "rating": 1})
    assert r.status_code == 400 and "--learn" in r.json()["error"]["message"]
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "retain_for_training": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "retain_for_training"
