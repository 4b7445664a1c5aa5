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
from reclaim.online.planner import CostModel, Decision, Sample, plan  # noqa: F401 - re-exported
from reclaim.online.probe import RegressionGate, load_probes
from reclaim.online.recorder import PromptRecord, recompute_loss, reuse_loss
from reclaim.online.store import RecordStore
from reclaim.online.versions import VersionSnapshots
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

    # `{model}` becomes the served model's name (`for_model`), so each model has its own run
    output_dir: str = "runs/online/{model}"
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
    # weights versions kept in host memory for rollback and the gate (trainable parameters and
    # optimizer state: 3x the weights each for full fine-tuning); 0: rollback to checkpoints only
    keep_versions: int = 0
    probe_path: str | None = None  # held-out JSON lines ({"prompt", "answer"} or {"text"})
    max_probe_regression: float = 0.05  # nats per token an update may add to the probe loss
    report_to: str | list[str] = "none"  # none | tensorboard | wandb | trackio, or a list (reclaim/trackers.py)

    def __post_init__(self) -> None:
        if self.per_device_train_batch_size < 1:
            raise ValueError(f"per_device_train_batch_size={self.per_device_train_batch_size}: "
                             "must be >= 1")
        for name in ("save_steps", "max_staleness", "lora_r", "micro_batch_size", "keep_versions"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 0")
        if self.cost_model not in COST_MODELS:
            raise ValueError(f"cost_model={self.cost_model!r}; allowed: {list(COST_MODELS)}")
        record_policy(self.record)
        report_to_list(self.report_to)
        for name in ("record_budget", "record_host_budget"):
            parse_size(getattr(self, name))
        if not self.max_probe_regression >= 0:
            raise ValueError(f"max_probe_regression={self.max_probe_regression}; allowed: >= 0 "
                             "(nats per token)")
        if self.probe_path is not None and self.keep_versions < 2:
            raise ValueError(f"keep_versions={self.keep_versions} with probe_path: the gate undoes "
                             "an update from the version before it, so keep at least 2")

    def for_model(self, name: str) -> "OnlineTrainConfig":
        """This config with `{model}` in output_dir and feedback_db replaced by `name` (its last
        path part, so a model given as a path names a directory, not a subtree)."""
        safe = Path(name.rstrip("/")).name or "model"
        return replace(self, output_dir=self.output_dir.replace("{model}", safe),
                       feedback_db=self.feedback_db and self.feedback_db.replace("{model}", safe))

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


class VersionNotKept(LookupError):
    """A rollback to a version that never existed, was undone or is no longer kept (404)."""


def model_identity(model: torch.nn.Module, name: str | None) -> dict:
    """What a checkpoint records of the model it was trained from: its name and shape."""
    cfg = model.config
    shape = {k: getattr(cfg, k, None) for k in ("model_type", "vocab_size", "hidden_size",
                                                 "intermediate_size", "num_hidden_layers",
                                                 "num_attention_heads", "num_key_value_heads")}
    return {"name": name, "shape": shape}


class OnlineTrainer:
    """Trains `model` in place from a feedback log, reusing prompt records from a store.

    model_name: the served model's name, written into checkpoints; resuming refuses a checkpoint
    of another model. tokenize: turns corrections (and probe texts) into token ids."""

    def __init__(self, model: torch.nn.Module, cfg: OnlineTrainConfig, feedback: FeedbackLog,
                 store: RecordStore, *, tokenize: Callable[[str], list[int]] | None = None,
                 cost: CostModel | None = None, model_name: str | None = None) -> None:
        self.model, self.cfg, self.feedback, self.store = model, cfg, feedback, store
        self.tokenize = tokenize
        self.identity = model_identity(model, model_name)
        if cfg.lora_r:
            from reclaim.online.lora import apply_lora

            apply_lora(model, cfg.lora_r, cfg.lora_alpha, cfg.lora_target_modules)
        # the embedding's gradient as rows added into .grad: 20% off a 256/128 step on a CPU
        RowGradEmbedding(model)
        self.gate = None
        if cfg.probe_path is not None:
            if tokenize is None:
                raise ValueError("probe_path needs a tokenize function to read the probe texts")
            self.gate = RegressionGate(load_probes(cfg.probe_path), tokenize,
                                       cfg.max_probe_regression, model.config.max_position_embeddings)
        if cost is None:
            cost = CostModel.measure(model) if cfg.cost_model == "measure" else CostModel.fixed(
                cfg.cost_model)
        self.cost = cost
        self.optimizer = adamw([p for p in model.parameters() if p.requires_grad],
                               lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                               weight_decay=cfg.weight_decay)
        self.version = 0  # the weights' version: the step that made them (0: as loaded)
        self.next_version = 1  # the next step's number: one past every version ever made
        self.kept = VersionSnapshots(cfg.keep_versions)
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
    def step(self) -> int:
        """The version of the weights (the step that made them), as checkpoints name it."""
        return self.version

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

    def train_step(self, finish: bool = True) -> dict | None:
        """One optimizer step on the oldest pending feedback; its log entry, or None if none.
        finish=False leaves the gate, the log line and the checkpoint to `finish(entry)`."""
        entry = self.update()
        return self.finish(entry) if finish and entry is not None else entry

    def update(self) -> dict | None:
        """The optimizer step of `train_step`, unsettled (see `finish`)."""
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
        parent, self.version = self.version, self.next_version
        self.next_version += 1
        self.feedback.mark_trained([s.feedback_id for s in samples], self.version, parent)
        self.kept.take(self.version, self.model, self.optimizer)
        self.store.drop_older_than(self.version - self.cfg.max_staleness)
        for d in decisions:
            self.counts[d.action] += 1
            self.counts[f"{d.action}:{d.reason}"] += 1
        return dict(step=self.version, parent=parent, loss=loss / tokens, tokens=tokens,
                    seconds=time.perf_counter() - t0,
                    feedback_ids=[s.feedback_id for s in samples],
                    decisions=[asdict(d) for d in decisions])

    def finish(self, entry: dict) -> dict:
        """Settle a step `train_step` made: with a probe set, its loss decides whether the update
        stays (else it is undone and its feedback quarantined); then the log line and, every
        save_steps, a checkpoint. Runs where serving does not (between engine steps): the probe
        forwards must not hand serving a turn with weights it has not been told of."""
        if self.gate is not None:
            verdict = self.gate.check(self.model)
            entry.update(probe_loss_before=verdict.before, probe_loss=verdict.after,
                         accepted=verdict.accepted)
            if not verdict.accepted:
                self.kept.restore(entry["parent"], self.model, self.optimizer)
                self.kept.drop([self.version])
                self.feedback.reject([self.version], "quarantined")
                self.store.drop_newer_than(entry["parent"])
                self.version = entry["parent"]
                self.counts["quarantined_steps"] += 1
                log.warning("online step %d undone: the probe loss rose from %.4f to %.4f (allowed: "
                            "+%g); its %d feedback quarantined, weights back to version %d",
                            entry["step"], verdict.before, verdict.after,
                            self.cfg.max_probe_regression, len(entry["feedback_ids"]), self.version)
        if self.run_log is None:
            self.run_log = RunLog(self.cfg.report_to, self.out, log_file=self.log_path.name,
                                  config=asdict(self.cfg), resume_step=entry["step"] - 1)
        self.run_log.log(entry)
        log.info("online step %d: loss %.4f on %d tokens", entry["step"], entry["loss"],
                 entry["tokens"])
        if entry.get("accepted", True) and self.cfg.save_steps and \
                self.version % self.cfg.save_steps == 0:
            self.save()
        return entry

    def metrics(self) -> dict[str, float]:
        """Decision counts (reuse, recompute, and per reason), reuse rate, step, and with a probe
        set its loss and the updates it accepted and undid."""
        n = self.counts["reuse"] + self.counts["recompute"]
        out = dict(step=self.version, reuse_rate=self.counts["reuse"] / n if n else 0.0,
                   **self.counts)
        if self.gate is not None:
            out.update(probe_loss=self.gate.loss if self.gate.loss is not None else math.nan,
                       probe_accepted=self.gate.accepted, probe_rejected=self.gate.rejected)
        return out

    # ---- versions ----------------------------------------------------------------------------

    def kept_versions(self) -> dict[int, str]:
        """Versions a rollback can restore -> where they are kept ("memory" or "checkpoint")."""
        out = {self._version_of(p): "checkpoint" for p in self.checkpoints()}
        out.update({v: "memory" for v in self.kept.versions()})
        return dict(sorted(out.items()))

    def versions(self) -> list[dict]:
        """Every version on the current line (0 first, the current last), with its parent and
        where it is kept (None: not kept)."""
        parents, kept = self.feedback.parents(), self.kept_versions()
        line, v = [], self.version
        while True:
            line.append(dict(version=v, parent=parents.get(v), kept=kept.get(v),
                             current=v == self.version))
            if v == 0 or v not in parents:
                break
            v = parents[v]
        return line[::-1]

    def rollback(self, version: int, reason: str = "rollback") -> list[int]:
        """Restore `version` in place (weights and optimizer state, bit for bit) and reject the
        versions after it and the feedback they trained; returns the versions undone. Raises
        VersionNotKept naming the versions kept."""
        kept = self.kept_versions()
        if isinstance(version, bool) or not isinstance(version, int) or version not in kept:
            raise VersionNotKept(f"version {version!r} is not kept; kept: {list(kept)} (the current "
                                 f"is {self.version}; a version undone by a rollback is gone)")
        parents, undone, v = self.feedback.parents(), [], self.version
        while v != version:  # a kept version is on the current line: the walk reaches it
            undone.append(v)
            v = parents.get(v, v - 1)
        self.feedback.reject(undone, reason)  # durable first: a crash from here resumes past it
        for path in self.checkpoints():
            if self._version_of(path) in undone:
                self._remove(path)
        if kept[version] == "memory":
            self.kept.restore(version, self.model, self.optimizer)
        else:
            self._load(self.out / f"{CHECKPOINT_PREFIX}{version}")
        self.kept.drop(undone)
        self.store.drop_newer_than(version)
        self.version = version
        if version not in self.kept.snapshots:  # so the next step can be undone too
            self.kept.take(version, self.model, self.optimizer)
        if self.gate is not None:
            self.gate.reset(self.model)
        if undone:
            log.warning("online weights rolled back to version %d: versions %s undone, their "
                        "feedback rejected", version, undone)
        return undone

    # ---- checkpoints -------------------------------------------------------------------------

    def checkpoints(self) -> list[Path]:
        """Complete checkpoint-{step} directories, oldest first."""
        return checkpoints(self.out)

    @staticmethod
    def _version_of(path: Path) -> int:
        return int(path.name.removeprefix(CHECKPOINT_PREFIX))

    @staticmethod
    def _remove(path: Path) -> None:
        """Remove a checkpoint: renamed away first (atomic), so a crash midway leaves no
        half-deleted checkpoint for a restart to load."""
        gone = path.parent / f".{path.name}.removed"
        shutil.rmtree(gone, ignore_errors=True)
        path.rename(gone)
        shutil.rmtree(gone, ignore_errors=True)

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
            state = dict(step=self.version, version=self.version, counts=dict(self.counts),
                         model=self.identity)
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2) + "\n")

        path = atomic_dir(self.out / f"{CHECKPOINT_PREFIX}{self.version}", write)
        if self.cfg.save_total_limit:
            for old in self.checkpoints()[:-self.cfg.save_total_limit]:
                shutil.rmtree(old, ignore_errors=True)
        return path

    def _load(self, path: Path) -> dict:
        """Load a checkpoint's weights and optimizer state (refusing another model's); returns
        its trainer state."""
        from reclaim.models.loading import SafetensorsSource

        state = json.loads((path / "trainer_state.json").read_text())
        saved = state.get("model")
        if saved is not None and (saved["shape"] != self.identity["shape"] or (
                saved["name"] and self.identity["name"] and saved["name"] != self.identity["name"])):
            raise ValueError(f"checkpoint {str(path)!r} is of model {saved['name']!r} "
                             f"({saved['shape']}), not of the served {self.identity['name']!r} "
                             f"({self.identity['shape']}); give each model its own output_dir "
                             "(the default, runs/online/{model}, is one per model)")
        has_adapter = (path / ADAPTER_FILE).exists()
        if has_adapter != bool(self.cfg.lora_r):
            raise ValueError(f"{str(path)!r} was written {'with' if has_adapter else 'without'}"
                             f" LoRA adapters but lora_r={self.cfg.lora_r}; resume with the "
                             "run's own lora settings")
        if has_adapter:
            from safetensors.torch import load_file

            src = load_file(path / ADAPTER_FILE)
            trained = {n: p for n, p in self.model.named_parameters() if ".lora_" in n}
        else:
            src, trained = SafetensorsSource(path), dict(self.model.named_parameters())
        with torch.no_grad():
            for name, p in trained.items():
                p.copy_(src[name])
        self.optimizer.load_state_dict(torch.load(path / "optimizer.pt"))
        return state

    def resume(self, rollback_to: int | None = None) -> int:
        """Load the latest checkpoint (none: keep the model as given, version 0), reopen feedback
        trained by later steps and drop their log lines. With `rollback_to` (a checkpoint's
        version, or 0: the model as given), first reject every version after it and their
        feedback, as `rollback` does. Returns the version resumed at."""
        found = []
        for path in self.checkpoints():  # a crash during a rollback may leave undone ones
            undone = self._version_of(path) in self.feedback.rejected_versions()
            (self._remove if undone else found.append)(path)
        if rollback_to is not None:
            kept = [0] + [self._version_of(p) for p in found]
            if isinstance(rollback_to, bool) or rollback_to not in kept:
                raise VersionNotKept(f"--rollback-to {rollback_to!r}: no such version kept; at "
                                     f"start-up kept: {kept} (0: the model as given, the others "
                                     f"checkpoints in {str(self.out)!r})")
            undone = sorted(v for v in self.feedback.parents() if v > rollback_to)
            n = self.feedback.reject(undone, "rollback")
            for path in found:
                if self._version_of(path) > rollback_to:
                    self._remove(path)
            found = [p for p in found if self._version_of(p) <= rollback_to]
            log.warning("online weights rolled back to version %d at start-up: versions %s undone, "
                        "%d feedback rejected", rollback_to, undone, n)
        if found:
            state = self._load(found[-1])
            self.version = state["step"]
            self.counts = Counter(state.get("counts", {}))
        rejected = self.feedback.rejected_versions()
        reopened = self.feedback.unmark_after(self.version)
        self.next_version = max(self.feedback.last_version(), self.version) + 1
        if self.log_path.exists():
            keep = []
            for line in self.log_path.read_text().splitlines():
                try:
                    step = json.loads(line)["step"]
                except json.JSONDecodeError:  # a line torn by the crash
                    continue
                if step <= self.version or step in rejected:
                    keep.append(line)
            self.log_path.write_text("".join(ln + "\n" for ln in keep))
        log.info("online trainer resumed at version %d; %d feedback reopened", self.version, reopened)
        self.kept.take(self.version, self.model, self.optimizer)
        if self.gate is not None:
            self.gate.reset(self.model)
        return self.version


class _Weights:
    """A state dict posing as a module for write_weights."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.tensors
