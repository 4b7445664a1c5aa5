"""TLT's drafter trained on idle workers, measured: GRPO at world size N, plain rollouts against
adaptive rollouts whose EAGLE drafter trains on the ranks that finish their share early.

    python scripts/grpo_idle_drafter.py [--config grpo-smollm2-add] [--steps 4] [--nproc 2]

Runs `torchrun --standalone --nproc_per_node=N -m reclaim.cli grpo` twice on the same config, one
prompt x num_generations per rank and step, one torch thread per process: `speculative: none`, then
`speculative: eagle` (the bundled model's drafter) with `drafter_online: true`. Per step, from the
logs: step, rollout and training time; the workers' idle wait for the slowest (rollout_idle_s,
summed over ranks: the time TLT gives the drafter), the drafter's training seconds (the longest
rank's) and steps; tail time and tau; held-out tau of the online drafter and of a frozen copy; and
whether both arms sampled the same completions (speculation is lossless, seeds are per request).
Writes benchmarks/grpo-idle-drafter.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from grpo_world_size import lines

ARMS = {"plain": ["--speculative", "none"],
        "adaptive": ["--speculative", "eagle", "--drafter_online", "true"]}
KEPT = ("step_time", "rollout_s", "train_s", "rollout_idle_s", "rollout_tail_s", "rollout_spec_tau",
        "drafter/train_s", "drafter/steps_all_ranks", "drafter/tau_online", "drafter/tau_frozen",
        "completions/mean_length", "completions/max_length")


def run(arm: str, cfg: str, steps: int, nproc: int, out: Path) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "reclaim.cli", "grpo", "--config", cfg, "--max_steps", str(steps), "--save_steps", "0",
           "--gradient_accumulation_steps", "1", "--log_completions", "true", "--threads", "1",
           "--output_dir", str(out), *ARMS[arm]]
    t = time.perf_counter()
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="grpo-smollm2-add")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/grpo-idle-drafter.json")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="grpo-idle-drafter-") as tmp:
        dirs = {arm: Path(tmp) / arm for arm in ARMS}
        seconds = {arm: run(arm, a.config, a.steps, a.nproc, d) for arm, d in dirs.items()}
        logs = {arm: lines(d / "log.jsonl") for arm, d in dirs.items()}
        done = {arm: [sorted(json.dumps(r, sort_keys=True) for r in lines(d / "completions.jsonl") if r["step"] == s)
                      for s in range(1, a.steps + 1)] for arm, d in dirs.items()}
    steps = {arm: [{k: r[k] for k in ("step", *KEPT) if k in r} for r in logs[arm]] for arm in ARMS}
    median = {arm: statistics.median(r["step_time"] for r in steps[arm]) for arm in ARMS}
    ad = steps["adaptive"]
    result = {"config": a.config, "nproc": a.nproc, "steps": steps, "seconds": seconds,
              "completions_identical": [x == y for x, y in zip(done["plain"], done["adaptive"])],
              "step_time_median": median, "adaptive_step_speedup_vs_plain": median["plain"] / median["adaptive"],
              "drafter_train_s_total": sum(r.get("drafter/train_s", 0.0) for r in ad),
              "rollout_idle_s_total": {arm: sum(r["rollout_idle_s"] for r in steps[arm]) for arm in ARMS}}
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0 if all(result["completions_identical"]) else 1


if __name__ == "__main__":
    sys.exit(main())
