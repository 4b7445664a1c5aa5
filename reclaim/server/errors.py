"""OpenAI-style error bodies, and the handlers that turn every failure into one.

A client always gets `{"error": {"message", "type", "param", "code"}}` with a fitting status; an
unexpected exception becomes a logged 500 and the server keeps serving.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("reclaim.server")

# status -> (OpenAI error type, default code)
ERROR_KINDS: dict[int, tuple[str, str | None]] = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    403: ("invalid_request_error", "permission_denied"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    408: ("invalid_request_error", "request_timeout"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "unsupported_media_type"),
    429: ("invalid_request_error", "rate_limit_exceeded"),
    500: ("server_error", "internal_error"),
    503: ("server_error", "service_unavailable"),
}


class APIError(Exception):
    """A request failure with its HTTP status and the OpenAI error fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.retry_after = retry_after  # seconds, sent as Retry-After (429, 503)
        kind, default_code = ERROR_KINDS.get(status, ("invalid_request_error", None))
        self.type, self.code = kind, code or default_code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
        return JSONResponse(self.body(), status_code=self.status, headers=headers or None)


BOUND_ERRORS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")


def allowed_range(schema: type[BaseModel], name: str) -> str | None:
    """A field's numeric bounds as text ('-1 to 2147483647', '> 0 and <= 1'), if it has any."""
    field = schema.model_fields.get(name)
    if field is None:
        return None
    bounds = {op: getattr(m, attr) for m in field.metadata
              for op, attr in ((">=", "ge"), (">", "gt"), ("<=", "le"), ("<", "lt"))
              if getattr(m, attr, None) is not None}
    if ">=" in bounds and "<=" in bounds:
        return f"{bounds['>=']} to {bounds['<=']}"
    return " and ".join(f"{op} {v}" for op, v in bounds.items()) or None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _type_tag(part: Any) -> bool:
    """Whether a location part is pydantic's name of a union member ('str', 'list[int]',
    'NamedToolChoice') rather than a field name (snake_case, as OpenAI's) or index."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "dict", "list")
                                      or "[" in part or part[:1].isupper())


def _loc(error: dict) -> list[str]:
    return [str(p) for p in error.get("loc", ()) if p != "body" and not _type_tag(p)]


def validation_error(exc: ValidationError | RequestValidationError,
                     schema: type[BaseModel] | None = None) -> APIError:
    """The first pydantic complaint as a 400 naming the offending field (and, for a number out
    of bounds, the allowed range when `schema` is given)."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body")
    first = errors[0]
    loc = _loc(first)
    param = ".".join(loc) or None
    message = first.get("msg", "invalid value").removeprefix("Value error, ")
    cause = (first.get("ctx") or {}).get("error")
    if getattr(cause, "param", None):  # a model-level check names its field itself
        return APIError(400, str(cause), param=cause.param)
    # A union's failure is one error per member at the same place: one problem, not several.
    others = len({tuple(_loc(e)) for e in errors} - {tuple(loc)})
    extra = f" ({others} more problems)" if others else ""
    allowed = allowed_range(schema, loc[0]) if schema and len(loc) == 1 and \
        first.get("type") in BOUND_ERRORS else None
    if allowed is not None:
        message = f"{param}={_short(first.get('input'))} is out of range; allowed: {allowed}"
    elif param:
        message = f"{param}: {message}"
    return APIError(400, message + extra, param=param)


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception type FastAPI can raise to an OpenAI-style JSON body."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            detail = f"no route {request.method} {request.url.path}"
        return APIError(exc.status_code, detail).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}").response()
