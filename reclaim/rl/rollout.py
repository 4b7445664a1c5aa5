"""GRPO's rollout: completions sampled on the engine, scored, their advantages and metrics
(`rollout` -> RolloutBatch), and how they decode (adaptive rollouts, TLT): plain decoding while the
batch is large, speculation in the long tail, with the speculative config picked per step by a
bandit over batch-size buckets.

`AdaptiveRollout.generate` drives the engine one step at a time. While more than `threshold`
sequences are in flight it decodes plainly; below, it asks the bandit for an arm (a
SpeculativeConfig or None) for the current batch size, runs the step and pays the arm the tokens
committed per second of that step. Speculation is lossless, so the outputs are those of plain
decoding (greedy: identical; sampled: identically distributed). Each decision is logged.

Under torchrun `rollout` splits the step's prompts among the rollout workers: each rank with its
own engine, or with `rollout_tensor_parallel_size` N each group of N ranks with one
tensor-parallel engine, whose leader (the group's first rank) holds the requests, the proposer,
the bandit and the scoring while the other ranks run its forwards on their shards.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from reclaim.drafter.online import OnlineDrafterTrainer
from reclaim.engine.engine import Engine
from reclaim.engine.request import RequestOutput, SamplingParams
from reclaim.engine.speculative import MODEL_METHODS, SpeculativeConfig
from reclaim.rl.bandit import BucketedBandit
from reclaim.rl.data import request_seed
from reclaim.rl.distributed import World
from reclaim.rl.grpo_config import GRPOConfig
from reclaim.rl.logps import completion_mask
from reclaim.rl.loss import group_advantages, nanstd
from reclaim.rl.rewards import score


@dataclass
class RolloutStats:
    """What one rollout cost and how the tail went."""

    tokens: int = 0
    seconds: float = 0.0
    tail_tokens: int = 0  # produced while at most `threshold` sequences were in flight
    tail_seconds: float = 0.0
    steps: int = 0
    decisions: list[dict[str, Any]] = field(default_factory=list)
    spec: dict[str, float] = field(default_factory=dict)  # the engine's drafted/accepted/verifies

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tokens_per_s"] = self.tokens_per_s
        d["tail_tokens_per_s"] = self.tail_tokens / self.tail_seconds if self.tail_seconds else 0.0
        return d


class AdaptiveRollout:
    """Generates with an engine, choosing speculation per step (None bandit: never speculates)."""

    def __init__(self, bandit: BucketedBandit | None, threshold: int = 4,
                 log: Callable[[dict[str, Any]], None] | None = None) -> None:
        if threshold < 0:
            raise ValueError(f"threshold={threshold}; allowed: >= 0 sequences")
        self.bandit, self.threshold, self.log = bandit, threshold, log

    def generate(self, engine: Engine, prompts: list[list[int]],
                 params: list[SamplingParams]) -> tuple[list[RequestOutput], RolloutStats]:
        """Run every prompt to completion; outputs in order and the rollout's stats."""
        stats = RolloutStats()
        before = dict(engine.spec_stats)
        ids = [engine.add_request(None, p, sp) for p, sp in zip(prompts, params)]
        final: dict[str, RequestOutput] = {}
        start = time.perf_counter()
        while len(final) < len(ids):
            sched = engine.scheduler
            in_flight = min(len(sched.running) + len(sched.waiting) + len(engine._inbox), sched.max_num_seqs)
            decision = None
            if self.bandit is not None and in_flight <= self.threshold:
                decision = self.bandit.choose(in_flight)
                engine.set_speculative(self.bandit.arms[decision.arm])
            else:
                engine.set_speculative(None)
            t = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t
            made = sum(len(o.new_token_ids) for o in outs)
            stats.steps += 1
            stats.tokens += made
            if in_flight <= self.threshold:
                stats.tail_tokens += made
                stats.tail_seconds += dt
            if decision is not None:
                reward = made / dt if dt > 0 else 0.0
                self.bandit.update(decision, reward)
                record = {"batch": in_flight, "bucket": decision.bucket, "arm": decision.arm,
                          "reason": decision.reason, "tokens": made, "seconds": dt, "reward": reward}
                stats.decisions.append(record)
                if self.log is not None:
                    self.log(record)
            for o in outs:
                if o.finished:
                    final[o.request_id] = o
        stats.seconds = time.perf_counter() - start
        stats.spec = {k: engine.spec_stats[k] - before.get(k, 0) for k in engine.spec_stats}
        return [final[i] for i in ids], stats


# ---- GRPO's rollout ---------------------------------------------------------------------------

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


def drafter_path(speculative: str) -> str:
    """The EAGLE drafter directory a `speculative` setting names (eagle, hybrid: the bundled
    model's, trained on first use)."""
    method, _, path = speculative.partition(":")
    if method not in MODEL_METHODS:
        raise ValueError(f"speculative={speculative!r} has no EAGLE drafter")
    if not path:
        from reclaim.drafter.bundled import default_drafter_dir

        return str(default_drafter_dir())
    return path


def speculative_arm(cfg: GRPOConfig, depth: int | None, method: str | None = None) -> SpeculativeConfig:
    """A speculative config for cfg.speculative (not 'none'): `method` (default its own) at
    draft depth `depth` (None: the method's default)."""
    own = cfg.speculative.partition(":")[0]
    method = method or own
    model = drafter_path(cfg.speculative) if own in MODEL_METHODS else None
    return SpeculativeConfig(method=method, model=model,
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


def _drafter_step(online: OnlineDrafterTrainer, outs: list, engine: Any, world: World) -> dict[str, Any]:
    """The drafter's part of a rollout on this rank: its samples, and training on them (and the
    buffer) right away with one process, or while the slowest worker is still rolling out."""
    samples = online.collect(outs)
    signal = world.signal_done()
    t = time.perf_counter()
    # A TP group's leader trains it, on the whole embedding and head its engine keeps for the
    # drafter (draft_target); its followers hold shards of those and train nothing.
    records = online.train(samples, engine.draft_target, stop=signal.all_done if world.size > 1 else None) \
        if world.is_rollout_leader else []
    train_s = time.perf_counter() - t
    signal.wait()
    return {"samples": samples, "steps": len(records), "train_s": train_s,
            "loss": [r["loss"] for r in records]}


def _generate(engine: Any, runner: AdaptiveRollout, ids: list[list[int]],
              params: list[SamplingParams]) -> tuple[list[RequestOutput], RolloutStats]:
    """This rank's share through the engine. A tensor-parallel follower has no share: it runs its
    leader's forwards until the leader is done (released even when generating fails)."""
    if not engine.is_leader:
        engine.follow()
        return [], RolloutStats()
    try:
        return runner.generate(engine, ids, params) if ids else ([], RolloutStats())
    finally:
        engine.release()


def rollout(engine: Any, rows: list[dict[str, Any]], prompts: list[list[int]], step: int, cfg: GRPOConfig,
            reward_funcs: Sequence[Callable], reward_names: Sequence[str], eos: set[int],
            completions_log: Path | None = None, runner: AdaptiveRollout | None = None,
            world: World | None = None, online: OnlineDrafterTrainer | None = None) -> RolloutBatch:
    """Sample num_generations completions per prompt on the engine (through `runner`: plain or
    adaptive speculation) and score them (and append them to `completions_log`, JSON lines).

    Under torchrun each rank rolls out and scores its contiguous share of the prompts on its own
    engine, with the seeds of their places in the whole rollout, and the shares are gathered:
    every rank holds the step's whole batch, as one process would have made it. With
    tensor-parallel rollout groups (World.rollout_group) the share is the group's: its leader
    rolls it out and scores it, the other ranks follow the engine's forwards and gather an empty
    part (their busy time is the time they followed). With `online`, the drafter learns from the
    rollout's hidden states (see OnlineDrafterTrainer) before the gather."""
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
    next_round = getattr(engine.proposer, "next_round", None)
    if next_round is not None:  # a history drafter's window of steps moves on
        next_round()
    t0 = time.perf_counter()
    outs: list = []
    try:  # an error here is raised on every rank after the gather, so none waits for the others forever
        outs, stats = _generate(engine, runner or AdaptiveRollout(None), ids, params)
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
    metrics = {"reward": torch.nanmean(rewards).item(), "reward_std": nanstd(rewards).item(),
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
    memory = getattr(engine.proposer, "memory", None)
    if memory is not None:  # the history drafter's size on this rank
        metrics.update({f"suffix/{k}": v for k, v in memory().items()})
    if spec["verifies"]:
        metrics["rollout_spec_tau"] = (spec["accepted"] + spec["verifies"]) / spec["verifies"]
        metrics["rollout_spec_acceptance"] = spec["accepted"] / max(1, spec["drafted"])
    for j, name in enumerate(reward_names):
        metrics[f"rewards/{name}/mean"] = torch.nanmean(per_func[:, j]).item()
        metrics[f"rewards/{name}/std"] = nanstd(per_func[:, j]).item()
    if online is not None:
        metrics.update(_sync_drafter(online, [p["drafter"] for p in parts], engine, world))
    if completions_log is not None and world.is_main:
        with open(completions_log, "a") as f:
            for i, r in enumerate(rep):
                f.write(json.dumps({"step": step + 1, "prompt": r["prompt"][-1]["content"], "completion": texts[i][0]["content"],
                                    "rewards": dict(zip(reward_names, per_func[i].tolist())),
                                    "advantage": adv[i].item()}) + "\n")
    order = torch.randperm(len(ids), device="cpu",
                           generator=torch.Generator().manual_seed(request_seed(cfg.seed, step, -1)))
    return RolloutBatch(ids, completions, mask, adv, order.tolist(), metrics=metrics)


def _sync_drafter(online: OnlineDrafterTrainer, parts: list[dict[str, Any]], engine: Any,
                  world: World) -> dict[str, float]:
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
        out.update(online.evaluate(parts[0]["samples"], engine.draft_target))
        out["drafter/eval_s"] = time.perf_counter() - t
    return out
