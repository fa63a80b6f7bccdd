"""A request's life on the wire: server-sent events, queue places, client disconnects.

- `PlacedStream`: an SSE response holding a place in the bounded queue until it has ended,
  however it ends (finished, failed, or the client went away: Starlette cancels the body
  iterator on `http.disconnect`, which closes the cache's stream, which aborts the request in
  vLLM and the tree; see bridges.astream_from).
- `until_disconnect`: a non-streamed request cancelled when its client disconnects (the
  pattern of vLLM's `with_cancellation`): its work is cancelled the same way.
- `final_result`: the `QueryResult` at a cache stream's end (the stream closed, and so its
  request aborted, on every path).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ragcache_core.errors import RAGCacheError
from ragcache_core.results import QueryResult, StreamChunk
from ragcache_core.serve.errors import ServeError
from ragcache_core.serve.queue import Place

T = TypeVar("T")

DONE = "data: [DONE]\n\n"


def event(data: dict[str, Any]) -> str:
    """One server-sent event carrying `data` as JSON."""
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


class ClientGone(ServeError):
    """The client disconnected before its response (499, never delivered)."""

    def __init__(self) -> None:
        super().__init__(499, "the client closed the request")


class PlacedStream(StreamingResponse):
    """An SSE response that releases its queue place (and closes its events) when it ends.
    `on_end(completed)` tells whether the events ran to their end."""

    def __init__(
        self,
        events: AsyncIterator[str],
        place: Place,
        on_end: Callable[[bool], None],
    ) -> None:
        self._events = events
        self._place = place
        self._on_end = on_end
        self._completed = False
        super().__init__(
            self._tracked(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def _tracked(self) -> AsyncIterator[str]:
        async for item in self._events:
            yield item
        self._completed = True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Cancelled before the first event, a generator's body never ran: close it anyway.
            with contextlib.suppress(Exception):
                await self._events.aclose()  # type: ignore[attr-defined]
            self._place.release()
            self._on_end(self._completed)


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or `ClientGone` once the client disconnected (`work` is cancelled)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _disconnected(request: Request) -> None:
    # The body has been read (FastAPI parsed it), so receive() now only reports a disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def final_result(chunks: AsyncIterator[StreamChunk]) -> QueryResult:
    """The `QueryResult` at the end of a cache stream (the stream is closed on every path)."""
    async with contextlib.aclosing(chunks):  # type: ignore[type-var]
        async for chunk in chunks:
            if chunk.result is not None:
                return chunk.result
    raise RAGCacheError("the answer's stream ended without a result")
