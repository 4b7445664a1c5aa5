"""Request bodies of the OpenAI routes, validated strictly from raw JSON bytes.

Strict mode: a string is not a number and a float is not an int, as in OpenAI's API. The extra
keys vLLM accepts at the top level (top_k, min_p, stop_token_ids, guided_json, ...) are fields
here. Every other field of OpenAI's and vLLM's requests that this server does not implement is
in REFUSED: sent with anything but its neutral value, it gets a 400 naming it. A top-level key
neither API defines gets a 400 naming it, as OpenAI answers ("Unrecognized request argument
supplied"), so a misspelt field (max_token) is not silently ignored.
"""

from __future__ import annotations

import difflib
import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from reclaim.server.errors import validation_error

INT64 = 2**63  # seeds are signed 64-bit integers
# Upper bounds of the sampling fields: each fits the engine's int32/float tensors and its own
# checks in SamplingParams, so nothing a client sends can overflow inside an engine step.
MAX_INT32 = 2**31 - 1
MAX_TEMPERATURE = 100.0
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024
MAX_TOOLS = 128
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # more than any vocabulary served here
MAX_BAD_WORDS = 256  # each is matched against the output at every step

# Fields of OpenAI's and vLLM's requests this server does not implement -> their neutral values
# (sending one of those, or null, is accepted: it asks for nothing).
REFUSED: dict[str, tuple] = {
    "audio": (), "modalities": (["text"],), "prediction": (), "reasoning_effort": (),
    "web_search_options": (), "verbosity": (), "functions": ([],), "function_call": ("none",),
    "suffix": ("",), "best_of": (1,), "store": (False,), "service_tier": ("auto", "default"),
    "use_beam_search": (False,), "length_penalty": (1, 1.0), "documents": ([],),
    "mm_processor_kwargs": ({},), "structural_tag": (),
    "guided_decoding_backend": (), "guided_whitespace_pattern": (), "priority": (0,),
    "logits_processors": ([],), "return_tokens_as_token_ids": (False,),
    "return_token_ids": (False,), "kv_transfer_params": (), "vllm_xargs": ({},),
    "prompt_embeds": (), "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,), "image": (), "images": ([],), "moderation": (),
    "cache_salt": (), "max_repetition_pattern_size": (0,), "min_repetition_pattern_size": (0,),
    "repetition_min_count": (0,),
}
# Accepted and without effect on what is generated or returned, as in OpenAI's API without
# stored completions: labels for the caller's own bookkeeping and prompt-cache hints (this
# server's prefix cache needs none).
INFORMATIONAL = ("user", "metadata", "safety_identifier", "prompt_cache_key",
                 "prompt_cache_retention", "prompt_cache_options")
# vLLM's chat echo (repeat the last message), its reasoning parser's switch, and BOS on top of
# the template: not here (completions implements add_special_tokens).
REFUSED_CHAT_ONLY = {"echo": (False,), "include_reasoning": (True,), "add_special_tokens": (False,)}


class FieldError(ValueError):
    """A validation failure about `param` (a body field), raised where pydantic cannot tell
    which field it is about (a model-level check)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _unrecognized(extra: dict[str, Any] | None, known: Any, fields: Any) -> None:
    """A 400 naming the top-level keys that are neither fields nor in `known` (OpenAI's answer)."""
    unknown = [k for k in extra or {} if k not in known]
    if unknown:
        hints = [m[0] for k in unknown if (m := difflib.get_close_matches(k, fields, n=1))]
        s = "s" if len(unknown) > 1 else ""
        raise FieldError(unknown[0], f"Unrecognized request argument{s} supplied: {', '.join(unknown)}"
                         + (f" (did you mean {', '.join(hints)}?)" if hints else ""))


def _refuse(extra: dict[str, Any] | None, table: dict[str, tuple]) -> None:
    for key, value in (extra or {}).items():
        if key in table and value is not None and value not in table[key]:
            neutral = " or send " + " / ".join(json.dumps(v) for v in table[key]) if table[key] else ""
            raise FieldError(key, f"{key} is not supported by this server; omit it{neutral}")


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    name: str = Field("response", max_length=256)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema(self) -> "ResponseFormat":
        if self.type == "json_schema" and (self.json_schema is None
                                           or self.json_schema.json_schema is None):
            raise FieldError("response_format.json_schema",
                             "type 'json_schema' needs json_schema.schema, the JSON schema")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (the newer form of the guided_* keys): one of these."""

    model_config = ConfigDict(strict=True, extra="forbid")
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class FunctionDef(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: FunctionName


class SamplingRequest(BaseModel):
    """Fields both generation routes share."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_INT32)  # the server's --max-n is checked in plan.py
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    temperature: float | None = Field(None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=MAX_INT32)  # above the vocabulary size: no cut
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    min_tokens: int = Field(0, ge=0, le=MAX_INT32)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    truncate_prompt_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    allowed_token_ids: list[int] | None = Field(None, max_length=MAX_ALLOWED_TOKEN_IDS)
    bad_words: list[str] | None = Field(None, max_length=MAX_BAD_WORDS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    request_id: str | None = Field(None, max_length=128, pattern=r"^[A-Za-z0-9_.:\-]+$")
    retain_for_training: bool = False  # record the prefill for training on feedback (serve --learn)
    # Structured output (see structured.py): at most one of these.
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None

    # Top-level keys accepted besides the fields: the refused ones (a 400 of their own unless
    # neutral) and the informational ones.
    KNOWN_EXTRAS: ClassVar[frozenset[str]] = frozenset(REFUSED) | frozenset(INFORMATIONAL)

    @model_validator(mode="after")
    def _supported(self) -> "SamplingRequest":
        _unrecognized(self.model_extra, self.KNOWN_EXTRAS, type(self).model_fields)
        _refuse(self.model_extra, REFUSED)
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options is only allowed with stream=true")
        return self

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"{len(stops)} stop strings; allowed: at most {MAX_STOP_STRINGS}")
        bad = next((s for s in stops if not 0 < len(s) <= MAX_STOP_CHARS), None)
        if bad is not None:
            raise ValueError(f"a stop string has {len(bad)} characters; allowed: 1 to "
                             f"{MAX_STOP_CHARS}")
        return stop

    @field_validator("bad_words")
    @classmethod
    def _bad_words(cls, words: list[str] | None) -> list[str] | None:
        for i, word in enumerate(words or []):
            if not 0 < len(word.strip()) <= MAX_STOP_CHARS:
                raise ValueError(f"word {i} has {len(word.strip())} characters besides spaces; "
                                 f"allowed: 1 to {MAX_STOP_CHARS}")
        return words

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (bias or {}).items():
            if not key.isdigit():
                raise ValueError(f"key {key[:20]!r} is not a token id; keys are token ids as "
                                 f"strings, e.g. \"50256\"")
            if not -100 <= value <= 100:
                raise ValueError(f"token {key} has bias {value}; allowed: -100 to 100")
        return bias

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and (self.stream_options.include_usage
                                                    or self.stream_options.continuous_usage_stats)

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


# Content part types -> what they are, for the refusal.
MEDIA_PARTS = {"image_url": "image", "input_image": "image", "image": "image",
               "image_pil": "image", "input_audio": "audio", "audio_url": "audio",
               "audio": "audio", "video_url": "video", "video": "video", "file": "file",
               "input_file": "file"}


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result answers this call

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, content: Any) -> Any:
        if isinstance(content, list):
            for i, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in MEDIA_PARTS:
                    raise ValueError(f"part {i} is of type {kind!r}: {MEDIA_PARTS[kind]} inputs "
                                     f"are not supported by this server; send text parts")
                if kind != "text":
                    raise ValueError(f"part {i} has type {str(kind)[:30]!r}; allowed: 'text'")
        return content

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = Field(None, max_length=64 << 10)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    KNOWN_EXTRAS: ClassVar[frozenset[str]] = SamplingRequest.KNOWN_EXTRAS | frozenset(REFUSED_CHAT_ONLY)

    @model_validator(mode="after")
    def _chat(self) -> "ChatCompletionRequest":
        _refuse(self.model_extra, REFUSED_CHAT_ONLY)
        for i, m in enumerate(self.messages):
            if m.role == "tool" and m.tool_call_id is None:
                raise FieldError(f"messages[{i}].tool_call_id",
                                 f"messages[{i}].tool_call_id is missing: a message with role 'tool' "
                                 "must name the tool call it answers")
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs requires logprobs=true")
        if self.continue_final_message and self.add_generation_prompt:
            raise FieldError("continue_final_message",
                             "continue_final_message=true needs add_generation_prompt=false")
        return self


class CompletionRequest(SamplingRequest):
    """POST /v1/completions; `prompt` is text, token ids, or a batch of either."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0, le=MAX_INT32)  # 0 only with echo
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _prompt(self) -> "CompletionRequest":
        if isinstance(self.prompt, list) and not self.prompt:
            raise FieldError("prompt", "prompt is an empty list; send text or at least one token id")
        return self

    def prompt_list(self) -> list[str | list[int]]:
        """The prompts of this request, one entry per prompt."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [p]
        return list(p)


class TokenizeCompletionRequest(BaseModel):
    """POST /tokenize with a prompt (vLLM's shape)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    """POST /tokenize with chat messages, rendered with the chat template (vLLM's shape)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = Field(None, max_length=64 << 10)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's shape)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    tokens: list[int]


def parse(raw: bytes, schema: type[BaseModel]) -> Any:
    """Validate a JSON body against `schema`; any problem is a 400 naming the field."""
    try:
        return schema.model_validate_json(raw, strict=True)
    except ValidationError as exc:
        raise validation_error(exc, schema) from None


class RollbackRequest(BaseModel):
    """POST /v1/weights/rollback (serve --learn, admin key): the weights version to restore."""

    model_config = ConfigDict(strict=True, extra="forbid")
    version: int = Field(ge=0)


class FeedbackRequest(BaseModel):
    """POST /v1/feedback (serve --learn): a rating of a served response, or a correction of it."""

    model_config = ConfigDict(strict=True, extra="forbid")
    response_id: str = Field(min_length=1, max_length=256)
    rating: Literal[-1, 0, 1]
    correction: str | None = Field(None, min_length=1)
    choice_index: int = Field(0, ge=0, le=1 << 16)
