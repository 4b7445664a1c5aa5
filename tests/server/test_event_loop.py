"""Nothing CPU-heavy runs on the event loop: while eight 3.9 MiB bodies are received, validated
and rejected, /health keeps answering. On a quiet machine its worst latency is well under
100 ms; the bound here leaves room for a loaded 2-core CI machine. Before the prep threads and
the prefix check, each body froze the loop for seconds of tokenizing."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from live_server import start_server
from reclaim.models.tokenizer import encode_chat
from reclaim.server.errors import APIError
from reclaim.server.plan import Limits, plan_chat, plan_completion
from reclaim.server.schemas import ChatCompletionRequest, CompletionRequest

BIG = int(3.9 * (1 << 20))  # 3.9 MiB, under the default 4 MiB body limit
HEALTH_BOUND_S = 0.5


@pytest.fixture(scope="module")
def big_server():
    live = start_server(max_body_bytes=4 << 20)
    yield live
    live.stop()


def big_bodies() -> list[tuple[str, bytes]]:
    text = ("Hello, world! The quick brown fox. " * (BIG // 35))[:BIG - 200]
    chat = json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 4})
    completion = json.dumps({"prompt": text, "max_tokens": 4})
    return [("/v1/chat/completions", chat.encode()), ("/v1/completions", completion.encode())] * 4


def test_health_answers_while_eight_huge_bodies_are_rejected(big_server):
    bodies = big_bodies()
    assert all(3.8 * (1 << 20) < len(b) < 4 << 20 for _, b in bodies)
    statuses: list[int] = []

    def post(route: str, body: bytes) -> None:
        r = httpx.post(big_server.url + route, content=body, timeout=120,
                       headers={"Content-Type": "application/json"})
        statuses.append(r.status_code)

    posters = [threading.Thread(target=post, args=rb) for rb in bodies]
    latencies = []
    with httpx.Client(base_url=big_server.url, timeout=30) as http:
        http.get("/health")  # connection warm: measure the server, not the TCP handshake
        for t in posters:
            t.start()
        while any(t.is_alive() for t in posters):
            t0 = time.perf_counter()
            assert http.get("/health").status_code == 200
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.005)
    for t in posters:
        t.join()
    assert statuses == [400] * 8  # each prompt is far longer than the context
    assert latencies and max(latencies) < HEALTH_BOUND_S, \
        f"worst /health {max(latencies) * 1000:.0f} ms over {len(latencies)} probes"


def test_huge_prompt_is_refused_from_its_prefix(big_server):
    r = httpx.post(big_server.url + "/v1/completions", json={"prompt": "fox " * 1_000_000},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "in its first" in r.json()["error"]["message"]  # judged without tokenizing it all


TEXTS = ["Hello, world! The quick brown fox. ", "a", "aaaa bb ", "東京 café 🙂", "\n\n", "x9 ",
         "{}[]()<>=+-*/"]


@pytest.mark.parametrize("unit", TEXTS)
def test_prefix_check_agrees_with_tokenizing_everything(big_server, unit):
    """The shortcut refuses only prompts that full tokenizing refuses too, even when the
    vocabulary's longest token is understated (a small span makes the shortcut fire often)."""
    tok = big_server.tokenizer
    limits = Limits(model_names=("m",), max_model_len=64, vocab_size=len(tok), max_token_chars=1)
    for repeat in range(1, 300, 11):
        text = unit * repeat
        chat = [{"role": "system", "content": text[: len(text) // 3]},
                {"role": "user", "content": text}]
        for req, planner, prompt_len in (
                (CompletionRequest(prompt=text, max_tokens=1), plan_completion, len(tok.encode(text))),
                (ChatCompletionRequest(messages=chat, max_tokens=1), plan_chat,
                 len(encode_chat(tok, chat)))):
            try:
                planner(req, tok, limits)
                planned = True
            except APIError as exc:
                assert exc.code == "context_length_exceeded", exc.message
                planned = False
            assert planned == (prompt_len < limits.max_model_len), (planner.__name__, unit, repeat)
