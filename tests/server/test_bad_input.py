"""Bad requests get OpenAI-style error JSON with the right 4xx, and the server keeps serving."""

from __future__ import annotations

import concurrent.futures as cf
import json

import httpx
import pytest

from live_server import MODEL_NAME

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]
JSON = {"Content-Type": "application/json"}


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


# (route, raw body, status, param the error should name or None)
CASES = {
    "malformed json": (CHAT, b'{"model": ', 400, None),
    "empty body": (CHAT, b"", 400, None),
    "not an object": (COMPLETIONS, b"[1, 2]", 400, None),
    "deeply nested": (COMPLETIONS, b"[" * 10000 + b"]" * 10000, 400, None),
    "invalid utf-8": (COMPLETIONS, b'{"prompt": "caf\xe9", "max_tokens": 1}', 400, None),
    "lone surrogate": (COMPLETIONS, b'{"prompt": "a\\ud800b", "max_tokens": 1}', 400, None),
    "NaN temperature": (COMPLETIONS, b'{"prompt": "a", "temperature": NaN}', 400, "temperature"),
    "max_tokens as string": (COMPLETIONS, body(prompt="a", max_tokens="5"), 400, "max_tokens"),
    "temperature as string": (CHAT, body(messages=MSG, temperature="hot"), 400, "temperature"),
    "n as float": (CHAT, body(messages=MSG, n=2.0), 400, "n"),
    "stream as string": (CHAT, body(messages=MSG, stream="yes"), 400, "stream"),
    "messages not a list": (CHAT, body(messages="hi"), 400, "messages"),
    "missing messages": (CHAT, body(model=MODEL_NAME), 400, "messages"),
    "empty messages": (CHAT, body(messages=[]), 400, "messages"),
    "bad role": (CHAT, body(messages=[{"role": "wizard", "content": "hi"}]), 400,
                 "messages.0.role"),
    "image part": (CHAT, body(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]), 400, "messages.0.content"),
    "unknown model": (CHAT, body(model="gpt-9", messages=MSG), 404, "model"),
    "max_tokens zero": (CHAT, body(messages=MSG, max_tokens=0), 400, "max_tokens"),
    "max_tokens negative": (CHAT, body(messages=MSG, max_tokens=-3), 400, "max_tokens"),
    "max_tokens over context": (COMPLETIONS, body(prompt="a", max_tokens=10_000), 400,
                                "max_tokens"),
    "max_completion_tokens over": (CHAT, body(messages=MSG, max_completion_tokens=10_000), 400,
                                   "max_completion_tokens"),
    "n over limit": (CHAT, body(messages=MSG, n=5), 400, "n"),
    "n zero": (COMPLETIONS, body(prompt="a", n=0), 400, "n"),
    "token prompt too long": (COMPLETIONS, body(prompt=[5] * 300), 400, "prompt"),
    "chat prompt too long": (CHAT, body(messages=[{"role": "user", "content": "x " * 3000}]),
                             400, "messages"),
    "token id out of vocab": (COMPLETIONS, body(prompt=[5, 10**6]), 400, "prompt"),
    "empty prompt text": (COMPLETIONS, body(prompt=""), 400, "prompt"),
    "empty prompt list": (COMPLETIONS, body(prompt=[]), 400, None),
    "negative temperature": (COMPLETIONS, body(prompt="a", temperature=-1), 400, "temperature"),
    "top_p zero": (COMPLETIONS, body(prompt="a", top_p=0), 400, "top_p"),
    "top_p above one": (CHAT, body(messages=MSG, top_p=1.5), 400, "top_p"),
    "min_p above one": (CHAT, body(messages=MSG, min_p=2.0), 400, "min_p"),
    "logprobs over 20": (COMPLETIONS, body(prompt="a", logprobs=21), 400, "logprobs"),
    "top_logprobs alone": (CHAT, body(messages=MSG, top_logprobs=2), 400, "top_logprobs"),
    "stream_options without stream": (CHAT, body(messages=MSG, stream_options={
        "include_usage": True}), 400, "stream_options"),
    "empty stop string": (COMPLETIONS, body(prompt="a", stop=[""]), 400, None),
    "huge seed": (COMPLETIONS, body(prompt="a", seed=2**70), 400, "seed"),
    "stop token out of vocab": (COMPLETIONS, body(prompt="a", stop_token_ids=[10**6]), 400,
                                "stop_token_ids"),
    "penalty out of range": (CHAT, body(messages=MSG, presence_penalty=2.5), 400,
                             "presence_penalty"),
    "unsupported beam search": (CHAT, body(messages=MSG, use_beam_search=True), 400,
                                "use_beam_search"),
    "tool without function": (CHAT, body(messages=MSG, tools=[{"type": "function"}]), 400,
                              "tools.0.function"),
    "logit_bias key not an id": (CHAT, body(messages=MSG, logit_bias={"x": 1}), 400,
                                 "logit_bias"),
    "logit_bias id out of vocab": (CHAT, body(messages=MSG, logit_bias={"100000": 1}), 400,
                                   "logit_bias"),
    "min_tokens over max_tokens": (COMPLETIONS, body(prompt="a", max_tokens=2, min_tokens=5),
                                   400, "min_tokens"),
    "max_tokens zero without echo": (COMPLETIONS, body(prompt="a", max_tokens=0), 400,
                                     "max_tokens"),
    "two structured outputs": (CHAT, body(messages=MSG, guided_regex="a+",
                                          guided_choice=["a"]), 400, "guided_choice"),
    "bad regex": (CHAT, body(messages=MSG, guided_regex="(a"), 400, "guided_regex"),
    "bad json schema": (CHAT, body(messages=MSG, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}), 400,
        "response_format.json_schema.schema"),
    "json_schema without schema": (CHAT, body(messages=MSG, response_format={
        "type": "json_schema"}), 400, "response_format.json_schema"),
    "unknown response_format type": (CHAT, body(messages=MSG, response_format={
        "type": "yaml"}), 400, "response_format.type"),
    "tool_choice names unknown tool": (CHAT, body(messages=MSG, tools=[
        {"type": "function", "function": {"name": "f"}}], tool_choice={
        "type": "function", "function": {"name": "g"}}), 400, "tool_choice"),
    "tool_choice required without tools": (CHAT, body(messages=MSG, tool_choice="required"),
                                           400, "tool_choice"),
    "template kwargs clash": (CHAT, body(messages=MSG, chat_template_kwargs={"tools": []}),
                              400, "chat_template_kwargs"),
    "bad tool_choice": (CHAT, body(messages=MSG, tool_choice="bogus"), 400, "tool_choice"),
    "audio part": (CHAT, body(messages=[{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "x", "format": "wav"}}]}]), 400,
        "messages.0.content"),
    "body over size limit": (COMPLETIONS, body(prompt="a" * (100 << 10)), 413, None),
    # Upper bounds: nothing a client sends may overflow inside the engine step.
    "top_k 2**63": (CHAT, body(messages=MSG, top_k=2**63), 400, "top_k"),
    "top_k over int32": (COMPLETIONS, body(prompt="a", top_k=2**31), 400, "top_k"),
    "n 2**63": (CHAT, body(messages=MSG, n=2**63), 400, "n"),
    "max_tokens 2**63": (COMPLETIONS, body(prompt="a", max_tokens=2**63), 400, "max_tokens"),
    "max_completion_tokens 2**63": (CHAT, body(messages=MSG, max_completion_tokens=2**63), 400,
                                    "max_completion_tokens"),
    "temperature 1e300": (CHAT, body(messages=MSG, temperature=1e300), 400, "temperature"),
    "top_logprobs 2**63": (CHAT, body(messages=MSG, logprobs=True, top_logprobs=2**63), 400,
                           "top_logprobs"),
    "logprobs 2**63": (COMPLETIONS, body(prompt="a", logprobs=2**63), 400, "logprobs"),
    "too many stop strings": (COMPLETIONS, body(prompt="a", stop=["x"] * 17), 400, "stop"),
    "stop string over 1024 chars": (CHAT, body(messages=MSG, stop="x" * 1025), 400, "stop"),
    "too many stop token ids": (COMPLETIONS, body(prompt="a", stop_token_ids=[1] * 257), 400,
                                "stop_token_ids"),
    "more messages than context": (CHAT, body(messages=MSG * 257), 400, "messages"),
    # Keys neither OpenAI nor vLLM defines: OpenAI's 400 "Unrecognized request argument supplied"
    "misspelt max_tokens": (COMPLETIONS, body(prompt="a", max_token=3), 400, "max_token"),
    "unknown chat field": (CHAT, body(messages=MSG, temprature=0.5), 400, "temprature"),
    "prompt sent to chat": (CHAT, body(messages=MSG, prompt="a"), 400, "prompt"),
    "messages sent to completions": (COMPLETIONS, body(prompt="a", messages=MSG), 400, "messages"),
    "tool message without tool_call_id": (CHAT, body(messages=[*MSG, {"role": "tool", "content": "21"}]), 400,
                                          "messages[1].tool_call_id"),
}


def check_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] in ("invalid_request_error", "server_error")
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize("name", list(CASES))
def test_bad_request_gets_openai_error(http, name):
    route, raw, status, param = CASES[name]
    r = http.post(route, content=raw, headers=JSON)
    err = check_error(r, status, param)
    if name.endswith("too long"):
        assert err["code"] == "context_length_exceeded"


@pytest.mark.parametrize("field,value,allowed", [
    ("top_k", 2**63, "-1 to 2147483647"), ("temperature", 101.0, "0.0 to 100.0"),
    ("top_p", 0.0, "> 0.0 and <= 1.0"), ("seed", -(2**64), ">= -9223372036854775808 and < 9223372036854775808")])
def test_out_of_range_names_field_and_range(http, field, value, allowed):
    r = http.post(CHAT, json={"messages": MSG, field: value})
    err = check_error(r, 400, field)
    assert err["message"] == f"{field}={value!r} is out of range; allowed: {allowed}"


def test_no_pydantic_prefix_in_messages(http):
    err = check_error(http.post(COMPLETIONS, json={"prompt": "a", "stop": [""]}), 400, "stop")
    assert "Value error" not in err["message"] and "1 to 1024" in err["message"]


@pytest.mark.parametrize("name", list(CASES))
def test_error_messages_are_sentences(http, name):
    """No pydantic prefix, no Python repr of a rejected value (schemas, tool lists)."""
    route, raw, status, _ = CASES[name]
    message = http.post(route, content=raw, headers=JSON).json()["error"]["message"]
    assert "Value error" not in message and "{'" not in message and "[{" not in message
    assert ".str" not in message and "list[" not in message  # pydantic's union member names
    assert "NamedToolChoice" not in message


def test_a_union_failure_is_one_problem(http):
    err = check_error(http.post(CHAT, json={"messages": MSG, "tool_choice": "bogus"}), 400,
                      "tool_choice")
    assert err["message"] == "tool_choice: Input should be 'auto', 'none' or 'required'"


def test_image_part_is_named_as_such(http):
    err = check_error(http.post(CHAT, json={"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}), 400,
        "messages.0.content")
    assert "image inputs are not supported" in err["message"] and "part 1" in err["message"]


@pytest.mark.parametrize("key,value", [("use_beam_search", True), ("suffix", "x"),
                                       ("best_of", 3), ("audio", {"voice": "x"}),
                                       ("functions", [{"name": "f"}]), ("priority", 2)])
def test_unsupported_field_refused_by_name(http, key, value):
    err = check_error(http.post(COMPLETIONS, json={"prompt": "a", key: value}), 400, key)
    assert err["message"].startswith(f"{key} is not supported by this server")
    assert repr(value) not in err["message"]


def test_huge_top_k_fails_alone(server, http):
    """Ten streams beside a 2**63 top_k request all complete, equal to running alone."""
    req = {"prompt": "Hello", "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    alone = http.post(COMPLETIONS, json=req).json()["choices"][0]["text"]
    with cf.ThreadPoolExecutor(11) as pool:
        innocent = [pool.submit(http.post, COMPLETIONS, json=req) for _ in range(10)]
        bad = pool.submit(http.post, CHAT, json={"messages": MSG, "top_k": 2**63})
        check_error(bad.result(), 400, "top_k")
        assert [f.result().json()["choices"][0]["text"] for f in innocent] == [alone] * 10


def test_neutral_values_of_unsupported_keys_are_accepted(http):
    r = http.post(COMPLETIONS, json={
        "prompt": "a", "max_tokens": 2, "presence_penalty": 0, "frequency_penalty": 0.0,
        "logit_bias": {}, "echo": False, "best_of": 1, "user": "u1",
        "use_beam_search": False, "suffix": None, "store": False, "skip_special_tokens": True})
    assert r.status_code == 200, r.text


def test_unknown_fields_are_named_as_openai_names_them(http):
    err = check_error(http.post(COMPLETIONS, json={"prompt": "a", "max_token": 3, "foo": 1}), 400, "max_token")
    assert err["message"] == "Unrecognized request arguments supplied: max_token, foo (did you mean max_tokens?)"
    err = check_error(http.post(CHAT, json={"messages": MSG, "stream_option": {}}), 400, "stream_option")
    assert err["message"] == "Unrecognized request argument supplied: stream_option (did you mean stream_options?)"


def test_a_tool_message_must_name_its_call(http):
    msgs = [*MSG, {"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "21"}]
    err = check_error(http.post(CHAT, json={"messages": msgs, "max_tokens": 1}), 400, "messages[2].tool_call_id")
    assert err["message"].startswith("messages[2].tool_call_id is missing")
    msgs[2]["tool_call_id"] = "call_1"
    assert http.post(CHAT, json={"messages": msgs, "max_tokens": 1}).status_code == 200


def test_unknown_route_and_method(http):
    check_error(http.get("/v1/nothing"), 404)
    check_error(http.get(COMPLETIONS), 405)


def test_server_healthy_and_idle_after_bad_input(server, http):
    for name in CASES:
        route, raw, status, _ = CASES[name]
        assert http.post(route, content=raw, headers=JSON).status_code == status
    assert server.healthy()
    assert server.wait_idle()["kv_blocks_used"] == 0
    ok = http.post(CHAT, json={"messages": MSG, "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")
