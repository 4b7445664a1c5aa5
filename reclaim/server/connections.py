"""Connection limits: a cap on open connections and deadlines for a request's headers and body.

uvicorn's keep-alive timeout starts only after a response, so a connection that never finishes
its first request's headers stays open forever, and h11 bounds sizes, not time. This subclass of
uvicorn's h11 protocol arms one deadline per phase: the headers must arrive within
`header_timeout` of the connection opening (or of the previous response ending), then the body
within `body_timeout`; no deadline runs while the app answers. Connections over the cap get a
503 with Retry-After. Malformed HTTP gets an OpenAI-style JSON 400 instead of plain text.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from reclaim.server.errors import APIError
from reclaim.server.metrics import ServerMetrics

log = logging.getLogger("reclaim.server")

ACCEPT_ERROR = "socket.accept() out of system resource"


@dataclass
class ConnectionLimits:
    """How many connections the server holds and how long a client may take to send a request."""

    max_connections: int = 1024  # open connections; over it, requests get 503 + Retry-After
    header_timeout: float = 10.0  # seconds from connect (or the last response) to the headers
    body_timeout: float = 30.0  # seconds from the headers to the end of the body
    keep_alive: float = 5.0  # idle seconds between requests on one connection
    retry_after: int = 1  # seconds a 503 asks the client to wait

    def __post_init__(self) -> None:
        for name in ("max_connections", "header_timeout", "body_timeout", "keep_alive"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name}={value!r} is invalid; allowed: a number > 0")


def _json_error(error: APIError, *extra: tuple[bytes, bytes]) -> tuple[list, bytes]:
    """Headers and body of an OpenAI-style error answered on a connection about to close."""
    body = json.dumps(error.body()).encode()
    return [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"), *extra], body


def _busy_app(limits: ConnectionLimits) -> Any:
    """The ASGI app a connection over the cap gets: 503, Retry-After, close."""
    headers, body = _json_error(
        APIError(503, f"the server holds {limits.max_connections} connections, its limit "
                 f"(--limit-concurrency); retry after {limits.retry_after} s"),
        (b"retry-after", str(limits.retry_after).encode()))

    async def busy(scope: dict, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return busy


def guarded_protocol(limits: ConnectionLimits,
                     metrics: ServerMetrics | None = None) -> type[H11Protocol]:
    """uvicorn's h11 protocol class with `limits` applied (pass it as `Config(http=...)`)."""
    busy = _busy_app(limits)

    def count(reason: str) -> None:
        if metrics is not None:
            metrics.connections_closed.inc(1, (reason,))

    class GuardedH11Protocol(H11Protocol):
        _timer: asyncio.TimerHandle | None = None
        _phase: str | None = None
        over_cap = False

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.over_cap = len(self.connections) > limits.max_connections
            if self.over_cap:
                self.app = busy
                count("over_limit")
            self._watch()

        def connection_lost(self, exc: Exception | None) -> None:
            self._arm(None)
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            self._watch()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._watch()

        def _watch(self) -> None:
            """Arm the deadline of the phase the request is in: headers, body, or none."""
            if self.transport.is_closing():
                return self._arm(None)
            state = self.conn.their_state
            self._arm("header" if state is h11.IDLE else "body" if state is h11.SEND_BODY
                      else None)

        def _arm(self, phase: str | None) -> None:
            if phase == self._phase:
                return  # the deadline runs from the phase's start: trickled bytes don't reset it
            if self._timer is not None:
                self._timer.cancel()
            self._phase, self._timer = phase, None
            if phase is not None:
                timeout = limits.header_timeout if phase == "header" else limits.body_timeout
                if self.over_cap:  # it only gets a 503; don't let it hold a descriptor long
                    timeout = min(timeout, 1.0)
                self._timer = self.loop.call_later(timeout, self._expire, phase, timeout)

        def _expire(self, phase: str, timeout: float) -> None:
            self._timer = None
            if self.transport.is_closing():
                return
            count(f"{phase}_timeout")
            log.debug("closing %s: no complete request %s within %.1f s", self.client, phase,
                      timeout)
            if phase == "header" and self.conn.trailing_data[0]:  # a request was begun
                self._answer(APIError(408, f"the request headers did not arrive within "
                                           f"{timeout:g} s"), b"Request Timeout")
            self.transport.close()

        def send_400_response(self, msg: str) -> None:
            self._answer(APIError(400, "malformed HTTP request; this server speaks HTTP/1.1"),
                         b"Bad Request")
            self.transport.close()

        def _answer(self, error: APIError, reason: bytes) -> None:
            """Write `error` straight through h11, if no response has started yet."""
            if self.conn.our_state is not h11.IDLE:
                return
            headers, body = _json_error(error)
            try:
                for event in (h11.Response(status_code=error.status, headers=headers,
                                           reason=reason),
                              h11.Data(data=body), h11.EndOfMessage()):
                    self.transport.write(self.conn.send(event))
            except h11.LocalProtocolError:
                pass  # h11 cannot answer in this state; closing is all that is left

    return GuardedH11Protocol


class Throttle:
    """Lets an event through at most once per `every_s` seconds; `__call__` returns how many were
    held back since the last one let through, or None to hold this one back."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s, self.last, self.held = every_s, -math.inf, 0

    def __call__(self) -> int | None:
        now = time.monotonic()
        if now - self.last < self.every_s:
            self.held += 1
            return None
        held, self.last, self.held = self.held, now, 0
        return held


def quiet_accept_errors(loop: asyncio.AbstractEventLoop, every_s: float = 10.0) -> None:
    """Log 'socket.accept() out of system resource' at most once per `every_s` seconds (with how
    many were left out); asyncio would log it, with a traceback, on every failed accept."""
    previous = loop.get_exception_handler()
    throttle = Throttle(every_s)

    def handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        if context.get("message") != ACCEPT_ERROR:
            if previous is not None:
                return previous(loop, context)
            return loop.default_exception_handler(context)
        held = throttle()
        if held is not None:
            log.error("cannot accept connections: %s (%d more in the last %g s); raise the file "
                      "limit (ulimit -n) or lower --limit-concurrency", context.get("exception"),
                      held, every_s)

    loop.set_exception_handler(handler)


class QuietInvalidHTTP(logging.Filter):
    """uvicorn warns once per malformed request; let one warning through per 10 s, with a count."""

    MESSAGE = "Invalid HTTP request received."

    def __init__(self, every_s: float = 10.0) -> None:
        super().__init__()
        self.throttle, self.every_s = Throttle(every_s), every_s

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != self.MESSAGE:
            return True
        held = self.throttle()
        if held:
            record.msg = f"{self.MESSAGE} ({held} more in the last {self.every_s:g} s)"
        return held is not None

    @classmethod
    def install(cls) -> None:
        """Add the filter to uvicorn's error logger once per process."""
        logger = logging.getLogger("uvicorn.error")
        if not any(isinstance(f, cls) for f in logger.filters):
            logger.addFilter(cls())
