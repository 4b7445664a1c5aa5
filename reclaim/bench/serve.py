"""`reclaim bench serve`: the OpenAI server under closed-loop load at several concurrencies, and a
stream's worst gap between tokens while a long prompt is prefilled.

Each level runs `c` clients that each send streamed chat requests back to back (greedy, EOS
ignored, so every request yields exactly `max_tokens` tokens). Measured at the client: request
throughput, output tokens/s, time to first token and time per output token (p50/p99). Two
baselines run in the same process on the same prompts, right after the server at each level: the
engine called directly with the same `c` requests in flight (what HTTP, SSE and the event loop
cost), and transformers' `generate` serving the same `c` clients with static batching (the `c`
queued requests form one left-padded batch; the next batch starts when it finishes; TTFT is when
the batch's first forward ends). Every level is repeated `repeats` times (server, engine,
transformers, then the next level); the JSON keeps every run and the medians with min/max.

The gap point (issue 12): one stream runs alone, then again while a ~8K-token prompt (the longest
the model's context allows) is sent after its first tokens; the worst gap between its tokens is
reported at each `max_num_batched_tokens` (the engine's token budget per step, passed through the
server's engine args), with the long prompt's time to first token beside it.

The structured-output point (issue 11): at each concurrency, the same clients send requests with
`response_format: json_schema` (STRUCTURED_SCHEMA by default, strict; the grammar ends each
reply) and unconstrained ones, each as long as the constrained reply to the same prompt; tokens/s
of both and the ratio, every constrained output validated against the schema. `only="structured"`
runs this point alone and adds it to an existing serve.json.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from reclaim.bench.meta import finish_metadata, run_metadata, write_result
from reclaim.bench.serve_load import (
    ServeBenchSpec, aggregate, chat_messages, in_thread, openai_client, run_engine_level, run_hf_static, run_server_level,
    spread,
)


# ---- a stream's worst inter-token gap while a long prompt is prefilled ----

async def stream_gaps(url: str, model: str, *, long_messages: list[dict] | None,
                      alone_tokens: int, stream_max_tokens: int, warm_tokens: int = 4) -> dict[str, Any]:
    """One greedy stream (chat_messages(0)); with `long_messages`, that request is sent once
    the stream has `warm_tokens` tokens, and the stream is read until 2 tokens after the long
    request's first token. Returns the worst gap between the stream's tokens in that window (ms)."""
    async with openai_client(url) as client:
        stream = await client.chat.completions.create(
            model=model, messages=chat_messages(0), max_tokens=stream_max_tokens, temperature=0.0,
            stream=True, extra_body={"ignore_eos": True})
        arrivals: list[float] = []
        long_task: asyncio.Task | None = None
        sent = done = None

        async def long_request() -> float:
            await client.chat.completions.create(model=model, messages=long_messages, max_tokens=1,
                                                 temperature=0.0)
            return time.perf_counter()

        async for chunk in stream:
            if not (chunk.choices and chunk.choices[0].delta.content):
                continue
            arrivals.append(time.perf_counter())
            if long_messages is None:
                if len(arrivals) >= warm_tokens + alone_tokens:
                    break
                continue
            if long_task is None and len(arrivals) >= warm_tokens:
                sent = time.perf_counter()
                long_task = asyncio.create_task(long_request())
            elif long_task is not None and long_task.done():
                done = done or long_task.result()
                if sum(t > done for t in arrivals) >= 2:
                    break
        await stream.close()
        if long_task is not None:
            done = done or await long_task  # the stream may end first
    start = arrivals[warm_tokens - 1] if long_messages is None else sent
    end = done if done is not None else float("inf")
    window = [b - a for a, b in zip(arrivals, arrivals[1:]) if start < b and a <= end]
    out = {"worst_gap_ms": 1000 * max(window), "median_gap_ms": 1000 * statistics.median(window),
           "gaps": len(window)}
    if long_messages is not None:
        out["long_prompt_ttft_s"] = done - sent
    return out


def gap_point(model: Any, tokenizer: Any, name: str, spec: ServeBenchSpec) -> dict[str, Any]:
    """The stream's worst gap alone and beside the long prompt, at each token budget."""
    from reclaim.data.sharegpt import user_message
    from reclaim.models.tokenizer import encode_chat
    from reclaim.engine.config import EngineConfig
    from reclaim.server.serve import BackgroundServer, build_app

    context = model.config.max_position_embeddings
    want = min(spec.long_prompt_tokens, context - 64)
    rng = random.Random(0)
    text = user_message(tokenizer, want, rng)
    long_messages = [{"role": "user", "content": text}]
    while len(encode_chat(tokenizer, long_messages)) >= context - 8:  # the template adds a few
        text = text[: int(len(text) * 0.98)]
        long_messages = [{"role": "user", "content": text}]
    n_long = len(encode_chat(tokenizer, long_messages))
    # The stream may run to the end of the context while the long prompt is prefilled.
    kw = {"alone_tokens": spec.gap_stream_tokens,
          "stream_max_tokens": context - len(encode_chat(tokenizer, chat_messages(0))) - 1}
    rows = []
    for budget in spec.gap_budgets:
        args = EngineConfig(max_num_seqs=spec.max_num_seqs, device=spec.device,
                          max_num_batched_tokens=budget)
        app, _, _ = build_app(model, tokenizer, (name,), args)
        server = BackgroundServer(app)
        try:
            asyncio.run(run_server_level(server.url, name, 1, 1, 4))  # warm-up
            alone = asyncio.run(stream_gaps(server.url, name, long_messages=None, **kw))
            beside = asyncio.run(stream_gaps(server.url, name, long_messages=long_messages, **kw))
        finally:
            server.stop()
        rows.append({"max_num_batched_tokens": budget, "alone": alone, "with_long_prompt": beside})
        print(f"gap, budget {budget}: worst {alone['worst_gap_ms']:.0f} ms alone, "
              f"{beside['worst_gap_ms']:.0f} ms beside a {n_long}-token prompt "
              f"(its TTFT {beside['long_prompt_ttft_s']:.1f} s)", flush=True)
    return {"long_prompt_tokens": n_long, "requested_long_prompt_tokens": spec.long_prompt_tokens,
            "model_context": context,
            "clipped_to_context": n_long < spec.long_prompt_tokens, "budgets": rows}


# ---- structured output against unconstrained ----

def valid_outputs(texts: list[str], schema: dict) -> int:
    """How many of `texts` are JSON that `schema` accepts."""
    import jsonschema

    ok = 0
    for text in texts:
        try:
            jsonschema.validate(json.loads(text), schema)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            continue
        ok += 1
    return ok


def structured_point(url: str, name: str, spec: ServeBenchSpec) -> dict[str, Any]:
    """At each concurrency and repeat, back to back: json_schema requests and unconstrained ones,
    request i of those asking for (ignore_eos) as many tokens as constrained reply i had, so both
    sides do the same work in the same batches; the order alternates between repeats, so a
    load that drifts during a pair favours neither side."""
    schema = spec.structured_schema
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    levels = []
    for c in spec.structured_concurrency:
        n = max(spec.min_requests, spec.requests_per_client * c)
        got: dict[str, list] = {"json_schema": [], "unconstrained": []}
        valid = total = 0
        lengths: dict[int, int] = {}  # request i -> its constrained reply's tokens (greedy: fixed)
        for r in range(spec.repeats):
            replies: dict[int, tuple[str, int]] = {}

            def constrained() -> dict:
                return asyncio.run(run_server_level(url, name, c, n, spec.structured_max_tokens,
                                                    replies, response_format=fmt))

            if r % 2 == 0:
                js = constrained()
                lengths = lengths or {i: max(1, k) for i, (_, k) in replies.items()}
                free = asyncio.run(run_server_level(url, name, c, n, lengths))
            else:
                free = asyncio.run(run_server_level(url, name, c, n, lengths))
                js = constrained()
            valid += valid_outputs([text for text, _ in replies.values()], schema)
            total += len(replies)
            got["json_schema"].append(js)
            got["unconstrained"].append(free)
            print(f"structured repeat {r + 1}/{spec.repeats} c={c}: json_schema {_line(js)}; "
                  f"unconstrained (the same lengths) {_line(free)}", flush=True)
        ratios = [a["output_tok_per_s"] / b["output_tok_per_s"]
                  for a, b in zip(got["json_schema"], got["unconstrained"])]
        levels.append({"concurrency": c, "requests": n, **{k: aggregate(v) for k, v in got.items()},
                       "json_schema_vs_unconstrained_tok_per_s": spread(ratios),
                       "outputs_valid": valid, "outputs": total,
                       "reply_tokens": [lengths[i] for i in sorted(lengths)]})
    return {"schema": schema, "max_tokens": spec.structured_max_tokens, "levels": levels}


def engine_config(spec: ServeBenchSpec) -> Any:
    """The server's and the bare engine's config: `spec.engine` (--engine-config) over the
    bench's device, and the bench's max_num_seqs over both."""
    from reclaim.engine.config import EngineConfig

    return EngineConfig(**{"device": spec.device, **spec.engine}).replace(max_num_seqs=spec.max_num_seqs)


def _model_and_app(spec: ServeBenchSpec) -> tuple[Any, Any, Any, Any]:
    """The model directory, reclaim's model and tokenizer, and the server app on them (threads set)."""
    from reclaim.models.loading import load_model, resolve_model_dir
    from reclaim.server.serve import build_app

    if spec.threads:
        torch.set_num_threads(spec.threads)
    model_dir = resolve_model_dir(spec.model)
    model, tokenizer = load_model(model_dir, device=spec.device)
    app, _, _ = build_app(model, tokenizer, (model_dir.name,), engine_config(spec))
    return model_dir, model, tokenizer, app


def run_structured(spec: ServeBenchSpec) -> dict:
    """The structured-output point alone, with its own run metadata."""
    from reclaim.server.serve import BackgroundServer

    model_dir, model, tokenizer, app = _model_and_app(spec)
    meta = run_metadata()  # after the threads are set: it records them
    name = model_dir.name
    server = BackgroundServer(app)
    try:
        asyncio.run(run_server_level(server.url, name, 1, 2, 4))  # warm-up
        point = structured_point(server.url, name, spec)
    finally:
        server.stop()
    return {**point, "model": str(model_dir), **finish_metadata(meta), "device": spec.device}


# ---- the sweep ----

def run(spec: ServeBenchSpec) -> dict:
    """Each level's repeats against the server, the engine and transformers; then the gap point."""
    from reclaim.engine.engine import Engine
    from reclaim.models.hf import load_hf_model
    from reclaim.models.tokenizer import encode_chat
    from reclaim.server.serve import BackgroundServer

    model_dir, model, tokenizer, app = _model_and_app(spec)
    meta = run_metadata()  # after the threads are set: it records them
    hf = load_hf_model(model_dir, device=spec.device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    name = model_dir.name
    counts = {c: max(spec.min_requests, spec.requests_per_client * c) for c in spec.concurrency}
    prompts = [encode_chat(tokenizer, chat_messages(i)) for i in range(max(counts.values()))]
    server = BackgroundServer(app)
    engine = Engine(model, tokenizer, engine_config(spec))
    runs: dict[int, dict[str, list]] = {c: {"server": [], "engine": [], "hf_static": []}
                                        for c in spec.concurrency}
    try:
        asyncio.run(run_server_level(server.url, name, 1, 2, 4))  # warm-up
        in_thread(run_engine_level, engine, prompts[:2], 2, 4)
        in_thread(run_hf_static, hf, prompts[:2], 2, 4, pad)
        for r in range(spec.repeats):
            for c in spec.concurrency:
                # Server and baselines back to back, so all see the same machine load.
                n = counts[c]
                got = runs[c]
                got["server"].append(asyncio.run(run_server_level(server.url, name, c, n, spec.max_tokens)))
                got["engine"].append(in_thread(run_engine_level, engine, prompts[:n], c, spec.max_tokens))
                got["hf_static"].append(in_thread(run_hf_static, hf, prompts[:n], c, spec.max_tokens, pad))
                print(f"repeat {r + 1}/{spec.repeats} c={c}: " + "; ".join(
                    f"{side} {_line(v[-1])}" for side, v in got.items()), flush=True)
        structured = structured_point(server.url, name, spec) if spec.structured_concurrency else None
    finally:
        server.stop()
    del engine, app, server
    levels = []
    for c in spec.concurrency:
        got = runs[c]
        tps = {side: [r["output_tok_per_s"] for r in v] for side, v in got.items()}
        levels.append({
            "concurrency": c, "requests": counts[c],
            **{side: aggregate(v) for side, v in got.items()},
            "ratios": {  # per repeat, then median and min/max
                "server_vs_engine_tok_per_s": spread([a / b for a, b in zip(tps["server"], tps["engine"])]),
                "server_vs_hf_static_tok_per_s": spread(
                    [a / b for a, b in zip(tps["server"], tps["hf_static"])]),
            },
        })
    gaps = gap_point(model, tokenizer, name, spec) if spec.gap_budgets else None
    return {"benchmark": "serve", "model": str(model_dir), "spec": asdict(spec),
            **finish_metadata(meta), "device": spec.device,
            "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts),
            "levels": levels, "inter_token_gap": gaps, "structured_output": structured}


def _line(r: dict) -> str:
    return (f"{r['output_tok_per_s']:.1f} tok/s, TTFT p50 {r['ttft_p50_ms']:.0f} ms, "
            f"TPOT p50 {r['tpot_p50_ms']:.1f} ms")


def plot(result: dict, path: Path) -> None:
    """Throughput (server, engine, transformers static batching; median with min/max bars),
    server latency percentiles against concurrency, and the worst inter-token gap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = result["levels"]
    cs = [lv["concurrency"] for lv in levels]
    gaps = result.get("inter_token_gap")
    structured = result.get("structured_output")
    panels = 2 + bool(gaps) + bool(structured)
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels + 1, 4))
    a, b = axes[0], axes[1]
    for side, style, label in (("server", "o-", "reclaim server (HTTP, SSE)"),
                               ("engine", "s--", "reclaim engine, direct"),
                               ("hf_static", "^:", "transformers generate, static batches")):
        sp = [lv[side]["output_tok_per_s_spread"] for lv in levels]
        med = [s["median"] for s in sp]
        a.errorbar(cs, med, yerr=[[m - s["min"] for m, s in zip(med, sp)],
                                  [s["max"] - m for m, s in zip(med, sp)]],
                   fmt=style, capsize=3, label=label)
    a.set(xscale="log", xlabel="concurrent clients", ylabel="output tokens/s",
          title=f"Throughput (median, min-max of {result['spec']['repeats']})")
    a.set_xticks(cs, [str(c) for c in cs])
    a.minorticks_off()
    a.legend(fontsize=8)
    for key, style in (("ttft", "o-"), ("tpot", "s-")):
        for q, alpha in ((50, 1.0), (99, 0.5)):
            b.plot(cs, [lv["server"][f"{key}_p{q}_ms"] for lv in levels], style, alpha=alpha,
                   label=f"{key.upper()} p{q}")
    b.set(xscale="log", yscale="log", xlabel="concurrent clients", ylabel="ms",
          title="Server latency (client side, median of repeats)")
    b.set_xticks(cs, [str(c) for c in cs])
    b.minorticks_off()
    b.legend(fontsize=8)
    if gaps:
        g = axes[2]
        rows = gaps["budgets"]
        xs = range(len(rows))
        g.bar([x - 0.2 for x in xs], [r["alone"]["worst_gap_ms"] for r in rows], 0.4, label="stream alone")
        g.bar([x + 0.2 for x in xs], [r["with_long_prompt"]["worst_gap_ms"] for r in rows], 0.4,
              label=f"beside a {gaps['long_prompt_tokens']}-token prompt")
        g.set_xticks(list(xs), [f"budget {r['max_num_batched_tokens']}" for r in rows])
        g.set(yscale="log", ylabel="worst gap between tokens (ms)",
              title="Stream stall during a long prefill")
        g.legend(fontsize=8)
    if structured:
        plot_structured(axes[-1], structured)
    m = result["machine"]
    fig.suptitle(f"reclaim bench serve: {Path(result['model']).name}, "
                 f"{result['spec']['max_tokens']} output tokens/request, {result['device']}, "
                 f"{m['torch_threads']} threads, load {m['load_average_at_start'][0]}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_structured(ax: Any, point: dict) -> None:
    """Tokens/s of json_schema and unconstrained requests per concurrency, the ratio on top."""
    rows = point["levels"]
    xs = range(len(rows))
    for side, dx in (("json_schema", -0.2), ("unconstrained", 0.2)):
        sp = [r[side]["output_tok_per_s_spread"] for r in rows]
        med = [x["median"] for x in sp]
        ax.bar([x + dx for x in xs], med, 0.4, label=side.replace("_", " "),
               yerr=[[m - x["min"] for m, x in zip(med, sp)], [x["max"] - m for m, x in zip(med, sp)]],
               capsize=3)
    for x, r in zip(xs, rows):
        top = max(r[side]["output_tok_per_s_spread"]["max"] for side in ("json_schema", "unconstrained"))
        ax.annotate(f"{r['json_schema_vs_unconstrained_tok_per_s']['median']:.2f}x, "
                    f"{r['outputs_valid']}/{r['outputs']} valid", (x, top), ha="center",
                    va="bottom", fontsize=8)
    ax.set_xticks(list(xs), [f"{r['concurrency']} clients" for r in rows])
    load = (point.get("machine") or {}).get("load_average_at_start")
    ax.set(ylabel="output tokens/s", title="json_schema vs unconstrained, same lengths"
           + (f" (load {load[0]})" if load else ""))
    ax.legend(fontsize=8, loc="lower right")


def main(spec: ServeBenchSpec) -> dict:
    """Run the sweep and write serve.json and serve.png under `spec.out_dir`; with
    only="structured", run that point alone and put it into the existing serve.json."""
    out = Path(spec.out_dir)
    if spec.only == "structured":
        if not (out / "serve.json").exists():
            raise FileNotFoundError(f"{out / 'serve.json'} does not exist; run the whole sweep first")
        result = json.loads((out / "serve.json").read_text())
        result["structured_output"] = run_structured(spec)
    else:
        result = run(spec)
    write_result(out, "serve", result, plot)
    return result
