"""Structured output against a live server: a random model's output, constrained by the grammar,
always parses (JSON schemas validated with jsonschema, regexes fullmatch, choices are members),
whole and streamed, and unconstrained requests batched beside it are unchanged."""

from __future__ import annotations

import concurrent.futures as cf
import json
import re

import jsonschema
import pytest

from reclaim.server.structured import GrammarCompiler

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MSG = [{"role": "user", "content": "Give me data."}]
SAMPLED = {"temperature": 1.0, "seed": 7, "max_tokens": 200}

SCHEMAS = {
    "flat": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0,
                                                            "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "admin": {"type": "boolean"}}, "required": ["id", "admin"],
            "additionalProperties": False},
        "score": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["user", "score"], "additionalProperties": False},
    "enum and array": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1,
                 "maxItems": 3}},
        "required": ["color", "tags"], "additionalProperties": False},
    "optional field": {"type": "object", "properties": {
        "a": {"type": "boolean"}, "b": {"type": "null"}}, "required": ["a"],
        "additionalProperties": False},
}


def _text(r) -> list[str]:
    assert r.status_code == 200, r.text
    body = r.json()
    return [c["message"]["content"] if "message" in c else c["text"] for c in body["choices"]]


def _streamed(http, route, body) -> list[str]:
    texts: dict[int, str] = {}
    with http.stream("POST", route, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                piece = c["delta"].get("content") if "delta" in c else c["text"]
                texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
    return [texts[i] for i in sorted(texts)]


@pytest.mark.parametrize("name", list(SCHEMAS))
@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_outputs_validate(http, name, stream):
    schema = SCHEMAS[name]
    body = {"messages": MSG, "n": 3, **SAMPLED, "response_format": {
        "type": "json_schema", "json_schema": {"name": "data", "schema": schema, "strict": True}}}
    texts = _streamed(http, CHAT, body) if stream else _text(http.post(CHAT, json=body))
    assert len(texts) == 3
    for text in texts:
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS])
def test_guided_json_regex_choice_grammar(server, http, route):
    base = {"messages": MSG} if route == CHAT else {"prompt": "Data:"}
    # Any JSON object has unbounded strings: a random model is nudged to close them (the bias
    # applies under the grammar's mask, so the output is JSON either way).
    closing = {str(server.tokenizer.convert_tokens_to_ids(c)): 15 for c in ('"', "}")}
    schema = SCHEMAS["enum and array"]
    for extra, check in [
        ({"guided_json": schema}, lambda t: jsonschema.validate(json.loads(t), schema)),
        ({"structured_outputs": {"json": schema}},
         lambda t: jsonschema.validate(json.loads(t), schema)),
        ({"guided_regex": r"[a-c]{2,5}-\d{3}"},
         lambda t: re.fullmatch(r"[a-c]{2,5}-\d{3}", t) or pytest.fail(t)),
        ({"guided_choice": ["yes", "no", "maybe"]},
         lambda t: t in ("yes", "no", "maybe") or pytest.fail(t)),
        ({"structured_outputs": {"choice": ["left", "right"]}},
         lambda t: t in ("left", "right") or pytest.fail(t)),
        ({"guided_grammar": 'root ::= "x" [0-9] [0-9]? "y"'},
         lambda t: re.fullmatch(r"x\d\d?y", t) or pytest.fail(t)),
        ({"response_format": {"type": "json_object"}, "logit_bias": closing},
         lambda t: isinstance(json.loads(t), dict) or pytest.fail(t)),
    ]:
        body = {**base, "n": 2, **SAMPLED, **extra}
        r = http.post(route, json=body)
        for text, choice in zip(_text(r), r.json()["choices"]):
            assert choice["finish_reason"] == "stop", (extra, text)
            check(text)
        for text in _streamed(http, route, body):
            check(text)


def test_unconstrained_requests_beside_constrained_are_unchanged(http):
    plain = {"prompt": "The quick brown", "max_tokens": 12, "temperature": 0.0,
             "ignore_eos": True}
    alone = _text(http.post(COMPLETIONS, json=plain))
    constrained = {"messages": MSG, **SAMPLED, "guided_json": SCHEMAS["nested"]}
    with cf.ThreadPoolExecutor(8) as pool:
        busy = [pool.submit(http.post, CHAT, json=constrained) for _ in range(4)]
        plains = [pool.submit(http.post, COMPLETIONS, json=plain) for _ in range(4)]
        assert [_text(f.result()) for f in plains] == [alone] * 4
        for f in busy:
            jsonschema.validate(json.loads(_text(f.result())[0]), SCHEMAS["nested"])


def test_constraint_masks_and_finishes(server):
    """The Constraint protocol directly: allowed tokens only, finished once the choice is made."""
    tok = server.tokenizer
    grammars = GrammarCompiler(tok)
    c = grammars.constraint(grammars.choice(["yes", "no"], "guided_choice"))
    mask = c.allowed(len(tok) + 5)
    assert mask.dtype == torch_bool() and mask.shape == (len(tok) + 5,)
    assert not mask[len(tok):].any()
    starts = {tok.decode([t]) for t in mask.nonzero().flatten().tolist()}
    assert starts and all("yes".startswith(s) or "no".startswith(s) for s in starts)
    for t in tok.encode("no"):
        assert not c.finished()
        c.accept(t)
    assert c.finished()
    with pytest.raises(ValueError):
        grammars.constraint(grammars.choice(["yes"], "x")).accept(tok.encode("no")[0])


def torch_bool():
    import torch

    return torch.bool
