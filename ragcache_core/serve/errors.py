"""HTTP errors in OpenAI's shape, as `vllm serve` answers them:

    {"error": {"message": "...", "type": "BadRequestError", "param": "documents.0.text",
               "code": 400}}

`ServeError` is raised by routes; `install_handlers` maps it, FastAPI's validation errors (a
malformed body: 400 naming the field, as vLLM turns FastAPI's 422 into 400), RAGCache's
`InputError` (400) and its other errors (500) to that shape.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from ragcache_core.errors import InputError, RAGCacheError

logger = logging.getLogger(__name__)

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class ServeError(Exception):
    """An HTTP error with a message that names the problem (and the field, `param`)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """The JSON of an error (also sent as the last event of a stream that failed)."""
    kind = _TYPES.get(status, HTTPStatus(status).phrase.replace(" ", ""))
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def bad_request(message: str, param: str | None = None) -> ServeError:
    return ServeError(400, message, param=param)


def as_serve_error(exc: BaseException, param: str | None = None) -> ServeError:
    """RAGCache's errors as HTTP ones: bad input 400 (naming `param`), the rest 500."""
    if isinstance(exc, ServeError):
        return exc
    if isinstance(exc, InputError):
        return bad_request(str(exc), param)
    if isinstance(exc, RAGCacheError):
        return ServeError(500, str(exc))
    logger.exception("unexpected error in a request", exc_info=exc)
    return ServeError(500, f"internal error: {type(exc).__name__}")


def field_path(loc: Sequence[Any]) -> str:
    """A pydantic error location as a dotted field name (`body` dropped)."""
    parts = [str(p) for p in loc]
    if parts and parts[0] == "body":
        parts = parts[1:]
    return ".".join(parts) or "body"


def validation_message(errors: Sequence[Any]) -> tuple[str, str]:
    """(message, param) for pydantic's errors: the first one, named by its field."""
    if not errors:
        return "the request body is invalid", "body"
    first = errors[0]
    param = field_path(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON: {first.get('msg', '')}", "body"
    message = f"{param}: {first.get('msg', 'invalid')}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error(s))"
    return message, param


def install_handlers(app: FastAPI) -> None:
    """Every error leaves as OpenAI-shaped JSON."""

    async def on_serve_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ServeError)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        message, param = validation_message(exc.errors())
        return JSONResponse(error_body(400, message, param), status_code=400)

    async def on_ragcache_error(request: Request, exc: Exception) -> JSONResponse:
        error = as_serve_error(exc)
        return JSONResponse(error.body(), status_code=error.status)

    app.add_exception_handler(ServeError, on_serve_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(RAGCacheError, on_ragcache_error)
