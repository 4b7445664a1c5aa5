"""Every field of OpenAI's chat and completions requests (read from the openai SDK's own types)
and of vLLM's extras (listed from its protocol) is implemented (a request using it is served;
the tests named beside it check its effect), informational, or refused with a 400 naming it:
none is accepted and ignored."""

from __future__ import annotations

import typing

import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from live_server import start_server
from reclaim.server.schemas import INFORMATIONAL, REFUSED, REFUSED_CHAT_ONLY

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
SCHEMA = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
          "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}



@pytest.fixture(scope="module")
def server():
    live = start_server(max_model_len=512, num_blocks=256)  # room for a tool list
    yield live
    live.stop()


# field -> (a value that uses it, the test file that checks its effect)
SHARED = {
    "model": ("tiny-llama", "test_openai_api"), "n": (2, "test_openai_api"),
    "max_tokens": (3, "test_openai_api"), "temperature": (0.5, "test_openai_api"),
    "top_p": (0.9, "test_openai_api"), "seed": (1, "test_openai_api"),
    "stop": (["x"], "test_openai_api"), "stream": (False, "test_openai_api"),
    "stream_options": ({"include_usage": True}, "test_request_options"),
    "frequency_penalty": (0.5, "test_request_options"),
    "presence_penalty": (0.5, "test_request_options"),
    "logit_bias": ({"5": 1.0}, "test_request_options"),
    "response_format": ({"type": "json_object"}, "test_structured_output"),
    # vLLM's extras
    "top_k": (5, "test_openai_api"), "min_p": (0.1, "test_openai_api"),
    "repetition_penalty": (1.2, "test_request_options"),
    "stop_token_ids": ([5], "test_request_options"), "ignore_eos": (True, "test_openai_api"),
    "include_stop_str_in_output": (True, "test_openai_api"),
    "min_tokens": (2, "test_request_options"),
    "truncate_prompt_tokens": (4, "test_request_options"),
    "prompt_logprobs": (1, "test_prompt_logprobs"),
    "allowed_token_ids": ([5, 6, 7], "test_token_restrictions"),
    "bad_words": (["fox"], "test_token_restrictions"),
    "guided_json": (SCHEMA, "test_structured_output"),
    "guided_regex": ("[ab]{2}", "test_structured_output"),
    "guided_choice": (["y", "n"], "test_structured_output"),
    "guided_grammar": ('root ::= "a"', "test_structured_output"),
    "structured_outputs": ({"choice": ["y"]}, "test_structured_output"),
    "request_id": ("abc-1", "test_request_fields"),
}
CHAT_ONLY = {
    "messages": ([{"role": "user", "content": "hi"}], "test_openai_api"),
    "logprobs": (True, "test_openai_api"), "top_logprobs": (2, "test_openai_api"),
    "max_completion_tokens": (3, "test_openai_api"),
    "tools": ([TOOL], "test_tools"), "tool_choice": ("auto", "test_tools"),
    "parallel_tool_calls": (False, "test_tools"),
    "add_generation_prompt": (True, "test_browsers"),
    "continue_final_message": (False, "test_request_fields"),
    "chat_template": ("{% for m in messages %}{{ m['content'] }}{% endfor %}",
                      "test_request_options"),
    "chat_template_kwargs": ({"x": 1}, "test_request_options"),
}
COMPLETION_ONLY = {
    "prompt": ("Hello", "test_openai_api"), "logprobs": (1, "test_openai_api"),
    "echo": (True, "test_prompt_logprobs"), "add_special_tokens": (True, "test_request_fields"),
}
COMPANIONS = {"top_logprobs": {"logprobs": True}, "tool_choice": {"tools": [TOOL]},
              "parallel_tool_calls": {"tools": [TOOL]}, "stream_options": {"stream": True}}
SAMPLES = {"modalities": ["audio"], "function_call": "auto", "functions": [{"name": "f"}],
           "suffix": "x", "best_of": 2, "store": True, "service_tier": "flex",
           "length_penalty": 2.0, "priority": 1,
           "return_tokens_as_token_ids": True, "return_token_ids": True,
           "skip_special_tokens": False, "spaces_between_special_tokens": False,
           "logits_processors": ["x"], "documents": [{"title": "x"}], "echo": True,
           "include_reasoning": False, "add_special_tokens": True, "cache_salt": "salt",
           "max_repetition_pattern_size": 4, "min_repetition_pattern_size": 2,
           "repetition_min_count": 3}


# vLLM's request fields beyond OpenAI's (ChatCompletionRequest and CompletionRequest in
# vllm/entrypoints/openai/{chat_completion,completion}/protocol.py at d5dba2d, plus the top-level
# guided_* keys of earlier releases).
VLLM_SHARED = {
    "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "allowed_token_ids",
    "prompt_logprobs", "response_format", "structured_outputs", "priority", "request_id",
    "logits_processors", "return_tokens_as_token_ids", "return_token_ids", "cache_salt",
    "kv_transfer_params", "vllm_xargs", "max_repetition_pattern_size", "min_repetition_pattern_size",
    "repetition_min_count", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "guided_decoding_backend", "guided_whitespace_pattern"}
VLLM_CHAT = VLLM_SHARED | {
    "bad_words", "echo", "add_generation_prompt", "continue_final_message", "add_special_tokens",
    "documents", "chat_template", "chat_template_kwargs", "mm_processor_kwargs", "structural_tag",
    "include_reasoning", "reasoning_effort"}
VLLM_COMPLETION = VLLM_SHARED | {"prompt_embeds", "add_special_tokens", "echo"}


def openai_fields(params) -> set[str]:
    return set(typing.get_type_hints(params.CompletionCreateParamsBase)) | {"stream"}


@pytest.mark.parametrize("route,params,implemented", [
    (CHAT, chat_params, {**SHARED, **CHAT_ONLY}),
    (COMPLETIONS, completion_params, {**SHARED, **COMPLETION_ONLY})])
def test_every_openai_field_is_implemented_informational_or_refused(route, params, implemented):
    refused = {**REFUSED, **(REFUSED_CHAT_ONLY if route == CHAT else {})}
    unknown = openai_fields(params) - set(implemented) - set(INFORMATIONAL) - set(refused)
    assert not unknown, f"OpenAI fields with no decision: {sorted(unknown)}"


@pytest.mark.parametrize("route,fields,implemented", [
    (CHAT, VLLM_CHAT, {**SHARED, **CHAT_ONLY}), (COMPLETIONS, VLLM_COMPLETION, {**SHARED, **COMPLETION_ONLY})])
def test_every_vllm_extra_is_implemented_or_refused(route, fields, implemented):
    refused = {**REFUSED, **(REFUSED_CHAT_ONLY if route == CHAT else {})}
    unknown = fields - set(implemented) - set(INFORMATIONAL) - set(refused)
    assert not unknown, f"vLLM fields with no decision: {sorted(unknown)}"


@pytest.mark.parametrize("route,implemented", [(CHAT, {**SHARED, **CHAT_ONLY}),
                                               (COMPLETIONS, {**SHARED, **COMPLETION_ONLY})])
def test_implemented_fields_are_served(http, route, implemented):
    base = {"messages": CHAT_ONLY["messages"][0]} if route == CHAT else {"prompt": "Hello"}
    structured = {"response_format", "guided_json", "guided_regex", "guided_choice",
                  "guided_grammar", "structured_outputs", "tools", "tool_choice"}
    for key, (value, test_file) in implemented.items():
        body = {**base, "max_tokens": 3, key: value, **COMPANIONS.get(key, {})}
        if key in structured:
            body["max_tokens"] = 40
        r = http.post(route, json=body)
        assert r.status_code == 200, (key, r.text)


@pytest.mark.parametrize("key", sorted(INFORMATIONAL))
def test_informational_fields_are_accepted(http, key):
    value = {"metadata": {"k": "v"}, "prompt_cache_options": {}}.get(key, "x")
    assert http.post(COMPLETIONS, json={"prompt": "a", "max_tokens": 1, key: value}) \
        .status_code == 200


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("key", sorted({**REFUSED, **REFUSED_CHAT_ONLY}))
def test_refused_fields_name_themselves(http, route, key):
    if key in REFUSED_CHAT_ONLY and route == COMPLETIONS:
        return  # completions implements it
    base = {"messages": CHAT_ONLY["messages"][0]} if route == CHAT else {"prompt": "Hello"}
    r = http.post(route, json={**base, "max_tokens": 1, key: SAMPLES.get(key, {"x": 1})})
    assert r.status_code == 400, (key, r.text)
    err = r.json()["error"]
    assert err["param"] == key and err["message"].startswith(f"{key} is not supported")
    for neutral in REFUSED.get(key, REFUSED_CHAT_ONLY.get(key, ())):
        assert http.post(route, json={**base, "max_tokens": 1, key: neutral}).status_code == 200


def test_request_id_names_the_response(http):
    r = http.post(COMPLETIONS, json={"prompt": "a", "max_tokens": 1, "request_id": "abc-1"})
    assert r.json()["id"] == "cmpl-abc-1"


def test_continue_final_message_and_add_special_tokens(server, http):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    ids = http.post("/tokenize", json={"messages": msgs, "add_generation_prompt": False,
                                       "continue_final_message": True}).json()["tokens"]
    assert server.tokenizer.decode(ids).endswith("assistant\nHel")  # the turn is left open
    r = http.post(CHAT, json={"messages": msgs, "add_generation_prompt": False,
                              "continue_final_message": True, "max_tokens": 1})
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    bos = server.tokenizer.bos_token_id
    with_bos = server.tokenizer("Hi", add_special_tokens=True)["input_ids"]
    r = http.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 1,
                                     "add_special_tokens": False}).json()
    assert r["usage"]["prompt_tokens"] == len(server.tokenizer.encode("Hi",
                                                                      add_special_tokens=False))
    assert bos is None or len(with_bos) >= r["usage"]["prompt_tokens"]
