"""The online trainer: small batches of feedback, each sample reusing its prompt record or
recomputing the prompt, as a planner decides; checkpoints that make a crash cost no feedback.

Per step: take up to `per_device_train_batch_size` pending feedback from the log; `plan` decides
per sample reuse or recompute, with the reason (no record, evicted, stale, cost); reused samples
run one padded forward over their responses attending to the records' K/V, recomputed ones one
forward over prompt + response; one loss (mean over all response tokens), one optimizer step, the
weights version bumped, the feedback marked with the step, a JSON line logged. Every `save_steps`
steps a checkpoint is written atomically; `resume()` loads the latest and reopens feedback marked
by steps it lacks, so each feedback is in the weights exactly once.

    cfg = load_config(OnlineTrainConfig, "online-smollm2")
    trainer = OnlineTrainer(model, cfg, FeedbackLog(cfg.feedback_path), RecordStore(...), tokenize=...)
    trainer.resume()
    while trainer.train_step(): ...
"""

from __future__ import annotations

import json
import logging
import math
import random
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

import torch

from reclaim.checkpoints import CHECKPOINT_PREFIX, checkpoints, remove_partial_saves
from reclaim.online.embedding_grad import RowGradEmbedding
from reclaim.online.feedback import Feedback, FeedbackLog
from reclaim.online.recorder import PromptRecord, record_prompt, recompute_loss, reuse_loss
from reclaim.online.store import RecordInfo, RecordStore
from reclaim.optim import adamw
from reclaim.storage import parse_size
from reclaim.trackers import RunLog, report_to_list

log = logging.getLogger(__name__)

ADAPTER_FILE = "adapter.safetensors"
COST_MODELS = ("measure", "reuse", "recompute")


@dataclass
class OnlineTrainConfig:
    """Online training from feedback; names follow transformers' TrainingArguments where they
    exist. Load with `reclaim.config.load_config(OnlineTrainConfig, path_or_name, overrides)`."""

    output_dir: str = "runs/online"
    feedback_db: str | None = None  # None: output_dir/feedback.db
    per_device_train_batch_size: int = 8
    # samples per forward + backward within a step (0: the whole batch at once); 1 lets training
    # that runs in slices beside serving stop between samples (smaller units, shorter waits)
    micro_batch_size: int = 0
    learning_rate: float = 1e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    max_grad_norm: float = 1.0
    lora_r: int = 0  # 0: full fine-tuning; else adapters of this rank (base weights frozen)
    lora_alpha: float = 16.0
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    save_steps: int = 50  # checkpoint every N steps (0: never)
    save_total_limit: int | None = 2
    # Recording (the engine's side): all | requested (body key retain_for_training) | fraction:F
    record: str = "requested"
    # False: a request is served unrecorded (training recomputes its prompt) when another one
    # waits for its first token, since a recorded prefill is slower and would hold that one up
    record_when_queued: bool = False
    record_budget: str = "1GB"  # records kept on the device
    record_host_budget: str = "4GB"  # records offloaded to host memory
    prefix_grad: bool = True  # False: records stop gradients at the prompt (cheaper, not exact)
    # True: records keep only matmul/attention outputs (~half the bytes, exact; not offloadable)
    selective_recompute: bool = False
    max_staleness: int = 0  # weights versions a record may lag; 0: only exact reuse
    cost_model: str = "measure"  # measure (at start-up) | reuse | recompute (always)
    seed: int = 42
    report_to: str | list[str] = "none"  # none | tensorboard | wandb | trackio, or a list (reclaim/trackers.py)

    def __post_init__(self) -> None:
        if self.per_device_train_batch_size < 1:
            raise ValueError(f"per_device_train_batch_size={self.per_device_train_batch_size}: "
                             "must be >= 1")
        for name in ("save_steps", "max_staleness", "lora_r", "micro_batch_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 0")
        if self.cost_model not in COST_MODELS:
            raise ValueError(f"cost_model={self.cost_model!r}; allowed: {list(COST_MODELS)}")
        record_policy(self.record)
        report_to_list(self.report_to)
        for name in ("record_budget", "record_host_budget"):
            parse_size(getattr(self, name))

    @property
    def feedback_path(self) -> Path:
        return Path(self.feedback_db) if self.feedback_db else Path(self.output_dir) / "feedback.db"


def record_policy(policy: str) -> Callable[[bool], bool]:
    """`should_record(requested)` for --record all | requested | fraction:F (F in [0, 1])."""
    if policy == "all":
        return lambda requested: True
    if policy == "requested":
        return lambda requested: requested
    if policy.startswith("fraction:"):
        try:
            f = float(policy.removeprefix("fraction:"))
        except ValueError:
            f = math.nan
        if 0 <= f <= 1:
            rng = random.Random(0)
            return lambda requested: requested or rng.random() < f
    raise ValueError(f"record={policy!r}; allowed: 'all', 'requested', 'fraction:F' with 0 <= F <= 1")


# ---- cost model and planner ------------------------------------------------------------------

@dataclass(frozen=True)
class CostModel:
    """What reusing a sample's record saves and costs, in seconds. Reuse skips the prompt's
    forward, forward_fixed_s + forward_s_per_token * P for P prompt tokens (the backward is the
    same either way), and pays reuse_overhead_s (attaching the record) plus reload_s_per_byte
    per byte of a record offloaded to host memory. The planner reuses when it saves more.
    Serving pays for a record too (`record_extra_s`): the prefill's forward with autograd over
    the inference one, plus a forward of its own for the decode rows of that engine step (a
    recorded prefill is not batched with them), inference_fixed_s."""

    forward_fixed_s: float
    forward_s_per_token: float
    reuse_overhead_s: float
    reload_s_per_byte: float
    inference_fixed_s: float = 0.0
    inference_s_per_token: float = 0.0

    def saved_s(self, prompt_tokens: int) -> float:
        return self.forward_fixed_s + self.forward_s_per_token * prompt_tokens

    def record_extra_s(self, prompt_tokens: int) -> float:
        """Serving seconds recording a prompt of this many tokens adds to its engine step; 0
        when the inference forward was not measured."""
        if not (self.inference_fixed_s or self.inference_s_per_token):
            return 0.0
        inference = self.inference_fixed_s + self.inference_s_per_token * prompt_tokens
        return max(self.saved_s(prompt_tokens) - inference, 0.0) + self.inference_fixed_s

    def cost_s(self, info: RecordInfo) -> float:
        reload = info.nbytes * self.reload_s_per_byte if info.where == "host" else 0.0
        return self.reuse_overhead_s + reload

    @classmethod
    def fixed(cls, prefer: str) -> "CostModel":
        """A model that always prefers `prefer` ("reuse" or "recompute")."""
        return cls(1e9, 0.0, 0.0, 0.0) if prefer == "reuse" else cls(0.0, 0.0, 1e9, 0.0)

    @classmethod
    def measure(cls, model: torch.nn.Module, prompt_tokens: Sequence[int] = (64, 256),
                response_tokens: int = 32, repeats: int = 2) -> "CostModel":
        """Time on `model` the prompt's forward with autograd and without at two prompt lengths
        (the lines through them), the reuse overhead (a reused step less the recompute step
        without its prompt forward) at the shorter, and a host reload; the best of `repeats` runs
        (the machine may be shared)."""
        vocab = model.config.vocab_size
        g = torch.Generator().manual_seed(0)
        dev = next(model.parameters()).device  # token ids are drawn on the CPU, run where the model is

        def best(fn: Callable[[object], object], setup: Callable[[], object] = lambda: None) -> float:
            out = math.inf
            for _ in range(repeats):
                model.zero_grad(set_to_none=True)
                arg = setup()
                t = time.perf_counter()
                fn(arg)
                if dev.type == "cuda":  # kernels run asynchronously: wait for them
                    torch.cuda.synchronize(dev)
                out = min(out, time.perf_counter() - t)
            return out

        forward, inference = [], []
        for p in prompt_tokens:
            ids = torch.randint(vocab, (1, p), generator=g, device=g.device).to(dev)
            with torch.enable_grad():
                forward.append(best(lambda _: model(ids, return_hidden=True, compute_logits=False)))
            with torch.inference_mode():
                inference.append(best(lambda _: model(ids, return_hidden=True, compute_logits=False)))

        def line(ts: list[float]) -> tuple[float, float]:
            """(fixed seconds, seconds per token) through the two lengths' times."""
            slope = max((ts[-1] - ts[0]) / max(prompt_tokens[-1] - prompt_tokens[0], 1), 0.0)
            return max(ts[0] - slope * prompt_tokens[0], 0.0), slope

        p0, f0 = prompt_tokens[0], forward[0]
        (fixed, slope), (inf_fixed, inf_slope) = line(forward), line(inference)
        prompt = torch.randint(vocab, (p0,), generator=g, device=g.device).tolist()
        resp = torch.randint(vocab, (response_tokens,), generator=g, device=g.device).tolist()
        with torch.enable_grad():
            recompute = best(lambda _: recompute_loss(model, [prompt], [resp])[0].backward())
            reuse = best(lambda rec: reuse_loss(model, [rec], [resp])[0].backward(),
                         lambda: record_prompt(model, prompt, response_id="probe", version=0))
        model.zero_grad(set_to_none=True)
        buf = torch.empty(4 << 20)  # 16 MiB
        t = time.perf_counter()
        buf.to(dev, copy=True)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        per_byte = (time.perf_counter() - t) / buf.nbytes
        return cls(fixed, slope, max(reuse - (recompute - f0), 0.0), per_byte, inf_fixed, inf_slope)


@dataclass(frozen=True)
class Sample:
    """One thing to train on: the prompt and the response tokens the loss is on."""

    feedback_id: int
    response_id: str
    prompt_ids: list[int]
    response_ids: list[int]


@dataclass(frozen=True)
class Decision:
    """Reuse or recompute one sample, and why: record (exact reuse), record_stale (within
    max_staleness, gradient stopped at the prompt), no_record, evicted, stale, cost."""

    feedback_id: int
    response_id: str
    action: str  # "reuse" | "recompute"
    reason: str
    prompt_tokens: int
    saved_s: float  # the cost model's estimates: the prompt forward reuse skips,
    cost_s: float | None  # and what reusing the record costs (None: no usable record)


def plan(samples: Sequence[Sample], infos: Sequence[RecordInfo], version: int, max_staleness: int,
         cost: CostModel) -> list[Decision]:
    """Per sample, reuse its record when it exists, is recent enough and saves more time than
    it costs."""
    out = []
    for s, info in zip(samples, infos, strict=True):
        p = len(s.prompt_ids)
        d = Decision(s.feedback_id, s.response_id, "recompute", "", p, cost.saved_s(p), None)
        if info.status != "present":
            d = replace(d, reason="no_record" if info.status == "missing" else info.status)
        elif info.prompt_tokens != p:
            d = replace(d, reason="no_record")  # a record of another prompt: never attach it
        elif not 0 <= version - info.version <= max_staleness:
            d = replace(d, reason="stale")
        else:
            d = replace(d, cost_s=cost.cost_s(info))
            if d.cost_s >= d.saved_s:
                d = replace(d, reason="cost")
            else:
                d = replace(d, action="reuse",
                            reason="record" if info.version == version else "record_stale")
        out.append(d)
    return out


# ---- trainer ---------------------------------------------------------------------------------

def clip_grad_norm_in_parts(params: Sequence[torch.nn.Parameter], max_norm: float,
                            pause: Callable[[str], None], parts: int = 8) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ (the same per-tensor norms, total and scale) in `parts`
    pieces of about equal bytes with a `pause("clip")` after each, so a training step run in
    slices can hand serving its turn inside the clipping (the gradients are not served, so any
    split is safe). Returns the total norm."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    total_bytes, groups, acc = sum(g.nbytes for g in grads), [[]], 0
    for g in grads:
        if acc >= (len(groups) * total_bytes) / parts and groups[-1]:
            groups.append([])
        groups[-1].append(g)
        acc += g.nbytes
    norms: list[torch.Tensor] = []
    for group in groups:
        norms.extend(torch._foreach_norm(group))
        pause("clip")
    total = torch.linalg.vector_norm(torch.stack(norms))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for group in groups:
        torch._foreach_mul_(group, coef)
        pause("clip")
    return total


class OnlineTrainer:
    """Trains `model` in place from a feedback log, reusing prompt records from a store."""

    def __init__(self, model: torch.nn.Module, cfg: OnlineTrainConfig, feedback: FeedbackLog,
                 store: RecordStore, *, tokenize: Callable[[str], list[int]] | None = None,
                 cost: CostModel | None = None) -> None:
        self.model, self.cfg, self.feedback, self.store = model, cfg, feedback, store
        self.tokenize = tokenize
        if cfg.lora_r:
            from reclaim.online.lora import apply_lora

            apply_lora(model, cfg.lora_r, cfg.lora_alpha, cfg.lora_target_modules)
        # the embedding's gradient as rows added into .grad: 20% off a 256/128 step on a CPU
        RowGradEmbedding(model)
        if cost is None:
            cost = CostModel.measure(model) if cfg.cost_model == "measure" else CostModel.fixed(
                cfg.cost_model)
        self.cost = cost
        self.optimizer = adamw([p for p in model.parameters() if p.requires_grad],
                               lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                               weight_decay=cfg.weight_decay)
        self.step = 0  # optimizer steps taken; the weights version is the step
        # called where a step may pause with the weights untouched (grads complete, before the
        # optimizer step): co-location hands serving its turn there (slices.TrainingSlices)
        self.pause: Callable[[str], None] = lambda name: None
        self.counts: Counter[str] = Counter()
        self.out = Path(cfg.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        remove_partial_saves(self.out)
        self.log_path = self.out / "train_log.jsonl"
        self.run_log: RunLog | None = None  # opened at the first step, once resume() has set the step

    @property
    def version(self) -> int:
        return self.step

    def sample(self, f: Feedback) -> Sample:
        """The served response (rating 1) or the tokenized correction, after the logged prompt."""
        r = self.feedback.response(f.response_id)
        if f.correction is None:
            return Sample(f.id, f.response_id, r.prompt_ids, r.response_ids)
        if self.tokenize is None:
            raise ValueError(f"feedback {f.id} has a correction, but the trainer was given no "
                             "tokenize function")
        ids = list(self.tokenize(f.correction))
        if not ids:
            raise ValueError(f"feedback {f.id}: correction {f.correction!r} tokenizes to nothing")
        return Sample(f.id, f.response_id, r.prompt_ids, ids)

    def train_step(self) -> dict | None:
        """One optimizer step on the oldest pending feedback; its log entry, or None if none."""
        batch = self.feedback.pending(limit=self.cfg.per_device_train_batch_size)
        if not batch:
            return None
        t0 = time.perf_counter()
        samples = [self.sample(f) for f in batch]
        infos = [self.store.info(s.response_id) for s in samples]
        decisions = plan(samples, infos, self.version, self.cfg.max_staleness, self.cost)
        reused: list[tuple[Sample, PromptRecord]] = []
        recomputed: list[Sample] = []
        for i, (s, d) in enumerate(zip(samples, decisions)):
            rec = None
            if d.action == "reuse":
                rec, status = self.store.take(s.response_id, self.version, self.cfg.max_staleness)
                if rec is None:  # gone since planning
                    decisions[i] = d = replace(d, action="recompute", reason=status)
                elif rec.prompt_ids != s.prompt_ids:
                    raise ValueError(f"the record for {s.response_id!r} was made from another "
                                     "prompt than the one logged for it; records must be made "
                                     "from the served prompt")
            elif d.reason == "stale" and infos[i].status == "present":
                self.store.take(s.response_id, self.version, self.cfg.max_staleness)  # counted
            elif infos[i].status == "present":
                self.store.discard(s.response_id)  # the costlier path: free its memory now
            if rec is not None:
                reused.append((s, rec if status == "hit" and rec.exact else rec.detached()))
            else:
                recomputed.append(s)
        tokens = sum(len(s.response_ids) for s in samples)
        self.optimizer.zero_grad(set_to_none=True)
        loss = 0.0
        mb = self.cfg.micro_batch_size or len(samples)
        with torch.enable_grad():
            for i in range(0, len(reused), mb):
                part, _ = reuse_loss(self.model, [r for _, r in reused[i:i + mb]],
                                     [s.response_ids for s, _ in reused[i:i + mb]])
                (part / tokens).backward()
                loss += part.item()
            for i in range(0, len(recomputed), mb):
                part, _ = recompute_loss(self.model, [s.prompt_ids for s in recomputed[i:i + mb]],
                                         [s.response_ids for s in recomputed[i:i + mb]])
                (part / tokens).backward()
                loss += part.item()
        if self.cfg.max_grad_norm:
            clip_grad_norm_in_parts(list(self.model.parameters()), self.cfg.max_grad_norm, self.pause)
        self.pause("optimizer")
        self.optimizer.step()  # from here to the return, nothing pauses: the weights are new
        self.step += 1
        self.feedback.mark_trained([s.feedback_id for s in samples], self.step)
        self.store.drop_older_than(self.version - self.cfg.max_staleness)
        for d in decisions:
            self.counts[d.action] += 1
            self.counts[f"{d.action}:{d.reason}"] += 1
        entry = dict(step=self.step, loss=loss / tokens, tokens=tokens,
                     seconds=time.perf_counter() - t0,
                     feedback_ids=[s.feedback_id for s in samples],
                     decisions=[asdict(d) for d in decisions])
        if self.run_log is None:
            self.run_log = RunLog(self.cfg.report_to, self.out, log_file=self.log_path.name,
                                  config=asdict(self.cfg), resume_step=self.step - 1)
        self.run_log.log(entry)
        log.info("online step %d: loss %.4f on %d tokens, %d reused, %d recomputed", self.step,
                 entry["loss"], tokens, len(reused), len(recomputed))
        if self.cfg.save_steps and self.step % self.cfg.save_steps == 0:
            self.save()
        return entry

    def metrics(self) -> dict[str, float]:
        """Decision counts (reuse, recompute, and per reason), reuse rate, step."""
        n = self.counts["reuse"] + self.counts["recompute"]
        return dict(step=self.step, reuse_rate=self.counts["reuse"] / n if n else 0.0,
                    **self.counts)

    # ---- checkpoints -------------------------------------------------------------------------

    def checkpoints(self) -> list[Path]:
        """Complete checkpoint-{step} directories, oldest first."""
        return checkpoints(self.out)

    def save(self) -> Path:
        """Write checkpoint-{step}/ (HF model dir, optimizer, trainer_state.json) atomically."""
        from safetensors.torch import save_file

        from reclaim.models.loading import MAX_SHARD_SIZE, write_weights
        from reclaim.online.lora import adapter_state_dict, merged_state_dict
        from reclaim.storage import atomic_dir

        def write(tmp: Path) -> None:
            cfg = self.model.config
            (tmp / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2, sort_keys=True) + "\n")
            if self.cfg.lora_r:  # a servable HF dir with the adapters folded in, and the adapters
                merged = merged_state_dict(self.model)
                write_weights(_Weights(merged), cfg, tmp, MAX_SHARD_SIZE)
                save_file({k: v.contiguous() for k, v in adapter_state_dict(self.model).items()},
                          tmp / ADAPTER_FILE)
            else:
                write_weights(self.model, cfg, tmp, MAX_SHARD_SIZE)
            torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
            state = dict(step=self.step, version=self.version, counts=dict(self.counts))
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2) + "\n")

        path = atomic_dir(self.out / f"{CHECKPOINT_PREFIX}{self.step}", write)
        if self.cfg.save_total_limit:
            for old in self.checkpoints()[:-self.cfg.save_total_limit]:
                shutil.rmtree(old, ignore_errors=True)
        return path

    def resume(self) -> int:
        """Load the latest checkpoint (none: keep the model as given, step 0), reopen feedback
        trained by later steps and drop their log lines; returns the step resumed at."""
        from reclaim.models.loading import SafetensorsSource

        found = self.checkpoints()
        if found:
            last = found[-1]
            state = json.loads((last / "trainer_state.json").read_text())
            has_adapter = (last / ADAPTER_FILE).exists()
            if has_adapter != bool(self.cfg.lora_r):
                raise ValueError(f"{str(last)!r} was written {'with' if has_adapter else 'without'}"
                                 f" LoRA adapters but lora_r={self.cfg.lora_r}; resume with the "
                                 "run's own lora settings")
            if has_adapter:
                from safetensors.torch import load_file

                src = load_file(last / ADAPTER_FILE)
                trained = {n: p for n, p in self.model.named_parameters() if ".lora_" in n}
            else:
                src, trained = SafetensorsSource(last), dict(self.model.named_parameters())
            with torch.no_grad():
                for name, p in trained.items():
                    p.copy_(src[name])
            self.optimizer.load_state_dict(torch.load(last / "optimizer.pt"))
            self.step = state["step"]
            self.counts = Counter(state.get("counts", {}))
        reopened = self.feedback.unmark_after(self.step)
        if self.log_path.exists():
            keep = []
            for line in self.log_path.read_text().splitlines():
                try:
                    if json.loads(line)["step"] <= self.step:
                        keep.append(line)
                except json.JSONDecodeError:  # a line torn by the crash
                    continue
            self.log_path.write_text("".join(ln + "\n" for ln in keep))
        log.info("online trainer resumed at step %d; %d feedback reopened", self.step, reopened)
        return self.step


class _Weights:
    """A state dict posing as a module for write_weights."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.tensors
