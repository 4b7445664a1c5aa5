"""With an API key, every route but /health needs `Authorization: Bearer KEY`."""

from __future__ import annotations

import httpx
import openai
import pytest

from live_server import MODEL_NAME, start_server

KEY = "sk-test-123"
GUARDED = [("GET", "/v1/models", None), ("GET", "/metrics", None),
           ("POST", "/v1/completions", {"prompt": "a", "max_tokens": 2}),
           ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                                             "max_tokens": 2})]


@pytest.fixture(scope="module")
def keyed():
    live = start_server(api_key=KEY)
    yield live
    live.stop()


@pytest.mark.parametrize("method,path,body", GUARDED)
def test_routes_need_the_key(keyed, method, path, body):
    with httpx.Client(base_url=keyed.url, timeout=30) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                        {"Authorization": f"Basic {KEY}"}):
            r = http.request(method, path, json=body, headers=headers)
            assert r.status_code == 401, (headers, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
        r = http.request(method, path, json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200, r.text


def test_health_is_open(keyed):
    assert keyed.healthy()


def test_openai_client_with_and_without_key(keyed):
    good = openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEY, max_retries=0)
    r = good.completions.create(model=MODEL_NAME, prompt="a", max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")
    bad = openai.OpenAI(base_url=keyed.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL_NAME, prompt="a", max_tokens=2)


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_bearer_scheme_is_case_insensitive(keyed, scheme):
    r = httpx.get(keyed.url + "/v1/models", headers={"Authorization": f"{scheme} {KEY}"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("value,status", [(f"Bearer  {KEY}", 200), (f"Bearer {KEY}x", 401),
                                          (f"Bearer{KEY}", 401), ("Bearer", 401),
                                          (f"Token {KEY}", 401), (f"Bearer {KEY[:-1]}", 401)])
def test_only_the_key_passes(keyed, value, status):
    r = httpx.get(keyed.url + "/v1/models", headers={"Authorization": value})
    assert r.status_code == status, value
