"""Tool calling: tools reach the chat template, tool_choice required / named constrain the
output to a call that parses, "auto" parses the formats in tools.FORMATS, streamed and not, a
strict tool under "auto" constrains each call the model opens, and tool results and earlier
calls are accepted in the history."""

from __future__ import annotations

import json

import jsonschema
import pytest

from live_server import start_server
from reclaim.server.tools import parse_tool_calls

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 10},
    "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
             "required": ["zone"], "additionalProperties": False}}}]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
SAMPLED = {"temperature": 1.0, "seed": 3, "max_tokens": 120}


@pytest.fixture(scope="module")
def server():
    live = start_server(max_model_len=1024, num_blocks=512)  # room for the tool list
    yield live
    live.stop()


def stream_choice(http, body) -> tuple[str, list[dict], str | None]:
    """(content, tool_calls, finish_reason) of a streamed choice 0, assembled from deltas."""
    content, calls, finish = "", {}, None
    with http.stream("POST", CHAT, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for c in json.loads(line[6:])["choices"]:
                if c["index"] != 0:
                    continue
                content += c["delta"].get("content") or ""
                for d in c["delta"].get("tool_calls") or []:
                    call = calls.setdefault(d["index"], {"name": "", "arguments": ""})
                    call["name"] += d.get("function", {}).get("name") or ""
                    call["arguments"] += d.get("function", {}).get("arguments") or ""
                finish = c["finish_reason"] or finish
    return content, [calls[i] for i in sorted(calls)], finish


def check_calls(calls: list[dict], names=("get_weather", "get_time")) -> None:
    assert calls
    for call in calls:
        fn = call.get("function", call)
        assert fn["name"] in names
        jsonschema.validate(json.loads(fn["arguments"]), PARAMS[fn["name"]])


def test_named_tool_choice_always_parses(http):
    body = {"messages": MSG, "tools": TOOLS, "n": 3, **SAMPLED, "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}}
    r = http.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        msg = choice["message"]
        assert choice["finish_reason"] == "tool_calls" and msg["content"] is None
        assert len(msg["tool_calls"]) == 1 and msg["tool_calls"][0]["type"] == "function"
        assert msg["tool_calls"][0]["id"].startswith("call_")
        check_calls(msg["tool_calls"], ("get_weather",))
    content, calls, finish = stream_choice(http, body)
    assert content == "" and finish == "tool_calls"
    check_calls(calls, ("get_weather",))


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_always_parses(http, parallel):
    body = {"messages": MSG, "tools": TOOLS, "tool_choice": "required", "n": 3, **SAMPLED,
            "parallel_tool_calls": parallel}
    if parallel:  # a random model's list of calls can run past max_tokens; one call always ends
        body["max_tokens"] = 400
    r = http.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    for choice in choices:
        if parallel and choice["finish_reason"] == "length":
            continue  # cut inside an unfinished list of calls: nothing to parse
        assert choice["finish_reason"] == "tool_calls", choice
        check_calls(choice["message"]["tool_calls"])
        if not parallel:
            assert len(choice["message"]["tool_calls"]) == 1
    assert any(c["finish_reason"] == "tool_calls" for c in choices)
    if not parallel:
        _, calls, finish = stream_choice(http, body)
        assert finish == "tool_calls"
        check_calls(calls)


HERMES = ('Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", '
          '"unit": "c"}}</tool_call>')
PLAIN = '{"name": "get_time", "parameters": {"zone": "utc"}}'


@pytest.mark.parametrize("output,content,name", [(HERMES, "Let me check.", "get_weather"),
                                                 (PLAIN, None, "get_time")])
def test_auto_parses_a_call_the_model_writes(http, output, content, name):
    """A model's own tool call (forced here with guided_choice, as a trained model would write
    it) comes back as tool_calls, whole and streamed."""
    body = {"messages": MSG, "tools": TOOLS, "guided_choice": [output], **SAMPLED}
    choice = http.post(CHAT, json=body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == content
    check_calls(choice["message"]["tool_calls"], (name,))
    streamed, calls, finish = stream_choice(http, body)
    assert finish == "tool_calls" and (streamed or None) == content
    check_calls(calls, (name,))


def test_auto_keeps_one_call_without_parallel_tool_calls(http):
    two = ('<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>'
           '<tool_call>{"name": "get_time", "arguments": {"zone": "cet"}}</tool_call>')
    body = {"messages": MSG, "tools": TOOLS, "guided_choice": [two], **SAMPLED, "max_tokens": 300}
    calls = http.post(CHAT, json=body).json()["choices"][0]["message"]["tool_calls"]
    assert [json.loads(c["function"]["arguments"])["zone"] for c in calls] == ["utc", "cet"]
    body["parallel_tool_calls"] = False
    calls = http.post(CHAT, json=body).json()["choices"][0]["message"]["tool_calls"]
    assert [json.loads(c["function"]["arguments"])["zone"] for c in calls] == ["utc"]


def test_auto_without_a_call_is_plain_text(http):
    body = {"messages": MSG, "tools": TOOLS, "guided_choice": ["It is sunny <tool"],
            **SAMPLED}
    choice = http.post(CHAT, json=body).json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "It is sunny <tool"}
    assert choice["finish_reason"] == "stop"
    assert stream_choice(http, body) == ("It is sunny <tool", [], "stop")


def test_tools_reach_the_template_and_history_is_accepted(http):
    history = MSG + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    ids = http.post("/tokenize", json={"messages": history, "tools": TOOLS}).json()["tokens"]
    text = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert '<tools>{"type": "function", "function": {"name": "get_weather"' in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"' in text
    assert "<|im_start|>tool\n21 degrees" in text
    r = http.post(CHAT, json={"messages": history, "tools": TOOLS, "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    none = http.post("/tokenize", json={"messages": MSG, "tools": TOOLS, "tool_choice": "none"})
    assert "<tools>" not in http.post("/detokenize", json={
        "tokens": none.json()["tokens"]}).json()["prompt"]


def test_parse_tool_call_formats():
    names = ("f", "g")
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
                            '<tool_call>{"name": "g", "arguments": {}}</tool_call>', names)[1] \
        and len(parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}</tool_call>\n'
                                 '<tool_call>{"name": "g", "arguments": {}}</tool_call>',
                                 names)[1]) == 2
    content, calls = parse_tool_calls('[{"name": "f", "arguments": {"x": "y"}}]', names)
    assert content is None and calls[0].name == "f" and json.loads(calls[0].arguments) == {"x": "y"}
    # Unknown tool, broken JSON, or plain JSON that is not a call: text, not a half-parsed call.
    for text in ('<tool_call>{"name": "h", "arguments": {}}</tool_call>',
                 '<tool_call>{"name": "f", "argu', '{"answer": 42}', "hello"):
        assert parse_tool_calls(text, names) == (text, [])


STRICT_TOOLS = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS[:1]] + TOOLS[1:]


def strict_plan(server, **body):
    """The plan the server makes for an "auto" request with a strict tool."""
    from reclaim.server.plan import Limits, plan_chat
    from reclaim.server.schemas import ChatCompletionRequest

    req = ChatCompletionRequest.model_validate(
        {"messages": MSG, "tools": STRICT_TOOLS, "tool_choice": "auto", **body})
    return plan_chat(req, server.tokenizer, Limits(("tiny-llama",), 1024, len(server.tokenizer)))


def walk(server, constraint, text: str) -> int | None:
    """Feed `text`'s tokens through the constraint: the index of the first token its mask
    refuses, or None when all pass."""
    ids = server.tokenizer.encode(text, add_special_tokens=False)
    for i, t in enumerate(ids):
        if not constraint.allowed(len(server.tokenizer))[t]:
            return i
        constraint.accept(t)
    return None


def test_strict_tool_under_auto_constrains_each_call(server):
    """OpenAI's `strict` with tool_choice auto: free text stays free, but a <tool_call> block,
    once opened, must be a call of a given tool whose arguments fit its schema."""
    plan = strict_plan(server)
    tools = plan.tools
    assert tools.strict and plan.params[0].constraint is not None
    good = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris",'
            '"unit":"c"}}\n</tool_call>')
    assert walk(server, strict_plan(server).params[0].constraint, good) is None
    content, calls = tools.parse(good)
    assert content == "Let me check." and [c.name for c in calls] == ["get_weather"]
    check_calls([c.body() for c in calls])
    assert walk(server, strict_plan(server).params[0].constraint, "No call needed, it is sunny.") is None
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"town":"Paris"}}\n</tool_call>'
    refused = walk(server, strict_plan(server).params[0].constraint, bad)
    assert refused is not None  # refused where the arguments leave the schema
    prefix = server.tokenizer.decode(server.tokenizer.encode(bad, add_special_tokens=False)[:refused])
    assert prefix.startswith('<tool_call>\n{"name": "get_weather", "arguments": {') and "town" not in prefix
    unknown = '<tool_call>\n{"name": "get_stock", "arguments": {}}\n</tool_call>'
    assert walk(server, strict_plan(server).params[0].constraint, unknown) is not None
    # Only the constrained format is read: a bare JSON reply is text, not an unchecked call.
    assert tools.parse(PLAIN) == (PLAIN, [])


def test_strict_tool_under_auto_is_served_and_conflicts_name_themselves(http):
    body = {"messages": MSG, "tools": STRICT_TOOLS, **SAMPLED, "n": 2}
    r = http.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        if choice["message"].get("tool_calls"):  # a random model rarely calls; any call fits
            check_calls(choice["message"]["tool_calls"])
    r = http.post(CHAT, json={**body, "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
