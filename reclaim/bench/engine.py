"""`reclaim bench engine`: generation tokens/s of reclaim's engine against transformers' `generate`.

Three workloads, both sides greedy on the same weights in one process:

- static batch 1: `batch1_prompts` chat prompts, each run alone (stopping at EOS);
- static batch 16: the first `static_batch` prompts as one batch (stopping at EOS);
- ShareGPT-shaped: `sharegpt_requests` requests with ShareGPT-shaped prompt and output lengths
  (`reclaim.data.sharegpt`) through at most `sharegpt_slots` slots: reclaim's continuous
  batching with every request added at once, against transformers `generate` in static batches
  of `sharegpt_slots` in arrival order (each left-padded to its longest prompt and run for its
  longest output). Every request asks for exactly its output length (EOS ignored) and tokens/s
  counts those requested tokens only, so the padding rows a static batch computes count for
  nothing.

reclaim runs with each kernel choice in `heads`: 'linear' is plain `F.linear` in every layer and
the LM head, the kernels transformers uses (the same kernels on both sides); 'auto' lets the
engine use its own on CPU, which transformers does not get: the few-row C kernel
(`models/kernels/small_linear.c`) for products of at most 16 rows and oneDNN for the head beyond.
The static points alternate sides `repeats` times and report the median with min/max; the
ShareGPT point runs once per side. Outputs are compared token for token (the ShareGPT point: each
request's first L_i tokens). Writes JSON and a PNG.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from reclaim.bench.meta import finish_metadata, run_metadata, write_result

QUESTIONS = [
    "What is the capital of France?",
    "Write a short story about a lighthouse keeper.",
    "Explain how photosynthesis works.",
    "Give me three tips for learning a new language.",
    "What is 17 times 23?",
    "Describe the water cycle for a ten-year-old.",
    "Write a haiku about autumn.",
    "What are the main differences between Python lists and tuples?",
    "Summarize the plot of Romeo and Juliet.",
    "How do I make a cup of green tea?",
    "Name the planets of the solar system.",
    "Why is the sky blue?",
    "Write a polite email declining a meeting invitation.",
    "What causes earthquakes?",
    "Suggest a name for a bakery.",
    "Explain what a hash table is.",
]
WORKLOADS = ("batch1", "static", "sharegpt")
HEADS = ("linear", "auto")


@dataclass
class EngineBenchSpec:
    """What to run: model, workloads and their sizes, repeats, threads, where to write."""

    model: str | None = None
    workloads: list[str] = field(default_factory=lambda: list(WORKLOADS))
    heads: list[str] = field(default_factory=lambda: list(HEADS))
    batch1_prompts: int = 8  # static batch 1: this many prompts, each run alone
    static_batch: int = 16
    max_tokens: int = 64  # static points: most tokens per prompt (stops at EOS unless ignore_eos)
    ignore_eos: bool = False
    repeats: int = 2  # static points: alternating runs per side
    sharegpt_requests: int = 128
    sharegpt_slots: int = 16
    sharegpt_scale: float = 0.2  # multiplies ShareGPT's median lengths (see reclaim.data.sharegpt)
    sharegpt_file: str | None = None  # a ShareGPT JSON: its lengths instead of synthetic ones
    seed: int = 0
    max_model_len: int = 2048
    threads: int | None = None
    out_dir: str = "benchmarks"
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields (--engine-config)

    def __post_init__(self) -> None:
        for name, got, allowed in (("workloads", self.workloads, WORKLOADS), ("heads", self.heads, HEADS)):
            bad = sorted(set(got) - set(allowed))
            if bad or not got:
                raise ValueError(f"{name} {bad or got} unknown or empty; allowed: {list(allowed)}")
        sizes = (self.batch1_prompts, self.static_batch, self.max_tokens, self.repeats,
                 self.sharegpt_requests, self.sharegpt_slots)
        if min(sizes) < 1 or self.sharegpt_scale <= 0:
            raise ValueError("prompt counts, batch sizes, max_tokens, repeats, requests and slots "
                             f"must be >= 1 and scale > 0; got {sizes}, scale {self.sharegpt_scale}")


def chat_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    """The first `n` questions (cycled) as chat-templated token ids."""
    from reclaim.models.tokenizer import encode_chat

    return [encode_chat(tokenizer, [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
            for i in range(n)]


def sharegpt_workload(tokenizer: Any, spec: EngineBenchSpec) -> list[tuple[list[int], int]]:
    """(prompt ids, output tokens) per request: from spec.sharegpt_file's lengths if given
    (cycled), else seeded synthetic ShareGPT-shaped lengths; prompts are synthetic chat messages."""
    import random

    from reclaim.data.sharegpt import (chat_prompt, load_sharegpt, sharegpt_lengths,
                                       synthetic_requests)

    n, total = spec.sharegpt_requests, spec.max_model_len
    if spec.sharegpt_file is None:
        return synthetic_requests(tokenizer, n, seed=spec.seed, scale=spec.sharegpt_scale,
                                  max_total=total)
    pairs = sharegpt_lengths(load_sharegpt(spec.sharegpt_file), tokenizer)
    if not pairs:
        raise ValueError(f"{spec.sharegpt_file}: no conversation passed the ShareGPT length filter")
    rng = random.Random(spec.seed)
    out = []
    for i in range(n):
        p = pairs[i % len(pairs)]
        ids = chat_prompt(tokenizer, max(1, round(p.prompt_tokens * spec.sharegpt_scale)), rng)
        out.append((ids, max(1, min(round(p.output_tokens * spec.sharegpt_scale), total - len(ids)))))
    return out


def _until_eos(row: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(row):
        if t in eos:
            return row[: i + 1]
    return row


def run_transformers(hf: Any, prompts: list[list[int]], max_tokens: int, pad: int,
                     ignore_eos: bool, eos: set[int]) -> tuple[list[list[int]], float]:
    """One left-padded `generate` call over `prompts`; (tokens per prompt, seconds)."""
    from reclaim.models.hf import hf_generate

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t = time.perf_counter()
    out = hf_generate(hf, ids, mask, max_new_tokens=max_tokens, ignore_eos=ignore_eos)
    dt = time.perf_counter() - t
    rows = out.tolist()
    return [r if ignore_eos else _until_eos(r, eos) for r in rows], dt


def run_reclaim(engine: Any, prompts: list[list[int]], max_tokens: list[int],
                ignore_eos: bool) -> tuple[list[list[int]], float]:
    """All prompts added to one engine at once, run to completion; (tokens per prompt, seconds)."""
    from reclaim.engine.request import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=ignore_eos) for m in max_tokens]
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    return [list(o.token_ids) for o in outs], time.perf_counter() - t


def _spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def static_point(name: str, groups: list[list[list[int]]], hf: Any, engines: dict[str, Any],
                 spec: EngineBenchSpec, pad: int, eos: set[int]) -> dict[str, Any]:
    """Run `groups` (one generate call each) on every side, alternating, `spec.repeats` times."""
    sides = ["transformers"] + [f"reclaim[{h}]" for h in engines]
    secs: dict[str, list[float]] = {s: [] for s in sides}
    toks: dict[str, list[list[int]]] = {}
    for _ in range(spec.repeats):
        for side in sides:
            got, total = [], 0.0
            for g in groups:
                if side == "transformers":
                    out, dt = run_transformers(hf, g, spec.max_tokens, pad, spec.ignore_eos, eos)
                else:
                    out, dt = run_reclaim(engines[side[8:-1]], g, [spec.max_tokens] * len(g),
                                          spec.ignore_eos)
                got += out
                total += dt
            secs[side].append(total)
            toks[side] = got
    base = toks["transformers"]
    row: dict[str, Any] = {"workload": name, "prompts": len(base), "repeats": spec.repeats,
                           "output_lengths": [len(r) for r in base]}
    for side in sides:
        n = sum(len(r) for r in toks[side])
        row[side] = {"tokens": n, "seconds": _spread(secs[side]),
                     "tokens_per_s": n / statistics.median(secs[side])}
        if side != "transformers":
            # Per repeat: reclaim's tokens/s over transformers' from the same round.
            ratios = [(n / s) / (sum(map(len, base)) / b) for s, b in zip(secs[side], secs["transformers"])]
            row[side]["speedup"] = _spread(ratios)
            same = sum(a == b for a, b in zip(base, toks[side]))
            row[side]["identical_outputs"] = f"{same}/{len(base)}"
    return row


def sharegpt_point(requests: list[tuple[list[int], int]], hf: Any, engines: dict[str, Any],
                   spec: EngineBenchSpec, pad: int) -> dict[str, Any]:
    """Continuous batching (all requests added at once) against static batches of the slot count."""
    prompts = [p for p, _ in requests]
    lengths = [n for _, n in requests]
    want = sum(lengths)
    k = spec.sharegpt_slots
    hf_out: list[list[int]] = []
    hf_secs = 0.0
    batch_steps = []
    for i in range(0, len(requests), k):
        batch = requests[i:i + k]
        steps = max(n for _, n in batch)
        out, dt = run_transformers(hf, [p for p, _ in batch], steps, pad, True, set())
        hf_out += [r[:n] for r, (_, n) in zip(out, batch)]
        hf_secs += dt
        batch_steps.append(steps)
    row: dict[str, Any] = {
        "workload": "sharegpt", "requests": len(requests), "slots": k, "repeats": 1,
        "prompt_tokens": _spread([len(p) for p in prompts]) | {"mean": statistics.mean(map(len, prompts))},
        "output_tokens": _spread(lengths) | {"mean": statistics.mean(lengths), "total": want},
        "transformers": {"tokens": want, "seconds": hf_secs, "tokens_per_s": want / hf_secs,
                         "batch_decode_steps": batch_steps,
                         "computed_row_steps_per_requested_token": k * sum(batch_steps) / want},
    }
    for head, engine in engines.items():
        out, dt = run_reclaim(engine, prompts, lengths, True)
        n = sum(len(r) for r in out)
        same = sum(a[:m] == b for a, b, m in zip(out, hf_out, lengths))
        row[f"reclaim[{head}]"] = {"tokens": n, "seconds": dt, "tokens_per_s": want / dt,
                                   "speedup": hf_secs / dt, "identical_outputs": f"{same}/{len(out)}"}
    return row


def measure(spec: EngineBenchSpec) -> dict[str, Any]:
    """Run the chosen workloads on both sides; returns the JSON-ready result."""
    from reclaim.engine.config import EngineConfig
    from reclaim.engine.engine import Engine
    from reclaim.models.hf import load_hf_model
    from reclaim.models.loading import load_model, resolve_model_dir

    if spec.threads:
        torch.set_num_threads(spec.threads)
    meta = run_metadata()
    model, tok = load_model(spec.model)
    hf = load_hf_model(resolve_model_dir(spec.model))
    eos = {tok.eos_token_id}
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    max_len = min(spec.max_model_len, model.config.max_position_embeddings)
    slots = max(spec.static_batch, spec.sharegpt_slots)
    prompts = chat_prompts(tok, max(spec.batch1_prompts, spec.static_batch))
    rows = []
    with torch.inference_mode():
        # Warm both sides up (first-call allocations, kernel selection).
        run_transformers(hf, prompts[:2], 4, pad, False, eos)
        base = EngineConfig(**{"max_model_len": max_len, **spec.engine})
        engines = {h: Engine(model, tok, base, max_num_seqs=slots, head=h) for h in spec.heads}
        for e in engines.values():
            run_reclaim(e, prompts[:2], [4, 4], False)
        if "batch1" in spec.workloads:
            groups = [[p] for p in prompts[:spec.batch1_prompts]]
            rows.append(static_point("static batch 1", groups, hf, engines, spec, pad, eos))
            _print(rows[-1])
        if "static" in spec.workloads:
            groups = [prompts[:spec.static_batch]]
            rows.append(static_point(f"static batch {spec.static_batch}", groups, hf, engines,
                                     spec, pad, eos))
            _print(rows[-1])
        if "sharegpt" in spec.workloads:
            requests = sharegpt_workload(tok, spec)
            rows.append(sharegpt_point(requests, hf, engines, spec, pad))
            _print(rows[-1])
    return {
        "benchmark": "engine", "spec": asdict(spec), **finish_metadata(meta),
        "model": str(resolve_model_dir(spec.model)), "dtype": str(next(model.parameters()).dtype),
        "results": rows,
    }


def _label(row: dict[str, Any]) -> str:
    if row["workload"] == "sharegpt":
        return f"ShareGPT-shaped\n{row['requests']} req, {row['slots']} slots"
    return row["workload"]


def _print(row: dict[str, Any]) -> None:
    hf = row["transformers"]["tokens_per_s"]
    parts = [f"{row['workload']:>16}: transformers {hf:7.1f} tok/s"]
    for side, r in row.items():
        if side.startswith("reclaim["):
            s = r["speedup"]
            s = s["median"] if isinstance(s, dict) else s
            parts.append(f"{side} {r['tokens_per_s']:7.1f} tok/s {s:.2f}x "
                         f"(identical {r['identical_outputs']})")
    print(", ".join(parts), flush=True)


def plot(result: dict[str, Any], path: Path) -> None:
    """Grouped bars of tokens/s per workload, each reclaim bar labelled with its ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["results"]
    sides = ["transformers"] + [f"reclaim[{h}]" for h in result["spec"]["heads"]]
    names = {"transformers": "transformers generate (static batches)",
             "reclaim[linear]": "reclaim, F.linear (same kernels)",
             "reclaim[auto]": "reclaim, own kernels (auto)"}
    width = 0.8 / len(sides)
    fig, ax = plt.subplots(figsize=(8, 4.2))
    top = 0.0
    for j, side in enumerate(sides):
        xs = [i + (j - (len(sides) - 1) / 2) * width for i in range(len(rows))]
        ys = [r[side]["tokens_per_s"] for r in rows]
        top = max(top, *ys)
        ax.bar(xs, ys, width, label=names.get(side, side))
        if side != "transformers":
            for x, r, y in zip(xs, rows, ys):
                s = r[side]["speedup"]
                s = s["median"] if isinstance(s, dict) else s
                ax.text(x, y * 1.02, f"{s:.2f}x", ha="center", fontsize=8)
    ax.set_xticks(range(len(rows)), [_label(r) for r in rows], fontsize=8)
    ax.set_ylabel("output tokens / s (ShareGPT: requested tokens only)")
    m = result["machine"]
    ax.set_title(f"Greedy generation, {Path(result['model']).name} {result['dtype']}\n"
                 f"{m['cpu_model']}, {m['torch_threads']} thread(s), load {m['load_average_at_start'][0]}",
                 fontsize=9)
    ax.set_ylim(0, top * 1.2)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(spec: EngineBenchSpec) -> dict[str, Any]:
    """Measure, write engine.json and engine.png under spec.out_dir."""
    result = measure(spec)
    write_result(spec.out_dir, "engine", result, plot)
    return result
