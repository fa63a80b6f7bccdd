"""RAGCache's private event loop, and the bridges from it to its callers: one body per call.

vLLM's `AsyncLLM` binds to the loop that first uses it and the knowledge tree is not
thread-safe, so all of RAGCache's work runs on one private loop (`LoopThread`). A call's body
is one coroutine on it; the async API awaits it from the caller's loop (`LoopThread.arun`), the
sync API blocks on it (`LoopThread.run`), so the sync calls also work inside notebooks whose
loop is already running. A streamed answer is produced on the private loop and pushed to the
caller's loop (`astream_from`); the blocking `stream` iterates that same async stream, driven
from the private loop (`iterate_on`), so there is one stream body.

Shared by `RAGCache` (runtime/) and `RAGCacheClient` (client/): it imports nothing heavier
than asyncio.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from concurrent.futures import CancelledError, Future
from typing import Any, TypeVar

from ragcache_core.errors import CacheClosedError
from ragcache_core.query_result import QueryResult, StreamChunk

T = TypeVar("T")

Emit = Callable[[StreamChunk], None]
"""Where a generation sends the text deltas of its answer as they come."""

Work = Callable[[Emit], Coroutine[Any, Any, QueryResult]]
"""A request's body on the private loop: it emits deltas and returns the result."""

_Item = StreamChunk | BaseException | None
"""What a stream's producer hands its consumer: a chunk, the error, or None at the end."""


class LoopThread:
    """A daemon thread running one event loop (see the module docstring).

    `owner` names what the loop serves ("RAGCache", "RAGCacheClient") in the errors it raises.
    After `stop()` every call (`run`, `arun`, `submit`) raises `CacheClosedError` without
    running its coroutine, and a call that `stop()` cut short raises it instead of a bare
    `CancelledError`.
    """

    def __init__(self, name: str = "ragcache-loop", owner: str = "RAGCache") -> None:
        self.owner = owner
        self.loop = asyncio.new_event_loop()
        self._stopping = False
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        self.loop.run_forever()

    @property
    def is_current(self) -> bool:
        return threading.current_thread() is self._thread

    @property
    def closed(self) -> bool:
        """Whether `stop()` was called: no new work is taken."""
        return self._stopping

    def closed_error(self, cut_short: bool = False) -> CacheClosedError:
        """The error a call gets once the loop is stopping (`cut_short`: the call was running)."""
        if cut_short:
            return CacheClosedError(f"the {self.owner} was closed while this call ran")
        return CacheClosedError(
            f"this {self.owner} is closed: create a new {self.owner} to run more calls"
        )

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Schedule `coro` on the loop. Raises `CacheClosedError` (and closes `coro`, unrun)
        once `stop()` was called."""
        if self._stopping:
            coro.close()
            raise self.closed_error()
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the loop and wait for it (never call from the loop's own thread)."""
        if self.is_current:
            coro.close()
            raise RuntimeError("LoopThread.run called from its own loop: await the coroutine")
        future = self.submit(coro)
        try:
            return future.result()
        except CancelledError:
            if self._stopping:
                raise self.closed_error(cut_short=True) from None
            raise

    async def arun(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await `coro` on the loop from any other loop (or directly when already on it)."""
        if self.is_current:
            if self._stopping:
                coro.close()
                raise self.closed_error()
            return await coro
        future = self.submit(coro)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if self._stopping and future.cancelled():  # not the caller's own cancellation
                raise self.closed_error(cut_short=True) from None
            raise

    def stop(self, final: Coroutine[Any, Any, Any] | None = None) -> None:
        """Take no new work, run `final` (the owner's shutdown) on the loop, then stop the
        loop. Safe to call twice (a second `final` is closed unrun)."""
        if self._stopping or not self._thread.is_alive():
            self._stopping = True
            if final is not None:
                final.close()
            return
        self._stopping = True
        try:
            if final is not None:
                asyncio.run_coroutine_threadsafe(final, self.loop).result()
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=30)
            if not self.loop.is_running():
                self.loop.close()


async def astream_from(loop: LoopThread, work: Work) -> AsyncIterator[StreamChunk]:
    """Run `work` on `loop` and yield its chunks on the caller's loop; the last chunk carries
    the `QueryResult`. Closing the iterator early cancels `work`."""
    caller = asyncio.get_running_loop()
    items: asyncio.Queue[_Item] = asyncio.Queue()

    def put(item: _Item) -> None:
        caller.call_soon_threadsafe(items.put_nowait, item)

    async def produce() -> None:
        try:
            put(StreamChunk("", await work(put)))
        except BaseException as exc:  # surfaced to the consumer
            put(exc)
        finally:
            put(None)

    future = loop.submit(produce())
    try:
        while (item := await items.get()) is not None:
            if isinstance(item, asyncio.CancelledError) and loop.closed:
                raise loop.closed_error(cut_short=True) from None
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        future.cancel()


def iterate_on(loop: LoopThread, stream: AsyncIterator[T]) -> Iterator[T]:
    """Iterate an async iterator from synchronous code: each step runs on `loop` (so this also
    works where the caller's thread runs an event loop, as in notebooks)."""

    async def step() -> tuple[bool, T | None]:
        try:
            return True, await anext(stream)
        except StopAsyncIteration:
            return False, None

    async def close() -> None:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()

    try:
        while True:
            more, item = loop.run(step())
            if not more:
                return
            yield item  # type: ignore[misc]
    finally:
        if not loop.closed:  # a closed loop cancelled the stream's work already
            loop.run(close())
