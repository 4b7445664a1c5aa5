"""The load `reclaim bench serve` puts on a server and its baselines: the spec, closed-loop
clients through the openai client (`run_server_level`), the engine called directly with the same
requests in flight (`run_engine_level`) and transformers' static batching (`run_hf_static`), and
the statistics of their timings. bench/serve.py runs the sweep and the points on top.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

T = TypeVar("T")
QUESTIONS = [
    "Explain how a hash map handles collisions.",
    "Write a haiku about autumn rain in the city.",
    "What are the main causes of inflation? Answer briefly.",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "How do I reverse a linked list in Python?",
    "Give me three tips for a good night's sleep.",
    "What is the difference between TCP and UDP?",
    "Describe photosynthesis to a ten-year-old.",
    "Suggest a name for a coffee shop run by cats.",
    "Why is the sky blue?",
    "List the planets of the solar system in order.",
    "How does gradient descent find a minimum?",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "What should I pack for a weekend hiking trip?",
    "Explain recursion with a short example.",
    "What makes a good password?",
]
# Bounded (enums, maxLength, maxItems), so every reply ends within STRUCTURED_MAX_TOKENS.
STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {
        "topic": {"type": "string", "enum": ["science", "history", "code", "health", "food",
                                             "travel", "language", "other"]},
        "answer": {"type": "string", "maxLength": 80},
        "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
        "keywords": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["topic", "answer", "confidence", "keywords"],
    "additionalProperties": False,
}


@dataclass
class ServeBenchSpec:
    """One sweep; requests per level are max(min_requests, requests_per_client x c)."""

    model: str | None = None
    concurrency: list[int] = field(default_factory=lambda: [1, 8, 32])
    max_tokens: int = 32
    requests_per_client: int = 2
    min_requests: int = 4
    repeats: int = 3
    max_num_seqs: int = 32
    # The inter-token-gap point: budgets to compare, the long prompt's length (clipped to the
    # context), and how many tokens the stream reads when alone.
    gap_budgets: list[int] = field(default_factory=lambda: [256, 2048])
    long_prompt_tokens: int = 8000
    gap_stream_tokens: int = 32
    # The structured-output point: json_schema against unconstrained requests at these
    # concurrencies (empty skips it); `only="structured"` runs it alone (see main).
    structured_concurrency: list[int] = field(default_factory=lambda: [1, 8])
    structured_max_tokens: int = 160
    structured_schema: dict = field(default_factory=lambda: json.loads(json.dumps(STRUCTURED_SCHEMA)))
    only: str | None = None
    threads: int | None = None
    device: str = "cpu"
    out_dir: str = "benchmarks"
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields (--engine-config)

    def __post_init__(self) -> None:
        if self.only not in (None, "structured"):
            raise ValueError(f"only={self.only!r} is not a point of this benchmark; allowed: "
                             f"None (the whole sweep) or 'structured'")


@dataclass
class Timing:
    """One request as its client saw it (seconds)."""

    start: float
    first: float
    end: float
    tokens: int

    @property
    def ttft(self) -> float:
        return self.first - self.start

    @property
    def tpot(self) -> float | None:
        return (self.end - self.first) / (self.tokens - 1) if self.tokens > 1 else None


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(timings: list[Timing], wall: float) -> dict[str, float]:
    """Throughput and latency percentiles (milliseconds) of one run of one level."""
    ttft = [t.ttft for t in timings]
    tpot = [t.tpot for t in timings if t.tpot is not None]
    out = {"requests": len(timings), "wall_s": wall, "req_per_s": len(timings) / wall,
           "output_tok_per_s": sum(t.tokens for t in timings) / wall}
    for name, xs in (("ttft", ttft), ("tpot", tpot)):
        for q in (50, 99):
            out[f"{name}_p{q}_ms"] = 1000 * percentile(xs, q) if xs else float("nan")
    return out


def spread(xs: list[float]) -> dict[str, float]:
    """Median, min and max over repeats."""
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def aggregate(runs: list[dict[str, float]]) -> dict[str, Any]:
    """Every metric's median over the repeats, throughput's min/max, and the runs themselves."""
    out: dict[str, Any] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    out["output_tok_per_s_spread"] = spread([r["output_tok_per_s"] for r in runs])
    out["runs"] = runs
    return out


def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """Run `fn` in a worker thread, as the server runs its engine loop.

    Baselines then run in the same kind of thread as the server's engine: on a CPU shared with
    other work, torch's intra-op threads behave very differently on the main thread.
    """
    box: list = []
    worker = threading.Thread(target=lambda: box.append(fn(*args)))
    worker.start()
    worker.join()
    if not box:
        raise RuntimeError(f"{getattr(fn, '__name__', fn)} failed in its worker thread")
    return box[0]


def chat_messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]


# ---- reclaim server through the openai client ----

async def _client_loop(client: Any, model: str, queue: deque, max_tokens: int | dict[int, int],
                       out: list[Timing], replies: dict[int, tuple[str, int]] | None = None,
                       **extra: Any) -> None:
    """Send queued requests one after another; request i asks for max_tokens (or
    max_tokens[i]); `extra` goes to the request (response_format); each reply's (text, tokens)
    goes to `replies[i]` when given."""
    while queue:
        i = queue.popleft()
        start = time.perf_counter()
        first = None
        tokens = 0
        parts: list[str] = []
        stream = await client.chat.completions.create(
            model=model, messages=chat_messages(i), temperature=0.0,
            max_tokens=max_tokens[i] if isinstance(max_tokens, dict) else max_tokens,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            **extra)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                parts.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        end = time.perf_counter()
        out.append(Timing(start, first or end, end, tokens))
        if replies is not None:
            replies[i] = ("".join(parts), tokens)


def openai_client(url: str) -> Any:
    import openai

    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=600)


async def run_server_level(url: str, model: str, c: int, n: int, max_tokens: int | dict[int, int],
                           replies: dict[int, tuple[str, int]] | None = None, **extra: Any) -> dict:
    """`c` closed-loop streaming clients sending `n` requests in all (`max_tokens`, `extra`,
    `replies`: see _client_loop)."""
    queue, timings = deque(range(n)), []
    async with openai_client(url) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(_client_loop(client, model, queue, max_tokens, timings, replies, **extra)
                               for _ in range(c)))
        wall = time.perf_counter() - t0
    return summarize(timings, wall)


# ---- baselines ----

def run_engine_level(engine: Any, prompts: list[list[int]], c: int, max_tokens: int) -> dict:
    """The engine stepped directly, keeping `c` requests in flight like `c` clients."""
    from reclaim.engine.request import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    pending = deque(range(len(prompts)))
    live: dict[str, Timing] = {}
    done: list[Timing] = []
    tag = f"bench-{time.monotonic_ns()}"

    def admit() -> None:
        while pending and len(live) < c:
            i = pending.popleft()
            rid = f"{tag}-{i}"
            engine.add_request(rid, prompts[i], params)
            live[rid] = Timing(time.perf_counter(), 0.0, 0.0, 0)

    t0 = time.perf_counter()
    admit()
    while live:
        outputs = engine.step()
        now = time.perf_counter()
        for o in outputs:
            t = live[o.request_id]
            t.tokens += len(o.new_token_ids)
            if o.new_token_ids and not t.first:
                t.first = now
            if o.finished:
                t.end = now
                done.append(live.pop(o.request_id))
        admit()
    return summarize(done, time.perf_counter() - t0)


def run_hf_static(hf: Any, prompts: list[list[int]], c: int, max_tokens: int, pad: int) -> dict:
    """transformers' generate serving `c` closed-loop clients with static batching: each batch is
    the `c` queued requests, left-padded, run to max_tokens; a request's first token is out when
    the batch's first forward (the prefill) ends."""
    from reclaim.bench.engine import run_transformers

    ends: list[float] = []
    hook = hf.register_forward_hook(lambda *_: ends.append(time.perf_counter()))
    timings = []
    try:
        with torch.inference_mode():
            t0 = time.perf_counter()
            for i in range(0, len(prompts), c):
                batch = prompts[i:i + c]
                ends.clear()
                start = time.perf_counter()
                out, _ = run_transformers(hf, batch, max_tokens, pad, True, set())
                end = time.perf_counter()
                timings += [Timing(start, ends[0], end, len(r)) for r in out]
            wall = time.perf_counter() - t0
    finally:
        hook.remove()
    return summarize(timings, wall)
