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
   completion positions, divided by temperature, logits_chunk_size positions at a time; each
   distinct prompt runs once for all its completions, packed behind it in one row: logps.py),
   the clipped ratio loss with epsilon and epsilon_high, plus beta * k3 KL, normalised per
   loss_type as TRL does; then one optimizer step.
5. The new weights go into the engine's copy in rollout_dtype (`update_weights`, each tensor cast
   on its shard and gathered one at a time: rollout_weights.py; version bumped; the next rollout
   starts from them, no K/V of old weights reused).

`reclaim grpo --config grpo-smollm2` runs it with a progress bar, output_dir/log.jsonl,
checkpoint-{step}/ directories and --resume. A checkpoint is the policy in HF layout (for users
and the engine), its trainer state (model, optimizer, scheduler) as a torch.distributed.checkpoint
in dcp/, RNG, the rollout being iterated on, the online drafter, and trainer_state.json.

`torchrun --nproc_per_node=N -m reclaim.cli grpo ...` runs N rollout workers: each rolls out a
contiguous share of the step's prompts on its own engine (same per-completion seeds, so the
completions are one process's), scores it, and the shares are gathered; the policy trains under
DDP (distributed.py: gradients summed once per optimizer step), per_device_train_batch_size per
rank as in TRL; rank 0 logs, every rank writes its share of the DCP checkpoint (output_dir must
be one directory all ranks see), and --resume loads it at any world size. With drafter_online (TLT) the EAGLE
drafter learns from the rollouts' hidden states on the workers that finished their share early
(drafter/online.py's OnlineDrafterTrainer).

With rollout_tensor_parallel_size N (dividing the world size W) the rollout workers are W/N
groups of N consecutive ranks, each sharing one tensor-parallel engine (engine/tensor_parallel.py):
every rank holds its 1/N shard of the rollout weights and K/V, the group's first rank rolls out
and scores the group's share while the others run its forwards, and after each optimizer step
every rank slices the gathered weights to its shard. Training is as without it. EAGLE drafters
(speculative eagle, hybrid, drafter_online) are refused with it; ngram and suffix draft on the leader.

The config is grpo_config.py, the prompts data.py, the loss loss.py, the rollout rollout.py and
the checkpoints reclaim/checkpoints.py; this file is the training step and the loop.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from reclaim.checkpoints import (
    CHECKPOINT_PREFIX, TRAINER_STATE, checkpoints, load_trainer_state, run_dir, save_grpo_checkpoint, trim_log,
)
from reclaim.drafter.online import OnlineDrafterTrainer
from reclaim.fsdp import (
    FullWeights, checkpoint_layers, clip_grad_norm_, decoder_layers, local_bytes, parallelize, training_bytes,
)
from reclaim.models.tensor_parallel import check_tensor_parallel, copy_full
from reclaim.optim import adamw
from reclaim.engine.speculative import MODEL_METHODS
from reclaim.rl.data import build_dataset, prompt_rows
from reclaim.rl.distributed import World, accumulating
from reclaim.rl.grpo_config import GRPOConfig
from reclaim.rl.logps import completion_logps
from reclaim.rl.loss import grpo_loss
from reclaim.rl.offload import Offload
from reclaim.rl.rewards import load_reward
from reclaim.rl.rollout import RolloutBatch, drafter_path, rollout, rollout_runner, spec_arms, speculative_arm
from reclaim.rl.rollout_weights import host_copy, meta_copy, rollout_copy, rollout_dtype
from reclaim.schedule import lr_scheduler
from reclaim.trackers import RunLog, progress_bar


# ---- the training step -------------------------------------------------------------------------

def micro_batches(order: list[int], batch_size: int, accumulation: int, world: World) -> list[list[int]]:
    """This rank's micro-batches (rows of the batch): the step has accumulation * world.size of
    batch_size rows in `order`; rank r takes k * size + r, so the ranks together take what one
    process accumulating all of them takes."""
    picks = [k * world.size + world.rank for k in range(accumulation)]
    return [order[j * batch_size:(j + 1) * batch_size] for j in picks]


def _micro_batches(batch: RolloutBatch, cfg: GRPOConfig, world: World) -> list[list[int]]:
    return micro_batches(batch.order, cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps, world)


def precision(bf16: bool, model: torch.nn.Module) -> torch.autocast:
    """The training forwards' precision: bfloat16 autocast with bf16, else the weights' dtype."""
    return torch.autocast(next(model.parameters()).device.type, dtype=torch.bfloat16, enabled=bf16)


def _chunked_logps(model: torch.nn.Module, batch: RolloutBatch, cfg: GRPOConfig, world: World) -> torch.Tensor:
    """Log-probs [N, C] of the batch's completions under `model` (no grad), each rank computing
    the rows of its micro-batches, summed over ranks."""
    out = torch.zeros(batch.mask.shape)
    with torch.no_grad(), precision(cfg.bf16, model):
        for idx in _micro_batches(batch, cfg, world):
            lp, _ = completion_logps(model, [batch.prompt_ids[i] for i in idx],
                                     [batch.completion_ids[i] for i in idx], cfg.temperature,
                                     chunk_size=cfg.logits_chunk_size)
            out[idx, :lp.shape[1]] = lp.float().cpu()
    return world.sum_(out)


def backward_step(model: torch.nn.Module, batch: RolloutBatch, cfg: GRPOConfig, world: World) -> dict[str, float]:
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
            with precision(cfg.bf16, model):
                logps, ent = completion_logps(model, [batch.prompt_ids[i] for i in idx], comps, cfg.temperature,
                                              entropy=True, chunk_size=cfg.logits_chunk_size)
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
    engine (or its group's share on the group's tensor-parallel engine), the policy trains data
    parallel (see distributed.py), rank 0 logs and checkpoints."""
    world = World.start(cfg.device)
    if world.device.type == "cuda":
        cfg = dataclasses.replace(cfg, device=str(world.device))  # this rank's GPU
    try:
        with run_dir(cfg.output_dir, main=world.is_main):
            return _train(cfg, world, progress, log)
    finally:
        world.close()


def _parallelize(model: torch.nn.Module, ref: torch.nn.Module | None, cfg: GRPOConfig,
                 world: World) -> torch.nn.Module:
    """The policy to train, per cfg.parallelism: under fsdp `model` sharded in place (and the
    reference model beside it, without gradients), under ddp `model` in DDP (one process: itself);
    with gradient_checkpointing each decoder layer reruns its forward in the backward."""
    if cfg.parallelism == "fsdp" and world.size > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(world.device.type, (world.size,))
        if ref is not None:
            parallelize(ref, mesh, bf16=cfg.bf16, cpu_offload=cfg.fsdp_cpu_offload)
        return parallelize(model, mesh, bf16=cfg.bf16, cpu_offload=cfg.fsdp_cpu_offload,
                           gradient_checkpointing=cfg.gradient_checkpointing)
    if cfg.gradient_checkpointing:
        checkpoint_layers(model)
    return world.data_parallel(model)


def _open_engine(cfg: GRPOConfig, served: torch.nn.Module, tokenizer: Any, max_len: int,
                 last: Path | None, tp_groups: tuple[Any, Any] | None = None
                 ) -> tuple[Any, OnlineDrafterTrainer | None]:
    """The rollout engine on `served`, the rank's copy of the policy (its shard, over `tp_groups`:
    this rank's tensor-parallel group and its gloo control group); with drafter_online, its EAGLE
    drafter is the online one (the checkpoint's on resume; the frozen copy is always the
    configured drafter). The proposer drafts on the leader alone (a follower only runs forwards; it
    builds an EAGLE one too, for the engine's gather of the whole embedding and head)."""
    import torch.distributed as dist

    from reclaim.engine.engine import Engine

    online = None
    if cfg.drafter_online:
        from reclaim.models.drafter import load_drafter

        drafter = load_drafter(drafter_path(cfg.speculative), served)
        online = OnlineDrafterTrainer(drafter, buffer_tokens=cfg.drafter_buffer_tokens,
                               lr=cfg.drafter_learning_rate, max_steps=cfg.drafter_max_steps_per_rollout,
                               seed=cfg.seed, eval_samples=cfg.drafter_eval_samples,
                               eval_depth=max(cfg.spec_depths))
        if last is not None and (last / "drafter").exists():
            online.load(last, served)
    from reclaim.engine.proposers import HybridProposer, history_proposer, make_proposer

    drafter = online.proposer(served) if online is not None else None
    if drafter is not None and cfg.speculative.startswith("hybrid"):  # the online EAGLE drafter beside the history
        arm = speculative_arm(cfg, None)
        drafter = HybridProposer(history_proposer(arm), drafter, model_tokens=arm.hybrid_eagle_tokens)
    leader = tp_groups is None or dist.get_rank(tp_groups[0]) == 0
    model_drafter = cfg.speculative.partition(":")[0] in MODEL_METHODS
    if drafter is None and cfg.speculative != "none" and (leader or model_drafter):
        # Built now, so it follows every sequence from its prefill; one made in the tail could not
        # draft for sequences it has not seen. An EAGLE drafter is built on every rank of a TP
        # group too: the engine gathers the whole embedding and head for it from all of them.
        drafter = make_proposer(spec_arms(cfg)[-1], served)
    groups = {} if tp_groups is None else {"tp_group": tp_groups[0], "tp_control": tp_groups[1]}
    engine = Engine(served, tokenizer, cfg.engine_config(max_len), proposer=drafter, **groups)
    return engine, online


def _train(cfg: GRPOConfig, world: World, progress: bool, log: Callable[[str], None]) -> dict[str, Any]:
    from reclaim.models.loading import load_model, read_config, resolve_model_dir
    from reclaim.models.tokenizer import encode_chat

    t_start = time.perf_counter()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    if (cfg.generation_batch_size * world.size) % cfg.num_generations:
        raise ValueError(f"per_device_train_batch_size * gradient_accumulation_steps * world size = "
                         f"{cfg.generation_batch_size * world.size} completions per step must be a multiple of "
                         f"num_generations={cfg.num_generations}")
    tp = cfg.rollout_tensor_parallel_size
    if tp > 1:  # every rank refuses alike, from config.json alone, before any weights load
        check_tensor_parallel(read_config(resolve_model_dir(cfg.model)), tp, name="rollout_tensor_parallel_size",
                              world_size=world.size)
    main = world.is_main
    out = Path(cfg.output_dir)
    rows = build_dataset(cfg)
    reward_funcs = [load_reward(spec) for spec in cfg.reward_funcs]
    reward_names = [getattr(f, "__name__", spec) if ":" in spec or "." in spec else spec
                    for f, spec in zip(reward_funcs, cfg.reward_funcs)]
    world.barrier()  # output_dir exists (run_dir) before any rank writes to it
    last = None
    if cfg.resume_from_checkpoint:
        found = checkpoints(out, require=TRAINER_STATE)
        if not found:
            raise ValueError(f"resume_from_checkpoint is set but {str(out)!r} has no {CHECKPOINT_PREFIX}* directory")
        last = found[-1]
    torch.manual_seed(cfg.seed)
    dtype = None if cfg.dtype == "auto" else cfg.dtype
    model, tokenizer = load_model(last or cfg.model, dtype=dtype, device=cfg.device)
    if tokenizer is None:
        raise ValueError(f"model {cfg.model!r} has no tokenizer files; prompts need its chat template")
    if cfg.parallelism == "fsdp":
        decoder_layers(model)  # a model FSDP cannot shard is refused on every rank, before any collective
    ref = None
    if cfg.beta > 0:  # the starting model, also on resume
        ref = load_model(cfg.model, dtype=dtype, device=cfg.device)[0] if last else copy.deepcopy(model)
        ref.requires_grad_(False)
    # The rollout engine's weights in rollout_dtype: the whole policy, or this rank's shard of it
    # in a tensor-parallel rollout group (where the checkpoint's HF layout takes `layout`'s shape).
    served_dtype = rollout_dtype(cfg.rollout_dtype, model)
    tp_groups = world.rollout_group(tp)
    served = rollout_copy(model, served_dtype, None if tp_groups is None else tp_groups[0])
    layout = served if tp == 1 else meta_copy(model)
    prompts = [encode_chat(tokenizer, r["prompt"]) for r in rows]
    if cfg.max_prompt_length is not None:
        prompts = [p[-cfg.max_prompt_length:] for p in prompts]
    limit = model.config.max_position_embeddings
    max_len = min(limit, max(len(p) for p in prompts) + cfg.max_completion_length)
    if max(len(p) for p in prompts) >= max_len:
        raise ValueError(f"a prompt of {max(len(p) for p in prompts)} tokens leaves no room to generate within the "
                         f"model's {limit} positions; lower max_prompt_length")
    policy = _parallelize(model, ref, cfg, world)  # trains; under ddp `model` is its module, whose weights
    opt = adamw(list(model.parameters()), lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                eps=cfg.adam_epsilon, weight_decay=cfg.weight_decay)
    sched = lr_scheduler(opt, cfg.lr_scheduler_type, warmup_steps=cfg.num_warmup_steps, total_steps=cfg.max_steps)
    if last is not None:
        load_trainer_state(last, model, opt, sched, world)
        copy_full(served, FullWeights(model, dtype=served_dtype))
    engine, online = _open_engine(cfg, served, tokenizer, max_len, last, tp_groups)
    eos = set(engine.eos_token_ids)
    kv_bytes = local_bytes([*engine.runner.pool.k, *engine.runner.pool.v])  # the engine's K/V pool
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

    offload = Offload(cfg.param_offload, cfg.optimizer_offload, next(model.parameters()).device)
    per_step = cfg.generation_batch_size * world.size // cfg.num_generations
    run_log = RunLog(cfg.report_to, out, config=config_dict, resume_step=step, main=main)
    bar = progress_bar(cfg.max_steps, step, "grpo", show=progress and main)
    model.train()
    while step < cfg.max_steps:
        t0 = time.perf_counter()
        rec: dict[str, Any] = {}
        if step % cfg.num_iterations == 0 or batch is None:
            idx = prompt_rows(len(rows), per_step, step // cfg.num_iterations, cfg.seed)
            offload.to_host(model, opt)
            batch = rollout(engine, [rows[i] for i in idx], [prompts[i] for i in idx], step, cfg,
                            reward_funcs, reward_names, eos, completions_log if cfg.log_completions else None,
                            runner, world, online)
            offload.params_to_device(model)
            if cfg.num_iterations > 1:
                batch.old_logps = _chunked_logps(model, batch, cfg, world)
            if ref is not None:
                batch.ref_logps = _chunked_logps(ref, batch, cfg, world)
            rec.update(batch.metrics)
        else:  # another iteration on the same rollout: its reward metrics, no rollout time
            rec.update({k: v for k, v in batch.metrics.items() if not k.startswith(("rollout", "drafter/"))})
        if cfg.enable_sleep_mode:  # the engine's K/V pool and weights free until the weights are updated
            rec["memory/sleep_freed_bytes"] = engine.sleep(level=2)
        opt.zero_grad(set_to_none=True)
        t_train = time.perf_counter()
        rec.update(backward_step(policy, batch, cfg, world))
        rec["grad_norm"] = clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        rec["learning_rate"] = opt.param_groups[0]["lr"]
        offload.optimizer_to_device(opt)
        opt.step()
        rec.update({f"memory/{k}": v for k, v in training_bytes(model, opt).items()})  # this rank's share
        # this rank's shard, and on a TP leader with an EAGLE drafter the whole embedding and head it keeps
        leader = engine.draft_target if engine.draft_target is not engine.model else None
        rec["memory/rollout_weights_bytes"] = local_bytes(served.parameters()) + (
            local_bytes(leader.parameters()) if leader is not None else 0)
        rec["memory/kv_cache_bytes"] = kv_bytes
        if offload.enabled:
            rec.update(offload.take())
        sched.step()
        opt.zero_grad(set_to_none=True)
        if cfg.enable_sleep_mode:  # asleep through training: the moments leave before the engine wakes
            offload.optimizer_to_host(opt)
            engine.wake_up()
        # fsdp: each tensor cast to the rollout dtype on its shard, then gathered, one at a time
        # (a tensor-parallel engine keeps its slice of each)
        rec["weights_version"] = engine.update_weights(FullWeights(model, dtype=served_dtype))
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
            run_log.log(entry)
            window = []
        if (cfg.save_steps and step % cfg.save_steps == 0) or step == cfg.max_steps:
            state = {"global_step": step, "max_steps": cfg.max_steps, "log_history": history,
                     "log_window": window, "config": config_dict, "world_size": world.size}
            pending = batch if step % cfg.num_iterations else None
            # The HF-layout policy: the engine's copy (the full weights of this very step) where it
            # is whole and keeps the training dtype, else those gathered into host memory in the
            # training dtype.
            train_dtype = next(model.parameters()).dtype
            whole = served_dtype == train_dtype and tp == 1
            full = engine.model if whole else host_copy(layout, model, train_dtype, main)
            save_grpo_checkpoint(out, step, model, full, tokenizer, opt, sched, state, pending, online, world)
            if main and cfg.save_total_limit:
                for old in checkpoints(out, require=TRAINER_STATE)[:-cfg.save_total_limit]:
                    shutil.rmtree(old, ignore_errors=True)
            world.barrier()  # every rank sees the checkpoint once any goes on
    bar.close()
    run_log.close()
    return {"steps": step, "last": history[-1] if history else None, "total_s": time.perf_counter() - t_start}
