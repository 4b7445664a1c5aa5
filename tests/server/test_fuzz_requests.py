"""Hypothesis-generated bodies and headers: never a 5xx, always a well-formed answer, never a dead server."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROUTES = ["/v1/chat/completions", "/v1/completions"]
FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

json_scalar = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
any_json = st.recursive(json_scalar, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "bot"]) | any_json},
    optional={"content": st.text(max_size=60) | any_json, "name": st.text(max_size=8)})
# Each key: a plausible value most of the time, anything at all otherwise.
FIELDS = {
    "model": st.sampled_from(["tiny-llama", "other"]),
    "messages": st.lists(message, max_size=3),
    "prompt": st.text(max_size=60) | st.lists(st.integers(-5, 400), max_size=20)
    | st.lists(st.text(max_size=10), max_size=3),
    "max_tokens": st.integers(-2, 12),
    "max_completion_tokens": st.integers(-2, 12),
    "n": st.integers(-1, 5),
    "temperature": st.floats(-1, 3, allow_nan=False),
    "top_p": st.floats(-0.5, 1.5, allow_nan=False),
    "top_k": st.integers(-3, 50),
    "min_p": st.floats(-0.5, 1.5, allow_nan=False),
    "seed": st.integers(-(2**65), 2**65),
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "logprobs": st.booleans() | st.integers(-1, 25),
    "top_logprobs": st.integers(-1, 25),
    "stop_token_ids": st.lists(st.integers(-5, 400), max_size=3),
    "ignore_eos": st.booleans(),
    "presence_penalty": st.floats(-2, 2, allow_nan=False),
}
# Values a well-behaved client sends: most of these requests should be served (200).
VALID = {
    "model": st.just("tiny-llama"),
    "max_tokens": st.integers(1, 8),
    "n": st.integers(1, 3),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 0.5),
    "seed": st.integers(0, 2**63 - 1),
    "stop": st.text(min_size=1, max_size=3),
    "stream": st.booleans(),
    "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(st.integers(0, 300), max_size=3),
}
plausible = st.fixed_dictionaries(
    {"messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]),
                                                 "content": st.text(max_size=60)}),
                          min_size=1, max_size=3),
     "prompt": st.text(min_size=1, max_size=60)},
    optional=VALID)
anything = st.fixed_dictionaries({}, optional={k: v | any_json for k, v in FIELDS.items()})
# Bound the work a valid request asks for, so the fuzz run stays quick.
body_dicts = (plausible | anything).map(lambda d: {"max_tokens": 4, **d})
header_text = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=30).map(str.strip)
headers = st.dictionaries(
    st.sampled_from(["Content-Type", "Authorization", "Accept", "X-Request-Id", "Accept-Encoding",
                     "Cookie", "X-Api-Key"]), header_text, max_size=4)


def check(r: httpx.Response) -> None:
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    elif r.headers["content-type"].startswith("text/event-stream"):
        frames = [f for f in r.text.split("\n\n") if f]
        assert frames[-1] == "data: [DONE]"
        for f in frames[:-1]:
            assert "error" not in json.loads(f.removeprefix("data: "))
    else:
        body = r.json()
        assert body["id"] and body["choices"] and "weights_version" in body


@FUZZ
@given(route=st.sampled_from(ROUTES), body=body_dicts, extra=headers)
def test_fuzzed_json_bodies(http, route, body, extra):
    other = "prompt" if route == ROUTES[0] else "messages"  # the other route's key: a 400 of its own
    body = {k: v for k, v in body.items() if k != other}
    check(http.post(route, content=json.dumps(body).encode(), headers=extra))


@FUZZ
@given(route=st.sampled_from(ROUTES), raw=st.binary(max_size=200) | any_json.map(
    lambda v: json.dumps(v).encode()))
def test_fuzzed_raw_bytes(http, route, raw):
    check(http.post(route, content=raw))


@pytest.fixture(scope="module", autouse=True)
def alive_afterwards(server):
    yield
    assert server.healthy()
    assert server.wait_idle()["kv_blocks_used"] == 0
