"""What a caller hands the engine (SamplingParams) and what it gets back (RequestOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Per-request sampling settings, named as in vLLM and the OpenAI API.

    top_k <= 0 and top_p = 1 and min_p = 0 disable those filters; temperature 0 is greedy.
    logprobs: None for none, k >= 0 for the sampled token's logprob plus the k most likely.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [
            (self.temperature >= 0, "temperature", self.temperature, ">= 0"),
            (0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]"),
            (self.top_k >= -1, "top_k", self.top_k, ">= -1 (0 or -1 disables it)"),
            (0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]"),
            (self.max_tokens >= 1, "max_tokens", self.max_tokens, ">= 1"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", self.logprobs,
             "None or 0..20"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", self.stop,
             "non-empty strings"),
        ]
        for ok, name, value, allowed in checks:
            if not ok:
                raise ValueError(f"{name}={value!r} is invalid; allowed: {allowed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class TokenLogprob:
    """The chosen token's logprob and the `k` most likely alternatives at that step."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput:
    """A request's state after an engine step: everything so far plus what this step added."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    delta_text: str
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    weights_version: int
