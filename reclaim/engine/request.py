"""What a caller hands the engine (SamplingParams) and what it gets back (RequestOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
    prompt_logprobs: the same for every prompt token after the first, computed at prefill.
    Logits processing, in this order: logit_bias (OpenAI: added to the logits), repetition_penalty
    (HF/vLLM: over prompt and output tokens, 1 = off), presence_penalty and frequency_penalty
    (OpenAI: over output tokens), min_tokens (EOS and stop_token_ids masked until that many
    tokens), allowed_token_ids (vLLM: every other token masked), bad_words_token_ids (vLLM's
    bad_words as token sequences: the last token of a sequence is masked when the output ends
    with the rest of it; see server/plan.py for how words become sequences), then `constraint`
    (a grammar: see constraint.py; one object per request, it holds state). max_tokens 0 runs
    the prefill only (e.g. for prompt_logprobs).
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
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    constraint: Any = field(default=None, compare=False, repr=False)

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
            (isinstance(self.max_tokens, int) and 0 <= self.max_tokens <= MAX_TOKENS, "max_tokens",
             self.max_tokens, f"0 (prefill only) to {MAX_TOKENS}"),
            (isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= max(self.max_tokens, 0), "min_tokens",
             self.min_tokens, f"0 to max_tokens ({self.max_tokens})"),
            (_finite(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "presence_penalty",
             self.presence_penalty, "-2 to 2"),
            (_finite(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "frequency_penalty",
             self.frequency_penalty, "-2 to 2"),
            (_finite(self.repetition_penalty) and 0 < self.repetition_penalty <= 10, "repetition_penalty",
             self.repetition_penalty, "in (0, 10] (1 = off)"),
            (self.logit_bias is None or (len(self.logit_bias) <= 1024 and all(
                isinstance(t, int) and t >= 0 and _finite(b) and -100 <= b <= 100
                for t, b in self.logit_bias.items())), "logit_bias",
             None if self.logit_bias is None else dict(list(self.logit_bias.items())[:4]),
             "at most 1024 token ids >= 0 with biases from -100 to 100"),
            (self.allowed_token_ids is None or (0 < len(self.allowed_token_ids) and all(
                isinstance(t, int) and 0 <= t < 2**31 for t in self.allowed_token_ids)), "allowed_token_ids",
             None if self.allowed_token_ids is None else self.allowed_token_ids[:8],
             "None or a non-empty list of token ids >= 0"),
            (self.bad_words_token_ids is None or all(
                isinstance(w, list) and w and all(isinstance(t, int) and 0 <= t < 2**31 for t in w)
                for w in self.bad_words_token_ids), "bad_words_token_ids",
             None if self.bad_words_token_ids is None else self.bad_words_token_ids[:4],
             "None or a list of non-empty token id sequences, ids >= 0"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs",
             self.prompt_logprobs, "None or 0..20"),
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

    @property
    def penalizes(self) -> bool:
        """Whether logit_bias, a penalty or min_tokens changes the logits (applied over the batch)."""
        return bool(self.min_tokens or self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty != 1.0)

    @property
    def masks(self) -> bool:
        """Whether allowed_token_ids, bad_words or a constraint masks tokens (applied per row)."""
        return bool(self.constraint is not None or self.allowed_token_ids is not None or self.bad_words_token_ids)

    @property
    def processes_logits(self) -> bool:
        """Whether anything changes the logits before the filters (such rows are not speculated:
        their distribution depends on the tokens before them in a draft)."""
        return self.penalizes or self.masks


@dataclass
class TokenLogprob:
    """The chosen token's logprob, its rank (1 = the most likely) and the `k` most likely
    alternatives at that step."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None


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
    # When asked for: [None, ...] on the first output after the prefill and on the final one.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Final output only (None while running):
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    text: str | None = None
    logprobs: list[TokenLogprob] | None = None
