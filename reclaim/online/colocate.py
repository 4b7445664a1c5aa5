"""Online learning inside a serving engine: the schedule between serving and training.

`Colocated` sits in the engine's loop (`reclaim serve --learn`). The engine runs a chosen
request's prefill through `record` (the learner's autograd forward, kept for training), so the
prompt is computed once for serving and training. Finished responses are logged so feedback can
name them. Training runs in slices between engine steps (`TrainingSlices`: a step runs a unit,
a part of a layer's forward or backward, only if it fits what is left of its slice): while the
engine is busy, each engine step of t seconds earns training t * credit_rate(s, rho) seconds,
with s = max_ttft_slowdown and rho the share of recent time the engine spent serving (queueing
makes extra work cost latency more the busier serving is; see `credit_rate`); the earned time is
spent once it covers the step's next unit (a unit as long as the optimizer step waits for credit
rather than overrunning a small slice), and only after steps that leave no request waiting for its
first token (a prefill never waits for training); recording a prefill, which lengthens its step, is
paid from the same credit while other requests share the engine (`may_record`); while it is idle,
training runs in short slices that let a new request in within about one unit's work. With
max_feedback_wait_s a step waits for a full batch of feedback (or that long), so steps are fewer and
the records they reuse fresher. The
optimizer step changes the weights of the served module between two engine steps, and the engine
takes the learner's version, so every response reports the version that produced it. The step is
settled (the regression gate's probe forwards, its checkpoint) in the engine thread after its last
slice, and admin work (a rollback, the list of versions) runs there too (`call`), between engine
steps: the weights never change under a running step.

Keys: the engine runs choice i of response R as request `R-i`; choice 0 is known as `R`, others
as `R#i` (what POST /v1/feedback names with `choice_index`).
"""

from __future__ import annotations

import queue
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from reclaim.engine.engine import Engine
from reclaim.engine.request import RequestOutput
from reclaim.online.learner import OnlineLearner
from reclaim.online.slices import TrainingSlices


def response_key(response_id: str, choice_index: int = 0) -> str:
    """The name the learner knows a response's choice by."""
    return response_id if choice_index == 0 else f"{response_id}#{choice_index}"


def key_of_request(request_id: str) -> str:
    """The learner's key for the engine request `R-i`."""
    response_id, _, index = request_id.rpartition("-")
    return response_key(response_id, int(index)) if index.isdigit() and response_id else request_id


def credit_rate(max_slowdown: float, utilization: float) -> float:
    """Training seconds a busy serving second may earn so that latency grows by at most
    `max_slowdown` at serving utilization rho (the share of time the engine serves).

    Latency is mostly queueing when serving is busy: in an M/M/1 queue it goes as 1 / (1 - rho), so
    a share d of extra work stretches it by (1 + d)(1 - rho) / (1 - rho (1 + d)), which is 1 + s for
    d = s (1 - rho) / (1 + s rho): all of s on a light load, next to nothing near saturation. (In
    `reclaim bench online` at rho ~0.8, training on s = 10% of busy time stretched TTFT by 35% and
    TPOT by 31%: every running request waited for it, and for the prefills that piled up meanwhile.)"""
    rho = min(max(utilization, 0.0), 1.0)
    return max_slowdown * (1 - rho) / (1 + max_slowdown * rho)


class Colocated:
    """A learner trained between the steps of the engine that serves its model."""

    def __init__(self, learner: OnlineLearner, engine: Engine, *, max_ttft_slowdown: float = 0.1,
                 idle_slice_s: float = 0.02, max_feedback_wait_s: float = 0.0,
                 utilization_window_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if engine.model is not learner.model:
            raise ValueError("online learning trains the served module itself: give the learner the engine's model")
        if not 0 <= max_ttft_slowdown:
            raise ValueError(f"max_ttft_slowdown={max_ttft_slowdown}; allowed: >= 0 (0.1 = 10%)")
        if not idle_slice_s > 0:
            raise ValueError(f"idle_slice_s={idle_slice_s}; allowed: > 0 seconds")
        if not max_feedback_wait_s >= 0:
            raise ValueError(f"max_feedback_wait_s={max_feedback_wait_s}; allowed: >= 0 seconds")
        if not utilization_window_s > 0:
            raise ValueError(f"utilization_window_s={utilization_window_s}; allowed: > 0 seconds")
        self.learner, self.engine, self.max_slowdown = learner, engine, max_ttft_slowdown
        self.idle_slice_s, self.max_feedback_wait_s = idle_slice_s, max_feedback_wait_s
        self._waiting_since: float | None = None  # when feedback started waiting for a step
        self.clock, self.window_s = clock, utilization_window_s
        self._started = clock()
        self._served: deque[tuple[float, float]] = deque()  # (end, seconds) of recent busy steps
        engine.recorder = self.record
        engine.record_when_queued = learner.cfg.record_when_queued
        engine.may_record = self.may_record
        engine.weights_version = learner.version  # a resumed learner has trained already
        self._new_slices()
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
        self.owners: dict[str, str] = {}  # engine request id -> the API key (digest) that sent it
        self.serve_s = 0.0  # engine steps' seconds
        self.train_s = 0.0  # training slices' seconds, idle or not
        self.credit_s = 0.0  # training time earned by busy engine steps, not yet used
        self.steps = 0
        self.deferred = 0  # slices not granted because a request waited for its first token
        self.records_refused = 0  # prefills served unrecorded: the credit did not cover recording

    def _new_slices(self) -> None:
        self.slices = TrainingSlices(self.learner.model, lambda: self.learner.train_step(finish=False))
        self.learner.trainer.pause = self.slices.boundary

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` in the engine thread between two engine steps (with no training unit
        running); its result or exception arrives in the future."""
        fut: Future = Future()
        self._calls.put((fn, fut))
        return fut

    def _run_calls(self) -> None:
        while True:
            try:
                fn, fut = self._calls.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except Exception as exc:  # noqa: BLE001 - the caller gets it
                    fut.set_exception(exc)

    def rollback(self, version: int) -> list[int]:
        """Restore weights `version` (call it through `call`): a training step in progress is
        abandoned (its feedback stays pending, to train on the restored weights); the versions
        undone."""
        kept = self.learner.trainer.kept_versions()
        if version != self.learner.version and version in kept and self.slices.in_step:
            self.slices.close()
            self._new_slices()
        undone = self.learner.rollback(version)
        if undone:
            self._weights_changed()
        return undone

    def _weights_changed(self) -> None:
        self.engine.weights_changed()  # cached K/V of other weights is not reused
        self.engine.weights_version = self.learner.version

    def should_record(self, requested: bool) -> bool:
        """Whether to record a request (the --record policy; `requested` is its
        retain_for_training)."""
        return self.learner.should_record(requested)

    def may_record(self, prompt_tokens: int) -> bool:
        """Whether a retained request's prefill is recorded now. Recording makes its engine step
        longer (`CostModel.record_extra_s`): serving's work grows as with a training slice, so
        while other requests share the engine it is paid from the same credit, and refused (the
        request served unrecorded; training recomputes its prompt) when the credit does not cover
        it; a request alone in the engine pays for itself (its prefill grows by about that)."""
        extra = self.learner.trainer.cost.record_extra_s(prompt_tokens)
        if len(self.engine.scheduler.running) + len(self.engine.scheduler.waiting) <= 1:
            return True
        if self.credit_s < extra:
            self.records_refused += 1
            return False
        self.credit_s -= extra
        return True

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
            owner = self.owners.pop(out.request_id, None) if out.finished else None
            if out.finished and out.finish_reason in ("stop", "length") and out.token_ids is not None:
                self.learner.on_response(key_of_request(out.request_id), out.prompt_token_ids, out.token_ids,
                                         owner)

    @property
    def busy(self) -> bool:
        """A training step is in progress or ready to start (see `ready`)."""
        return self.slices.in_step or self.ready

    @property
    def ready(self) -> bool:
        """A step may start: a full batch of feedback is pending, or some has waited
        max_feedback_wait_s (default 0: at once). Every step makes the records of the requests in
        flight stale (made by the weights before it), so fewer, fuller steps leave more records
        exact to reuse; but records wait longer meanwhile: in `reclaim bench online` on a CPU,
        waiting up to 30 s for batches of 4 held 2.8 GB of records and slowed serving (TTFT p50
        1.45x, TPOT 1.6x) where starting at once did not."""
        batch = self.learner.cfg.per_device_train_batch_size
        n = len(self.learner.log.pending(limit=batch))
        if n == 0:
            self._waiting_since = None
            return False
        now = self.clock()
        if self._waiting_since is None:
            self._waiting_since = now
        return n >= batch or now - self._waiting_since >= self.max_feedback_wait_s

    def after_step(self, seconds: float) -> dict[str, Any] | None:
        """After an engine step of `seconds` (0 when the engine is idle): a training slice, if
        training has work and time (the engine is idle, or busy steps have earned enough for the
        step's next unit, as long as its last one). Returns the log entry of a training step that
        finished in it."""
        self._run_calls()
        self.serve_s += seconds
        if seconds > 0:
            self._served.append((self.clock(), seconds))
        idle = not self.engine.has_unfinished()
        need = self.slices.next_unit_s
        if not idle:  # a busy step of t seconds earns t * credit_rate: latency grows by at most s
            earned = seconds * credit_rate(self.max_slowdown, self.utilization())
            self.credit_s = min(self.credit_s + earned, max(seconds, 0.1, need))
        if not self.busy or not (idle or self.credit_s >= max(need, 1e-6)):
            return None
        if not idle and self.engine.awaits_first_token():
            self.deferred += 1  # a prefill goes first: training waits for decode-only steps
            return None
        spent, entry = self._grant(self.idle_slice_s if idle else self.credit_s)
        if not idle:
            self.credit_s -= spent  # an overrun past the slice is paid back by later steps
        return entry

    def utilization(self) -> float:
        """The share of the last utilization_window_s (or of the time since the start, if less)
        that the engine spent in its steps: serving's own load, training's time not counted."""
        now = self.clock()
        while self._served and self._served[0][0] <= now - self.window_s:
            self._served.popleft()
        span = min(self.window_s, now - self._started)
        busy = sum(s for _, s in self._served)
        return min(1.0, busy / span) if span > 0 else 1.0

    def train_now(self) -> dict[str, Any] | None:
        """Run a training step to its end (or finish the one in progress), full batch or not;
        its log entry, or None when no feedback is pending."""
        if not (self.slices.in_step or self.learner.log.pending(limit=1)):
            return None
        return self._grant(float("inf"))[1]

    def _grant(self, seconds: float) -> tuple[float, dict[str, Any] | None]:
        self._waiting_since = None
        t = time.perf_counter()
        entry = self.slices.grant(seconds)
        spent = time.perf_counter() - t
        self.train_s += spent
        if entry is not None:
            t = time.perf_counter()
            entry = self.learner.finish(entry)  # here, not in a slice: no turn for serving in it
            spent += time.perf_counter() - t
            self.train_s += time.perf_counter() - t
            self.steps += 1
            if entry.get("accepted", True):  # an undone update left the served weights as they were
                self._weights_changed()
        return spent, entry

    def close(self) -> None:
        """Stop training (a step in progress is abandoned; its feedback stays pending); calls not
        yet run fail."""
        self.slices.close()
        while True:
            try:
                _, fut = self._calls.get_nowait()
            except queue.Empty:
                break
            if fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError("the engine stopped before this ran"))
        self.learner.trainer.pause = lambda name: None

    def metrics(self) -> dict[str, float]:
        """The learner's metrics, with training tokens/s over the slices' time (a step's wall
        time includes the serving it waited for)."""
        rho = self.utilization()
        out = {**self.learner.metrics(), "train_seconds": self.train_s, "serve_seconds": self.serve_s,
               "train_steps": self.steps, "train_slices": self.slices.slices,
               "train_slices_deferred": self.deferred, "records_refused": self.records_refused,
               "serving_utilization": rho, "train_credit_rate": credit_rate(self.max_slowdown, rho),
               "train_slice_overshoot_max_s": self.slices.max_overshoot_s,
               "train_slice_overshoot_mean_s": self.slices.overshoot_s / max(1, self.slices.slices)}
        out["train_tokens_per_s"] = out["train_tokens"] / self.train_s if self.train_s else 0.0
        return out
