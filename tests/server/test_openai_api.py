"""The official `openai` client against a live server: outputs equal plain greedy decoding."""

from __future__ import annotations

import re

import openai
import pytest

from live_server import MODEL_NAME, plain_greedy

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, world!"}]
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat_prompt(server, messages) -> list[int]:
    text = server.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return server.tokenizer.encode(text, add_special_tokens=False)


def visible_text(server, tokens: list[int]) -> str:
    return server.tokenizer.decode(tokens, skip_special_tokens=True)


def test_chat_matches_plain_greedy_with_logprobs(server, client):
    prompt = chat_prompt(server, CHAT)
    tokens, rows = plain_greedy(server.model, prompt, 12)
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=12,
                                       logprobs=True, top_logprobs=3, **GREEDY)
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == visible_text(server, tokens)
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(tokens)
    assert r.id.startswith("chatcmpl-") and r.model_extra["weights_version"] == 0
    content = choice.logprobs.content
    assert len(content) == len(tokens)
    special = set(server.tokenizer.all_special_ids)
    shown = b"".join(bytes(e.bytes) for e, t in zip(content, tokens) if t not in special)
    assert shown.decode("utf-8", "replace") == choice.message.content
    for entry, tok, row in zip(content, tokens, rows):
        assert entry.logprob == pytest.approx(float(row[tok]), abs=1e-4)
        top = row.topk(3).values.tolist()
        assert [e.logprob for e in entry.top_logprobs] == pytest.approx(top, abs=1e-4)


def test_chat_stream_equals_non_stream(server, client):
    kwargs = dict(model=MODEL_NAME, messages=CHAT, max_tokens=10, logprobs=True, top_logprobs=2,
                  **GREEDY)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True,
                                                 stream_options={"include_usage": True}, **kwargs))
    assert len({c.id for c in chunks}) == 1 and chunks[0].id != whole.id
    assert all(c.object == "chat.completion.chunk" and c.model_extra["weights_version"] == 0
               for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    body, usage = chunks[:-1], chunks[-1]
    assert usage.choices == [] and usage.usage.model_dump() == whole.usage.model_dump()
    assert all(c.usage is None for c in body)
    text = "".join(c.choices[0].delta.content or "" for c in body)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason]
    assert finishes == ["length"]
    streamed = [e for c in body if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == \
        [e.model_dump() for e in whole.choices[0].logprobs.content]


def test_completion_token_prompt_logprobs(server, client):
    prompt = server.tokenizer.encode("The quick brown fox")
    tokens, rows = plain_greedy(server.model, prompt, 8)
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, logprobs=2,
                                  **GREEDY)
    choice = r.choices[0]
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert choice.text == visible_text(server, tokens)
    lp = choice.logprobs
    assert lp.token_logprobs == pytest.approx([float(row[t]) for row, t in zip(rows, tokens)],
                                              abs=1e-4)
    assert lp.tokens == [server.tokenizer.decode([t]) for t in tokens]
    for top, row in zip(lp.top_logprobs, rows):
        assert 1 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(float(row.max()), abs=1e-4)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    streamed = list(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8,
                                              stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    assert streamed[-1].choices[0].finish_reason == "length"


def test_batch_prompts_with_n_are_ordered_and_seeded(server, client):
    prompts = ["Hello, world!", "Numbers: 1 2 3"]
    r = client.completions.create(model=MODEL_NAME, prompt=prompts, n=2, max_tokens=6, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:  # choices are prompt-major: index // n is the prompt
        ids = server.tokenizer.encode(prompts[c.index // 2])
        assert c.text == visible_text(server, plain_greedy(server.model, ids, 6)[0])
    assert r.usage.prompt_tokens == sum(len(server.tokenizer.encode(p)) for p in prompts)
    assert r.usage.completion_tokens == 4 * 6

    sampled = dict(model=MODEL_NAME, prompt=prompts[0], n=3, max_tokens=8, temperature=1.0,
                   seed=1234, extra_body={"ignore_eos": True})
    a, b = client.completions.create(**sampled), client.completions.create(**sampled)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # the n choices draw different streams


def test_stop_string_truncates(server, client):
    full = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=16,
                                     **GREEDY).choices[0].text
    stop = full[4:6]
    assert stop
    r = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=16, stop=[stop],
                                  **GREEDY)
    assert r.choices[0].text == full[: full.find(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_top_k_as_extra_body_key(server, client):
    greedy = client.completions.create(model=MODEL_NAME, prompt="Serving", max_tokens=10, **GREEDY)
    top1 = client.completions.create(model=MODEL_NAME, prompt="Serving", max_tokens=10,
                                     temperature=1.0, seed=5,
                                     extra_body={"top_k": 1, "ignore_eos": True})
    assert top1.choices[0].text == greedy.choices[0].text


def test_models_health_and_metrics(server, client, http):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert server.healthy()
    before = parse_metrics(http.get("/metrics").text)
    client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=5, **GREEDY)
    text = http.get("/metrics").text
    after = parse_metrics(text)
    assert after["reclaim_generation_tokens_total"] - before["reclaim_generation_tokens_total"] == 5
    assert after["reclaim_time_to_first_token_seconds_count"] == \
        before["reclaim_time_to_first_token_seconds_count"] + 1
    assert after["reclaim_time_per_output_token_seconds_count"] == \
        before["reclaim_time_per_output_token_seconds_count"] + 1
    assert after["reclaim_kv_cache_blocks_total"] == server.stats()["kv_blocks_total"]
    for name in ("reclaim_num_requests_waiting", "reclaim_num_requests_running",
                 "reclaim_kv_cache_blocks_used"):
        assert name in after
    buckets = [float(v) for v in re.findall(
        r'^reclaim_time_to_first_token_seconds_bucket\{le="[^"]+"\} (\S+)$', text, re.M)]
    assert buckets == sorted(buckets)
    assert buckets[-1] == after["reclaim_time_to_first_token_seconds_count"]


SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$')


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format -> {name: value} for unlabelled samples; checks every line's syntax."""
    out = {}
    for line in text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            continue
        m = SAMPLE.match(line)
        assert m, f"not a Prometheus sample line: {line!r}"
        if m.group(2) is None:
            out[m.group(1)] = float(m.group(3))
    return out
