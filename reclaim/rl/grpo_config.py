"""`reclaim grpo`'s config: GRPOConfig with TRL's names and meanings, every field checked."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reclaim.data.tasks import RG_PREFIX, TASK_FAMILIES, rg_names, rg_tasks
from reclaim.engine.config import EngineConfig
from reclaim.engine.speculative import SPECULATIVE_METHODS as SPEC_METHODS
from reclaim.fsdp import PARALLELISMS
from reclaim.rl.loss import LOSS_TYPES, SCALE_REWARDS
from reclaim.rl.rollout_weights import ROLLOUT_DTYPES
from reclaim.schedule import SCHEDULES
from reclaim.trackers import report_to_list

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
    # bf16; weights, gradients and optimizer in `dtype`).
    bf16: bool = False
    # The rollout engine's copy of the policy (rl/rollout_weights.py): bfloat16 as verl and TLT
    # roll out, refreshed from the trainer's weights after each step; auto: the training dtype.
    rollout_dtype: str = "bfloat16"
    # Ranks of a rollout engine's tensor-parallel group (verl's tensor_model_parallel_size): under
    # torchrun each N consecutive ranks share one engine, each holding 1/N of its weights and K/V;
    # it must divide the world size and the model's heads, K/V heads, MLP and vocabulary.
    rollout_tensor_parallel_size: int = 1
    device: str = "cpu"
    threads: int | None = None  # torch threads; None: torch's default (1 is faster on a busy CPU)
    # Under torchrun: "ddp" (a replica per rank, gradients all-reduced) or "fsdp" (FSDP2's
    # fully_shard per decoder layer and the root: 1/N of the policy, its gradients, the optimizer
    # state and the reference model per rank; reclaim/fsdp.py). One process: no difference.
    parallelism: str = "ddp"
    fsdp_cpu_offload: bool = False  # fsdp: the shards and the optimizer state in host memory
    # verl's names: while rolling out, the policy's parameters (this rank's shards) and / or
    # AdamW's moments wait in host memory (rl/offload.py); the moments come back just before the
    # optimizer step. On a CPU the moves are no-ops.
    param_offload: bool = False
    optimizer_offload: bool = False
    # TRL's vllm_enable_sleep_mode: the rollout engine sleeps through training (`Engine.sleep(2)`:
    # its K/V pool and weights give their memory back) and wakes for the weight update after the
    # optimizer step, as verl frees its cache engine; `reclaim plan` leaves both out of training.
    enable_sleep_mode: bool = False
    gradient_checkpointing: bool = False  # transformers' name: each decoder layer reruns its forward in the backward
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
    # The rollout engine's other EngineConfig fields (block_size, kv_cache_bytes, head, ...);
    # max_num_seqs and seed are their own fields, max_model_len follows the lengths.
    engine: dict[str, Any] = field(default_factory=dict)
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
    # Completion positions whose logits are made at once (the policy's, the old policy's and the
    # reference model's log-probs; rl/logps.py): a [tokens, vocabulary] tensor is never whole.
    # None: a micro-batch's all at once.
    logits_chunk_size: int | None = 1024
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
    report_to: str | list[str] = "none"  # none | tensorboard | wandb | trackio, or a list (reclaim/trackers.py)
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
        report_to_list(self.report_to)  # a tracker unknown or not installed: one line, before the model loads
        if isinstance(self.scale_rewards, str) and self.scale_rewards.lower() in ("true", "false"):
            self.scale_rewards = self.scale_rewards.lower() == "true"  # as TRL's command line reads it
        self.scale_rewards = {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)
        choices = [("loss_type", LOSS_TYPES), ("scale_rewards", SCALE_REWARDS), ("lr_scheduler_type", SCHEDULES),
                   ("dtype", ("float32", "bfloat16", "float16", "auto")), ("parallelism", PARALLELISMS),
                   ("rollout_dtype", ROLLOUT_DTYPES)]
        for name, allowed in choices:
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {list(allowed)}")
        for name in ("num_prompts", "max_completion_length", "max_num_seqs", "num_iterations",
                     "rollout_tensor_parallel_size", "per_device_train_batch_size", "gradient_accumulation_steps", "max_steps", "logging_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        self.engine_config(None)  # refuses an unknown engine field or a bad value by name
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
        if self.fsdp_cpu_offload and self.parallelism != "fsdp":
            raise ValueError(f"fsdp_cpu_offload offloads FSDP's shards; it needs parallelism 'fsdp', "
                             f"got parallelism={self.parallelism!r}")
        if self.logits_chunk_size is not None and self.logits_chunk_size < 1:
            raise ValueError(f"logits_chunk_size must be >= 1 or None (all positions at once), got "
                             f"{self.logits_chunk_size}")
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

    def engine_config(self, max_model_len: int | None) -> EngineConfig:
        """The rollout engine's config: `engine`'s fields with max_num_seqs, seed and the context."""
        owned = sorted({"max_num_seqs", "seed", "max_model_len", "speculative", "tensor_parallel_size"}
                       & set(self.engine))
        if owned:
            raise ValueError(f"engine: {owned} are set by GRPO (max_num_seqs, seed and "
                             f"rollout_tensor_parallel_size are its own fields); allowed there: the other "
                             f"EngineConfig fields")
        return EngineConfig().replace(**self.engine, max_num_seqs=self.max_num_seqs, seed=self.seed,
                                      max_model_len=max_model_len,
                                      tensor_parallel_size=self.rollout_tensor_parallel_size)


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
