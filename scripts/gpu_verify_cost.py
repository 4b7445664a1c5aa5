"""What a speculative verify costs against a plain decode step, on the GPU (or any device).

A model of SmolLM2-135M's shape (random weights: step costs do not depend on them) in the engine,
batches of B sequences 200 tokens into decoding. For each B it times the engine's plain decode
step (the median step once every request decodes), then one forward of T new tokens per sequence
over the same cached prefixes with the LM head on every token (what a verify of T - 1 draft
tokens runs). Prints one JSON line per (dtype, B): the plain step and each T's forward in ms,
and T's forward over the plain step. With tau tokens committed per verify, speculation can pay
at most tau / that ratio.

    python scripts/gpu_verify_cost.py            # cuda when there is one
    python scripts/gpu_verify_cost.py --tiny     # a two-layer model (a smoke run on a CPU)
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from reclaim.engine.config import EngineConfig
from reclaim.engine.engine import Engine
from reclaim.engine.request import SamplingParams
from reclaim.engine.runner import Row
from reclaim.models.llama import LlamaConfig, LlamaForCausalLM

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
               rope_theta=100000.0, tie_word_embeddings=True)
TINY = {**SMOLLM2, "num_hidden_layers": 2, "vocab_size": 4096}
PROMPT, DECODE = 200, 40


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, dev: torch.device, n: int) -> float:
    """Median ms of n calls of fn (after two warm-ups)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(n):
        sync(dev)
        t = time.perf_counter()
        fn()
        sync(dev)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def measure(model: LlamaForCausalLM, dev: torch.device, batch: int, widths: list[int]) -> dict:
    engine = Engine(model, None, EngineConfig(max_model_len=PROMPT + DECODE + 16, device=str(dev), max_num_seqs=batch,
                                              num_blocks=batch * 20 + 20, seed=0))
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0, max_tokens=DECODE, ignore_eos=True)
    ids = [engine.add_request(None, torch.randint(0, model.config.vocab_size, (PROMPT,), generator=g).tolist(),
                              params) for _ in range(batch)]
    steps, done = [], 0
    while done < batch:
        sync(dev)
        t = time.perf_counter()
        outs = engine.step()
        sync(dev)
        sched = engine.last_schedule
        if sched is not None and all(not c.is_prefill for c in sched.chunks) and len(sched.chunks) == batch:
            steps.append((time.perf_counter() - t) * 1e3)
        done += sum(o.finished for o in outs)
        if len(steps) == DECODE // 2:  # mid-run: every prefix is cached, time the verify widths here
            break
    plain = statistics.median(steps)
    runner = engine.runner
    lens = {r: engine._requests[r].seq.num_computed for r in ids}  # tokens with cached K/V
    out = {"batch": batch, "plain_step_ms": plain}
    with torch.inference_mode():
        for t in widths:
            rows = [Row(r, lens[r] - t, [1] * t) for r in ids]  # within each sequence's cached blocks
            ms = timed(lambda: runner.logits(runner.forward(rows)).argmax(-1).tolist(), dev, 10)
            out[f"verify{t}_ms"] = ms
            out[f"verify{t}_over_plain"] = ms / plain
    for r in ids:
        engine.abort_request(r)
    return out


def main() -> int:
    tiny = "--tiny" in sys.argv
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(json.dumps({"torch": torch.__version__, "device": str(dev),
                      "name": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"}), flush=True)
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**(TINY if tiny else SMOLLM2))).to(dev, dtype).eval()
        for batch in (1, 4, 16):
            row = measure(model, dev, batch, [1, 2, 4, 6, 8, 16])
            print(json.dumps({"dtype": str(dtype).removeprefix("torch."), **row}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
