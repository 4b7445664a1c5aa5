"""`reclaim bench fsdp`: per-rank memory of one GRPO run on SmolLM2 at world size 2, DDP vs FSDP2.

The same run (grpo-smollm2, a short step: 2 prompts x 2 completions of `max_completion_length`
tokens, the reference model with beta 0.04) is launched twice under torchrun on gloo, once per
parallelism. Each rank reports what it holds of the policy's parameters, gradients and AdamW
state (the trainer's `memory/*` figures, taken after the optimizer step, when all three are
there), and its process's peak resident memory (which also counts the rollout engine's full
copy and KV cache, the reference model, torch itself and the activations; the ranks run with a
fixed 256 KiB mmap threshold so that freed tensors leave the RSS). Losses and grad norms of the two runs are
compared: sharding changes where the state lives, not the step.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

FIELDS = ("params_bytes", "grads_bytes", "optimizer_bytes")
MALLOC = f"glibc.malloc.mmap_threshold={256 << 10}"


def distinct_reward(prompts: list, completions: list, completion_ids: list, **kwargs: Any) -> list[float]:
    """The share of distinct tokens in each completion: a reward that differs within every group,
    so the step has a gradient to compare (accuracy alone is rarely earned in 16 tokens)."""
    return [len(set(ids)) / max(len(ids), 1) for ids in completion_ids]


def run_fields(out_dir: Path, parallelism: str, max_completion_length: int) -> dict[str, Any]:
    return {"output_dir": str(out_dir), "parallelism": parallelism, "max_steps": 1, "num_prompts": 4,
            "num_generations": 2, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1,
            "max_completion_length": max_completion_length, "beta": 0.04, "save_steps": 0, "threads": 1,
            "speculative": "none",
            "reward_funcs": ["accuracy", "reclaim.bench.fsdp.distinct_reward"], "reward_weights": [1.0, 1.0]}


def _rank(out: Path, parallelism: str, max_completion_length: int) -> None:
    """One torchrun rank: the run, then this rank's memory figures into out/rank{r}.json."""
    from reclaim.config import load_config
    from reclaim.rl.grpo import train
    from reclaim.rl.grpo_config import GRPOConfig

    cfg = load_config(GRPOConfig, "grpo-smollm2", run_fields(out / parallelism, parallelism, max_completion_length))
    last = train(cfg, progress=False, log=lambda *_: None)["last"]  # this rank's record (its own memory/*)
    held = {k: last[f"memory/{k}"] for k in FIELDS}
    rank = int(os.environ["RANK"])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    (out / f"{parallelism}-rank{rank}.json").write_text(json.dumps({**held, "peak_rss_bytes": peak}))


def main(out_dir: Path, max_completion_length: int = 16, log=print) -> dict[str, Any]:  # noqa: ANN001
    from reclaim.bench.meta import finish_metadata, run_metadata, write_result

    meta = run_metadata()
    result: dict[str, Any] = {"world_size": 2, "max_completion_length": max_completion_length,
                              "glibc_tunables": MALLOC, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for par in ("ddp", "fsdp"):
            log(f"bench fsdp: GRPO on SmolLM2, 2 gloo ranks, parallelism {par}")
            # blocks over 256 KiB from mmap in the ranks, so that a freed tensor goes back to the kernel
            # and peak RSS follows what is live: the `reclaim` command's tunables keep every freed block
            # (reclaim/hugepages.py), and glibc's default raises its mmap threshold as blocks are
            # freed; either way the peak would count the heap's leftovers, not what a rank holds
            env = {**os.environ, "OMP_NUM_THREADS": "1", "GLIBC_TUNABLES": MALLOC}
            proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                   "--nproc_per_node=2", "-m", "reclaim.bench.fsdp", str(work), par,
                                   str(max_completion_length)], env=env, capture_output=True, text=True)
            if proc.returncode:
                raise RuntimeError(f"the {par} run failed:\n{proc.stderr[-3000:]}")
            ranks = [json.loads((work / f"{par}-rank{r}.json").read_text()) for r in (0, 1)]
            rec = json.loads((work / par / "log.jsonl").read_text().splitlines()[-1])
            result["runs"][par] = {"ranks": ranks, "loss": rec["loss"], "grad_norm": rec["grad_norm"],
                                   "reward": rec["reward"]}
    worst = {p: max(sum(r[k] for k in FIELDS) for r in run["ranks"]) for p, run in result["runs"].items()}
    rss = {p: max(r["peak_rss_bytes"] for r in run["ranks"]) for p, run in result["runs"].items()}
    ddp, fsdp = result["runs"]["ddp"], result["runs"]["fsdp"]
    result["summary"] = {
        "training_state_bytes_per_rank": worst,
        "training_state_ratio_fsdp_vs_ddp": worst["fsdp"] / worst["ddp"],
        "peak_rss_bytes_per_rank": rss, "peak_rss_ratio_fsdp_vs_ddp": rss["fsdp"] / rss["ddp"],
        "loss_rel_diff": abs(fsdp["loss"] - ddp["loss"]) / max(abs(ddp["loss"]), 1e-30),
        "grad_norm_rel_diff": abs(fsdp["grad_norm"] - ddp["grad_norm"]) / max(ddp["grad_norm"], 1e-30),
    }
    result.update(finish_metadata(meta))
    write_result(out_dir, "fsdp", result, plot)
    s = result["summary"]
    log(f"per rank: params+grads+AdamW {worst['ddp'] / 1e6:.0f} MB (ddp) -> {worst['fsdp'] / 1e6:.0f} MB (fsdp), "
        f"{s['training_state_ratio_fsdp_vs_ddp']:.3f}x; peak RSS {rss['ddp'] / 1e6:.0f} -> {rss['fsdp'] / 1e6:.0f} MB, "
        f"{s['peak_rss_ratio_fsdp_vs_ddp']:.3f}x; loss rel diff {s['loss_rel_diff']:.1e}")
    return result


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = ["parameters", "gradients", "AdamW", "peak RSS"]
    for i, par in enumerate(("ddp", "fsdp")):
        r = max(result["runs"][par]["ranks"], key=lambda x: x["params_bytes"])
        vals = [r[k] / 1e6 for k in FIELDS] + [max(x["peak_rss_bytes"] for x in result["runs"][par]["ranks"]) / 1e6]
        ax.bar([j + 0.4 * i for j in range(4)], vals, width=0.4, label=par)
    ax.set_xticks([j + 0.2 for j in range(4)], labels)
    ax.set_ylabel("MB per rank (worst rank)")
    ax.set_title("GRPO on SmolLM2-135M, 2 gloo ranks: DDP vs FSDP2")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    _rank(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
