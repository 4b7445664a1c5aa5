"""64 concurrent streaming clients: every stream whole and equal to plain greedy decoding."""

from __future__ import annotations

import asyncio

import openai

from live_server import MODEL_NAME, plain_greedy

CLIENTS, MAX_TOKENS = 64, 12


async def one_stream(client: openai.AsyncOpenAI, i: int) -> list:
    stream = await client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": f"Request {i}: count {i * 7}"}],
        max_tokens=MAX_TOKENS, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    return [chunk async for chunk in stream]


async def many_streams(url: str) -> list[list]:
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                  timeout=120) as client:
        return await asyncio.gather(*(one_stream(client, i) for i in range(CLIENTS)))


def test_concurrent_streams_are_complete_and_correct(server):
    results = asyncio.run(many_streams(server.url))
    ids = set()
    tok = server.tokenizer
    for i, chunks in enumerate(results):
        ids |= {c.id for c in chunks}
        assert len({c.id for c in chunks}) == 1
        assert chunks[0].choices[0].delta.role == "assistant"
        body, last = chunks[:-1], chunks[-1]
        assert [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason] == ["length"]
        assert body[-1].choices[0].finish_reason == "length"
        assert last.choices == [] and last.usage.completion_tokens == MAX_TOKENS
        text = "".join(c.choices[0].delta.content or "" for c in body)
        messages = [{"role": "user", "content": f"Request {i}: count {i * 7}"}]
        prompt = tok.encode(tok.apply_chat_template(messages, tokenize=False,
                                                    add_generation_prompt=True),
                            add_special_tokens=False)
        assert last.usage.prompt_tokens == len(prompt)
        tokens, _ = plain_greedy(server.model, prompt, MAX_TOKENS)
        assert text == tok.decode(tokens, skip_special_tokens=True), f"stream {i}"
    assert len(ids) == CLIENTS
    assert server.healthy()
    stats = server.wait_idle()
    assert stats["kv_blocks_used"] == 0 and stats["running"] == 0 and stats["waiting"] == 0
