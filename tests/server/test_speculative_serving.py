"""`reclaim serve --speculative`: responses (whole and streamed) equal a plain server's, and
/metrics reports the drafts, accepted tokens, acceptance rate and mean accepted length."""

from __future__ import annotations

import json
import re

import httpx

from live_server import start_server
from reclaim.engine.speculative import SpeculativeConfig

PROMPTS = ["one two three one two three one two", "Hello, world! Hello, world!", "abc abc abc abc"]


def _texts(url: str, stream: bool = False) -> list[str]:
    out = []
    with httpx.Client(base_url=url, timeout=120) as http:
        for p in PROMPTS:
            body = {"prompt": p, "max_tokens": 20, "temperature": 0.0, "ignore_eos": True, "stream": stream}
            r = http.post("/v1/completions", json=body)
            if not stream:
                out.append(r.json()["choices"][0]["text"])
                continue
            parts = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            out.append("".join(c["choices"][0]["text"] for c in parts if c["choices"]))
    return out


def test_speculative_server_answers_as_plain_and_reports_acceptance():
    plain = start_server()
    try:
        want = _texts(plain.url)
    finally:
        plain.stop()
    # fixed depth: every decode drafts, so the acceptance metrics have something to count
    fast = start_server(speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4, max_batch=4,
                                                      dynamic_depth=False))
    try:
        assert _texts(fast.url) == want
        assert _texts(fast.url, stream=True) == want
        metrics = httpx.get(f"{fast.url}/metrics", timeout=30).text
    finally:
        fast.stop()

    def value(name):
        m = re.search(rf"^{name} (\S+)$", metrics, re.M)
        assert m is not None, name
        return float(m.group(1))

    verifies, drafted = value("reclaim_spec_decode_num_verifies_total"), value("reclaim_spec_decode_num_draft_tokens_total")
    accepted = value("reclaim_spec_decode_num_accepted_tokens_total")
    assert verifies > 0 and 0 < accepted <= drafted
    assert abs(value("reclaim_spec_decode_mean_accepted_length") - (accepted + verifies) / verifies) < 1e-6
    assert abs(value("reclaim_spec_decode_acceptance_rate") - accepted / drafted) < 1e-6
    assert "# TYPE reclaim_spec_decode_num_plain_decodes_total counter" in metrics
    assert value("reclaim_spec_decode_num_plain_decodes_total") == int(value("reclaim_spec_decode_num_plain_decodes_total"))
