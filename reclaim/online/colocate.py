"""Online learning inside a serving engine: the schedule between serving and training.

`Colocated` sits in the engine's loop (`reclaim serve --learn`). The engine runs a chosen
request's prefill through `record` (the learner's autograd forward, kept for training), so the
prompt is computed once for serving and training. Finished responses are logged so feedback can
name them. Between engine steps it runs a training step when feedback is pending and either the
engine is idle or training has used at most `max_ttft_slowdown` of the time serving did; the
weights change in place on the served module, and the engine bumps its version, so every
response reports the version that produced it.

Keys: the engine runs choice i of response R as request `R-i`; choice 0 is known as `R`, others
as `R#i` (what POST /v1/feedback names with `choice_index`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from reclaim.engine.engine import Engine
from reclaim.engine.request import RequestOutput
from reclaim.online.learner import OnlineLearner


def response_key(response_id: str, choice_index: int = 0) -> str:
    """The name the learner knows a response's choice by."""
    return response_id if choice_index == 0 else f"{response_id}#{choice_index}"


def key_of_request(request_id: str) -> str:
    """The learner's key for the engine request `R-i`."""
    response_id, _, index = request_id.rpartition("-")
    return response_key(response_id, int(index)) if index.isdigit() and response_id else request_id


class Colocated:
    """A learner trained between the steps of the engine that serves its model."""

    def __init__(self, learner: OnlineLearner, engine: Engine, *, max_ttft_slowdown: float = 0.1) -> None:
        if engine.model is not learner.model:
            raise ValueError("online learning trains the served module itself: give the learner the engine's model")
        if max_ttft_slowdown < 0:
            raise ValueError(f"max_ttft_slowdown={max_ttft_slowdown}; allowed: >= 0 (0.1 = 10%)")
        self.learner, self.engine, self.max_slowdown = learner, engine, max_ttft_slowdown
        engine.recorder = self.record
        engine.weights_version = learner.version  # a resumed learner has trained already
        self.serve_s = 0.0
        self.train_s = 0.0
        self.steps = 0

    def should_record(self, requested: bool) -> bool:
        """Whether to record a request (the --record policy; `requested` is its
        retain_for_training)."""
        return self.learner.should_record(requested)

    def record(self, request_id: str, prompt_ids: list[int], version: int
               ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        """The engine's recorder: the learner's prefill with autograd; serving reads its K/V and
        the last hidden state."""
        rec = self.learner.record(prompt_ids, key_of_request(request_id))
        kv = [rec.kv(layer) for layer in range(len(rec.keys))]
        return [k for k, _ in kv], [v for _, v in kv], rec.hidden()[0, 0]

    def log_finished(self, outputs: Sequence[RequestOutput]) -> None:
        """Log the responses that finished, before they are handed to the clients (so feedback
        sent right after a response can always name it)."""
        for out in outputs:
            if out.finished and out.finish_reason in ("stop", "length") and out.token_ids is not None:
                self.learner.on_response(key_of_request(out.request_id), out.prompt_token_ids, out.token_ids)

    def after_step(self, seconds: float) -> dict[str, Any] | None:
        """Train one step if feedback is pending and the schedule allows (the engine is idle, or
        training has used at most max_ttft_slowdown of serving's time). Returns its log entry."""
        self.serve_s += seconds
        idle = not self.engine.has_unfinished()
        if not (idle or self.train_s <= self.max_slowdown * self.serve_s):
            return None
        if not self.learner.log.pending(limit=1):
            return None
        t = time.perf_counter()
        entry = self.learner.train_step()
        self.train_s += time.perf_counter() - t
        if entry is not None:
            self.steps += 1
            self.engine.weights_changed()
        return entry

    def metrics(self) -> dict[str, float]:
        return {**self.learner.metrics(), "train_seconds": self.train_s, "serve_seconds": self.serve_s,
                "train_steps": self.steps}
