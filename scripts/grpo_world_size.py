"""GRPO on the real model at world size 2 against world size 1 (CI checks it on a tiny float64 model).

    python scripts/grpo_world_size.py [--config grpo-smollm2-add] [--steps 2] [--accumulation 4]

Runs `reclaim grpo` in one process with gradient_accumulation_steps G, then under
`torchrun --standalone --nproc_per_node=2` with G/2 per rank (the same global batch), one torch
thread per process, and compares step by step: the logged completions and rewards (equal, or the
check fails), loss, grad_norm and entropy, and the final checkpoint's weights (largest relative
difference per tensor, beside how far training moved them from the starting model). Writes
benchmarks/grpo-world-size.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

COMPARED = ("loss", "reward", "reward_std", "grad_norm", "entropy", "completions/mean_length")


def run(world: int, cfg: str, steps: int, accumulation: int, out: Path) -> float:
    args = ["-m", "reclaim.cli", "grpo", "--config", cfg, "--max_steps", str(steps),
            "--save_steps", str(steps), "--per_device_train_batch_size", "4",
            "--gradient_accumulation_steps", str(accumulation // world),
            "--output_dir", str(out), "--threads", "1"]
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
    cmd = [sys.executable, *([] if world == 1 else launch), *args]
    t = time.perf_counter()
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return time.perf_counter() - t


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def weights(run_dir: Path, steps: int) -> dict[str, torch.Tensor]:
    return load_file(next((run_dir / f"checkpoint-{steps}").glob("*.safetensors")))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="grpo-smollm2-add")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--accumulation", type=int, default=4,
                    help="gradient_accumulation_steps at world size 1 (even)")
    ap.add_argument("--out", default="benchmarks/grpo-world-size.json")
    a = ap.parse_args()
    from reclaim.models.loading import load_model

    with tempfile.TemporaryDirectory(prefix="grpo-world-size-") as tmp:
        runs = {w: Path(tmp) / f"world{w}" for w in (1, 2)}
        seconds = {w: run(w, a.config, a.steps, a.accumulation, d) for w, d in runs.items()}
        logs = {w: lines(d / "log.jsonl") for w, d in runs.items()}
        done = {w: {s: sorted(json.dumps(r, sort_keys=True) for r in lines(d / "completions.jsonl")
                              if r["step"] == s) for s in range(1, a.steps + 1)}
                for w, d in runs.items()}
        w1, w2 = weights(runs[1], a.steps), weights(runs[2], a.steps)
        start = {n: p.detach() for n, p in load_model(None)[0].state_dict().items()}
    steps = [{"step": x["step"], "completions_identical": done[1][x["step"]] == done[2][x["step"]],
              "completions": len(done[1][x["step"]]), **{k: [x.get(k), y.get(k)] for k in COMPARED}}
             for x, y in zip(logs[1], logs[2])]
    result = {"config": a.config, "steps": steps, "seconds": seconds,
              "weights_max_rel_diff": max(rel(w2[k], w1[k]) for k in w1),
              "weights_max_rel_moved": max(rel(w1[k], start[k]) for k in w1 if k in start)}
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0 if all(s["completions_identical"] for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
