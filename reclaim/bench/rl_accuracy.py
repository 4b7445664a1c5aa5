"""Does GRPO training work: greedy accuracy on held-out prompts of a run's task, before and after
(`reclaim bench rl --accuracy RUN_DIR`), beside the speed arms of bench/rl.py.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from reclaim.bench.meta import finish_metadata, run_metadata, write_result


def held_out_rows(cfg: Any, n: int) -> list[dict[str, Any]]:
    """`n` prompts of cfg's task that are not among its training prompts (another seed's draw)."""
    from reclaim.rl.data import build_dataset

    if cfg.dataset is not None:
        raise ValueError(f"held-out accuracy needs a procedural task; the run trained on dataset {cfg.dataset!r}")
    train = {r["question"] for r in build_dataset(cfg)}
    drawn = build_dataset(dataclasses.replace(cfg, seed=cfg.seed + 1, num_prompts=2 * n))
    rows = [r for r in drawn if r["question"] not in train][:n]
    if len(rows) < n:
        raise ValueError(f"task {cfg.task!r} has only {len(rows)} prompts outside the training set; asked {n}")
    return rows


def greedy_accuracy(model_dir: str | Path | None, cfg: Any, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Greedy completions of `rows` by the model in `model_dir`: accuracy and format reward means."""
    from reclaim.engine.engine import Engine
    from reclaim.engine.request import SamplingParams
    from reclaim.models.loading import load_model
    from reclaim.models.tokenizer import encode_chat
    from reclaim.rl.rewards import accuracy_reward, format_reward

    model, tok = load_model(model_dir, dtype=cfg.dtype, device=cfg.device)
    prompts = [encode_chat(tok, r["prompt"])[-(cfg.max_prompt_length or 10**9):] for r in rows]
    engine = Engine(model, tok, cfg.engine_config(max(len(p) for p in prompts) + cfg.max_completion_length))
    t = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=cfg.max_completion_length))
    texts = [[{"role": "assistant", "content": o.text}] for o in outs]
    acc = accuracy_reward(None, texts, None, **{k: [r.get(k) for r in rows]  # rg tasks: their scorer's columns
                                                for k in ("answer", "task", "entry", "task_config")})
    fmt = format_reward(None, texts, None)
    return {"model": str(model_dir), "prompts": len(rows), "accuracy": sum(acc) / len(acc),
            "format": sum(fmt) / len(fmt), "mean_length": statistics.mean(len(o.token_ids) for o in outs),
            "seconds": time.perf_counter() - t,
            "examples": [{"question": r["question"], "answer": r["answer"], "completion": o.text}
                         for r, o in list(zip(rows, outs))[:3]]}


def held_out_accuracy(run_dir: str | Path, n: int = 100, threads: int | None = 1,
                      out_dir: str | Path = "benchmarks") -> dict[str, Any]:
    """Greedy accuracy on `n` held-out prompts of a `reclaim grpo` run's task: the starting model
    against the run's last checkpoint, with how long the run trained; writes rl-accuracy.json."""
    from reclaim.checkpoints import checkpoints
    from reclaim.config import load_config
    from reclaim.rl.grpo_config import GRPOConfig

    run = Path(run_dir)
    if not (run / "train_config.json").is_file():
        raise ValueError(f"{str(run)!r} is not a `reclaim grpo` output_dir (no train_config.json)")
    if threads:
        torch.set_num_threads(threads)
    meta = run_metadata()
    saved = json.loads((run / "train_config.json").read_text())
    known = {f.name for f in dataclasses.fields(GRPOConfig)}
    cfg = load_config(GRPOConfig, None, {k: v for k, v in saved.items() if k in known})
    found = checkpoints(run, require="trainer_state.json")
    if not found:
        raise ValueError(f"{str(run)!r} has no checkpoint yet; wait for the first save_steps")
    rows = held_out_rows(cfg, n)
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()] if (
        run / "log.jsonl").exists() else []
    last = found[-1]
    step = json.loads((last / "trainer_state.json").read_text())["global_step"]
    log = [r for r in log if r["step"] <= step]
    before = greedy_accuracy(cfg.model, cfg, rows)
    print(f"before: accuracy {before['accuracy']:.3f} on {n} held-out prompts", flush=True)
    after = greedy_accuracy(last, cfg, rows)
    print(f"after {step} steps: accuracy {after['accuracy']:.3f}", flush=True)
    k = max(1, min(5, len(log) // 2))
    result = {"run": str(run), "task": cfg.task, "checkpoint": str(last), "steps": step,
              "train_seconds": sum(r.get("step_time", 0.0) for r in log),
              "completions_per_step": cfg.generation_batch_size, "learning_rate": cfg.learning_rate,
              "sampled_reward_first_steps": statistics.mean(r["reward"] for r in log[:k]) if log else None,
              "sampled_reward_last_steps": statistics.mean(r["reward"] for r in log[-k:]) if log else None,
              "before": before, "after": after, "meta": finish_metadata(meta)}
    write_result(out_dir, "rl-accuracy", result)
    return result
