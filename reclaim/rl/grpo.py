"""GRPO (Group Relative Policy Optimization) with TRL's config names and loss, rollouts on reclaim's engine.

One RL step, as TRL's GRPOTrainer runs it on one process (steps_per_generation =
gradient_accumulation_steps, its default):

1. Rollout: per_device_train_batch_size * gradient_accumulation_steps / num_generations prompts,
   each added to the engine num_generations times with a seed drawn from (seed, step, index), so
   a run (and a resumed one) samples the same completions.
2. Rewards from each reward function (TRL's signature, see rewards.py), summed with
   reward_weights; advantages are the rewards minus their group mean, divided by the group's std
   (scale_rewards "group"), the batch's ("batch") or not at all ("none").
3. Old-policy log-probs when num_iterations > 1 (the batch is then trained on num_iterations
   times), reference log-probs when beta > 0 (the starting model, frozen).
4. gradient_accumulation_steps micro-batches of per_device_train_batch_size completions: the
   policy's log-probs of the completion tokens (a training forward with logits only at the
   completion positions, divided by temperature; each distinct prompt runs once for all its
   completions, packed behind it in one row: logps.py), the clipped ratio loss with epsilon and
   epsilon_high, plus beta * k3 KL, normalised per loss_type as TRL does; then one optimizer step.
5. The new weights go into the engine (`update_weights`: version bumped; the next rollout starts
   from them, no K/V of old weights reused).

`reclaim grpo --config grpo-smollm2` runs it with a progress bar, output_dir/log.jsonl,
checkpoint-{step}/ directories and --resume. A checkpoint is the policy in HF layout (for users
and the engine), its trainer state (model, optimizer, scheduler) as a torch.distributed.checkpoint
in dcp/, RNG, the rollout being iterated on, the online drafter, and trainer_state.json.

`torchrun --nproc_per_node=N -m reclaim.cli grpo ...` runs N rollout workers: each rolls out a
contiguous share of the step's prompts on its own engine (same per-completion seeds, so the
completions are one process's), scores it, and the shares are gathered; the policy trains under
DDP (distributed.py: gradients summed once per optimizer step), per_device_train_batch_size per
rank as in TRL; rank 0 logs, every rank writes its share of the DCP checkpoint (output_dir must
be one directory all ranks see), and --resume loads it at any world size. With drafter_online (TLT) the EAGLE drafter learns from the rollouts' hidden
states on the workers that finished their share early (drafter/online.py's OnlineDrafter).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import random
import shutil
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from reclaim.checkpoints import CHECKPOINT_PREFIX, trim_log
from reclaim.checkpoints import checkpoints as list_checkpoints
from reclaim.data.tasks import RG_PREFIX, TASK_FAMILIES, rg_names, rg_tasks
from reclaim.engine.speculative import MODEL_METHODS, SPECULATIVE_METHODS as SPEC_METHODS, SpeculativeConfig
from reclaim.optim import adamw
from reclaim.rl.bandit import BucketedBandit
from reclaim.rl.rewards import load_reward, score
from reclaim.rl.distributed import World, accumulating
from reclaim.rl.logps import completion_logps, completion_mask
from reclaim.drafter.online import OnlineDrafter
from reclaim.rl.rollout import AdaptiveRollout, RolloutStats
from reclaim.schedule import SCHEDULES, lr_scheduler

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")
ALL_TASKS = "all"
DEFAULT_TEMPLATE = "{question}\nGive the final answer in <answer></answer> tags."


@dataclass
class GRPOConfig:
    """`reclaim grpo`: TRL's GRPOConfig names and meanings (steps_per_generation is
    gradient_accumulation_steps; batch sizes are per rank under torchrun). Load one with
    `load_config(GRPOConfig, path_or_name, overrides)`."""

    output_dir: str = "runs/grpo"
    model: str | None = None  # HF directory; None: the bundled SmolLM2-135M-Instruct
    dtype: str = "float32"  # auto: the checkpoint's own dtype
    # transformers' `bf16`: the training forwards and backward under bfloat16 autocast (matmuls in
    # bf16; weights, gradients and optimizer in `dtype`). Rollouts keep `dtype`.
    bf16: bool = False
    device: str = "cpu"
    threads: int | None = None  # torch threads; None: torch's default (1 is faster on a busy CPU)
    # Data: procedural tasks (reclaim/data/tasks.py) or a JSON-lines dataset.
    task: str = "arithmetic"  # a family of data/tasks.py, several comma-separated, "all", or rg:<dataset>[,<dataset>]
    task_config: dict[str, dict[str, Any]] | None = None  # rg tasks: options per dataset, {chain_sum: {max_terms: 2}}
    dataset: str | None = None  # JSON lines {"prompt": str | messages, "answer": ..., ...}; replaces task
    num_prompts: int = 512  # distinct training prompts drawn from the task(s)
    system_prompt: str | None = None
    prompt_template: str = DEFAULT_TEMPLATE  # the user message; {question} is the task's question
    max_prompt_length: int | None = 512  # longer prompts keep their last tokens (TRL < 1.0's rule)
    # Generation.
    num_generations: int = 8
    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    max_num_seqs: int = 64  # sequences the engine decodes at once
    # Rewards.
    reward_funcs: list[str] = field(default_factory=lambda: ["accuracy", "format"])
    reward_weights: list[float] | None = None  # None: 1.0 each
    scale_rewards: str | bool = "group"  # group | batch | none (True = group, False = none)
    mask_truncated_completions: bool = False
    # Loss.
    loss_type: str = "dapo"
    beta: float = 0.0
    use_bias_correction_kl: bool = True  # the KL term times the importance ratio (TRL's default)
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None: epsilon
    num_iterations: int = 1
    # Optimisation (transformers' TrainingArguments names; AdamW).
    learning_rate: float = 1e-6
    lr_scheduler_type: str = "linear"
    warmup_ratio: float = 0.0
    warmup_steps: int = 0  # > 0 wins over warmup_ratio, as in transformers
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    per_device_train_batch_size: int = 8  # completions per micro-batch
    gradient_accumulation_steps: int = 1
    max_grad_norm: float = 1.0
    max_steps: int = 100
    seed: int = 42
    logging_steps: int = 1
    log_completions: bool = False  # each rollout's prompts, completions, rewards -> output_dir/completions.jsonl
    save_steps: int = 500  # 0: only at the end
    save_total_limit: int | None = None
    resume_from_checkpoint: bool = False
    # Rollouts with speculative decoding in the long tail (TLT). Lossless, and with the per-request
    # seeds the completions are identical with it on or off: only the rollout time changes.
    # none | ngram | suffix | eagle:PATH | eagle (the bundled model's drafter) | hybrid:PATH | hybrid
    # suffix drafts from history: the prompt, the group's other completions (finished or still
    # decoding) and the prompt's completions of the last suffix_history_steps steps (DAS);
    # hybrid merges suffix and EAGLE drafts into one verify tree.
    speculative: str = "none"
    spec_threshold: int = 4  # speculate only while at most this many sequences are in flight
    spec_depths: list[int] = field(default_factory=lambda: [2, 4])  # EAGLE / ngram draft depths: the bandit's arms
    adaptive: bool = True  # a bandit per batch-size bucket picks plain or an arm; False: the last arm always
    # (suffix has one arm and no plain one: the history drafter drafts only where it pays)
    suffix_history_steps: int | None = 4  # suffix, hybrid: steps of a prompt's completions kept; None: all
    suffix_cache_tokens: int = 1 << 20  # suffix, hybrid: tokens of finished completions kept in all
    bandit_policy: str = "epsilon_greedy"  # or ucb1
    bandit_epsilon: float = 0.1
    # The EAGLE drafter trained online on the rollouts' hidden states (TLT; needs speculative eagle):
    # one process trains it right after each rollout for drafter_max_steps_per_rollout steps;
    # under torchrun the ranks that finish their share early train it until the slowest is done
    # (at most that many steps), and the most-trained drafter goes to every rank for the next rollout.
    drafter_online: bool = False
    drafter_buffer_tokens: int = 65536  # hidden states of recent rollouts kept (tokens; oldest dropped)
    drafter_learning_rate: float = 1e-4
    drafter_max_steps_per_rollout: int = 8
    drafter_eval_samples: int = 4  # completions per step replayed for tau (online vs frozen); 0: none

    def __post_init__(self) -> None:
        if isinstance(self.scale_rewards, str) and self.scale_rewards.lower() in ("true", "false"):
            self.scale_rewards = self.scale_rewards.lower() == "true"  # as TRL's command line reads it
        self.scale_rewards = {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)
        choices = [("loss_type", LOSS_TYPES), ("scale_rewards", SCALE_REWARDS), ("lr_scheduler_type", SCHEDULES),
                   ("dtype", ("float32", "bfloat16", "float16", "auto"))]
        for name, allowed in choices:
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {list(allowed)}")
        for name in ("num_prompts", "max_completion_length", "max_num_seqs", "num_iterations",
                     "per_device_train_batch_size", "gradient_accumulation_steps", "max_steps", "logging_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("beta", "epsilon", "learning_rate", "weight_decay", "save_steps", "warmup_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.num_generations < 2:
            raise ValueError(f"num_generations must be >= 2 (advantages compare completions of a prompt), "
                             f"got {self.num_generations}")
        if self.generation_batch_size % self.num_generations:
            raise ValueError(f"per_device_train_batch_size * gradient_accumulation_steps = "
                             f"{self.generation_batch_size} "
                             f"completions per step must be a multiple of num_generations={self.num_generations}")
        if not 0 < self.temperature <= 100 or not 0 < self.top_p <= 1:
            raise ValueError(f"need 0 < temperature <= 100 and 0 < top_p <= 1; got {self.temperature}, {self.top_p}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1 or None, got {self.threads}")
        if self.max_prompt_length is not None and self.max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be >= 1 or None, got {self.max_prompt_length}")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if not self.reward_funcs:
            raise ValueError("reward_funcs is empty; name at least one (built-in: accuracy, format)")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(f"{len(self.reward_weights)} reward_weights for {len(self.reward_funcs)} reward_funcs "
                             f"{self.reward_funcs}; give one weight per function")
        if self.dataset is None:
            task_names(self.task)  # an unknown task is refused now, not after the model loads
            if self.task.startswith(RG_PREFIX):  # and so are options reasoning-gym refuses
                rg_tasks(self.task, 1, self.seed, self.task_config)
            elif self.task_config:
                raise ValueError(f"task_config sets options of reasoning-gym datasets; task {self.task!r} names none "
                                 f"(write task: {RG_PREFIX}<dataset>)")
        elif not Path(self.dataset).expanduser().is_file():
            raise ValueError(f"dataset {self.dataset!r} is not a file (JSON lines with 'prompt' and 'answer')")
        if self.speculative != "none":
            method, colon, _ = self.speculative.partition(":")
            if method not in SPEC_METHODS or (method in ("ngram", "suffix") and colon):
                raise ValueError(f"speculative={self.speculative!r}; allowed: none, ngram, suffix, eagle, eagle:PATH, "
                                 "hybrid, hybrid:PATH")
            if not self.spec_depths or min(self.spec_depths) < 1 or self.spec_threshold < 1:
                raise ValueError(f"spec_depths={self.spec_depths}, spec_threshold={self.spec_threshold}: need "
                                 "depths >= 1 and a threshold >= 1")
        if (self.suffix_history_steps is not None and self.suffix_history_steps < 0) or self.suffix_cache_tokens < 1:
            raise ValueError(f"suffix_history_steps={self.suffix_history_steps}, suffix_cache_tokens="
                             f"{self.suffix_cache_tokens}: need steps >= 0 (or None: all) and tokens >= 1")
        if self.drafter_online and not self.speculative.startswith(("eagle", "hybrid")):
            raise ValueError(f"drafter_online trains an EAGLE drafter; it needs speculative eagle, eagle:PATH, "
                             f"hybrid or hybrid:PATH, got speculative={self.speculative!r}")
        for name in ("drafter_buffer_tokens", "drafter_max_steps_per_rollout"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.drafter_learning_rate <= 0 or self.drafter_eval_samples < 0:
            raise ValueError(f"need drafter_learning_rate > 0 and drafter_eval_samples >= 0; got "
                             f"{self.drafter_learning_rate}, {self.drafter_eval_samples}")
        if "{question}" not in self.prompt_template:
            raise ValueError(f"prompt_template {self.prompt_template!r} must contain {{question}}")

    @property
    def generation_batch_size(self) -> int:
        """Completions per rollout and rank (TRL: per_device_train_batch_size * steps_per_generation;
        times the world size under torchrun)."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps

    @property
    def epsilon_low(self) -> float:
        return self.epsilon

    @property
    def upper_epsilon(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def num_warmup_steps(self) -> int:
        """transformers' rule: warmup_steps if set, else ceil(warmup_ratio * max_steps)."""
        return self.warmup_steps if self.warmup_steps > 0 else math.ceil(self.warmup_ratio * self.max_steps)


# ---- data --------------------------------------------------------------------------------------

def task_names(task: str) -> list[str]:
    """The task families `task` names ("all", one, or several comma-separated; or reasoning-gym's
    datasets, `rg:<dataset>[,<dataset>]`); unknown ones refused."""
    if task.startswith(RG_PREFIX):
        return [RG_PREFIX + n for n in rg_names(task)]
    names = list(TASK_FAMILIES) if task == ALL_TASKS else [t.strip() for t in task.split(",") if t.strip()]
    unknown = [t for t in names if t not in TASK_FAMILIES]
    if unknown or not names:
        raise ValueError(f"unknown task {unknown or task!r}; allowed: {sorted(TASK_FAMILIES)} (comma-separated), "
                         f"{ALL_TASKS!r}, or {RG_PREFIX}<reasoning-gym dataset>")
    return names


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
        out.append(int(torch.randperm(num_rows, generator=g)[i]))
    return out


def request_seed(seed: int, step: int, index: int) -> int:
    """The sampling seed of completion `index` of the rollout at `step`."""
    return (seed * 1_000_003 + step * 7_919 + index) % (2**63 - 1)


# ---- the loss ----------------------------------------------------------------------------------

def group_advantages(rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int,
                     scale_rewards: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL's sum_then_normalize: (advantages, rewards, std) for rewards [N, F] in groups of
    num_generations consecutive rows. A row every function left None gets advantage 0 and is
    left out of its group's mean and std."""
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * weights[None]).nansum(dim=1)
    rewards[unscorable] = torch.nan
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = _nanstd(rewards).expand_as(rewards)
    else:
        std = _nanstd(grouped, dim=1).repeat_interleave(num_generations)
    adv = rewards - mean
    if scale_rewards != "none":
        adv = adv / (std + 1e-4)
    return torch.nan_to_num(adv, nan=0.0), rewards, std


def _nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sample std (Bessel) ignoring NaNs, as TRL's nanstd."""
    mean = torch.nanmean(x, dim=dim, keepdim=dim is not None)
    var = torch.nanmean((x - mean) ** 2, dim=dim)
    count = (~torch.isnan(x)).sum(dim=dim) if dim is not None else (~torch.isnan(x)).sum()
    return (var * count / (count - 1)).sqrt()


def grpo_loss(logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *, loss_type: str,
              epsilon_low: float, epsilon_high: float, beta: float = 0.0, old_logps: torch.Tensor | None = None,
              ref_logps: torch.Tensor | None = None, use_bias_correction_kl: bool = True,
              max_completion_length: int | None = None, num_items_in_batch: float | None = None,
              gradient_accumulation_steps: int = 1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch's loss, as TRL's GRPOTrainer computes it (token-level importance ratio).

    logps, old_logps, ref_logps, mask: [B, C]; advantages [B]. old_logps None: the ratio is 1
    (num_iterations = 1). With beta > 0 each token adds beta * k3 KL to the reference,
    exp(ref - logp) - (ref - logp) - 1, times the ratio if use_bias_correction_kl. The loss is
    already divided for gradient accumulation: summed over the step's micro-batches it is the
    step's loss. grpo: mean over sequences of each one's token mean; bnpo: the micro-batch's token
    mean; dr_grpo: token sum / (B * max_completion_length); dapo: token sum / num_items_in_batch,
    the completion tokens of the whole step. Also returns masked sums for metrics: kl,
    low/high/region clipping, and the token count."""
    adv = advantages[:, None]
    old = logps.detach() if old_logps is None else old_logps
    coef_1 = torch.exp(logps - old)
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs ref_logps (the reference model's log-probs)")
        per_token_kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        if use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1
        per_token = per_token + beta * per_token_kl
    masked = per_token * mask
    if loss_type == "grpo":
        loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / gradient_accumulation_steps
    elif loss_type == "bnpo":
        loss = masked.sum() / mask.sum().clamp(min=1.0) / gradient_accumulation_steps
    elif loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type 'dr_grpo' needs max_completion_length")
        loss = masked.sum() / (per_token.size(0) * max_completion_length) / gradient_accumulation_steps
    elif loss_type == "dapo":
        if num_items_in_batch is None:
            raise ValueError("loss_type 'dapo' needs num_items_in_batch (completion tokens of the step)")
        loss = masked.sum() / max(float(num_items_in_batch), 1.0)
    else:
        raise ValueError(f"loss_type {loss_type!r} is not one of {list(LOSS_TYPES)}")
    with torch.no_grad():
        low = ((coef_1 < 1 - epsilon_low) & (adv < 0)).float()
        high = ((coef_1 > 1 + epsilon_high) & (adv > 0)).float()
        sums = {"tokens": mask.sum(), "clip_low": (low * mask).sum(), "clip_high": (high * mask).sum(),
                "clip_region": (((low + high) > 0).float() * mask).sum()}
        if beta != 0.0:
            sums["kl"] = (per_token_kl * mask).sum()
    return loss, sums


# ---- rollouts ----------------------------------------------------------------------------------

@dataclass
class RolloutBatch:
    """One rollout's completions with what training needs: advantages, old and reference log-probs
    ([N, C] or None), the shuffled order of the micro-batches, and the rollout's metrics."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    mask: torch.Tensor  # [N, C]
    advantages: torch.Tensor  # [N]
    order: list[int]
    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)


def _micro_batches(batch: RolloutBatch, cfg: GRPOConfig, world: World) -> list[list[int]]:
    """This rank's micro-batches (rows of the batch): the step has gradient_accumulation_steps *
    world.size of per_device_train_batch_size rows in `order`; rank r takes k * size + r, so the
    ranks together take what one process accumulating all of them takes."""
    b = cfg.per_device_train_batch_size
    picks = [k * world.size + world.rank for k in range(cfg.gradient_accumulation_steps)]
    return [batch.order[j * b:(j + 1) * b] for j in picks]


def precision(cfg: GRPOConfig, model: torch.nn.Module) -> torch.autocast:
    """The training forwards' precision: bfloat16 autocast with cfg.bf16, else the weights' dtype."""
    return torch.autocast(next(model.parameters()).device.type, dtype=torch.bfloat16, enabled=cfg.bf16)


def _chunked_logps(model: torch.nn.Module, batch: RolloutBatch, cfg: GRPOConfig, world: World) -> torch.Tensor:
    """Log-probs [N, C] of the batch's completions under `model` (no grad), each rank computing
    the rows of its micro-batches, summed over ranks."""
    out = torch.zeros(batch.mask.shape)
    with torch.no_grad(), precision(cfg, model):
        for idx in _micro_batches(batch, cfg, world):
            lp, _ = completion_logps(model, [batch.prompt_ids[i] for i in idx],
                                     [batch.completion_ids[i] for i in idx], cfg.temperature)
            out[idx, :lp.shape[1]] = lp.float().cpu()
    return world.sum_(out)


def drafter_path(cfg: GRPOConfig) -> str:
    """The EAGLE drafter directory cfg.speculative names (eagle, hybrid: the bundled model's,
    trained on first use)."""
    method, _, path = cfg.speculative.partition(":")
    if method not in MODEL_METHODS:
        raise ValueError(f"speculative={cfg.speculative!r} has no EAGLE drafter")
    if not path:
        from reclaim.drafter.bundled import default_drafter_dir

        return str(default_drafter_dir())
    return path


def speculative_arm(cfg: GRPOConfig, depth: int | None, method: str | None = None) -> SpeculativeConfig:
    """A speculative config for cfg.speculative (not 'none'): `method` (default its own) at
    draft depth `depth` (None: the method's default)."""
    own = cfg.speculative.partition(":")[0]
    method = method or own
    return SpeculativeConfig(method=method, model=drafter_path(cfg) if own in MODEL_METHODS else None,
                             num_speculative_tokens=depth, max_batch=cfg.spec_threshold,
                             suffix_history_steps=cfg.suffix_history_steps, suffix_cache_tokens=cfg.suffix_cache_tokens)


def spec_arms(cfg: GRPOConfig) -> list[SpeculativeConfig]:
    """The speculative arms: a config per depth (ngram, eagle), the history drafter (suffix), or
    for hybrid the history drafter, EAGLE per depth and the merged tree (the last is the default)."""
    own = cfg.speculative.partition(":")[0]
    if own == "suffix":
        return [speculative_arm(cfg, None)]
    depths = [speculative_arm(cfg, d, "eagle" if own == "hybrid" else own) for d in sorted(cfg.spec_depths)]
    if own == "hybrid":
        return [speculative_arm(cfg, None, "suffix"), *depths, speculative_arm(cfg, None)]
    return depths


def rollout_runner(cfg: GRPOConfig, log: Callable[[dict[str, Any]], None] | None = None) -> AdaptiveRollout:
    """How rollouts decode: plain, or speculative in the tail with the config the bandit picks."""
    if cfg.speculative == "none":
        return AdaptiveRollout(None)
    arms = spec_arms(cfg)
    # The history drafter needs no plain arm: it drafts only what pays at the step's measured cost.
    arms = [None, *arms] if cfg.adaptive and cfg.speculative != "suffix" else arms[-1:]
    bandit = BucketedBandit(arms, buckets=[b for b in (1, 2, 4, 8, 16, 32, 64) if b <= cfg.spec_threshold] or [1],
                            policy=cfg.bandit_policy, epsilon=cfg.bandit_epsilon, seed=cfg.seed)
    return AdaptiveRollout(bandit, threshold=cfg.spec_threshold, log=log)


def _drafter_step(online: OnlineDrafter, outs: list, engine: Any, world: World) -> dict[str, Any]:
    """The drafter's part of a rollout on this rank: its samples, and training on them (and the
    buffer) right away with one process, or while the slowest worker is still rolling out."""
    samples = online.collect(outs)
    signal = world.signal_done()
    t = time.perf_counter()
    records = online.train(samples, engine.model, stop=signal.all_done if world.size > 1 else None)
    train_s = time.perf_counter() - t
    signal.wait()
    return {"samples": samples, "steps": len(records), "train_s": train_s,
            "loss": [r["loss"] for r in records]}


def rollout(engine: Any, rows: list[dict[str, Any]], prompts: list[list[int]], step: int, cfg: GRPOConfig,
            reward_funcs: Sequence[Callable], reward_names: Sequence[str], eos: set[int],
            completions_log: Path | None = None, runner: AdaptiveRollout | None = None,
            world: World | None = None, online: OnlineDrafter | None = None) -> RolloutBatch:
    """Sample num_generations completions per prompt on the engine (through `runner`: plain or
    adaptive speculation) and score them (and append them to `completions_log`, JSON lines).

    Under torchrun each rank rolls out and scores its contiguous share of the prompts on its own
    engine, with the seeds of their places in the whole rollout, and the shares are gathered:
    every rank holds the step's whole batch, as one process would have made it. With `online`,
    the drafter learns from the rollout's hidden states (see OnlineDrafter) before the gather."""
    from reclaim.engine.request import SamplingParams

    world = world or World()
    g = cfg.num_generations
    mine = world.share(len(prompts))
    first = mine.start * g  # this share's first completion in the whole rollout
    ids = [prompts[p] for p in mine for _ in range(g)]
    rep = [rows[p] for p in mine for _ in range(g)]
    params = [SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_completion_length,
                             seed=request_seed(cfg.seed, step, first + i)) for i in range(len(ids))]
    if online is not None:
        online.begin_rollout()
    next_round = getattr(engine.drafter, "next_round", None)
    if next_round is not None:  # a history drafter's window of steps moves on
        next_round()
    t0 = time.perf_counter()
    outs: list = []
    try:  # an error here is raised on every rank after the gather, so none waits for the others forever
        outs, stats = (runner or AdaptiveRollout(None)).generate(engine, ids, params) if ids else ([], RolloutStats())
        failed = [o for o in outs if o.finish_reason == "error"]
        if failed:
            raise RuntimeError(f"{len(failed)} rollout request(s) failed in the engine, e.g. {failed[0].error}")
        completions = [list(o.token_ids) for o in outs]
        texts = [[{"role": "assistant", "content": o.text}] for o in outs]
        columns = {k: [r.get(k) for r in rep] for k in dict.fromkeys(k for r in rows for k in r) if k != "prompt"}
        state = SimpleNamespace(global_step=step, max_steps=cfg.max_steps)
        per_func = (score(reward_funcs, reward_names, [r["prompt"] for r in rep], texts, completions, columns,
                          trainer_state=state) if ids else torch.empty(0, len(reward_funcs)))
        part = {"completions": completions, "texts": texts, "per_func": per_func,
                "busy_s": time.perf_counter() - t0, "stats": stats.to_dict()}
    except Exception as exc:  # noqa: BLE001 - re-raised below, on every rank
        if world.size == 1:
            raise
        part, outs = {"error": exc}, []
    if online is not None:
        part["drafter"] = _drafter_step(online, outs, engine, world)
    parts = world.gather(part)
    errors = [p["error"] for p in parts if "error" in p]
    if errors:
        raise part.get("error", errors[0])
    completions = [c for p in parts for c in p["completions"]]
    texts = [t for p in parts for t in p["texts"]]
    per_func = torch.cat([p["per_func"] for p in parts])
    st = [p["stats"] for p in parts]
    busy = [p["busy_s"] for p in parts]
    rollout_s = max(busy)  # the step waits for the slowest worker

    ids = [p for p in prompts for _ in range(g)]
    rep = [r for r in rows for _ in range(g)]
    mask = completion_mask(completions)
    truncated = torch.tensor([not (c and c[-1] in eos) for c in completions])
    if cfg.mask_truncated_completions:
        mask = mask * (~truncated).float()[:, None]
    weights = torch.tensor(cfg.reward_weights or [1.0] * len(reward_funcs))
    adv, rewards, std = group_advantages(per_func, weights, g, cfg.scale_rewards)
    lens = torch.tensor([len(c) for c in completions], dtype=torch.float)
    n_tokens = int(lens.sum())
    tail_tokens, tail_s = sum(s["tail_tokens"] for s in st), sum(s["tail_seconds"] for s in st)
    metrics = {"reward": torch.nanmean(rewards).item(), "reward_std": _nanstd(rewards).item(),
               "frac_reward_zero_std": torch.isclose(std, torch.zeros_like(std)).float().mean().item(),
               "completions/mean_length": lens.mean().item(), "completions/min_length": lens.min().item(),
               "completions/max_length": lens.max().item(),
               "completions/clipped_ratio": truncated.float().mean().item(),
               "rollout_s": rollout_s, "rollout_tokens": n_tokens, "rollout_tokens_per_s": n_tokens / rollout_s,
               "rollout_tail_s": max(s["tail_seconds"] for s in st),
               "rollout_tail_tokens_per_s": tail_tokens / tail_s if tail_s else 0.0,  # per worker
               "rollout_idle_s": sum(rollout_s - b for b in busy),  # workers waiting for the slowest
               "rollout_spec_decisions": sum(len(s["decisions"]) for s in st)}
    spec = {k: sum(s["spec"].get(k, 0) for s in st) for k in ("verifies", "accepted", "drafted", "draft_seconds")}
    metrics["rollout_spec_draft_s"] = max(s["spec"].get("draft_seconds", 0.0) for s in st)  # per worker
    memory = getattr(engine.drafter, "memory", None)
    if memory is not None:  # the history drafter's size on this rank
        metrics.update({f"suffix/{k}": v for k, v in memory().items()})
    if spec["verifies"]:
        metrics["rollout_spec_tau"] = (spec["accepted"] + spec["verifies"]) / spec["verifies"]
        metrics["rollout_spec_acceptance"] = spec["accepted"] / max(1, spec["drafted"])
    for j, name in enumerate(reward_names):
        metrics[f"rewards/{name}/mean"] = torch.nanmean(per_func[:, j]).item()
        metrics[f"rewards/{name}/std"] = _nanstd(per_func[:, j]).item()
    if online is not None:
        metrics.update(_sync_drafter(online, [p["drafter"] for p in parts], engine, world))
    if completions_log is not None and world.is_main:
        with open(completions_log, "a") as f:
            for i, r in enumerate(rep):
                f.write(json.dumps({"step": step + 1, "prompt": r["prompt"][-1]["content"], "completion": texts[i][0]["content"],
                                    "rewards": dict(zip(reward_names, per_func[i].tolist())),
                                    "advantage": adv[i].item()}) + "\n")
    order = torch.randperm(len(ids), generator=torch.Generator().manual_seed(request_seed(cfg.seed, step, -1)))
    return RolloutBatch(ids, completions, mask, adv, order.tolist(), metrics=metrics)


def _sync_drafter(online: OnlineDrafter, parts: list[dict[str, Any]], engine: Any, world: World) -> dict[str, float]:
    """Every rank takes the most-trained drafter; rank 0 replays the rollout for tau (online vs
    frozen starting drafter). Metrics: drafter/steps (of the drafter in use next), its loss (first
    and last step), steps summed over ranks, training seconds (the longest), buffer tokens, tau."""
    src = online.sync(world, [p["samples"] for p in parts], [p["steps"] for p in parts])
    losses = parts[src]["loss"]
    out: dict[str, float] = {"drafter/steps": len(losses), "drafter/steps_all_ranks": sum(p["steps"] for p in parts),
                             "drafter/train_s": max(p["train_s"] for p in parts),
                             "drafter/buffer_tokens": online.buffer.num_tokens, "drafter/total_steps": online.steps}
    if losses:
        out["drafter/loss"] = sum(losses) / len(losses)
        out["drafter/loss_first"], out["drafter/loss_last"] = losses[0], losses[-1]
    if world.is_main and online.eval_samples:
        t = time.perf_counter()
        out.update(online.evaluate(parts[0]["samples"], engine.model))
        out["drafter/eval_s"] = time.perf_counter() - t
    return out


# ---- checkpoints -------------------------------------------------------------------------------

def checkpoints(output_dir: str | Path) -> list[Path]:
    """The run's complete checkpoint-{step} directories (trainer state written), oldest first."""
    return list_checkpoints(output_dir, require="trainer_state.json")


DCP_DIR = "dcp"  # checkpoint-{step}/dcp: the torch.distributed.checkpoint of model, optimizer, scheduler


class TrainerState:
    """What DCP saves and loads (torch.distributed.checkpoint's Stateful): the policy, the optimizer
    (state dicts keyed by parameter name, as get_state_dict gives them, so any world size reads
    them) and the LR scheduler."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optimizer": optim_sd, "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
        self.scheduler.load_state_dict(sd["scheduler"])


def save_checkpoint(out: Path, step: int, model: torch.nn.Module, tokenizer: Any, optimizer, scheduler,
                    state: dict[str, Any], batch: RolloutBatch | None, online: OnlineDrafter | None = None,
                    world: World | None = None) -> Path:
    """checkpoint-{step}/: the policy (HF layout), dcp/ (TrainerState, every rank writing its share),
    RNG states, the rollout still being trained on (num_iterations > 1), the online drafter
    (drafter/, drafter_state.pt) and trainer_state.json (last). Every rank calls it; rank 0 builds
    the directory under a temp name and renames it into place once all is written, so a crash
    mid-save leaves the previous checkpoint the latest."""
    import torch.distributed.checkpoint as dcp

    from reclaim.models.loading import save_model
    from reclaim.storage import atomic_dir

    world = world or World()
    trainer = {"trainer": TrainerState(model, optimizer, scheduler)}
    path = out / f"{CHECKPOINT_PREFIX}{step}"
    if not world.is_main:
        _dcp(dcp.save, trainer, world.broadcast(None, src=0), world)
        return path

    def write(tmp: Path) -> None:
        save_model(model, tokenizer, tmp)  # first, while tmp is empty (it replaces the directory)
        _dcp(dcp.save, trainer, world.broadcast(tmp / DCP_DIR, src=0), world)
        torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, tmp / "rng_state.pt")
        if batch is not None:
            torch.save(dataclasses.asdict(batch), tmp / "rollout.pt")
        if online is not None:
            online.save(tmp)
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2) + "\n")

    return atomic_dir(path, write)


def load_trainer_state(checkpoint: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                       scheduler: Any, world: World | None = None) -> None:
    """Load the checkpoint's dcp/ into the policy, optimizer and scheduler (every rank calls it; the
    world size may differ from the one that saved)."""
    import torch.distributed.checkpoint as dcp

    if not (checkpoint / DCP_DIR / ".metadata").is_file():
        raise ValueError(f"{str(checkpoint)!r} has no {DCP_DIR}/.metadata (the torch.distributed.checkpoint of the "
                         f"model, optimizer and scheduler); it was not written by this version of reclaim grpo, so "
                         f"it cannot be resumed: start a fresh run (model: {str(checkpoint)!r} starts from its weights)")
    _dcp(dcp.load, {"trainer": TrainerState(model, optimizer, scheduler)}, checkpoint / DCP_DIR, world or World())


def _dcp(op: Callable, state: dict[str, Any], path: Path, world: World) -> None:
    """dcp.save or dcp.load at `path`: collective over the ranks; one process runs it without a
    process group, as it says in a warning silenced here, since that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*single process")
        op(state, checkpoint_id=path, no_dist=world.size == 1)


# ---- the trainer -------------------------------------------------------------------------------

def _optimizer_step(model: torch.nn.Module, batch: RolloutBatch, cfg: GRPOConfig, world: World) -> dict[str, float]:
    """This rank's micro-batches of the rollout through `model` (the DDP-wrapped policy under
    torchrun), backward each; DDP sums the gradients over ranks during the last one's backward (no
    optimizer step). Each micro-batch's loss is normalised to the whole step (all ranks'
    gradient_accumulation_steps * world.size micro-batches), so the sum is the step's."""
    num_items = float(batch.mask.sum())
    totals: dict[str, float] = {}
    loss_sum = entropy_sum = 0.0
    device = next(model.parameters()).device
    micro = _micro_batches(batch, cfg, world)
    for n, idx in enumerate(micro):
        comps = [batch.completion_ids[i] for i in idx]
        c = max(len(x) for x in comps)
        pick = lambda t: None if t is None else t[idx, :c].to(device)  # noqa: E731
        mask = pick(batch.mask)
        with accumulating(model, last=n == len(micro) - 1):
            with precision(cfg, model):
                logps, ent = completion_logps(model, [batch.prompt_ids[i] for i in idx], comps, cfg.temperature,
                                              entropy=True)
            loss, sums = grpo_loss(logps.float(), batch.advantages[idx].to(device), mask, loss_type=cfg.loss_type,
                                   epsilon_low=cfg.epsilon_low, epsilon_high=cfg.upper_epsilon, beta=cfg.beta,
                                   old_logps=pick(batch.old_logps), ref_logps=pick(batch.ref_logps),
                                   use_bias_correction_kl=cfg.use_bias_correction_kl,
                                   max_completion_length=cfg.max_completion_length, num_items_in_batch=num_items,
                                   gradient_accumulation_steps=cfg.gradient_accumulation_steps * world.size)
            loss.backward()
        loss_sum += loss.item()
        entropy_sum += float((ent * mask).sum())
        for key, v in sums.items():
            totals[key] = totals.get(key, 0.0) + float(v)
    keys = sorted(totals)
    summed = world.sum_(torch.tensor([loss_sum, entropy_sum, *(totals[k] for k in keys)], dtype=torch.float64))
    loss_sum, entropy_sum = summed[0].item(), summed[1].item()
    totals = dict(zip(keys, summed[2:].tolist()))
    tokens = max(totals.pop("tokens"), 1.0)
    out = {"loss": loss_sum, "entropy": entropy_sum / tokens}
    for key in ("clip_low", "clip_high", "clip_region"):
        out[f"clip_ratio/{key.removeprefix('clip_')}_mean"] = totals[key] / tokens
    if "kl" in totals:
        out["kl"] = totals["kl"] / tokens
    return out


def train(cfg: GRPOConfig, *, progress: bool = True, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run `reclaim grpo` per cfg; returns a summary (steps, the last logged record, seconds).

    Under torchrun every rank calls this: each rolls out its share of every step on its own
    engine, the policy trains data parallel (see distributed.py), rank 0 logs and checkpoints."""
    world = World.start(cfg.device)
    if world.device.type == "cuda":
        cfg = dataclasses.replace(cfg, device=str(world.device))  # this rank's GPU
    try:
        return _train(cfg, world, progress, log)
    finally:
        world.close()


def _open_engine(cfg: GRPOConfig, model: torch.nn.Module, tokenizer: Any, max_len: int,
                 last: Path | None) -> tuple[Any, OnlineDrafter | None]:
    """The rollout engine on a copy of the policy; with drafter_online, its EAGLE drafter is the
    online one (the checkpoint's on resume; the frozen copy is always the configured drafter)."""
    from reclaim.engine.engine import Engine

    served = copy.deepcopy(model)
    online = None
    if cfg.drafter_online:
        from reclaim.models.drafter import load_drafter

        online = OnlineDrafter(load_drafter(drafter_path(cfg), served), buffer_tokens=cfg.drafter_buffer_tokens,
                               lr=cfg.drafter_learning_rate, max_steps=cfg.drafter_max_steps_per_rollout,
                               seed=cfg.seed, eval_samples=cfg.drafter_eval_samples,
                               eval_depth=max(cfg.spec_depths))
        if last is not None and (last / "drafter").exists():
            online.load(last, served)
    from reclaim.engine.drafters import HybridDrafter, history_drafter, make_drafter

    drafter = online.proposer(served) if online is not None else None
    if drafter is not None and cfg.speculative.startswith("hybrid"):  # the online EAGLE drafter beside the history
        arm = speculative_arm(cfg, None)
        drafter = HybridDrafter(history_drafter(arm), drafter, model_tokens=arm.hybrid_eagle_tokens)
    if drafter is None and cfg.speculative != "none":
        # Built now, so it follows every sequence from its prefill; one made in the tail could not
        # draft for sequences it has not seen.
        drafter = make_drafter(spec_arms(cfg)[-1], served)
    engine = Engine(served, tokenizer, max_num_seqs=cfg.max_num_seqs, max_model_len=max_len, seed=cfg.seed,
                    drafter=drafter)
    return engine, online


def _train(cfg: GRPOConfig, world: World, progress: bool, log: Callable[[str], None]) -> dict[str, Any]:
    from tqdm import tqdm

    from reclaim.models.loading import load_model
    from reclaim.models.tokenizer import encode_chat

    t_start = time.perf_counter()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    if (cfg.generation_batch_size * world.size) % cfg.num_generations:
        raise ValueError(f"per_device_train_batch_size * gradient_accumulation_steps * world size = "
                         f"{cfg.generation_batch_size * world.size} completions per step must be a multiple of "
                         f"num_generations={cfg.num_generations}")
    main = world.is_main
    out = Path(cfg.output_dir)
    rows = build_dataset(cfg)
    reward_funcs = [load_reward(spec) for spec in cfg.reward_funcs]
    reward_names = [getattr(f, "__name__", spec) if ":" in spec or "." in spec else spec
                    for f, spec in zip(reward_funcs, cfg.reward_funcs)]
    if main:
        out.mkdir(parents=True, exist_ok=True)
    world.barrier()
    last = None
    if cfg.resume_from_checkpoint:
        found = checkpoints(out)
        if not found:
            raise ValueError(f"resume_from_checkpoint is set but {str(out)!r} has no {CHECKPOINT_PREFIX}* directory")
        last = found[-1]
    torch.manual_seed(cfg.seed)
    dtype = None if cfg.dtype == "auto" else cfg.dtype
    model, tokenizer = load_model(last or cfg.model, dtype=dtype, device=cfg.device)
    if tokenizer is None:
        raise ValueError(f"model {cfg.model!r} has no tokenizer files; prompts need its chat template")
    ref = None
    if cfg.beta > 0:  # the starting model, also on resume
        ref = load_model(cfg.model, dtype=dtype, device=cfg.device)[0] if last else copy.deepcopy(model)
        ref.requires_grad_(False)
    prompts = [encode_chat(tokenizer, r["prompt"]) for r in rows]
    if cfg.max_prompt_length is not None:
        prompts = [p[-cfg.max_prompt_length:] for p in prompts]
    limit = model.config.max_position_embeddings
    max_len = min(limit, max(len(p) for p in prompts) + cfg.max_completion_length)
    if max(len(p) for p in prompts) >= max_len:
        raise ValueError(f"a prompt of {max(len(p) for p in prompts)} tokens leaves no room to generate within the "
                         f"model's {limit} positions; lower max_prompt_length")
    opt = adamw(list(model.parameters()), lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                eps=cfg.adam_epsilon, weight_decay=cfg.weight_decay)
    sched = lr_scheduler(opt, cfg.lr_scheduler_type, warmup_steps=cfg.num_warmup_steps, total_steps=cfg.max_steps)
    if last is not None:
        load_trainer_state(last, model, opt, sched, world)
    policy = world.data_parallel(model)  # trains; the engine and the checkpoints read `model`, its weights
    engine, online = _open_engine(cfg, model, tokenizer, max_len, last)
    eos = set(engine.eos_token_ids)
    decisions = out / ("spec_decisions.jsonl" if main else f"spec_decisions-rank{world.rank}.jsonl")

    def log_decision(d: dict[str, Any]) -> None:
        with open(decisions, "a") as f:
            f.write(json.dumps(d) + "\n")

    runner = rollout_runner(cfg, log=log_decision)
    step, history, window, batch = 0, [], [], None
    log_path, completions_log = out / "log.jsonl", out / "completions.jsonl"
    if last is not None:
        state = json.loads((last / "trainer_state.json").read_text())
        step, history, window = state["global_step"], state["log_history"], state["log_window"]
        rng = torch.load(last / "rng_state.pt", weights_only=False)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if (last / "rollout.pt").exists():
            batch = RolloutBatch(**torch.load(last / "rollout.pt", weights_only=False))
        if main:
            trim_log(log_path, step)
            trim_log(completions_log, step)
    else:  # a fresh run starts fresh logs
        decisions.unlink(missing_ok=True)
        if main:
            log_path.unlink(missing_ok=True)
            completions_log.unlink(missing_ok=True)
    config_dict = dataclasses.asdict(cfg)
    if main:
        (out / "train_config.json").write_text(json.dumps({**config_dict, "world_size": world.size}, indent=2) + "\n")

    per_step = cfg.generation_batch_size * world.size // cfg.num_generations
    bar = tqdm(total=cfg.max_steps, initial=step, disable=not (progress and main), desc="grpo")
    model.train()
    while step < cfg.max_steps:
        t0 = time.perf_counter()
        rec: dict[str, Any] = {}
        if step % cfg.num_iterations == 0 or batch is None:
            idx = prompt_rows(len(rows), per_step, step // cfg.num_iterations, cfg.seed)
            batch = rollout(engine, [rows[i] for i in idx], [prompts[i] for i in idx], step, cfg,
                            reward_funcs, reward_names, eos, completions_log if cfg.log_completions else None,
                            runner, world, online)
            if cfg.num_iterations > 1:
                batch.old_logps = _chunked_logps(model, batch, cfg, world)
            if ref is not None:
                batch.ref_logps = _chunked_logps(ref, batch, cfg, world)
            rec.update(batch.metrics)
        else:  # another iteration on the same rollout: its reward metrics, no rollout time
            rec.update({k: v for k, v in batch.metrics.items() if not k.startswith(("rollout", "drafter/"))})
        opt.zero_grad(set_to_none=True)
        t_train = time.perf_counter()
        rec.update(_optimizer_step(policy, batch, cfg, world))
        rec["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm))
        rec["learning_rate"] = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        rec["weights_version"] = engine.update_weights(model.state_dict())
        rec["train_s"] = time.perf_counter() - t_train
        # The drafter's tau replay is a measurement, not part of the step.
        rec["step_time"] = time.perf_counter() - t0 - rec.get("drafter/eval_s", 0.0)
        step += 1
        window.append(rec)
        bar.update(1)
        bar.set_postfix(reward=f"{rec['reward']:.3f}", loss=f"{rec['loss']:.4f}")
        if step % cfg.logging_steps == 0 or step == cfg.max_steps:
            keys = sorted({k for r in window for k in r})
            entry = {"step": step, **{k: sum(r[k] for r in window if k in r) / sum(k in r for r in window)
                                      for k in keys}}
            history.append(entry)
            if main:
                with open(log_path, "a") as f:
                    f.write(json.dumps(entry) + "\n")
            window = []
        if (cfg.save_steps and step % cfg.save_steps == 0) or step == cfg.max_steps:
            state = {"global_step": step, "max_steps": cfg.max_steps, "log_history": history,
                     "log_window": window, "config": config_dict, "world_size": world.size}
            pending = batch if step % cfg.num_iterations else None
            save_checkpoint(out, step, model, tokenizer, opt, sched, state, pending, online, world)
            if main and cfg.save_total_limit:
                for old in checkpoints(out)[:-cfg.save_total_limit]:
                    shutil.rmtree(old, ignore_errors=True)
            world.barrier()  # every rank sees the checkpoint once any goes on
    bar.close()
    return {"steps": step, "last": history[-1] if history else None, "total_s": time.perf_counter() - t_start}
