"""Real clients as oracles against a live server: the openai SDK's models.retrieve and
structured-output parse, langchain-openai's with_structured_output (json_schema, json_mode,
function_calling) and bind_tools, litellm's tool calls. The tiny model is random, but the grammar
constrains its output, so what the clients parse is always valid."""

from __future__ import annotations

import json
import os
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from live_server import MODEL_NAME, start_server


class Weather(BaseModel):
    """The weather in a city."""

    city: str = Field(max_length=8)
    unit: Literal["c", "f"]
    degrees: int = Field(ge=-50, le=50)


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    live = start_server(max_model_len=1024, num_blocks=512)  # room for schemas and tool lists
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_openai_parse_and_models_retrieve(client):
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    r = client.chat.completions.parse(model=MODEL_NAME, messages=ASK, response_format=Weather,
                                      max_tokens=300, seed=1)
    assert isinstance(r.choices[0].message.parsed, Weather)
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "strict": True,
                                                  "schema": Weather.model_json_schema()}}
    r = client.chat.completions.create(model=MODEL_NAME, messages=ASK, response_format=fmt,
                                       max_tokens=300, n=2, seed=2)
    for c in r.choices:
        Weather.model_validate_json(c.message.content)


def test_openai_tool_call(client):
    # One call: a random model's list of parallel calls may run past max_tokens.
    r = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=[WEATHER_TOOL],
                                       tool_choice="required", parallel_tool_calls=False, max_tokens=300, seed=3)
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments),
                        WEATHER_TOOL["function"]["parameters"])


@pytest.fixture(scope="module")
def chat_model(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(model=MODEL_NAME, base_url=server.url + "/v1",
                                       api_key="unused", max_retries=0, max_tokens=300, seed=4,
                                       temperature=1.0)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(chat_model, method):
    out = chat_model.with_structured_output(Weather, method=method).invoke("Weather in Paris?")
    assert isinstance(out, Weather)


def test_langchain_json_mode(server, chat_model):
    # Any JSON object: its strings are unbounded, so the random model is nudged to close them.
    tok = server.tokenizer
    closing = {tok.convert_tokens_to_ids(c): 15 for c in ('"', "}")}
    model = chat_model.bind(logit_bias=closing)
    out = model.with_structured_output(None, method="json_mode").invoke("Reply in JSON.")
    assert isinstance(out, dict)


class get_weather(BaseModel):  # noqa: N801 - a tool's name, as langchain takes it from the class
    """The weather in a city."""

    city: str = Field(max_length=8)


def test_langchain_bind_tools_and_usage(chat_model):
    for choice in ("get_weather", "required", "any"):
        bound = chat_model.bind_tools([get_weather], tool_choice=choice, strict=True)
        msg = bound.invoke("Weather in Paris?")
        assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
        assert isinstance(msg.tool_calls[0]["args"]["city"], str)
        assert msg.usage_metadata["input_tokens"] > 0
    chunks = list(chat_model.bind_tools([get_weather], tool_choice="get_weather", strict=True)
                  .stream("Weather in Paris?", stream_usage=True))
    merged = chunks[0]
    for c in chunks[1:]:
        merged += c
    assert merged.tool_calls[0]["name"] == "get_weather"
    assert merged.usage_metadata["output_tokens"] > 0


@pytest.mark.slow
def test_litellm_tool_call(server):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch at import
    litellm = pytest.importorskip("litellm")
    r = litellm.completion(model=f"openai/{MODEL_NAME}", api_base=server.url + "/v1",
                           api_key="unused", messages=ASK, tools=[WEATHER_TOOL],
                           tool_choice="required", parallel_tool_calls=False,  # one bounded call:
                           max_tokens=300, seed=5)  # a random model's list may not close in 300
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments),
                        WEATHER_TOOL["function"]["parameters"])
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
    streamed = litellm.completion(model=f"openai/{MODEL_NAME}", api_base=server.url + "/v1",
                                  api_key="unused", messages=ASK, tools=[WEATHER_TOOL],
                                  tool_choice={"type": "function",
                                               "function": {"name": "get_weather"}},
                                  max_tokens=300, stream=True, seed=6)
    chunks = list(streamed)
    rebuilt = litellm.stream_chunk_builder(chunks, messages=ASK)
    call = rebuilt.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments),
                        WEATHER_TOOL["function"]["parameters"])
