"""`reclaim bench engine`: generation tokens/s of reclaim's engine against transformers' `generate`.

Both run greedy decoding of the same chat prompts on the same weights in one process, at each
batch size; runs alternate (baseline, reclaim, baseline, ...) and the best of the repeats counts,
so background load hits both sides alike. Tokens are counted up to and including EOS on both
sides, and the outputs are compared token for token. Writes JSON and a PNG plot.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

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


@dataclass
class EngineBenchSpec:
    """What to run: model, batch sizes, output length, repeats, threads, where to write."""

    model: str | None = None
    batch_sizes: list[int] = field(default_factory=lambda: [1, 16])
    batch1_prompts: int = 2  # batch size 1 runs this many prompts one after another
    max_tokens: int = 128
    ignore_eos: bool = False
    repeats: int = 2
    threads: int | None = None
    out_dir: str = "benchmarks"


def chat_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    """The first `n` questions (cycled) as chat-templated token ids."""
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        out.append(tokenizer.encode(text))
    return out


def _until_eos(row: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(row):
        if t in eos:
            return row[: i + 1]
    return row


def run_transformers(hf: Any, prompts: list[list[int]], spec: EngineBenchSpec, pad: int,
                     eos: set[int]) -> tuple[list[list[int]], float]:
    """One left-padded `generate` call over all prompts; (tokens per prompt, seconds)."""
    from reclaim.models.hf import hf_generate

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t = time.perf_counter()
    out = hf_generate(hf, ids, mask, max_new_tokens=spec.max_tokens, ignore_eos=spec.ignore_eos)
    dt = time.perf_counter() - t
    rows = out.tolist()
    return [r if spec.ignore_eos else _until_eos(r, eos) for r in rows], dt


def run_reclaim(engine: Any, prompts: list[list[int]], spec: EngineBenchSpec) -> tuple[list[list[int]], float]:
    """All prompts through one engine at once; (tokens per prompt, seconds)."""
    from reclaim.engine.request import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=spec.max_tokens, ignore_eos=spec.ignore_eos)
    t = time.perf_counter()
    outs = engine.generate(prompts, params)
    return [o.token_ids for o in outs], time.perf_counter() - t


def measure(spec: EngineBenchSpec) -> dict[str, Any]:
    """Run both sides at each batch size; returns the JSON-ready result."""
    from reclaim.engine.engine import Engine
    from reclaim.models.hf import load_hf_model
    from reclaim.models.loading import load_model, resolve_model_dir

    if spec.threads:
        torch.set_num_threads(spec.threads)
    model, tok = load_model(spec.model)
    hf = load_hf_model(resolve_model_dir(spec.model))
    eos = {tok.eos_token_id}
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    prompts = chat_prompts(tok, max(spec.batch_sizes))
    rows = []
    with torch.inference_mode():
        # Warm both sides up (first-call allocations, kernel selection).
        run_transformers(hf, prompts[:1], EngineBenchSpec(max_tokens=4), pad, eos)
        engine = Engine(model, tok, max_num_seqs=max(spec.batch_sizes), max_model_len=2048)
        run_reclaim(engine, prompts[:1], EngineBenchSpec(max_tokens=4))
        for b in spec.batch_sizes:
            groups = [[p] for p in prompts[: spec.batch1_prompts]] if b == 1 else [prompts[:b]]
            best = {"transformers": float("inf"), "reclaim": float("inf")}
            toks: dict[str, list[list[int]]] = {}
            for _ in range(spec.repeats):
                for side in ("transformers", "reclaim"):
                    got, secs = [], 0.0
                    for g in groups:
                        if side == "transformers":
                            out, dt = run_transformers(hf, g, spec, pad, eos)
                        else:
                            out, dt = run_reclaim(engine, g, spec)
                        got += out
                        secs += dt
                    best[side] = min(best[side], secs)
                    toks[side] = got
            n = {side: sum(len(r) for r in toks[side]) for side in toks}
            tps = {side: n[side] / best[side] for side in best}
            same = sum(a == b for a, b in zip(toks["transformers"], toks["reclaim"]))
            rows.append({
                "batch_size": b, "prompts": len(toks["reclaim"]),
                "transformers": {"tokens": n["transformers"], "seconds": best["transformers"],
                                 "tokens_per_s": tps["transformers"]},
                "reclaim": {"tokens": n["reclaim"], "seconds": best["reclaim"],
                            "tokens_per_s": tps["reclaim"]},
                "speedup": tps["reclaim"] / tps["transformers"],
                "identical_outputs": f"{same}/{len(toks['reclaim'])}",
                "output_lengths": [len(r) for r in toks["reclaim"]],
            })
    return {
        "benchmark": "engine", "command": "reclaim bench engine", "spec": asdict(spec),
        "model": str(resolve_model_dir(spec.model)), "dtype": str(next(model.parameters()).dtype),
        "torch_threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
        "results": rows,
    }


def plot(result: dict[str, Any], path: Path) -> None:
    """Grouped bars of tokens/s per batch size, with the speedup written over each group."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["results"]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(6, 4))
    hf = [r["transformers"]["tokens_per_s"] for r in rows]
    ours = [r["reclaim"]["tokens_per_s"] for r in rows]
    ax.bar([i - 0.2 for i in x], hf, 0.4, label="transformers generate")
    ax.bar([i + 0.2 for i in x], ours, 0.4, label="reclaim engine")
    for i, r in zip(x, rows):
        ax.text(i, max(hf[i], ours[i]) * 1.02, f"{r['speedup']:.2f}x", ha="center")
    ax.set_xticks(list(x), [f"batch {r['batch_size']}" for r in rows])
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"Greedy generation on {result['machine']}, {result['torch_threads']} thread(s)\n"
                 f"{Path(result['model']).name}, {result['dtype']}", fontsize=9)
    ax.set_ylim(0, max(hf + ours) * 1.15)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(spec: EngineBenchSpec) -> dict[str, Any]:
    """Measure, write engine.json and engine.png under spec.out_dir, print the ratios."""
    result = measure(spec)
    out = Path(spec.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out / "engine.png")
    for r in result["results"]:
        print(f"batch {r['batch_size']:>3}: transformers {r['transformers']['tokens_per_s']:7.1f} tok/s, "
              f"reclaim {r['reclaim']['tokens_per_s']:7.1f} tok/s, {r['speedup']:.2f}x, "
              f"identical outputs {r['identical_outputs']}")
    return result
