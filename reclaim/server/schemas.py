"""Request bodies of the OpenAI routes, validated strictly from raw JSON bytes.

Strict mode: a string is not a number and a float is not an int, as in OpenAI's API. Extra
sampling keys vLLM accepts at the top level (top_k, min_p, stop_token_ids, ignore_eos, ...)
are fields here; other unknown keys are ignored, except the OpenAI features this server does not
implement, which are refused rather than silently dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

INT64 = 2**63  # seeds are signed 64-bit integers
# Upper bounds of the sampling fields: each fits the engine's int32/float tensors and its own
# checks in SamplingParams, so nothing a client sends can overflow inside an engine step.
MAX_INT32 = 2**31 - 1
MAX_TEMPERATURE = 100.0
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256
MAX_LOGPROBS = 20

# key -> its neutral value; any other value asks for a feature this server lacks.
UNSUPPORTED: dict[str, Any] = {
    "presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "logit_bias": None,
    "tools": None, "functions": None, "response_format": None, "suffix": None, "echo": False,
    "best_of": None, "use_beam_search": False, "prompt_logprobs": None,
}
_NEUTRAL_ALSO = {"logit_bias": ({},), "tools": ([],), "functions": ([],),
                 "response_format": ({"type": "text"},), "best_of": (1,)}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


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
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _supported(self) -> "SamplingRequest":
        for key, value in (self.model_extra or {}).items():
            if key in UNSUPPORTED and value is not None and value != UNSUPPORTED[key] \
                    and value not in _NEUTRAL_ALSO.get(key, ()):
                raise ValueError(f"{key}={value!r} is not supported by this server; "
                                 f"omit it or send {UNSUPPORTED[key]!r}")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
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

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

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

    @model_validator(mode="after")
    def _logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self


class CompletionRequest(SamplingRequest):
    """POST /v1/completions; `prompt` is text, token ids, or a batch of either."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _prompt(self) -> "CompletionRequest":
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt is an empty list; send text or at least one token id")
        return self

    def prompt_list(self) -> list[str | list[int]]:
        """The prompts of this request, one entry per prompt."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [p]
        return list(p)
