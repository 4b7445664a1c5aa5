"""What a caller hands the engine (SamplingParams) and what it gets back (RequestOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field

# Temperatures below this are greedy: dividing logits by less overflows float32 (1e-39 gave garbage).
GREEDY_TEMPERATURE = 1e-5
MAX_TOP_K = 2**31 - 1  # larger asks for no cut; the sampler clamps to the vocabulary
MAX_TOKENS = 2**31 - 1
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and x == x and abs(x) != float("inf")


@dataclass
class SamplingParams:
    """Per-request sampling settings, named as in vLLM and the OpenAI API.

    top_k <= 0 and top_p = 1 and min_p = 0 disable those filters; temperature 0 (or below
    GREEDY_TEMPERATURE) is greedy.
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
            (_finite(self.temperature) and 0 <= self.temperature <= 100, "temperature",
             self.temperature, "0 to 100"),
            (_finite(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]"),
            (isinstance(self.top_k, int) and -1 <= self.top_k <= MAX_TOP_K, "top_k", self.top_k,
             f"-1 to {MAX_TOP_K} (0 or -1 disables it)"),
            (_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]"),
            (isinstance(self.max_tokens, int) and 1 <= self.max_tokens <= MAX_TOKENS, "max_tokens",
             self.max_tokens, f"1 to {MAX_TOKENS}"),
            (self.seed is None or (isinstance(self.seed, int) and -2**63 <= self.seed < 2**63), "seed",
             self.seed, "None or a 64-bit signed integer"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", self.logprobs,
             "None or 0..20"),
            (len(self.stop) <= MAX_STOP_STRINGS and all(
                isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in self.stop), "stop",
             self.stop, f"at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS} characters"),
            (len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS and all(
                isinstance(t, int) and 0 <= t < 2**31 for t in self.stop_token_ids), "stop_token_ids",
             self.stop_token_ids[:8], f"at most {MAX_STOP_TOKEN_IDS} token ids >= 0"),
        ]
        for ok, name, value, allowed in checks:
            if not ok:
                raise ValueError(f"{name}={value!r} is invalid; allowed: {allowed}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


@dataclass
class TokenLogprob:
    """The chosen token's logprob and the `k` most likely alternatives at that step."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput:
    """What one engine step added to a request. Deltas only while it runs (no per-token copy of
    the history); the final output (`finished`) also carries the whole prompt, tokens, text and
    logprobs.

    weights_version is the version of the weights that produced the newest token and
    first_weights_version the one that produced the first: they differ when weights were swapped
    in the middle of the response.
    """

    request_id: str
    new_token_ids: list[int]
    delta_text: str
    new_logprobs: list[TokenLogprob] | None  # logprobs of new_token_ids, when asked for
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    weights_version: int
    first_weights_version: int
    text_offset: int = 0  # characters of text released before delta_text
    num_output_tokens: int = 0
    error: str | None = None  # why the request failed (finish_reason "error"); others go on
    # Final output only (None while running):
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    text: str | None = None
    logprobs: list[TokenLogprob] | None = None
