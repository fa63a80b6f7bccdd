"""HTTP errors in one shape, as `vllm serve` answers them, for every non-2xx response:

    {"error": {"message": "...", "type": "BadRequestError", "param": "documents.0.text",
               "code": 400}}

`ServeError` is raised by routes; `install_handlers` maps it, FastAPI's validation errors (a
malformed body: 400 naming the field, as vLLM turns FastAPI's 422 into 400), Starlette's own
HTTP errors (404 and 405 from routing, 400 for a body that is not JSON: too deeply nested or
not UTF-8, 413 from a size limit), RAGCache's `InputError` (400, naming its `param`), vLLM's
validation errors (400) and anything else (500, logged) to that shape. `require_json` refuses
a body that is not `application/json` (400, as vLLM).

`CountedResponses` (pure ASGI, outermost) counts every response in
`ragcache_serve_requests{route, status}`: the 401s of the API key, refusals, parse errors and
unknown routes (route "unmatched") included, and a streamed answer by how it ended (its
failure's status, or 499 when the client left), which a route records in the scope as
`STATUS_KEY`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ragcache_core.errors import InputError, RAGCacheError

logger = logging.getLogger(__name__)

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    499: "ClientClosedRequestError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}
NOT_JSON = "the body is not valid JSON (nested too deeply or not UTF-8)"
STATUS_KEY = "ragcache.status"
"""Scope key where a response that cannot change its status line (a stream) records how it
really ended, for `CountedResponses`."""
UNMATCHED = "unmatched"


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
    try:
        phrase = HTTPStatus(status).phrase.replace(" ", "") + "Error"
    except ValueError:
        phrase = "Error"
    kind = _TYPES.get(status, phrase)
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def bad_request(message: str, param: str | None = None) -> ServeError:
    return ServeError(400, message, param=param)


def as_serve_error(exc: BaseException, param: str | None = None) -> ServeError:
    """Errors as HTTP ones: bad input 400 (naming the error's own `param`, else `param`),
    vLLM's client errors (its validation) 400, the rest 500 (logged)."""
    if isinstance(exc, ServeError):
        return exc
    if isinstance(exc, InputError):
        return bad_request(str(exc), exc.param or param)
    if any(c.__name__ == "VLLMClientError" for c in type(exc).__mro__):
        from ragcache_core.engine.sampling import as_input_error

        error = as_input_error(exc)
        return bad_request(str(error), error.param or param)
    if isinstance(exc, RAGCacheError):
        return ServeError(500, str(exc))
    logger.error("unexpected error in a request", exc_info=exc)
    return ServeError(500, f"internal error: {type(exc).__name__}")


_BRANCH = re.compile(r"[\[\]{}()]")
_BRANCH_NAMES = frozenset(
    {
        "function-wrap",
        "function-after",
        "function-before",
        "function-plain",
        "json-or-python",
        "lax-or-strict",
        "chain",
        "default",
        "nullable",
        "tagged-union",
        "union",
        "str",
        "int",
        "float",
        "bool",
        "bytes",
        "list",
        "tuple",
        "dict",
        "set",
        "none",
        "nonetype",
    }
)


def field_path(loc: Sequence[Any]) -> str:
    """A pydantic error location as a dotted field name: `body` and pydantic's union-branch
    markers (`str`, `list[int]`, `function-after[...]`) dropped, as vLLM's
    `clean_loc_for_param` drops them; `template_documents` is the `documents` field."""
    parts = [str(p) for p in loc]
    if parts and parts[0] == "body":
        parts = parts[1:]
    kept = [p for p in parts if not (_BRANCH.search(p) or p.lower() in _BRANCH_NAMES)]
    if kept and kept[0] == "template_documents":
        kept[0] = "documents"
    return ".".join(kept) or "body"


def validation_message(errors: Sequence[Any]) -> tuple[str, str | None]:
    """(message, param) for pydantic's errors: the first one, named by its field (a
    cross-field check names its field itself, `fields.FieldError`)."""
    if not errors:
        return "the request body is invalid", "body"
    first = _best(errors)
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON: {first.get('msg', '')}", "body"
    cause = (first.get("ctx") or {}).get("error")
    own_field = getattr(cause, "field", None)
    param = own_field or field_path(first.get("loc", ()))
    text = str(cause) if own_field else str(first.get("msg", "invalid"))
    text = text.removeprefix("Value error, ")
    message = f"{param}: {text}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error(s))"
    return message, param


def _best(errors: Sequence[Any]) -> Any:
    """The first error, or, when it is one branch of a union, the branch of the type the
    client sent (a list of 5 stop strings: the list's error, not "should be a string")."""
    first = errors[0]
    param = field_path(first.get("loc", ()))
    sent = type(first.get("input")).__name__
    for error in errors:
        loc = [str(p) for p in error.get("loc", ())]
        same = field_path(loc) == param
        if same and any(p.split("[", 1)[0] == sent for p in loc if _BRANCH.search(p) or p == sent):
            return error
    return first


async def require_json(request: Request) -> None:
    """400 unless the body is `application/json` (a FastAPI dependency of the POST routes,
    run before the body is validated), as vLLM's `validate_json_request`."""
    media = request.headers.get("content-type", "").lower().split(";", 1)[0].strip()
    if media != "application/json":
        raise ServeError(400, "Unsupported Media Type: Only 'application/json' is allowed")


def install_handlers(app: FastAPI) -> None:
    """Every error leaves in the one shape."""

    async def on_serve_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ServeError)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        message, param = validation_message(exc.errors())
        return JSONResponse(error_body(400, message, param), status_code=400)

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        status, message, param = exc.status_code, str(exc.detail), None
        if status == 400 and "parsing the body" in message:
            message, param = NOT_JSON, "body"
        elif status == 404:
            message = f"no route {request.method} {request.url.path}"
        elif status == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        headers = dict(exc.headers or {})
        return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)

    async def on_other_error(request: Request, exc: Exception) -> JSONResponse:
        error = as_serve_error(exc)
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    app.add_exception_handler(ServeError, on_serve_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(RAGCacheError, on_other_error)
    app.add_exception_handler(Exception, on_other_error)


class CountedResponses:
    """Counts every response by route and status (module docstring). `count(route, status)`
    is looked up per response on the app's state (`serve.metrics.answered`), so responses
    sent while the server starts are not counted."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: list[int] = []

        async def sent(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(int(message["status"]))
            await send(message)

        try:
            await self.app(scope, receive, sent)
        except BaseException:
            if not status:
                status.append(500)  # the server's own 500 goes out after this
            raise
        finally:
            final = scope.get(STATUS_KEY) or (status[0] if status else 499)
            _count(scope, _route(scope), int(final))


def _route(scope: Scope) -> str:
    """The route's path when the app has it, else "unmatched" (bounded label values)."""
    path = str(scope.get("path", ""))
    app = scope.get("app")
    paths = {getattr(r, "path", None) for r in getattr(app, "routes", ())}
    return path if path in paths else UNMATCHED


def _count(scope: Scope, route: str, status: int) -> None:
    app = scope.get("app")
    state = getattr(getattr(app, "state", None), "serve", None)
    metrics = getattr(state, "metrics", None)
    if metrics is not None:
        metrics.answered(route, status)
