"""The engine loop in a background thread, and per-HTTP-request streams of its outputs.

The engine steps in its own thread so the asyncio front end keeps accepting, streaming and
noticing disconnects while the model runs. Outputs of one step cross to the event loop in a
single `call_soon_threadsafe`; each HTTP request reads its choices from one asyncio queue.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from reclaim.engine.request import RequestOutput, SamplingParams
from reclaim.server.metrics import ServerMetrics

log = logging.getLogger("reclaim.server")


class EngineFailure(Exception):
    """The engine raised during a step; every request in flight at that moment fails with it."""


@dataclass
class _Timing:
    start: float
    first: float | None = None
    tokens: int = 0


@dataclass
class Generation:
    """The engine requests behind one HTTP request (prompts x n choices), read as one stream."""

    runner: "EngineThread"
    index_of: dict[str, int]  # engine request id -> choice index
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    pending: set[str] = field(default_factory=set)
    failed: bool = False  # a choice failed (engine step or its own error): the response is an error

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yield (choice index, output) until every choice has finished."""
        while self.pending:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                self.failed = True
                raise item
            if item.finished:
                self.pending.discard(item.request_id)
                self.failed |= item.finish_reason == "error"
            yield self.index_of[item.request_id], item

    def abort(self) -> None:
        """Cancel the choices still running and free their cache blocks (idempotent)."""
        for rid in list(self.pending):
            self.runner.abort(rid)
        self.pending.clear()


class EngineThread:
    """Owns the engine thread; submits and aborts requests from the event loop."""

    def __init__(self, engine, metrics: ServerMetrics, idle_wait_s: float = 0.05, learner=None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.learner = learner  # online.colocate.Colocated with --learn: trains between steps
        self.idle_wait_s = idle_wait_s
        self.stats: dict = dict(engine.stats())
        self._sinks: dict[str, Generation] = {}
        self._timing: dict[str, _Timing] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- lifecycle (event-loop thread) ----

    def start(self) -> None:
        """Start the engine thread; call from inside the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="reclaim-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Abort whatever is still running and join the engine thread."""
        for rid in list(self._sinks):
            self.abort(rid)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        return len(self._sinks)

    # ---- requests (event-loop thread) ----

    def submit(self, request_id: str, prompts: list[list[int]],
               params: list[SamplingParams], record: bool = False,
               owner: str | None = None) -> Generation:
        """Queue one engine request per (prompt, params) pair, ids `{request_id}-{i}`; `record`
        asks for their prefills to be recorded for training (with --learn); `owner` (the API key
        that sent it, as a digest) is logged with the responses, for feedback to be checked against.

        Raises ValueError (nothing left queued) if the engine refuses any of them.
        """
        if not self.alive:
            raise EngineFailure("the engine loop is not running")
        ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        gen = Generation(self, {rid: i for i, rid in enumerate(ids)})
        now = time.perf_counter()
        try:
            for rid, prompt, p in zip(ids, prompts, params):
                self._sinks[rid] = gen
                gen.pending.add(rid)
                self._timing[rid] = _Timing(now)
                if owner is not None and self.learner is not None:
                    self.learner.owners[rid] = owner
                self.engine.add_request(rid, prompt, p, record=record)
        except Exception:
            gen.abort()
            raise
        self.metrics.prompt_tokens.inc(sum(len(p) for p in prompts))
        self._wake.set()
        return gen

    def abort(self, request_id: str) -> None:
        """Stop one engine request; its outputs are dropped from here on."""
        if self.learner is not None:
            self.learner.owners.pop(request_id, None)
        if self._sinks.pop(request_id, None) is not None:
            self._timing.pop(request_id, None)
            self.metrics.requests_finished.inc(1, ("abort",))
            self.engine.abort_request(request_id)
            self._wake.set()

    def end_all(self) -> int:
        """Abort every request in flight but keep its stream: the engine's 'abort' output ends
        it with a finish_reason and [DONE] (used when the shutdown grace period runs out)."""
        for rid in self._sinks:
            self.engine.abort_request(rid)
        self._wake.set()
        return len(self._sinks)

    def _deliver(self, outputs: list[RequestOutput], stats: dict) -> None:
        self.stats = stats
        now = time.perf_counter()
        for out in outputs:
            gen = self._sinks.get(out.request_id)
            if gen is None:
                continue  # aborted by the front end; its late outputs are moot
            self._record(out, now)
            if out.finished:
                del self._sinks[out.request_id]
            gen.queue.put_nowait(out)

    def _record(self, out: RequestOutput, now: float) -> None:
        t = self._timing[out.request_id]
        if out.new_token_ids:
            if t.first is None:
                t.first = now
                self.metrics.ttft.observe(now - t.start)
            t.tokens += len(out.new_token_ids)
            self.metrics.generation_tokens.inc(len(out.new_token_ids))
        if out.finished:
            del self._timing[out.request_id]
            self.metrics.requests_finished.inc(1, (out.finish_reason or "unknown",))
            self.metrics.e2e.observe(now - t.start)
            if t.first is not None and t.tokens > 1:
                self.metrics.tpot.observe((now - t.first) / (t.tokens - 1))

    def _fail_all(self, exc: BaseException) -> None:
        for rid, gen in list(self._sinks.items()):
            del self._sinks[rid]
            self._timing.pop(rid, None)
            self.metrics.requests_finished.inc(1, ("error",))
            self.engine.abort_request(rid)
            gen.queue.put_nowait(EngineFailure(f"engine step failed: {exc!r}"))

    # ---- engine thread ----

    def _learn(self, step_s: float) -> None:
        """With --learn: train between steps, per the schedule. A training failure is logged and
        never stops serving."""
        if self.learner is None:
            return
        try:
            entry = self.learner.after_step(step_s)
        except Exception:  # noqa: BLE001 - serving goes on; the feedback stays pending
            log.exception("online training step failed; serving continues")
            return
        if entry is not None:
            log.info("online training step %s: loss %.4f on %s tokens, weights version %d",
                     entry.get("step"), entry.get("loss", float("nan")), entry.get("tokens"),
                     self.engine.weights_version)

    def _run(self) -> None:
        engine, loop = self.engine, self._loop
        while not self._stop.is_set():
            self._wake.clear()
            if not engine.has_unfinished():
                self._learn(0.0)  # a short slice: a request arriving meanwhile waits for little
                if self.learner is None or not self.learner.busy:
                    self._wake.wait(self.idle_wait_s)
                continue
            try:
                t = time.perf_counter()
                outputs = engine.step()
                step_s = time.perf_counter() - t
            except Exception as exc:  # a broken step must not kill the server
                log.exception("engine step failed; failing the requests in flight")
                loop.call_soon_threadsafe(self._fail_all, exc)
                self._stop.wait(self.idle_wait_s)  # let the aborts land before stepping again
                continue
            stats = dict(engine.stats())
            if self.learner is not None:
                try:
                    self.learner.log_finished(outputs)  # before the clients see them
                except Exception:  # noqa: BLE001 - serving goes on
                    log.exception("logging finished responses for online learning failed")
            loop.call_soon_threadsafe(self._deliver, outputs, stats)
            self._learn(step_s)
        # Leave the engine clean: anything still queued when stopping was aborted above.
        self.stats = dict(engine.stats())
        if self.learner is not None:
            self.learner.close()  # a training step in progress is abandoned, its feedback kept
