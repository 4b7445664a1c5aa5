"""GRPO's prompts: the rows of a task or dataset, the rows of each rollout, each completion's seed."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch

from reclaim.data.tasks import RG_PREFIX, TASK_FAMILIES, rg_tasks
from reclaim.rl.grpo_config import GRPOConfig, task_names


def build_dataset(cfg: GRPOConfig) -> list[dict[str, Any]]:
    """Rows {"prompt": messages, "answer", "task", "question", ...}: cfg.num_prompts distinct tasks
    (families in turn, drawn from cfg.seed; reasoning-gym's rows add "entry" and "task_config" for
    its scorer), or the rows of cfg.dataset."""
    if cfg.dataset is not None:
        rows = []
        for n, line in enumerate(Path(cfg.dataset).expanduser().read_text().splitlines(), 1):
            if line.strip():
                row = json.loads(line)
                if not isinstance(row, dict) or "prompt" not in row:
                    raise ValueError(f"{cfg.dataset}:{n}: each line is a JSON object with a 'prompt'")
                if isinstance(row["prompt"], str):
                    row = {**row, "question": row["prompt"], "prompt": _messages(cfg, row["prompt"])}
                rows.append(row)
        if not rows:
            raise ValueError(f"dataset {cfg.dataset!r} has no rows")
        return rows
    if cfg.task.startswith(RG_PREFIX):
        return [{"prompt": _messages(cfg, t.question), "answer": t.answer, "task": t.family, "question": t.question,
                 "entry": t.entry, "task_config": t.config}
                for t in rg_tasks(cfg.task, cfg.num_prompts, cfg.seed, cfg.task_config)]
    r = random.Random(cfg.seed)
    families = task_names(cfg.task)
    rows, seen = [], set()
    for i in range(100 * cfg.num_prompts):
        if len(rows) == cfg.num_prompts:
            break
        t = TASK_FAMILIES[families[i % len(families)]](r)
        if t.question not in seen:
            seen.add(t.question)
            rows.append({"prompt": _messages(cfg, t.question), "answer": t.answer, "task": t.family,
                         "question": t.question})
    if len(rows) < cfg.num_prompts:
        raise ValueError(f"task {cfg.task!r} gave only {len(rows)} distinct prompts; num_prompts={cfg.num_prompts}")
    return rows


def _messages(cfg: GRPOConfig, question: str) -> list[dict[str, str]]:
    system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    return system + [{"role": "user", "content": cfg.prompt_template.format(question=question)}]


def prompt_rows(num_rows: int, per_step: int, generation: int, seed: int) -> list[int]:
    """Dataset rows of rollout `generation`: a fresh seeded permutation per pass over the data."""
    out = []
    for flat in range(generation * per_step, (generation + 1) * per_step):
        epoch, i = divmod(flat, num_rows)
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        out.append(int(torch.randperm(num_rows, generator=g, device=g.device)[i]))
    return out


def request_seed(seed: int, step: int, index: int) -> int:
    """The sampling seed of completion `index` of the rollout at `step`."""
    return (seed * 1_000_003 + step * 7_919 + index) % (2**63 - 1)
