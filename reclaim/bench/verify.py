"""`reclaim bench verify`: what a speculative verify costs against a plain decode step, here.

Speculation pays when the tokens a verify commits (tau) beat what the verify costs in decode
steps. This bench measures the second number on the machine it runs on, so that a drafter's
tau can be judged against it: for each batch size B, the engine's plain decode step (the median
step once every request decodes, 200 tokens in), then one forward of T new tokens per sequence
over the same cached prefixes with the LM head on every token (what a verify of T - 1 draft
tokens runs: its forward, not the acceptance rule beside it; T = 1's ratio is what a plain step
adds to a forward). A verify of T tokens pays only if the drafter's tau exceeds T's ratio to
the plain step, and gives 2x only at twice that ratio.

The model is SmolLM2-135M's shape with random weights (step costs do not depend on the weights;
no checkpoint to load), or `--model` (a directory or GGUF file, loaded with its weights).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
               rope_theta=100000.0, tie_word_embeddings=True)
TINY = {**SMOLLM2, "num_hidden_layers": 2, "vocab_size": 4096}
PROMPT, DECODE = 200, 40
FREE = 1.1  # a verify within 10% of a plain step counts as free


@dataclass
class VerifyBenchSpec:
    model: str | None = None  # None: SmolLM2-135M's shape, random weights
    tiny: bool = False  # two layers, a 4096-token vocabulary: a smoke run
    device: str | None = None  # None: cuda when there is one, else cpu
    dtypes: list[str] = field(default_factory=lambda: ["float32", "bfloat16"])
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 16])
    widths: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 6, 8, 12, 16])  # tokens per sequence
    threads: int | None = 1  # torch CPU threads (None: torch's default)
    repeats: int = 10  # timed calls per width (the median is kept)
    out_dir: str = "benchmarks/verify"

    def __post_init__(self) -> None:
        bad = [d for d in self.dtypes if d not in ("float32", "bfloat16", "float16")]
        if bad:
            raise ValueError(f"dtypes {bad} are unknown; allowed: float32, bfloat16, float16")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"batch_sizes={self.batch_sizes}; allowed: one or more sizes >= 1")
        if not self.widths or min(self.widths) < 1 or max(self.widths) > 64:
            raise ValueError(f"widths={self.widths}; allowed: one or more token counts from 1 to 64")
        if self.repeats < 1:
            raise ValueError(f"repeats={self.repeats}; allowed: >= 1")
        if self.model is not None and self.tiny:
            raise ValueError("--tiny builds its own model; it cannot be given with --model")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn: Any, dev: torch.device, n: int) -> float:
    """Median ms of n calls of fn (after two warm-ups)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(n):
        _sync(dev)
        t = time.perf_counter()
        fn()
        _sync(dev)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def measure(model: torch.nn.Module, dev: torch.device, batch: int, widths: list[int], repeats: int) -> dict[str, Any]:
    """One batch size: the plain decode step's ms, and each width's verify forward in ms and over it."""
    from reclaim.engine.config import EngineConfig
    from reclaim.engine.engine import Engine
    from reclaim.engine.request import SamplingParams
    from reclaim.engine.runner import Row

    engine = Engine(model, None, EngineConfig(max_model_len=PROMPT + DECODE + 16, device=str(dev), max_num_seqs=batch,
                                              num_blocks=batch * 20 + 20, seed=0))
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0, max_tokens=DECODE, ignore_eos=True)
    ids = [engine.add_request(None, torch.randint(0, model.config.vocab_size, (PROMPT,), generator=g, device=g.device).tolist(),
                              params) for _ in range(batch)]
    steps: list[float] = []
    while len(steps) < DECODE // 2:  # mid-run: every prefix is cached, the widths are timed there
        _sync(dev)
        t = time.perf_counter()
        engine.step()
        _sync(dev)
        sched = engine.last_schedule
        if sched is not None and len(sched.chunks) == batch and not any(c.is_prefill for c in sched.chunks):
            steps.append((time.perf_counter() - t) * 1e3)
    plain = statistics.median(steps)
    runner = engine.runner
    lens = {r: engine._requests[r].seq.num_computed for r in ids}  # tokens with cached K/V
    rows = []
    with torch.inference_mode():
        for w in widths:
            batch_rows = [Row(r, lens[r] - w, [1] * w) for r in ids]  # within each sequence's cached blocks
            ms = _timed(lambda: runner.logits(torch.cat(runner.forward(batch_rows))).argmax(-1).tolist(), dev, repeats)
            rows.append({"tokens": w, "draft_tokens": w - 1, "ms": ms, "over_plain": ms / plain})
    for r in ids:
        engine.abort_request(r)
    free = [r["tokens"] for r in rows if r["over_plain"] <= FREE]
    return {"batch": batch, "plain_step_ms": plain, "verify": rows,
            "free_tokens": max(free) if free else 0}


def _model(spec: VerifyBenchSpec, dev: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    if spec.model is not None:
        from reclaim.models.loading import load_model

        return load_model(spec.model)[0].to(dev, dtype).eval()
    from reclaim.models.llama import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**(TINY if spec.tiny else SMOLLM2))).to(dev, dtype).eval()


def main(spec: VerifyBenchSpec, log: Any = print) -> dict[str, Any]:
    from reclaim.bench.meta import finish_metadata, run_metadata, write_result

    if spec.threads:
        torch.set_num_threads(spec.threads)
    dev = torch.device(spec.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    meta = run_metadata()
    points = []
    for name in spec.dtypes:
        model = _model(spec, dev, getattr(torch, name))
        for batch in spec.batch_sizes:
            row = {"dtype": name, **measure(model, dev, batch, spec.widths, spec.repeats)}
            points.append(row)
            log(f"{name} batch {batch}: plain step {row['plain_step_ms']:.1f} ms; verify of T tokens / plain: "
                + ", ".join(f"T={v['tokens']} {v['over_plain']:.2f}x" for v in row["verify"]))
        del model
    result = {"spec": asdict(spec), "device": str(dev),
              "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
              "points": points, "meta": finish_metadata(meta)}
    write_result(spec.out_dir, "verify", result, plot)
    return result


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = list(dict.fromkeys(p["dtype"] for p in result["points"]))
    fig, axes = plt.subplots(1, len(dtypes), figsize=(5.5 * len(dtypes), 4), squeeze=False)
    for ax, name in zip(axes[0], dtypes):
        for p in (p for p in result["points"] if p["dtype"] == name):
            ax.plot([v["tokens"] for v in p["verify"]], [v["over_plain"] for v in p["verify"]], "o-",
                    label=f"batch {p['batch']} (plain {p['plain_step_ms']:.1f} ms)")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xlabel("tokens verified per sequence (draft + 1)")
        ax.set_ylabel("verify forward / plain decode step")
        ax.set_title(f"{result['device_name'] or result['device']}, {name}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
