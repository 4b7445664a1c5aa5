"""Preemptions (a sequence's blocks freed when the KV cache runs out, recomputed later) show on
/metrics, and the preempted requests still complete."""

from __future__ import annotations

import concurrent.futures as cf
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
            with cf.ThreadPoolExecutor(3) as pool:
                replies = list(pool.map(lambda _: http.post("/v1/completions", json=body),
                                        range(3)))
            assert [r.json()["choices"][0]["text"] for r in replies] == [alone] * 3
            metrics = http.get("/metrics").text
        m = re.search(r"^reclaim_num_preemptions_total (\S+)$", metrics, re.M)
        assert m is not None, metrics
        assert float(m.group(1)) == live.stats()["num_preemptions"] > 0
    finally:
        live.stop()
