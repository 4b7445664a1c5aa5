"""Assemble model, engine, runner and app, and run them under uvicorn with a graceful SIGTERM.

SIGTERM drains: new requests get 503, the listening socket closes, in-flight requests run to
completion for up to `shutdown_timeout` seconds and are then cancelled (freeing their blocks);
the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import uvicorn

from reclaim.engine.config import EngineConfig
from reclaim.server.app import ServerState, create_app
from reclaim.server.connections import (ConnectionLimits, QuietInvalidHTTP, guarded_protocol,
                                        quiet_accept_errors)
from reclaim.server.metrics import ServerMetrics
from reclaim.server.plan import Limits, max_token_chars
from reclaim.server.ratelimit import RateLimiter
from reclaim.server.engine_thread import EngineThread

log = logging.getLogger("reclaim.server")


class LearnerRefused(ValueError):
    """`--learn` could not start: its run directory or flags do not fit the served model (another
    model's checkpoint, a version to roll back to that is not kept, a bad probe set)."""


def build_app(model: Any, tokenizer: Any, model_names: tuple[str, ...], engine_config: EngineConfig,
              *, api_key: str | None = None, max_n: int = 16, max_body_bytes: int = 4 << 20,
              split_special_tokens: bool = False, allowed_origins: tuple[str, ...] = (),
              force_include_usage: bool = False, access_log: bool = True, learn: Any = None,
              max_ttft_slowdown: float = 0.1, admin_key: str | None = None,
              feedback_rate_limit: float = 120.0, rollback_to: int | None = None,
              model_id: str | None = None, tp_group: Any = None, tp_control: Any = None):
    """The FastAPI app serving `model`; returns (app, runner, state).

    force_include_usage: usage in every stream, asked for or not; access_log: one INFO line per
    request on the `reclaim.access` logger. learn: an OnlineTrainConfig to learn from feedback
    while serving (`serve --learn`), training between engine steps within max_ttft_slowdown; its
    `{model}` is model_id (default: the first served name), checkpoints of another model are
    refused; rollback_to: a weights version to roll back to at start-up. admin_key: may roll
    weights back and rate any response; feedback_rate_limit: feedback a minute per key (0: no
    limit). tp_group, tp_control: this leader's tensor-parallel groups (tensor_parallel.py).
    """
    from reclaim.engine.engine import Engine

    if tokenizer is None:
        raise ValueError("the server needs a tokenizer; the model directory has no tokenizer files")
    engine = Engine(model, tokenizer, engine_config, tp_group=tp_group, tp_control=tp_control)
    colocated = None
    if learn is not None:
        from reclaim.online.colocate import Colocated
        from reclaim.online.learner import OnlineLearner

        name = model_id or model_names[0]
        try:
            learner = OnlineLearner(model, learn.for_model(name), model_name=name, rollback_to=rollback_to,
                                    tokenize=lambda text: tokenizer.encode(text, add_special_tokens=False))
        except (ValueError, LookupError) as exc:  # the run dir or flags, not a bug: one line for it
            raise LearnerRefused(str(exc)) from exc
        colocated = Colocated(learner, engine, max_ttft_slowdown=max_ttft_slowdown)
    runner = EngineThread(engine, ServerMetrics(), learner=colocated)
    limits = Limits(model_names=model_names, max_model_len=engine.max_model_len,
                    vocab_size=model.config.vocab_size, max_n=max_n, max_body_bytes=max_body_bytes,
                    split_special_tokens=split_special_tokens,
                    max_token_chars=max_token_chars(tokenizer),
                    force_include_usage=force_include_usage)
    state = ServerState(api_key=api_key, access_log=access_log, admin_key=admin_key,
                        feedback_limit=RateLimiter(feedback_rate_limit) if feedback_rate_limit else None)
    app = create_app(runner, tokenizer, limits, state, allowed_origins=allowed_origins)
    return app, runner, state


def uvicorn_config(app: Any, connections: ConnectionLimits, metrics: ServerMetrics | None,
                   **kwargs: Any) -> uvicorn.Config:
    """uvicorn's config with the connection cap and the header/body/keep-alive deadlines."""
    return uvicorn.Config(app, http=guarded_protocol(connections, metrics),
                          timeout_keep_alive=connections.keep_alive, access_log=False, **kwargs)


def raise_file_limit(connections: ConnectionLimits) -> None:
    """Lift the soft descriptor limit to fit the connection cap (a client and a server side)."""
    want = connections.max_connections + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        if new < want:
            log.warning("the file limit (%d) is below --limit-concurrency %d + 256; accepts may "
                        "fail under load", new, connections.max_connections)


class Server(uvicorn.Server):
    """uvicorn that logs accept failures (out of descriptors) and malformed requests at most once
    every 10 s, so a flood of either cannot flood the log."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        quiet_accept_errors(asyncio.get_running_loop())
        QuietInvalidHTTP.install()
        await super().startup(sockets)


class DrainingServer(Server):
    """uvicorn that marks the app as draining on a signal and exits 0 after a SIGTERM.

    When `grace` seconds of shutdown have passed, the requests still running are aborted and
    end cleanly (finish_reason 'abort', then [DONE]); uvicorn cancels tasks only `END_S` later,
    if something still hangs.
    """

    END_S = 5.0  # time the aborted streams get to send their last chunk

    def __init__(self, config: uvicorn.Config, state: ServerState, runner: EngineThread,
                 grace: float) -> None:
        config.timeout_graceful_shutdown = grace + self.END_S
        super().__init__(config)
        self.state, self.runner, self.grace = state, runner, grace

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        cut = asyncio.get_running_loop().call_later(self.grace, self._end_in_flight)
        try:
            await super().shutdown(sockets)
        finally:
            cut.cancel()

    def _end_in_flight(self) -> None:
        n = self.runner.end_all()
        if n:
            log.info("shutdown grace of %g s is over: ending %d request(s) with "
                     "finish_reason 'abort'", self.grace, n)

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.state.draining = True
        if sig == signal.SIGTERM:
            # uvicorn would re-raise the signal after shutting down (exit 143); a drained
            # server has done what SIGTERM asks, so it ends normally instead.
            self.should_exit = True
            return
        super().handle_exit(sig, frame)


def serve(model: str | None, *, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, served_model_name: str | None = None,
          engine_config: EngineConfig | None = None, shutdown_timeout: float = 30.0,
          log_level: str = "info", connections: ConnectionLimits | None = None,
          allowed_origins: tuple[str, ...] = (), split_special_tokens: bool = False,
          force_include_usage: bool = False, access_log: bool = True, learn: Any = None,
          max_ttft_slowdown: float = 0.1, save_suffix_history: str | None = None,
          admin_key: str | None = None, feedback_rate_limit: float = 120.0,
          rollback_to: int | None = None) -> int:
    """Load `model` (a directory, or None for the default) and serve it until SIGTERM/SIGINT;
    with `learn` (an OnlineTrainConfig), also learn from feedback on the responses. With
    `save_suffix_history`, the history drafter's recent outputs are written there at shutdown
    (what `--suffix-history` starts the next server from)."""
    from reclaim.devices import resolve_device, resolve_dtype
    from reclaim.models.loading import load_model, read_config, resolve_model_dir

    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    path = resolve_model_dir(model)
    engine_config = engine_config or EngineConfig()
    device = resolve_device(engine_config.device)  # auto: CUDA when there is one
    tp = engine_config.tensor_parallel_size
    if tp > 1:  # refused by name before any weights load; then this rank's device and the group
        from reclaim.engine.tensor_parallel import check_launch, start_group

        check_launch(tp, read_config(path), ["serve", *(["--model", model] if model else []),
                                             "--tensor-parallel-size", str(tp)])
        if learn is not None:
            raise ValueError("--learn needs the whole model on one rank; allowed with --tensor-parallel-size "
                             "above 1: serving without it")
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
        tp_group, tp_control = start_group(tp, device)
    engine_config = engine_config.replace(device=str(device), dtype=resolve_dtype(
        engine_config.dtype, device, read_config(path).torch_dtype))
    # a TP rank reads only its shard, slice by slice: the whole model never sits on any rank
    weights, tokenizer = load_model(path, device=engine_config.device, dtype=engine_config.dtype,
                                    tp_group=tp_group if tp > 1 else None)
    if tp > 1 and dist.get_rank() != 0:  # a follower: the leader's forwards until it shuts down
        from reclaim.engine.engine import Engine

        # torchrun passes a SIGTERM to every rank: the leader drains, then lets this one go
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

        Engine(weights, tokenizer, engine_config, tp_group=tp_group, tp_control=tp_control).follow()
        dist.destroy_process_group()
        return 0
    tp_groups = {"tp_group": tp_group, "tp_control": tp_control} if tp > 1 else {}
    names = (served_model_name or (model if model else Path(path).name),)
    if model is None:
        names += ("default",)
    try:
        app, runner, state = build_app(weights, tokenizer, names, engine_config,
                                       api_key=api_key, allowed_origins=allowed_origins,
                                       split_special_tokens=split_special_tokens,
                                       force_include_usage=force_include_usage, access_log=access_log,
                                       learn=learn, max_ttft_slowdown=max_ttft_slowdown,
                                       admin_key=admin_key, feedback_rate_limit=feedback_rate_limit,
                                       rollback_to=rollback_to, model_id=Path(path).name,
                                       **tp_groups)
    except LearnerRefused as exc:
        log.error("not serving: %s", exc)
        return 2
    connections = connections or ConnectionLimits()
    raise_file_limit(connections)
    config = uvicorn_config(app, connections, runner.metrics, host=host, port=port,
                            log_level=log_level)
    server = DrainingServer(config, state, runner, grace=shutdown_timeout)
    log.info("serving %s on http://%s:%d (names %s)", path, host, port, list(names))
    try:
        server.run()
    finally:
        if tp > 1:  # the followers leave their loop and exit
            runner.engine.release()
            dist.destroy_process_group()
    if save_suffix_history is not None:
        save_suffix_history_of(runner, save_suffix_history)
    return 0 if server.started else 1


def save_suffix_history_of(runner: Any, path: str) -> tuple[int, int]:
    """Write the engine's history drafter's recent outputs to `path` (for the next server's
    `--suffix-history`); returns (outputs, tokens), (0, 0) without a history drafter."""
    recent = getattr(runner.engine.proposer, "recent_outputs", None)
    if recent is None:
        return 0, 0
    from reclaim.engine.history import write_history

    outputs = recent()
    write_history(path, outputs)
    tokens = sum(map(len, outputs))
    log.info("suffix history: %d outputs (%d tokens) written to %s", len(outputs), tokens, path)
    return len(outputs), tokens


class BackgroundServer:
    """uvicorn serving `app` from a daemon thread on a free loopback port (tests, benchmarks)."""

    def __init__(self, app: Any, *, log_level: str = "warning", start_timeout: float = 60.0,
                 connections: ConnectionLimits | None = None,
                 metrics: ServerMetrics | None = None) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn_config(app, connections or ConnectionLimits(), metrics,
                                log_level=log_level, timeout_graceful_shutdown=5)
        self.server = Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + start_timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"the server on port {self.port} did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
