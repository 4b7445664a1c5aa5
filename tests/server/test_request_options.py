"""Options that change what is generated or reported reach the engine (nothing accepted and
ignored): penalties and logit_bias against a reference loop, min_tokens, truncate_prompt_tokens,
chat_template_kwargs, usage in streams, the side routes and the access log."""

from __future__ import annotations

import json
import logging

import openai
import pytest
import torch

from live_server import MODEL_NAME, start_server

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@torch.no_grad()
def reference(model, prompt: list[int], n: int, presence=0.0, frequency=0.0, repetition=1.0,
              bias: dict[int, float] | None = None) -> list[int]:
    """Greedy decoding by full forwards with OpenAI's penalties (over output tokens), HF's
    repetition penalty (over prompt and output) and logit_bias, in a plain loop."""
    ids, out = list(prompt), []
    for _ in range(n):
        logits = model(torch.tensor([ids])).logits[0, -1].double()
        for t, b in (bias or {}).items():
            logits[t] += b
        if repetition != 1.0:
            seen = torch.tensor(sorted(set(ids)))
            x = logits[seen]
            logits[seen] = torch.where(x > 0, x / repetition, x * repetition)
        for t in set(out):
            logits[t] -= frequency * out.count(t) + presence
        out.append(int(logits.argmax()))
        ids.append(out[-1])
    return out


@pytest.mark.parametrize("options,ref", [
    ({"presence_penalty": 1.5}, {"presence": 1.5}),
    ({"frequency_penalty": 1.0, "presence_penalty": -0.5}, {"frequency": 1.0, "presence": -0.5}),
    ({"repetition_penalty": 1.8}, {"repetition": 1.8}),
])
def test_penalties_match_a_reference_loop(server, http, options, ref):
    prompt = server.tokenizer.encode("Numbers: 0 1 2 3")  # plain greedy repeats a token here
    want = reference(server.model, prompt, 16, **ref)
    assert want != reference(server.model, prompt, 16)  # the option matters for this prompt
    r = http.post(COMPLETIONS, json={"prompt": prompt, "max_tokens": 16, **GREEDY, **options})
    assert r.json()["choices"][0]["text"] == server.tokenizer.decode(want, skip_special_tokens=True)


def test_logit_bias_reaches_the_sampler(server, http):
    prompt = server.tokenizer.encode("Hello")
    target = server.tokenizer.encode(" fox")[0]
    want = reference(server.model, prompt, 6, bias={target: 100.0})
    assert want == [target] * 6
    r = http.post(CHAT, json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6,
                              "logit_bias": {str(target): 100}, **GREEDY})
    assert r.json()["choices"][0]["message"]["content"] == server.tokenizer.decode([target] * 6)


def test_min_tokens_holds_back_stop_tokens(server, http):
    prompt = server.tokenizer.encode("Hello, world!")
    base = {"prompt": prompt, "max_tokens": 12, **GREEDY}
    stop = {"stop_token_ids": reference(server.model, prompt, 3)[2:]}  # greedy's third token
    early = http.post(COMPLETIONS, json={**base, **stop}).json()
    assert early["usage"]["completion_tokens"] <= 3
    held = http.post(COMPLETIONS, json={**base, **stop, "min_tokens": 8}).json()
    assert held["usage"]["completion_tokens"] >= 8


def test_truncate_prompt_tokens_keeps_the_last_ones(server, http):
    ids = server.tokenizer.encode("Serving language models means batching requests")
    body = {"max_tokens": 6, **GREEDY}
    cut = http.post(COMPLETIONS, json={"prompt": ids, "truncate_prompt_tokens": 5, **body}).json()
    tail = http.post(COMPLETIONS, json={"prompt": ids[-5:], **body}).json()
    assert cut["usage"]["prompt_tokens"] == 5
    assert cut["choices"][0]["text"] == tail["choices"][0]["text"]
    too_long = http.post(COMPLETIONS, json={"prompt": [5] * 400, "truncate_prompt_tokens": 100,
                                            "max_tokens": 2})
    assert too_long.status_code == 200 and too_long.json()["usage"]["prompt_tokens"] == 100


def test_chat_template_kwargs_reach_the_template(http):
    template = "{{ note }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": template,
            "chat_template_kwargs": {"note": "NOTE"}}
    ids = http.post("/tokenize", json=body).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == "NOTE[hi]"
    r = http.post(CHAT, json={**body, "max_tokens": 1})
    assert r.json()["usage"]["prompt_tokens"] == len(ids)


def stream_frames(http, route, body) -> list[dict]:
    with http.stream("POST", route, json={**body, "stream": True}) as r:
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_continuous_usage_stats(http):
    frames = stream_frames(http, COMPLETIONS, {
        "prompt": "Hello", "max_tokens": 5, **GREEDY,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert all(f["usage"] is not None for f in frames)
    counts = [f["usage"]["completion_tokens"] for f in frames]
    assert counts == sorted(counts) and counts[-1] == 5
    assert frames[-1]["choices"] == []


def test_force_include_usage_and_access_log_off(caplog):
    live = start_server(force_include_usage=True, access_log=False)
    try:
        import httpx
        with httpx.Client(base_url=live.url, timeout=30) as http, \
                caplog.at_level(logging.INFO, logger="reclaim.access"):
            frames = stream_frames(http, CHAT, {"messages": [{"role": "user", "content": "x"}],
                                                "max_tokens": 3, **GREEDY})
            assert frames[-1]["choices"] == [] and frames[-1]["usage"]["completion_tokens"] == 3
            assert not [r for r in caplog.records if r.name == "reclaim.access"]
    finally:
        live.stop()


def test_access_log_line_per_request(http, caplog):
    with caplog.at_level(logging.INFO, logger="reclaim.access"):
        r = http.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 2})
        http.get("/v1/models/nope")
    lines = [r.getMessage() for r in caplog.records if r.name == "reclaim.access"]
    assert len(lines) == 2
    assert '"POST /v1/completions" 200 ' in lines[0] and lines[0].endswith(r.json()["id"])
    assert "ms" in lines[0] and '"GET /v1/models/nope" 404 ' in lines[1]


def test_side_routes(server, http):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-9")
    assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"
    tok = server.tokenizer
    r = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": "Hello world",
                                     "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode("Hello world") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 256 and r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {
        "prompt": "Hello world"}
    bad = http.post("/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert isinstance(http.get("/version").json()["version"], str)
