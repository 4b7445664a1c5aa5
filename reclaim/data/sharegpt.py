"""ShareGPT-shaped serving workloads: real conversations from a ShareGPT JSON file, or seeded
synthetic prompt and output lengths drawn from a documented distribution.

ShareGPT (shared ChatGPT conversations, e.g. `ShareGPT_V3_unfiltered_cleaned_split.json`) is
what vLLM's serving benchmarks replay: the first human turn is the prompt, the gpt turn after it
gives the output length, and pairs with either side under 4 tokens, a prompt over 1024 tokens or
both over 2048 are dropped (vLLM `benchmarks/benchmark_serving.py`, `sample_sharegpt_requests`).

The synthetic lengths are log-normal, the usual fit for these right-skewed length distributions,
with medians and spreads chosen so the means match what is reported for ShareGPT under that
filter: the vLLM paper (Kwon et al., SOSP 2023, Sec. 6.1) finds ShareGPT's prompts 8.4x and its
outputs 5.8x longer than Alpaca's on average, and vLLM's `benchmark_serving` on 1000 ShareGPT
prompts (Llama tokenizer) reports roughly 200-300 input and about 200 output tokens per request.
The parameters below are chosen to match those summaries, not fitted to the raw data (which is
not shipped here):

    prompt tokens ~ LogNormal(median 130, sigma 1.0): mean ~215, p90 ~470
    output tokens ~ LogNormal(median 150, sigma 0.8): mean ~205, p90 ~420

`scale` multiplies both medians (the shape is kept) so a small CPU finishes in minutes; lengths
are then clipped to [min_tokens, 1024 * scale] for prompts and to the context for prompt + output.
"""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import dataclass
from typing import Any

PROMPT_MEDIAN = 130.0
PROMPT_SIGMA = 1.0
OUTPUT_MEDIAN = 150.0
OUTPUT_SIGMA = 0.8
MAX_PROMPT = 1024  # vLLM's ShareGPT filter
MAX_TOTAL = 2048
MIN_TOKENS = 4

# Words for synthetic user messages: plain English, so the chat template wraps ordinary text.
WORDS = ("the of and to a in is that for it as was with be by on not he this are or his from at "
         "which but have an they you were her she there been one all we their has would when if "
         "so no will can more about said up out into time people water story explain how why what "
         "make write list three short simple example city river music light learn garden question "
         "answer travel morning kitchen history science language friend letter window market").split()


@dataclass
class LengthPair:
    """One request's prompt length and requested output length, in tokens."""

    prompt_tokens: int
    output_tokens: int


@dataclass
class Conversation:
    """A ShareGPT pair: the first human message and the gpt reply to it."""

    prompt: str
    completion: str


def load_sharegpt(path: str | os.PathLike) -> list[Conversation]:
    """First (human, gpt) pair of every conversation in a ShareGPT JSON file.

    The format is `[{"conversations": [{"from": "human" | "gpt", "value": str}, ...]}, ...]`;
    conversations that do not start with a human turn followed by a gpt turn are skipped.
    """
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations, got {type(data).__name__}")
    out = []
    for item in data:
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, second = turns[0], turns[1]
        if first.get("from") == "human" and second.get("from") == "gpt":
            out.append(Conversation(str(first.get("value", "")), str(second.get("value", ""))))
    return out


def sharegpt_lengths(conversations: list[Conversation], tokenizer: Any, *,
                     max_prompt: int = MAX_PROMPT, max_total: int = MAX_TOTAL,
                     min_tokens: int = MIN_TOKENS) -> list[LengthPair]:
    """Token lengths of each pair, with vLLM's ShareGPT filter applied (see the module docstring)."""
    out = []
    for c in conversations:
        p = len(tokenizer.encode(c.prompt, add_special_tokens=False))
        o = len(tokenizer.encode(c.completion, add_special_tokens=False))
        if p < min_tokens or o < min_tokens or p > max_prompt or p + o > max_total:
            continue
        out.append(LengthPair(p, o))
    return out


def synthetic_lengths(n: int, *, seed: int = 0, scale: float = 1.0, max_total: int = MAX_TOTAL,
                      min_tokens: int = MIN_TOKENS) -> list[LengthPair]:
    """`n` seeded (prompt, output) lengths from the log-normal fit above, medians times `scale`.

    Prompts are clipped to [min_tokens, MAX_PROMPT * scale], outputs to at least min_tokens and
    prompt + output to max_total (the context the engine will run them in).
    """
    if n < 0 or scale <= 0:
        raise ValueError(f"n={n}, scale={scale}; need n >= 0 and scale > 0")
    rng = random.Random(seed)
    max_prompt = max(min_tokens, min(int(MAX_PROMPT * scale), max_total - min_tokens))
    out = []
    for _ in range(n):
        p = round(rng.lognormvariate(math.log(PROMPT_MEDIAN * scale), PROMPT_SIGMA))
        o = round(rng.lognormvariate(math.log(OUTPUT_MEDIAN * scale), OUTPUT_SIGMA))
        p = min(max(p, min_tokens), max_prompt)
        o = min(max(o, min_tokens), max_total - p)
        out.append(LengthPair(p, o))
    return out


def user_message(tokenizer: Any, num_tokens: int, rng: random.Random) -> str:
    """A user message of random plain words that encodes to about `num_tokens` tokens."""
    words = [rng.choice(WORDS) for _ in range(num_tokens + 8)]
    ids = tokenizer.encode(" ".join(words), add_special_tokens=False)[:num_tokens]
    return tokenizer.decode(ids).strip()


def chat_prompt(tokenizer: Any, num_tokens: int, rng: random.Random) -> list[int]:
    """Chat-templated prompt ids around a synthetic user message of about `num_tokens` tokens."""
    from reclaim.models.tokenizer import encode_chat

    return encode_chat(tokenizer, [{"role": "user", "content": user_message(tokenizer, num_tokens, rng)}])


def synthetic_requests(tokenizer: Any, n: int, *, seed: int = 0, scale: float = 1.0,
                       max_total: int = MAX_TOTAL) -> list[tuple[list[int], int]]:
    """`n` (prompt ids, output tokens) requests: synthetic_lengths' prompt length becomes a user
    message of that many tokens inside the chat template; output + prompt stays within max_total."""
    rng = random.Random(seed + 1)
    out = []
    for pair in synthetic_lengths(n, seed=seed, scale=scale, max_total=max_total):
        ids = chat_prompt(tokenizer, pair.prompt_tokens, rng)
        out.append((ids, max(1, min(pair.output_tokens, max_total - len(ids)))))
    return out
