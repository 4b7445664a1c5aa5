"""The one object a server holds for online learning: it records prompts chosen by policy, logs
served responses and feedback, runs training steps between engine steps and reports metrics.

    learner = OnlineLearner(model, load_config(OnlineTrainConfig, "online-smollm2"), tokenize=...)
    if learner.should_record(body.get("retain_for_training", False)):
        rec = learner.record(prompt_ids, response_id)   # prefill with autograd: rec.keys / values
        first_token_logits = rec.last_logits            # are the prompt's K/V for decoding
    learner.on_response(response_id, prompt_ids, response_ids)   # when the response is complete
    fid = learner.feedback(response_id, rating, correction)      # POST /v1/feedback
    learner.train_step()                                          # between engine steps
    learner.rollback(3)                                           # POST /v1/weights/rollback
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from reclaim.online.feedback import FeedbackError, FeedbackLog, NotOwner
from reclaim.online.recorder import PromptRecord, record_prompt
from reclaim.online.store import RecordStore
from reclaim.online.trainer import CostModel, OnlineTrainConfig, OnlineTrainer, record_policy


class OnlineLearner:
    """Recorder policy, record store, feedback log and trainer for one served model."""

    def __init__(self, model: torch.nn.Module, cfg: OnlineTrainConfig, *,
                 tokenize: Callable[[str], list[int]] | None = None,
                 cost: CostModel | None = None, model_name: str | None = None,
                 rollback_to: int | None = None) -> None:
        self.model, self.cfg = model, cfg
        self.should_record = record_policy(cfg.record)
        self.store = RecordStore(cfg.record_budget, cfg.record_host_budget)
        self.log = FeedbackLog(cfg.feedback_path)
        self.trainer = OnlineTrainer(model, cfg, self.log, self.store, tokenize=tokenize, cost=cost,
                                     model_name=model_name)
        self.trainer.resume(rollback_to)
        self.train_seconds = 0.0
        self.train_tokens = 0

    @property
    def version(self) -> int:
        """The weights version: responses report it; it rises by one per training step."""
        return self.trainer.version

    def record(self, prompt_ids: Sequence[int], response_id: str) -> PromptRecord:
        """Run the prompt's prefill with autograd and keep it for training on `response_id`."""
        rec = record_prompt(self.model, prompt_ids, response_id=response_id, version=self.version,
                            prefix_grad=self.cfg.prefix_grad,
                            selective=self.cfg.selective_recompute)
        self.store.put(rec)
        return rec

    def on_response(self, response_id: str, prompt_ids: Sequence[int],
                    response_ids: Sequence[int], owner: str | None = None) -> None:
        """Log a finished response, so feedback can name it (and train on it after a restart);
        `owner` names the API key that asked for it."""
        self.log.add_response(response_id, prompt_ids, response_ids, self.version, owner)

    def feedback(self, response_id: str, rating: int, correction: str | None = None, *,
                 caller: str | None = None, admin: bool = False) -> int:
        """Durably log feedback; raises UnknownResponse (404), NotOwner (403: the response was
        made with another key than `caller`'s, and the caller is not an admin) or FeedbackError
        (400), the latter also for a correction that tokenizes to nothing or does not fit the
        context after the prompt (checked before anything is written)."""
        response = self.log.response(response_id)
        if response.owner is not None and response.owner != caller and not admin:
            raise NotOwner(f"response {response_id!r} was made with another API key; feedback on "
                           "it is taken only from that key or an admin key")
        if isinstance(correction, str) and self.trainer.tokenize is not None:
            prompt = len(response.prompt_ids)
            n, limit = len(self.trainer.tokenize(correction)), self.model.config.max_position_embeddings
            if n == 0 or prompt + n > limit:
                raise FeedbackError(f"correction of {n} tokens after a prompt of {prompt}: must be "
                                    f"1 to {limit - prompt} tokens (the context is {limit})")
        return self.log.append(response_id, rating, correction)

    def train_step(self, finish: bool = True) -> dict | None:
        """One training step if feedback is pending (its log entry), else None. finish=False
        leaves the gate, log line and checkpoint to `finish(entry)` (co-location runs that
        between engine steps, apart from the step's slices)."""
        t = time.perf_counter()
        entry = self.trainer.train_step(finish)
        if entry is not None:
            self.train_seconds += time.perf_counter() - t
            self.train_tokens += entry["tokens"]
        return entry

    def finish(self, entry: dict) -> dict:
        """Settle a step: the regression gate (an undone update's feedback quarantined), its log
        line, a checkpoint every save_steps."""
        t = time.perf_counter()
        entry = self.trainer.finish(entry)
        self.train_seconds += time.perf_counter() - t
        return entry

    def rollback(self, version: int) -> list[int]:
        """Restore weights version `version` in place and reject the feedback trained after it;
        the versions undone (VersionNotKept naming those kept if it is not)."""
        return self.trainer.rollback(version)

    def versions(self) -> list[dict]:
        """The current line of versions, oldest first, with where each is kept."""
        return self.trainer.versions()

    def metrics(self) -> dict[str, float]:
        """For /metrics: version, training tokens/s, reuse rate, decisions by reason, and the
        store's records, bytes, hits, misses, evictions, stale."""
        tps = self.train_tokens / self.train_seconds if self.train_seconds else 0.0
        out = {"version": self.version, "train_tokens": self.train_tokens,
               "train_tokens_per_s": tps, "pending_feedback": self.log.pending_count(),
               "rejected_feedback": self.log.rejected_count("rollback"),
               "quarantined_feedback": self.log.rejected_count("quarantined"),
               "kept_versions_bytes": self.trainer.kept.nbytes}
        out.update({f"train_{k}": v for k, v in self.trainer.metrics().items()})
        out.update({f"record_{k}": v for k, v in self.store.metrics().items()})
        return out
