"""`reclaim bench spec`: speculative decoding against plain decoding, in one process.

On the same model, prompts (reasoning tasks and chat) and sampling settings, each method runs
the prompts through the engine with at most `batch` sequences at a time: plain decoding, ngram
(prompt lookup), the history drafter (suffix: the prompt and the outputs before it in the run, as
a fresh server's cache holds them), an EAGLE chain and tree, and the hybrid tree (suffix and EAGLE
merged). Reported per point: output tokens/s, the
speed-up over plain decoding, the mean accepted length tau (tokens committed per verifying
forward, the bonus token included, as EAGLE reports it), the drafter's share of the time, and for
greedy runs whether every output equals plain decoding's. At batch 1, transformers' `generate`
and its own prompt-lookup decoding (`prompt_lookup_num_tokens`) run as the outside peers.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from reclaim.bench.meta import finish_metadata, run_metadata, write_result

CHAT = [
    "Explain why the sky is blue in a short paragraph.",
    "Write a Python function that checks whether a string is a palindrome.",
    "List five tips for learning a new language, one line each.",
    "What is the difference between a list and a tuple in Python?",
    "Summarise the plot of Romeo and Juliet in three sentences.",
    "Give me a recipe for pancakes with the steps numbered.",
    "Why do we have seasons on Earth?",
    "Write a haiku about autumn leaves, then explain it.",
]


def reasoning_prompts(source: str, n: int, seed: int = 0) -> list[str]:
    """`n` reasoning tasks of `source` (reasoning-gym datasets, `rg:<name>[,<name>]`), a worked
    answer asked for."""
    from reclaim.data.tasks import WORKED_STEPS, make_prompts

    return [q.strip() + WORKED_STEPS for q in make_prompts(source, n, seed)]


@dataclass
class SpecBenchSpec:
    """One sweep: methods x temperatures x batch sizes on the same prompts."""

    model: str | None = None
    drafter: str | None = None  # EAGLE drafter directory; None: the default model's (trained once)
    eagle3: str | None = None  # an EAGLE-3 drafter directory: adds its chain beside the others
    methods: list[str] | None = None  # which to run beside plain (None: all)
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 16])
    temperatures: list[float] = field(default_factory=lambda: [0.0, 0.7])
    num_prompts: int = 16  # batch 1 runs the first half
    tasks: str = "rg:basic_arithmetic,chain_sum,leg_counting,letter_counting"  # half the prompts
    max_tokens: int = 64
    depth: int = 4
    tree_topk: int = 4
    tree_tokens: int = 8
    spec_max_batch: int = 4
    threads: int | None = 1
    hf_peer: bool = True
    repeats: int = 2  # runs of each method, interleaved (tokens/s: the median, and the spread)
    seed: int = 0
    # suffix-warm: the history drafter starts from the model's greedy answers to this many other
    # prompts of the same kinds (seed + 1, none of the measured ones): a server that has served
    # such traffic before (`--suffix-history`). 0: no such arm.
    warm_prompts: int = 0
    out_dir: str = "benchmarks"
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields (--engine-config)


# The methods that draft with the EAGLE drafter (`drafter`; the default model's is trained on first use).
DRAFTER_METHODS = ("hybrid", "eagle-chain", "eagle-chain-fixed", "eagle-tree")


def _asked(spec: SpecBenchSpec) -> list[str]:
    """The methods to run beside plain, in the table's order; an unknown name is refused."""
    every = ["ngram", "suffix", *(["suffix-warm"] if spec.warm_prompts else []), *DRAFTER_METHODS,
             *(["eagle3-chain"] if spec.eagle3 is not None else [])]
    if spec.methods is None:
        return every
    unknown = sorted(set(spec.methods) - set(every) - {"plain"})  # plain always runs
    if unknown:
        raise ValueError(f"methods {unknown} are unknown; allowed: {sorted(every)}")
    return [m for m in every if m in spec.methods]


def _methods(spec: SpecBenchSpec, drafter: str | None, history: str | None = None) -> dict[str, Any]:
    """Plain and each asked-for method's SpeculativeConfig (`drafter`: None when none of them
    drafts with it; `history`: suffix-warm's history file)."""
    from reclaim.engine.speculative import SpeculativeConfig

    common = {"num_speculative_tokens": spec.depth, "max_batch": spec.spec_max_batch}
    make = {
        "ngram": lambda: SpeculativeConfig(method="ngram", prompt_lookup_max=3, **common),
        # History: the prompt and the outputs before it in this run (a fresh server's cache), drafts
        # sized by their confidence (up to 16 tokens).
        "suffix": lambda: SpeculativeConfig(method="suffix", max_batch=spec.spec_max_batch),
        "suffix-warm": lambda: SpeculativeConfig(method="suffix", max_batch=spec.spec_max_batch, suffix_history=history),
        "hybrid": lambda: SpeculativeConfig(method="hybrid", model=drafter, max_batch=spec.spec_max_batch),
        "eagle-chain": lambda: SpeculativeConfig(method="eagle", model=drafter, **common),
        # The same chain at its full depth every step: what dynamic depth (the default) changes.
        "eagle-chain-fixed": lambda: SpeculativeConfig(method="eagle", model=drafter, dynamic_depth=False, **common),
        "eagle-tree": lambda: SpeculativeConfig(method="eagle", model=drafter, eagle_topk=spec.tree_topk,
                                                num_draft_tokens=spec.tree_tokens, **common),
        "eagle3-chain": lambda: SpeculativeConfig(method="eagle3", model=spec.eagle3, **common),
    }
    return {"plain": None, **{name: make[name]() for name in _asked(spec)}}


def run_engine(model: Any, tok: Any, prompts: list[list[int]], params: Any, batch: int,
               speculative: Any, engine_fields: dict[str, Any] | None = None) -> dict[str, Any]:
    """Generate every prompt with at most `batch` running; tokens/s, tau, draft share, outputs.
    `engine_fields` (EngineConfig's) go over the bench's max_model_len 1024 and seed 0."""
    from reclaim.engine.engine import Engine
    from reclaim.engine.request import SamplingParams

    engine = Engine(model, tok, _engine_config(engine_fields), max_num_seqs=batch, speculative=speculative)
    # Warm-up on the chat template's first tokens only: a history drafter must not have seen the
    # answers it is measured on (it starts with nothing, as a fresh server does).
    engine.generate([prompts[0][:8]], SamplingParams(temperature=0, max_tokens=2))
    engine.spec_stats.update({k: 0 for k in engine.spec_stats})
    t = time.perf_counter()
    ids = [engine.add_request(None, p, params) for p in prompts]
    final, steps = {}, 0
    while len(final) < len(ids):
        steps += 1
        final.update({o.request_id: o for o in engine.step() if o.finished})
    secs = time.perf_counter() - t
    outs = [final[i] for i in ids]
    s = engine.spec_stats
    tokens = sum(len(o.token_ids) for o in outs)
    out = {"tokens": tokens, "seconds": secs, "tokens_per_s": tokens / secs,
           "tau": (s["accepted"] + s["verifies"]) / s["verifies"] if s["verifies"] else None,
           "acceptance_rate": s["accepted"] / s["drafted"] if s["drafted"] else None,
           "draft_share": s["draft_seconds"] / secs, "verifies": s["verifies"], "steps": steps,
           # one call of the drafter against the mean step it drafts for
           "draft_seconds_per_call": s["draft_seconds"] / s["draft_calls"] if s["draft_calls"] else None,
           "step_seconds": secs / steps, "outputs": [o.token_ids for o in outs]}
    memory = getattr(engine.proposer, "memory", None)
    if memory is not None:  # the history drafter's size after the run
        out["history"] = memory()
    return out


def _engine_config(fields: dict[str, Any] | None) -> Any:
    """The bench's engine: max_model_len 1024 and seed 0 under the --engine-config fields."""
    from reclaim.engine.config import EngineConfig

    return EngineConfig(**{"max_model_len": 1024, "seed": 0, **(fields or {})})


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median tokens/s (the lower middle one), with every run's tokens/s beside it."""
    rs = sorted(runs, key=lambda r: r["tokens_per_s"])
    return {**rs[(len(rs) - 1) // 2], "tokens_per_s_runs": [r["tokens_per_s"] for r in runs]}


def run_hf(hf: Any, prompts: list[list[int]], max_tokens: int, lookup: int | None) -> dict[str, Any]:
    """transformers' greedy generate one prompt at a time, optionally with its prompt lookup."""
    eos = hf.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    extra = {} if lookup is None else {"prompt_lookup_num_tokens": lookup}
    with torch.inference_mode():
        hf.generate(input_ids=torch.tensor([prompts[0]]), max_new_tokens=2, do_sample=False, **extra)
        outs, t = [], time.perf_counter()
        for p in prompts:
            ids = hf.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=max_tokens, do_sample=False, **extra)[0, len(p):].tolist()
            cut = next((i + 1 for i, x in enumerate(ids) if x in eos), len(ids))
            outs.append(ids[:cut])
        secs = time.perf_counter() - t
    tokens = sum(len(o) for o in outs)
    return {"tokens": tokens, "seconds": secs, "tokens_per_s": tokens / secs, "outputs": outs}


def measure(spec: SpecBenchSpec) -> dict[str, Any]:
    from reclaim.engine.request import SamplingParams
    from reclaim.models.loading import load_model, resolve_model_dir
    from reclaim.models.tokenizer import encode_chat

    if spec.threads:
        torch.set_num_threads(spec.threads)
    meta = run_metadata()
    model, tok = load_model(spec.model)
    drafter = spec.drafter
    drafter_seconds = None
    if drafter is None and set(_asked(spec)) & set(DRAFTER_METHODS):  # the default model's, trained on first use
        from reclaim.drafter.bundled import default_drafter_dir

        t = time.perf_counter()
        drafter = str(default_drafter_dir())
        drafter_seconds = time.perf_counter() - t
    half = spec.num_prompts // 2
    texts = reasoning_prompts(spec.tasks, half, spec.seed) + CHAT[: spec.num_prompts - half]
    prompts = [encode_chat(tok, [{"role": "user", "content": q}]) for q in texts]
    prompts = [p for pair in zip(prompts[:half], prompts[half:]) for p in pair]  # mix kinds in every wave
    history = _warm_history(model, tok, spec, texts) if "suffix-warm" in _asked(spec) else None
    methods = _methods(spec, drafter, history and history["path"])
    points = []
    for temp in spec.temperatures:
        params = SamplingParams(temperature=temp, max_tokens=spec.max_tokens, seed=None)
        for batch in spec.batch_sizes:
            use = prompts[: max(batch, half)] if batch == 1 else prompts
            tries: dict[str, list[dict[str, Any]]] = {name: [] for name in methods}
            for _ in range(spec.repeats):  # interleaved, so drifting load hits every method alike
                for name, cfg in methods.items():
                    tries[name].append(run_engine(model, tok, use, params, batch, cfg, spec.engine))
            runs = {name: _median_run(rs) for name, rs in tries.items()}
            base = runs["plain"]
            for name, r in runs.items():
                row = {"temperature": temp, "batch": batch, "method": name, "prompts": len(use),
                       **{k: v for k, v in r.items() if k != "outputs"},
                       "speedup": r["tokens_per_s"] / base["tokens_per_s"]}
                if temp == 0:
                    row["identical_to_plain"] = sum(a == b for a, b in zip(r["outputs"], base["outputs"]))
                points.append(row)
                _print(row)
            if spec.hf_peer and batch == 1 and temp == 0:
                hf = _hf(spec.model)
                for name, lookup in (("transformers", None), ("transformers-prompt-lookup", spec.depth)):
                    r = run_hf(hf, use, spec.max_tokens, lookup)
                    row = {"temperature": temp, "batch": batch, "method": name, "prompts": len(use),
                           **{k: v for k, v in r.items() if k != "outputs"},
                           "speedup": r["tokens_per_s"] / base["tokens_per_s"],
                           "identical_to_plain": sum(a == b for a, b in zip(r["outputs"], base["outputs"]))}
                    points.append(row)
                    _print(row)
    return {"spec": asdict(spec), "model": str(resolve_model_dir(spec.model)), "drafter": drafter,
            "drafter_train_seconds": drafter_seconds, "warm_history": history, "points": points,
            "meta": finish_metadata(meta)}


def _warm_history(model: Any, tok: Any, spec: SpecBenchSpec, measured: list[str]) -> dict[str, Any]:
    """suffix-warm's history: the model's greedy answers (prompt and answer, as a server keeps
    them) to `warm_prompts` other prompts of the bench's kinds, reasoning tasks and requests drawn
    with seed + 1, none of them a measured prompt; written to a file in a temp directory."""
    import tempfile

    from reclaim.data.tasks import make_prompts
    from reclaim.engine.engine import Engine
    from reclaim.engine.history import write_history
    from reclaim.engine.request import SamplingParams
    from reclaim.models.tokenizer import encode_chat

    half = spec.warm_prompts // 2
    texts = reasoning_prompts(spec.tasks, half, spec.seed + 1) + make_prompts("instruct", spec.warm_prompts - half,
                                                                             spec.seed + 1)
    skip = set(measured)
    prompts = [encode_chat(tok, [{"role": "user", "content": q}]) for q in texts if q not in skip]
    t, threads = time.perf_counter(), torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)  # preparation, not measured: every core
    try:
        outs = Engine(model, tok, _engine_config(spec.engine), max_num_seqs=32).generate(
            prompts, SamplingParams(temperature=0, max_tokens=spec.max_tokens))
    finally:
        torch.set_num_threads(threads)
    seconds = time.perf_counter() - t
    sequences = [p + o.token_ids for p, o in zip(prompts, outs)]
    path = str(Path(tempfile.mkdtemp(prefix="reclaim-warm-")) / "history.jsonl")
    write_history(path, sequences)
    answer_tokens = sum(len(o.token_ids) for o in outs)
    print(f"suffix-warm history: {len(prompts)} prompts, {answer_tokens} answer tokens in {seconds:.1f} s", flush=True)
    return {"path": path, "prompts": len(prompts), "answer_tokens": answer_tokens,
            "tokens": sum(map(len, sequences)), "seconds": seconds}


def _hf(model: str | None) -> Any:
    from reclaim.models.hf import load_hf_model
    from reclaim.models.loading import resolve_model_dir

    return load_hf_model(resolve_model_dir(model))


def _print(row: dict[str, Any]) -> None:
    tau = f"tau {row['tau']:.2f}" if row.get("tau") else ""
    same = f"identical {row['identical_to_plain']}/{row['prompts']}" if "identical_to_plain" in row else ""
    print(f"T={row['temperature']} batch {row['batch']:>2} {row['method']:<27} {row['tokens_per_s']:7.1f} tok/s "
          f"{row['speedup']:5.2f}x {tau} {same}", flush=True)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = result["spec"]["temperatures"]
    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4), squeeze=False)
    for ax, temp in zip(axes[0], temps):
        rows = [r for r in result["points"] if r["temperature"] == temp]
        batches = sorted({r["batch"] for r in rows})
        methods = [m for m in dict.fromkeys(r["method"] for r in rows)]
        width = 0.8 / len(methods)
        for i, m in enumerate(methods):
            xs = [j + i * width for j, b in enumerate(batches) if any(r["method"] == m and r["batch"] == b for r in rows)]
            ys = [r["speedup"] for b in batches for r in rows if r["method"] == m and r["batch"] == b]
            ax.bar(xs, ys, width, label=m)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(batches))], [f"batch {b}" for b in batches])
        ax.set_ylabel("tokens/s vs plain decoding")
        ax.set_title(f"temperature {temp}")
        ax.legend(fontsize=7)
    fig.suptitle("Speculative decoding on the CPU (reclaim bench spec)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(spec: SpecBenchSpec) -> dict[str, Any]:
    result = measure(spec)
    write_result(spec.out_dir, "spec", result, plot)
    return result
