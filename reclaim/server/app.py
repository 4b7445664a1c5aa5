"""The FastAPI app: OpenAI routes, health and metrics, and the gate in front of them.

The gate (a plain ASGI middleware, so streams pass through untouched) checks the API key (and
notes which key, or the admin key, a request came with), turns requests away with 503 while the
server drains for shutdown, and counts responses by status.
JSON validation, chat templating, tokenizing and rendering whole responses run in a small thread
pool, never on the event loop, so one huge body cannot stall `/health` or other streams.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel
from starlette.requests import ClientDisconnect

from reclaim.server.errors import APIError, install_error_handlers
from reclaim.server.metrics import CONTENT_TYPE
from reclaim.server.plan import (Limits, Plan, detokenize_body, plan_chat, plan_completion,
                                 tokenize_body)
from reclaim.server.responses import TokenText, collect, stream_body
from reclaim.server.engine_thread import EngineFailure, EngineThread, Generation
from reclaim.server.ratelimit import RateLimiter
from reclaim.server.schemas import (ChatCompletionRequest, CompletionRequest, FeedbackRequest,
                                    RollbackRequest, parse)
from reclaim.server.structured import GrammarCompiler

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/{id}", "/health",
          "/metrics", "/tokenize", "/detokenize", "/version", "/v1/feedback", "/v1/weights",
          "/v1/weights/rollback")
OPEN_ROUTES = ("/health",)  # reachable without the API key
DRAIN_EXEMPT = ("/metrics",)  # still answered while draining
# Threads that validate, template and tokenize requests: a few, so a burst of huge bodies
# queues there instead of taking the GIL from the event loop all at once.
PREP_THREADS = min(4, os.cpu_count() or 1)

log = logging.getLogger("reclaim.server")
access_log = logging.getLogger("reclaim.access")  # one line per request (--disable-access-log)


@dataclass
class ServerState:
    """Mutable state the gate and routes share.

    api_key: one key, or several separated by commas (each client its own: feedback on a response
    is taken only from the key that asked for it); admin_key: also passes the gate, and alone may
    roll weights back and give feedback on any response; feedback_limit: per-key feedback rate."""

    api_key: str | None = None
    draining: bool = False
    access_log: bool = True
    admin_key: str | None = None
    feedback_limit: RateLimiter | None = None

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(k.strip() for k in (self.api_key or "").split(",") if k.strip())


@dataclass(frozen=True)
class Caller:
    """Who sent a request: `key` a digest of its API key (None: no key needed), `admin` whether
    it was the admin key."""

    key: str | None
    admin: bool = False


def key_digest(key: str) -> str:
    """The name a key is known by in logs and the feedback log: never the key itself."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def caller_of(request: Request) -> Caller:
    return request.scope.get("reclaim.caller") or Caller(None)


class Gate:
    """API key, drain and status accounting for every HTTP request."""

    def __init__(self, app: Any, state: ServerState, runner: EngineThread) -> None:
        self.app, self.state, self.metrics = app, state, runner.metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        route = path if path in ROUTES else "/v1/models/{id}" if path.startswith("/v1/models/") \
            else "other"
        status = {"code": 0}
        scope["reclaim.status"] = status  # a stream that ends in an error event sets 500 here
        start = time.perf_counter()

        async def counted_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        error = self._refusal(scope)
        try:
            if error is not None:
                await error.response()(scope, receive, counted_send)
            else:
                await self.app(scope, receive, counted_send)
        except asyncio.CancelledError:
            if not self.state.draining:
                raise
            await self._cut(path, status, scope, receive, counted_send)
        finally:
            if status["code"]:
                self.metrics.http_requests.inc(1, (route, str(status["code"])))
            if self.state.access_log:
                self._log(scope, status["code"], time.perf_counter() - start)

    @staticmethod
    def _log(scope: dict, code: int, seconds: float) -> None:
        client = scope.get("client")
        access_log.info('%s "%s %s" %s %.1fms %s', f"{client[0]}:{client[1]}" if client else "-",
                        scope["method"], scope["path"], code or "-", seconds * 1000,
                        scope.get("reclaim.request_id", "-"))

    async def _cut(self, path: str, status: dict, scope: dict, receive: Any, send: Any) -> None:
        """uvicorn cancelled a request still running after the shutdown grace (the engine did
        not end it in time): answer 503, or end the stream with [DONE], instead of a traceback."""
        log.info("%s cancelled at shutdown", path)
        if not status["code"]:
            error = APIError(503, "the server shut down before this request finished")
            await error.response()(scope, receive, send)
        else:
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n",
                        "more_body": False})

    def _refusal(self, scope: dict) -> APIError | None:
        path = scope["path"]
        keys, admin = self.state.keys, self.state.admin_key
        if (keys or admin) and path not in OPEN_ROUTES:
            given = bearer_token(dict(scope["headers"]).get(b"authorization", b""))
            matched = [k for k in keys if hmac.compare_digest(given, k.encode())]
            if admin and hmac.compare_digest(given, admin.encode()):
                scope["reclaim.caller"] = Caller(key_digest(admin), admin=True)
            elif matched:
                scope["reclaim.caller"] = Caller(key_digest(matched[0]))
            elif keys:
                return APIError(401, "missing or wrong API key; send 'Authorization: Bearer <key>'")
        if self.state.draining and path not in DRAIN_EXEMPT:
            return APIError(503, "the server is shutting down and admits no new requests")
        return None


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("reclaim")
    except PackageNotFoundError:
        return "0+unknown"


def bearer_token(authorization: bytes) -> bytes:
    """The token of an `Authorization: Bearer <token>` header (the scheme is case-insensitive,
    RFC 7235); empty for any other scheme."""
    scheme, _, token = authorization.strip().partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else b""


def check_json(request: Request) -> None:
    """Refuse (415) a body that is not declared JSON: a web page can POST text/plain to a
    loopback server without a CORS preflight, but not application/json."""
    declared = request.headers.get("content-type")
    if declared is None:
        raise APIError(415, "the request has no Content-Type; send 'Content-Type: "
                       "application/json'")
    if declared.split(";")[0].strip().lower() != "application/json":
        raise APIError(415, f"Content-Type {declared[:100]!r} is not supported; allowed: "
                       f"application/json")


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refusing (413) anything over `limit` bytes before reading it all."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise APIError(400, f"Content-Length {declared!r} is not a byte count")
        if int(declared) > limit:
            raise APIError(413, f"the body is {declared} bytes; allowed: at most {limit}")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"the body is over {limit} bytes; allowed: at most {limit}")
            chunks.append(chunk)
    except ClientDisconnect:  # the client's business, not a server error: one line, no traceback
        client = request.client
        log.info("client %s left after %d bytes of its %s %s body",
                 f"{client.host}:{client.port}" if client else "?", size, request.method,
                 request.url.path)
        raise APIError(499, "the client closed the connection before sending the whole body")
    return b"".join(chunks)


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect_unless_gone(request: Request, work: Any) -> dict | None:
    """Run `work`; if the client hangs up first, cancel it (its finally frees the blocks)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    return task.result() if task.done() and not task.cancelled() else None


class EventStream(StreamingResponse):
    """SSE response that closes its generator however the connection ends, and counts a stream
    that ended in an error event as a 500 (its HTTP status was 200 before the error)."""

    media_type = "text/event-stream"

    def __init__(self, content: Any, gen: Generation, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.gen = gen

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            if self.gen.failed and "reclaim.status" in scope:
                scope["reclaim.status"]["code"] = 500


def create_app(runner: EngineThread, tokenizer: Any, limits: Limits,
               state: ServerState | None = None, *,
               allowed_origins: tuple[str, ...] = ()) -> FastAPI:
    """The server app around a (not yet started) runner; the lifespan starts and stops it.

    allowed_origins: web origins that may call the API from a browser (CORS); none by default.
    """
    state = state or ServerState()
    names = TokenText(tokenizer)
    grammars = GrammarCompiler(tokenizer)
    metrics = runner.metrics
    created = int(time.time())
    prep: ThreadPoolExecutor | None = None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        nonlocal prep
        prep = ThreadPoolExecutor(PREP_THREADS, thread_name_prefix="reclaim-prep")
        runner.start()
        try:
            yield
        finally:
            state.draining = True
            await runner.stop()
            prep.shutdown(wait=False, cancel_futures=True)

    def plan_body(raw: bytes, schema: type[BaseModel], planner: Callable) -> Plan:
        return planner(parse(raw, schema), tokenizer, limits, grammars)  # in a prep thread

    async def prepare(request: Request, schema: type[BaseModel], planner: Callable) -> Plan:
        """Read the body on the loop; validate, template and tokenize it in a prep thread."""
        check_json(request)
        raw = await read_body(request, limits.max_body_bytes)
        return await asyncio.get_running_loop().run_in_executor(prep, plan_body, raw, schema,
                                                                planner)

    app = FastAPI(title="reclaim", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server = state
    install_error_handlers(app)
    app.add_middleware(Gate, state=state, runner=runner)
    if allowed_origins:  # outside the gate, so a preflight needs no API key
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins),
                           allow_methods=["GET", "POST"], allow_headers=["*"])

    async def run(request: Request, plan: Plan):
        request.scope["reclaim.request_id"] = plan.response_id  # for the access log
        learner = runner.learner
        if plan.retain_for_training and learner is None:
            raise APIError(400, "retain_for_training needs a server that learns; start it with `reclaim serve "
                           "--learn`", param="retain_for_training")
        record = learner is not None and learner.should_record(plan.retain_for_training)
        try:
            gen = runner.submit(plan.response_id, plan.prompts, plan.params, record=record,
                                owner=caller_of(request).key)
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
        except EngineFailure as exc:
            raise APIError(503, str(exc)) from exc
        if plan.stream:
            return EventStream(stream_body(plan, gen, names, runner.engine.weights_version),
                               gen, headers={"Cache-Control": "no-cache"})
        try:
            body = await _collect_unless_gone(request, collect(plan, gen, names))
        except EngineFailure as exc:
            raise APIError(500, str(exc)) from exc
        finally:
            gen.abort()
        if body is None:  # the client left; nobody reads this
            return JSONResponse({}, status_code=499)
        # n long choices with top logprobs make megabytes of JSON: render them off the loop
        return await asyncio.get_running_loop().run_in_executor(prep, JSONResponse, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await run(request, await prepare(request, ChatCompletionRequest, plan_chat))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await run(request, await prepare(request, CompletionRequest, plan_completion))

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "reclaim",
                "root": limits.model_names[0], "parent": None,
                "max_model_len": limits.max_model_len,
                "weights_version": runner.engine.weights_version}

    def learner_or_refuse():
        if runner.learner is None:
            raise APIError(400, "this server does not learn from feedback; start it with `reclaim serve --learn`")
        return runner.learner

    @app.post("/v1/feedback")
    async def feedback(request: Request):
        """A rating (-1, 0, 1) or a correction of a served response; durable before the answer.
        With API keys, only from the key that asked for the response (or the admin key)."""
        from reclaim.online.colocate import response_key
        from reclaim.online.feedback import FeedbackError, NotOwner, UnknownResponse

        check_json(request)
        caller = caller_of(request)
        if state.feedback_limit is not None and not caller.admin:
            client = request.client
            who = caller.key or f"client {client.host if client else '?'}"
            wait = state.feedback_limit.take(who)
            if wait:
                raise APIError(429, f"too much feedback from {who}: at most "
                               f"{state.feedback_limit.rate * 60:g} a minute; retry in {wait:.1f} s",
                               retry_after=wait)
        req = parse(await read_body(request, limits.max_body_bytes), FeedbackRequest)
        learner = learner_or_refuse()
        key = response_key(req.response_id, req.choice_index)
        try:
            fid = await asyncio.to_thread(learner.learner.feedback, key, req.rating, req.correction,
                                          caller=caller.key, admin=caller.admin)
        except UnknownResponse as exc:
            raise APIError(404, f"no finished response {key!r} to give feedback on: {exc}", param="response_id",
                           code="response_not_found") from exc
        except NotOwner as exc:
            raise APIError(403, str(exc), param="response_id") from exc
        except FeedbackError as exc:
            raise APIError(400, str(exc), param="correction") from exc
        return {"id": fid, "object": "feedback", "response_id": req.response_id, "choice_index": req.choice_index,
                "status": "accepted"}

    async def between_steps(fn: Callable) -> Any:
        """Run fn in the engine thread between two engine steps (weights are not in use)."""
        if not runner.alive:
            raise APIError(503, "the engine loop is not running")
        return await asyncio.wrap_future(runner.learner.call(fn))

    @app.get("/v1/weights")
    async def weights():
        """The weights versions: the current line (oldest first) and where each is kept."""
        colocated = learner_or_refuse()
        line = await between_steps(colocated.learner.versions)
        rejected = colocated.learner.log.rejected_versions()
        return {"object": "list", "current": runner.engine.weights_version,
                "data": [{"object": "weights.version", **v} for v in line],
                "rejected": [{"version": v, "reason": r} for v, r in sorted(rejected.items())]}

    @app.post("/v1/weights/rollback")
    async def rollback(request: Request):
        """Restore a kept weights version in place (admin key); the feedback trained after it
        is rejected."""
        from reclaim.online.trainer import VersionNotKept

        check_json(request)
        colocated = learner_or_refuse()
        if state.admin_key is None:
            raise APIError(403, "rolling weights back needs the admin key; start the server with "
                           "--admin-key (or RECLAIM_ADMIN_KEY)")
        if not caller_of(request).admin:
            raise APIError(403, "rolling weights back needs the admin key; send 'Authorization: "
                           "Bearer <admin key>'")
        req = parse(await read_body(request, limits.max_body_bytes), RollbackRequest)
        try:
            undone = await between_steps(lambda: colocated.rollback(req.version))
        except VersionNotKept as exc:
            raise APIError(404, str(exc), param="version", code="version_not_found") from exc
        return {"object": "weights.rollback", "version": req.version, "undone": undone,
                "weights_version": runner.engine.weights_version}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(name) for name in limits.model_names]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id not in limits.model_names:
            raise APIError(404, f"model {model_id!r} is not served here; available: "
                           f"{list(limits.model_names)}", param="model", code="model_not_found")
        return model_card(model_id)

    async def in_prep(fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(prep, fn, *args)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        check_json(request)
        raw = await read_body(request, limits.max_body_bytes)
        return await in_prep(tokenize_body, raw, tokenizer, limits)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        check_json(request)
        raw = await read_body(request, limits.max_body_bytes)
        return await in_prep(detokenize_body, raw, tokenizer, limits)

    @app.get("/version")
    async def version():
        return {"version": package_version()}

    @app.get("/health")
    async def health():
        if not runner.alive:
            raise APIError(503, "the engine loop is not running")
        return {"status": "ok", "weights_version": runner.engine.weights_version}

    @app.get("/metrics")
    async def metrics_route():
        s = runner.stats
        metrics.running.set(s.get("running", 0))
        metrics.waiting.set(s.get("waiting", 0))
        metrics.kv_used.set(s.get("kv_blocks_used", 0))
        metrics.kv_total.set(s.get("kv_blocks_total", 0))
        metrics.weights_version.set(runner.engine.weights_version)
        metrics.preemptions.set_total(s.get("num_preemptions", 0))
        verifies, drafted, accepted = (s.get(f"spec_{k}", 0) for k in ("verifies", "drafted", "accepted"))
        metrics.spec_verifies.set_total(verifies)
        metrics.spec_drafted.set_total(drafted)
        metrics.spec_accepted.set_total(accepted)
        metrics.spec_plain.set_total(s.get("spec_plain_decodes", 0))
        metrics.spec_accept_rate.set(accepted / drafted if drafted else 0.0)
        metrics.spec_tau.set((accepted + verifies) / verifies if verifies else 0.0)
        if runner.learner is not None:
            for name, value in runner.learner.metrics().items():
                if isinstance(value, (int, float)):
                    metrics.online.values[(name,)] = float(value)
        return PlainTextResponse(metrics.render(), media_type=CONTENT_TYPE)

    return app
