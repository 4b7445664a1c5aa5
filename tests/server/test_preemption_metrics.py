"""Preemptions (a sequence's blocks freed when the KV cache runs out, recomputed later) show on
/metrics, and the preempted requests still complete."""

from __future__ import annotations

import re

import httpx

from live_server import start_server


def test_preemptions_are_on_metrics():
    live = start_server(num_blocks=4, max_num_seqs=3, max_model_len=64)  # 64 cached tokens for 3 x ~30
    try:
        body = {"prompt": "Hello, world!", "max_tokens": 24, "temperature": 0.0,
                "ignore_eos": True}
        with httpx.Client(base_url=live.url, timeout=120) as http:
            alone = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
            # three prompts in one request reach the engine together (three concurrent requests
            # could be served one after another on a loaded machine, and never preempt)
            reply = http.post("/v1/completions", json={**body, "prompt": [body["prompt"]] * 3}).json()
            assert [c["text"] for c in reply["choices"]] == [alone] * 3
            metrics = http.get("/metrics").text
        m = re.search(r"^reclaim_num_preemptions_total (\S+)$", metrics, re.M)
        assert m is not None, metrics
        assert float(m.group(1)) == live.stats()["num_preemptions"] > 0
    finally:
        live.stop()
