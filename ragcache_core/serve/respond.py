"""Answering one request that holds a queue place: whole (JSON) or streamed (SSE), with its
outcome counted. Shared by the OpenAI routes and `/v1/rag/query`.

A whole answer's work is cancelled if the client disconnects; a failure becomes the OpenAI
error JSON (400 for bad input, naming `param`; 500 otherwise). A streamed answer has sent its
status line before it fails, so its failure is its last event (`{"error": ...}`), then
`[DONE]`, as `vllm serve` does.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse

from ragcache_core.serve.errors import as_serve_error
from ragcache_core.serve.queue import Place
from ragcache_core.serve.state import ServeState
from ragcache_core.serve.streams import DONE, ClientGone, PlacedStream, event, until_disconnect

T = TypeVar("T")


async def whole(
    state: ServeState,
    request: Request,
    route: str,
    place: Place,
    work: Awaitable[T],
    render: Callable[[T], dict[str, Any]],
    param: str | None,
) -> JSONResponse:
    """`render(await work)` as JSON; the place is released on every path."""
    started = time.perf_counter()
    try:
        result = await until_disconnect(request, work)
    except ClientGone:
        state.metrics.disconnects.labels(route).inc()
        state.metrics.answered(route, 499, time.perf_counter() - started)
        raise
    except Exception as exc:
        error = as_serve_error(exc, param)
        state.metrics.answered(route, error.status, time.perf_counter() - started)
        raise error from exc
    finally:
        place.release()
    state.metrics.answered(route, 200, time.perf_counter() - started)
    return JSONResponse(render(result))


def streamed(
    state: ServeState,
    route: str,
    place: Place,
    events: AsyncIterator[str],
    param: str | None,
) -> PlacedStream:
    """`events` as SSE, a failure as the last event, then `[DONE]`. The outcome is counted
    with the failure's status (the 200 already sent cannot be taken back, the metric can)."""
    started = time.perf_counter()
    failed: list[int] = []  # the status of the failure that ended the stream, if any

    def ended(completed: bool) -> None:
        if not completed:
            state.metrics.disconnects.labels(route).inc()
        status = (failed[0] if failed else 200) if completed else 499
        state.metrics.answered(route, status, time.perf_counter() - started)

    return PlacedStream(_closed_by_done(events, param, failed), place, ended)


async def _closed_by_done(
    events: AsyncIterator[str], param: str | None, failed: list[int]
) -> AsyncIterator[str]:
    try:
        async for item in events:
            yield item
    except Exception as exc:  # the status line is out: the error is the stream's last event
        error = as_serve_error(exc, param)
        failed.append(error.status)
        yield event(error.body())
    finally:
        await events.aclose()  # type: ignore[attr-defined]
    yield DONE
