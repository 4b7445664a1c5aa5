"""`reclaim bench serve`: the OpenAI server under closed-loop load at several concurrencies.

Each level runs `c` clients that each send streamed chat requests back to back (greedy, EOS
ignored, so every request yields exactly `max_tokens` tokens). Measured at the client: request
throughput, output tokens/s, time to first token and time per output token (p50/p99). Two
baselines run in the same process on the same prompts: the engine called directly with the same
`c` requests in flight (what HTTP, SSE and the event loop cost), and transformers' `generate`
one request at a time (a server without continuous batching).
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
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


@dataclass
class ServeBenchSpec:
    """One sweep; requests per level are max(min_requests, requests_per_client x c)."""

    model: str | None = None
    concurrency: list[int] = field(default_factory=lambda: [1, 8, 32])
    max_tokens: int = 32
    requests_per_client: int = 2
    min_requests: int = 4
    hf_requests: int = 4
    max_num_seqs: int = 32
    device: str = "cpu"
    out_dir: str = "benchmarks"


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
    """Throughput and latency percentiles (milliseconds) of one level."""
    ttft = [t.ttft for t in timings]
    tpot = [t.tpot for t in timings if t.tpot is not None]
    out = {"requests": len(timings), "wall_s": wall, "req_per_s": len(timings) / wall,
           "output_tok_per_s": sum(t.tokens for t in timings) / wall}
    for name, xs in (("ttft", ttft), ("tpot", tpot)):
        for q in (50, 99):
            out[f"{name}_p{q}_ms"] = 1000 * percentile(xs, q) if xs else float("nan")
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

async def _client_loop(client: Any, model: str, queue: deque, max_tokens: int,
                       out: list[Timing]) -> None:
    while queue:
        i = queue.popleft()
        start = time.perf_counter()
        first = None
        tokens = 0
        stream = await client.chat.completions.create(
            model=model, messages=chat_messages(i), max_tokens=max_tokens, temperature=0.0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content and first is None:
                first = time.perf_counter()
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        end = time.perf_counter()
        out.append(Timing(start, first or end, end, tokens))


async def run_server_level(url: str, model: str, c: int, n: int, max_tokens: int) -> dict:
    """`c` closed-loop streaming clients sending `n` requests in all."""
    import openai

    queue, timings = deque(range(n)), []
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0,
                                  timeout=600) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(_client_loop(client, model, queue, max_tokens, timings)
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

    def admit() -> None:
        while pending and len(live) < c:
            i = pending.popleft()
            rid = f"bench-{i}"
            engine.add_request(rid, prompts[i], params)
            live[rid] = Timing(time.perf_counter(), 0.0, 0.0, 0)

    t0 = time.perf_counter()
    admit()
    while live:
        outputs = engine.step()
        now = time.perf_counter()
        for o in outputs:
            t = live[o.request_id]
            if o.new_token_ids and not t.first:
                t.first = now
            if o.finished:
                t.end, t.tokens = now, len(o.token_ids)
                done.append(live.pop(o.request_id))
        admit()
    return summarize(done, time.perf_counter() - t0)


def run_hf_sequential(model_dir: Path, prompts: list[list[int]], max_tokens: int,
                      device: str) -> dict:
    """transformers' generate, one request at a time; TTFT from a separate 1-token generate."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True,
                                              dtype=torch.float32).to(device).eval()
    timings = []
    with torch.inference_mode():
        hf.generate(torch.tensor([prompts[0]], device=device), max_new_tokens=2,
                    do_sample=False)  # warm-up
        for ids in prompts:
            x = torch.tensor([ids], device=device)
            t0 = time.perf_counter()
            hf.generate(x, max_new_tokens=1, do_sample=False)
            t1 = time.perf_counter()
            out = hf.generate(x, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                              do_sample=False)
            t2 = time.perf_counter()
            timings.append(Timing(0.0, t1 - t0, t2 - t1, out.shape[1] - x.shape[1]))
    return summarize(timings, sum(t.end for t in timings))


# ---- the sweep ----

def run(spec: ServeBenchSpec) -> dict:
    """Run each level against the server and then the engine; then the transformers baseline."""
    from reclaim.engine.engine import Engine
    from reclaim.models.loading import load_model, resolve_model_dir
    from reclaim.server.serve import BackgroundServer, EngineArgs, build_app

    load_before = os.getloadavg()[0]  # other work on a shared machine moves every figure
    model_dir = resolve_model_dir(spec.model)
    model, tokenizer = load_model(model_dir, device=spec.device)
    name = model_dir.name
    n_max = max(max(spec.min_requests, spec.requests_per_client * c) for c in spec.concurrency)
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(chat_messages(i), tokenize=False,
                                                              add_generation_prompt=True),
                                add_special_tokens=False) for i in range(n_max)]
    app, _, _ = build_app(model, tokenizer, (name,),
                               EngineArgs(max_num_seqs=spec.max_num_seqs, device=spec.device))
    server = BackgroundServer(app)
    levels = []
    try:
        asyncio.run(run_server_level(server.url, name, 1, 2, 4))  # warm-up
        for c in spec.concurrency:
            # Server and engine back to back, so both see the same machine load.
            n = max(spec.min_requests, spec.requests_per_client * c)
            served = asyncio.run(run_server_level(server.url, name, c, n, spec.max_tokens))
            print(f"server c={c}: {_line(served)}", flush=True)
            engine = Engine(model, tokenizer, max_num_seqs=c, device=spec.device)
            direct = in_thread(run_engine_level, engine, prompts[:n], c, spec.max_tokens)
            del engine
            print(f"engine c={c}: {_line(direct)}", flush=True)
            levels.append({"concurrency": c, "server": served, "engine": direct})
    finally:
        server.stop()
    hf = in_thread(run_hf_sequential, model_dir, prompts[:spec.hf_requests], spec.max_tokens,
                   spec.device)
    print(f"transformers sequential: {_line(hf)}", flush=True)
    for level in levels:
        s = level["server"]
        level["ratios"] = {
            "server_vs_engine_tok_per_s":
                s["output_tok_per_s"] / level["engine"]["output_tok_per_s"],
            "server_vs_hf_sequential_tok_per_s": s["output_tok_per_s"] / hf["output_tok_per_s"],
        }
    return {"benchmark": "serve", "model": str(model_dir), "spec": asdict(spec),
            "machine": {"platform": platform.platform(), "torch": torch.__version__,
                        "threads": torch.get_num_threads(), "device": spec.device,
                        "cpus": os.cpu_count(),
                        "load_average_1m": [load_before, os.getloadavg()[0]]},
            "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts),
            "levels": levels, "hf_sequential": hf}


def _line(r: dict) -> str:
    return (f"{r['req_per_s']:.2f} req/s, {r['output_tok_per_s']:.1f} tok/s, "
            f"TTFT p50/p99 {r['ttft_p50_ms']:.0f}/{r['ttft_p99_ms']:.0f} ms, "
            f"TPOT p50/p99 {r['tpot_p50_ms']:.1f}/{r['tpot_p99_ms']:.1f} ms")


def plot(result: dict, path: Path) -> None:
    """Throughput (server, engine, transformers) and latency percentiles against concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = result["levels"]
    cs = [lv["concurrency"] for lv in levels]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(cs, [lv["server"]["output_tok_per_s"] for lv in levels], "o-",
           label="reclaim server (HTTP, SSE)")
    a.plot(cs, [lv["engine"]["output_tok_per_s"] for lv in levels], "s--",
           label="reclaim engine, direct")
    a.axhline(result["hf_sequential"]["output_tok_per_s"], color="gray", ls=":",
              label="transformers generate, sequential")
    a.set(xscale="log", xlabel="concurrent clients", ylabel="output tokens/s",
          title="Throughput")
    a.set_xticks(cs, [str(c) for c in cs])
    a.minorticks_off()
    a.legend(fontsize=8)
    for key, style in (("ttft", "o-"), ("tpot", "s-")):
        for q, alpha in ((50, 1.0), (99, 0.5)):
            b.plot(cs, [lv["server"][f"{key}_p{q}_ms"] for lv in levels], style, alpha=alpha,
                   label=f"{key.upper()} p{q}")
    b.set(xscale="log", yscale="log", xlabel="concurrent clients", ylabel="ms",
          title="Server latency (client side)")
    b.set_xticks(cs, [str(c) for c in cs])
    b.minorticks_off()
    b.legend(fontsize=8)
    fig.suptitle(f"reclaim bench serve: {Path(result['model']).name}, "
                 f"{result['spec']['max_tokens']} output tokens/request, "
                 f"{result['machine']['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(spec: ServeBenchSpec) -> dict:
    """Run the sweep and write serve.json and serve.png under `spec.out_dir`."""
    result = run(spec)
    out = Path(spec.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out / "serve.png")
    return result
