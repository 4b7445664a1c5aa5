"""`reclaim drafter train --config drafter-smollm2`: the target answers chat prompts and
procedural tasks with the engine (hidden states recorded as it runs), then the drafter trains
with a progress bar, log.jsonl, HF-style checkpoint-{step}/ directories and --resume; the final
drafter (the EAGLE layout) lands in output_dir, and `greedy_acceptance` on held-out prompts gives
its tau. EAGLE-3's variant (drafter/eagle3.py) reuses `fit`, `_rollouts` and `_start`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from reclaim.checkpoints import CHECKPOINT_PREFIX, checkpoints, remove_partial_saves, save_checkpoint, trim_log
from reclaim.data.tasks import check_source
from reclaim.drafter.acceptance import greedy_acceptance
from reclaim.drafter.data import DrafterBuffer, DrafterSample, HiddenRecorder
from reclaim.drafter.loss import make_optimizer, train_drafter
from reclaim.models.drafter import EagleDrafter, load_drafter, most_frequent, new_drafter, save_drafter
from reclaim.models.loading import as_dtype
from reclaim.schedule import SCHEDULES, lr_scheduler
from reclaim.trackers import RunLog, progress_bar, report_to_list

CE_VOCABS = ("full", "buffer")
DRAFTER_TYPES = ("eagle", "eagle3")  # EAGLE-1/2 (this module) and EAGLE-3 (drafter/eagle3.py)

@dataclass
class DrafterTrainConfig:
    """`reclaim drafter train`: the target answers prompts, the drafter learns its hidden states.

    Names follow transformers' TrainingArguments where they exist. Load one with
    `reclaim.config.load_config(DrafterTrainConfig, path_or_name, overrides)`.
    """

    output_dir: str = "runs/drafter"
    drafter_type: str = "eagle"  # eagle (EAGLE-1/2) | eagle3 (its own fields: Eagle3TrainConfig)
    model: str | None = None  # the target's HF directory; None: the bundled SmolLM2-135M-Instruct
    dtype: str = "float32"
    device: str = "cpu"
    # Data: the target's own answers to these prompts (chat template applied).
    prompts: str = "mixed"  # chat | tasks | mixed | rg:<reasoning-gym dataset> | a file: one prompt per line or JSON lines {"prompt"}
    num_prompts: int = 128
    eval_prompts: int = 16  # held out (drawn after the training prompts): greedy tau at the end
    max_new_tokens: int = 96
    temperature: float = 0.0  # 0: greedy answers
    generation_batch_size: int = 32  # sequences the engine runs at once
    rollout_chunk: int = 256  # training prompts answered, then saved, at a time (resume continues from there)
    # The training answers' dtype (None: dtype): bfloat16 answers 2.5x faster on a CPU with AMX;
    # the drafter then learns that model's hidden states. Held-out answers always use dtype.
    rollout_dtype: str | None = None
    buffer_tokens: int = 1_000_000
    # Optimisation.
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    max_grad_norm: float = 0.5
    max_steps: int = 300
    per_device_train_batch_size: int = 8  # sequences per step
    max_batch_tokens: int = 4096  # padded tokens per step
    warmup_steps: int = 0  # > 0 wins over warmup_ratio, as in transformers
    warmup_ratio: float = 0.0
    lr_scheduler_type: str = "cosine"
    bf16: bool = False  # the loss under bfloat16 autocast, as transformers' TrainingArguments.bf16
    feature_noise: float = 0.1
    unroll_steps: int = 2  # passes feeding the drafter's own predictions (chain drafting's later tokens)
    ce_vocab: str = "buffer"  # full | buffer: the cross-entropy over the buffer's tokens (cheaper)
    # The drafter's own vocabulary at inference (EAGLE-3's d2t): the N most frequent training
    # tokens, so a draft token scores N head rows, not the whole vocabulary (0: all). Set after the
    # held-out evaluation, which scores the whole vocabulary.
    draft_vocab_size: int = 0
    reg_loss_weight: float = 1.0
    ce_loss_weight: float = 0.1
    num_speculative_tokens: int = 4  # the held-out evaluation's draft length
    seed: int = 42
    logging_steps: int = 10
    report_to: str | list[str] = "none"  # none | tensorboard | wandb | trackio, or a list (reclaim/trackers.py)
    save_steps: int = 0  # 0: save only at the end
    save_total_limit: int | None = None
    resume_from_checkpoint: bool = False

    def __post_init__(self) -> None:
        report_to_list(self.report_to)
        if self.drafter_type not in DRAFTER_TYPES:
            raise ValueError(f"drafter_type {self.drafter_type!r} is not one of {list(DRAFTER_TYPES)}")
        if self.lr_scheduler_type not in SCHEDULES:
            raise ValueError(f"lr_scheduler_type {self.lr_scheduler_type!r} is not one of {list(SCHEDULES)}")
        check_source(self.prompts)
        if self.rollout_dtype is not None:
            as_dtype(self.rollout_dtype)  # names the value and what is allowed
        for name in ("num_prompts", "max_new_tokens", "generation_batch_size", "rollout_chunk", "buffer_tokens",
                     "max_steps", "per_device_train_batch_size", "max_batch_tokens", "logging_steps",
                     "num_speculative_tokens", "unroll_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("eval_prompts", "warmup_steps", "save_steps", "temperature", "feature_noise",
                     "learning_rate", "weight_decay", "reg_loss_weight", "ce_loss_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.ce_vocab not in CE_VOCABS:
            raise ValueError(f"ce_vocab {self.ce_vocab!r} is not one of {list(CE_VOCABS)}")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")

    @property
    def num_warmup_steps(self) -> int:
        """transformers' rule: warmup_steps if set, else ceil(warmup_ratio * max_steps)."""
        return self.warmup_steps if self.warmup_steps > 0 else math.ceil(self.warmup_ratio * self.max_steps)


def _place_final(drafter: EagleDrafter, out: Path, save: Callable[[Any, Path], Path] = save_drafter) -> None:
    """The final drafter's config.json and weights in output_dir itself (beside the logs), the
    config last so a directory with one holds complete weights."""
    staged = save(drafter, out / ".final-drafter")
    for name in sorted(os.listdir(staged), key=lambda n: n == "config.json"):
        os.replace(staged / name, out / name)
    shutil.rmtree(staged, ignore_errors=True)


def _answer(engine: Any, recorder: HiddenRecorder, prompts: Sequence[list[int]],
            params: Sequence[Any]) -> list[DrafterSample | None]:
    """The engine's answers to `prompts` as samples (None for a one-token answer: no response
    position to learn from), the recorder emptied of them afterwards."""
    outs = engine.generate(list(prompts), list(params))
    got: list[DrafterSample | None] = [None] * len(outs)
    keep = [i for i, o in enumerate(outs) if len(o.token_ids) >= 2]
    samples = recorder.samples([(outs[i].request_id, outs[i].prompt_token_ids, outs[i].token_ids) for i in keep])
    for i, x in zip(keep, samples):
        got[i] = x
    for o in outs:
        recorder.drop(o.request_id)
    return got


def _rollouts(cfg: DrafterTrainConfig, target: torch.nn.Module, tokenizer: Any, out: Path,
              log: Callable[[str], None], train: bool = True) -> tuple[list[DrafterSample], list[DrafterSample]]:
    """Samples of the target answering the training prompts (at cfg.temperature, by the target
    cast to cfg.rollout_dtype if set; none without `train`) and the held-out ones (greedy, by the
    target itself, for the acceptance replay), hidden states recorded as the engine runs. The
    training prompts are answered in parts of cfg.rollout_chunk, each saved to
    output_dir/rollouts/ as it completes: a run started again with resume_from_checkpoint reads
    the parts back and answers only what is missing."""
    from reclaim.data.tasks import make_prompts
    from reclaim.engine.engine import Engine
    from reclaim.engine.request import SamplingParams
    from reclaim.models.tokenizer import encode_chat

    parts = out / "rollouts"
    if not cfg.resume_from_checkpoint and parts.exists():
        shutil.rmtree(parts)  # a fresh run answers afresh
    parts.mkdir(parents=True, exist_ok=True)
    if tokenizer is None:
        raise ValueError(f"the target {cfg.model!r} has no tokenizer files; the prompts need its chat template")
    texts = make_prompts(cfg.prompts, cfg.num_prompts + cfg.eval_prompts, cfg.seed)
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": q}]) for q in texts]
    max_len = min(max(len(p) for p in prompts) + cfg.max_new_tokens, target.config.max_position_embeddings)

    def engine_of(model: torch.nn.Module) -> tuple[Any, HiddenRecorder]:
        recorder = HiddenRecorder()
        return Engine(model, tokenizer, max_num_seqs=cfg.generation_batch_size, on_forward=recorder,
                      max_model_len=max_len, seed=cfg.seed), recorder

    def read(path: Path) -> list[DrafterSample | None]:
        return [None if d is None else DrafterSample(**d) for d in torch.load(path)]

    def save(path: Path, got: list[DrafterSample | None]) -> None:
        tmp = path.with_suffix(".tmp")
        torch.save([None if x is None else dataclasses.asdict(x) for x in got], tmp)
        os.replace(tmp, path)  # a part on disk is complete

    own = as_dtype(cfg.rollout_dtype) in (None, next(target.parameters()).dtype)
    gen_model = target if own else copy.deepcopy(target).to(as_dtype(cfg.rollout_dtype))
    engine, recorder = None, None
    train_s: list[DrafterSample] = []
    t0, tokens = time.perf_counter(), 0
    for k, start in enumerate(range(0, cfg.num_prompts if train else 0, cfg.rollout_chunk)):
        stop = min(start + cfg.rollout_chunk, cfg.num_prompts)
        path = parts / f"part-{k:05d}.pt"
        if path.exists():
            got = read(path)
        else:
            if engine is None:
                engine, recorder = engine_of(gen_model)
            params = [SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_new_tokens,
                                     seed=cfg.seed + i) for i in range(start, stop)]
            got = _answer(engine, recorder, prompts[start:stop], params)
            save(path, got)
            tokens += sum(x.num_tokens - len(prompts[start + i]) + 1 for i, x in enumerate(got) if x is not None)
            log(f"target answered {stop} of {cfg.num_prompts} training prompts: {tokens} answer tokens "
                f"in {time.perf_counter() - t0:.1f} s this run")
        train_s += [x for x in got if x is not None]
    eval_s: list[DrafterSample] = []
    if cfg.eval_prompts:
        if (parts / "eval.pt").exists():
            got = read(parts / "eval.pt")
        else:
            if not own or engine is None:
                engine, recorder = engine_of(target)
            got = _answer(engine, recorder, prompts[cfg.num_prompts:],
                          [SamplingParams(temperature=0.0, max_tokens=cfg.max_new_tokens)] * cfg.eval_prompts)
            save(parts / "eval.pt", got)
        eval_s = [x for x in got if x is not None]
    return train_s, eval_s


def _start(cfg: DrafterTrainConfig) -> tuple[Path, torch.nn.Module, Any]:
    """output_dir made, the frozen target and its tokenizer loaded; a resume with nothing saved refused."""
    from reclaim.models.loading import load_model

    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    remove_partial_saves(out)
    torch.manual_seed(cfg.seed)
    target, tokenizer = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device)
    target.requires_grad_(False)
    if cfg.resume_from_checkpoint and not (checkpoints(out) or (out / "rollouts").exists()):
        raise ValueError(f"resume_from_checkpoint is set but {str(out)!r} has neither a "
                         f"{CHECKPOINT_PREFIX}* directory nor saved rollouts")
    return out, target, tokenizer


def fit(cfg: DrafterTrainConfig, out: Path, *, new: Callable[[], Any], load: Callable[[Path], Any],
        save: Callable[[Any, Path], Path], run: Callable[..., Any], keys: Sequence[str],
        progress: bool = True) -> tuple[Any, list[dict[str, Any]], float]:
    """cfg.max_steps optimizer steps of a drafter made by `new()`, or resumed from output_dir's last
    checkpoint (`load`): AdamW, cfg's schedule, a progress bar, log.jsonl (means of `keys` every
    logging_steps) and checkpoint-{step}/ (`save`) every save_steps. run(drafter, optimizer,
    scheduler, start_step, on_step) runs the steps. Returns the drafter, the log history and the
    training seconds."""
    step, history = 0, []
    log_path = out / "log.jsonl"
    found = checkpoints(out) if cfg.resume_from_checkpoint else []
    last = found[-1] if found else None
    if last is not None:
        state = json.loads((last / "trainer_state.json").read_text())
        step, history = state["global_step"], state["log_history"]
        drafter = load(last)
        trim_log(log_path, step)
    else:
        torch.manual_seed(cfg.seed)
        drafter = new()
        if log_path.exists():
            log_path.unlink()  # a fresh run starts a fresh log
    opt = make_optimizer(drafter, cfg.learning_rate, weight_decay=cfg.weight_decay,
                         betas=(cfg.adam_beta1, cfg.adam_beta2))
    sched = lr_scheduler(opt, cfg.lr_scheduler_type, warmup_steps=cfg.num_warmup_steps,
                         total_steps=cfg.max_steps)
    if last is not None:
        opt.load_state_dict(torch.load(last / "optimizer.pt"))
        sched.load_state_dict(torch.load(last / "scheduler.pt"))
    config_dict = dataclasses.asdict(cfg)
    (out / "train_config.json").write_text(json.dumps(config_dict, indent=2) + "\n")

    run_log = RunLog(cfg.report_to, out, config=config_dict, resume_step=step)
    bar = progress_bar(cfg.max_steps, step, "drafter train", show=progress)
    window: list[dict[str, Any]] = []

    def on_step(rec: dict[str, Any]) -> None:
        window.append(rec)
        bar.update(1)
        bar.set_postfix(loss=f"{rec['loss']:.3f}", acc=f"{rec['accuracy']:.2f}")
        s = rec["step"]
        if s % cfg.logging_steps == 0 or s == cfg.max_steps:
            avg = {k: sum(r[k] for r in window) / len(window) for k in keys}
            entry = {"step": s, **avg, "learning_rate": rec["learning_rate"],
                     "tokens": sum(r["tokens"] for r in window)}
            history.append(entry)
            run_log.log(entry)
            window.clear()
        if (cfg.save_steps and s % cfg.save_steps == 0) or s == cfg.max_steps:
            state = {"global_step": s, "max_steps": cfg.max_steps, "log_history": history,
                     "config": config_dict}
            save_checkpoint(out, s, lambda tmp: save(drafter, tmp), opt, sched, state)
            if cfg.save_total_limit:
                for old in checkpoints(out)[:-cfg.save_total_limit]:
                    shutil.rmtree(old, ignore_errors=True)

    t_train = time.perf_counter()
    run(drafter, opt, sched, step, on_step)
    bar.close()
    run_log.close()
    return drafter, history, time.perf_counter() - t_train


def train(cfg: DrafterTrainConfig, *, progress: bool = True,
          log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run `reclaim drafter train` per cfg; returns a summary (steps, last record, held-out tau,
    seconds). The final drafter is in cfg.output_dir (config.json + model.safetensors)."""
    if cfg.drafter_type != "eagle":
        raise ValueError(f"drafter_type {cfg.drafter_type!r} trains with reclaim.drafter.eagle3.train_eagle3; "
                         "this trains 'eagle' (EAGLE-1/2)")
    t_start = time.perf_counter()
    out, target, tokenizer = _start(cfg)
    train_samples, held_out = _rollouts(cfg, target, tokenizer, out, log)
    buffer = DrafterBuffer(cfg.buffer_tokens)
    buffer.add(train_samples)

    def run(drafter, opt, sched, step, on_step):
        train_drafter(drafter, target, buffer, steps=cfg.max_steps - step, optimizer=opt, scheduler=sched,
                      batch_size=cfg.per_device_train_batch_size, batch_tokens=cfg.max_batch_tokens,
                      feature_noise=cfg.feature_noise, reg_weight=cfg.reg_loss_weight,
                      ce_weight=cfg.ce_loss_weight, max_grad_norm=cfg.max_grad_norm, seed=cfg.seed,
                      ce_vocab=buffer.vocab() if cfg.ce_vocab == "buffer" else None,
                      unroll_steps=cfg.unroll_steps, bf16=cfg.bf16,
                      start_step=step, on_step=on_step)

    drafter, history, train_s = fit(cfg, out, new=lambda: new_drafter(target), load=lambda p: load_drafter(p, target),
                                    save=save_drafter, run=run, progress=progress,
                                    keys=("loss", "reg_loss", "ce_loss", "accuracy", "grad_norm", "step_s"))
    _place_final(drafter, out)
    summary: dict[str, Any] = {"steps": cfg.max_steps, "train_s": train_s,
                               "last": history[-1] if history else None,
                               "train_sequences": len(buffer), "train_tokens": buffer.num_tokens}
    if held_out:
        summary["eval"] = {"prompts": len(held_out), "num_speculative_tokens": cfg.num_speculative_tokens,
                           **greedy_acceptance(drafter, target, held_out, cfg.num_speculative_tokens)}
    if cfg.draft_vocab_size:
        drafter.draft_ids = most_frequent([s.token_ids.tolist() for s in buffer], cfg.draft_vocab_size,
                                          target.config.vocab_size).to(next(drafter.parameters()).device)
        _place_final(drafter, out)
        summary["draft_vocab_size"] = int(drafter.draft_ids.numel())
    summary["total_s"] = time.perf_counter() - t_start
    (out / "eval.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
