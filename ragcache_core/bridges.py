"""From RAGCache's private event loop to its callers: one body per call, async first.

Every engine and tree operation runs on one `LoopThread`. A call's body is one coroutine on it;
the async API awaits it from the caller's loop (`LoopThread.arun`), the sync API blocks on it
(`LoopThread.run`). A streamed answer is produced on the private loop and pushed to the
caller's loop (`astream_from`); the blocking `stream` iterates that same async stream, driven
from the private loop (`iterate_on`), so there is one stream body.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

from ragcache_core.config import SamplingConfig
from ragcache_core.documents import Document
from ragcache_core.pipeline.loop import LoopThread
from ragcache_core.results import QueryResult, StreamChunk
from ragcache_core.retrieval.source import SearchSource

T = TypeVar("T")

Emit = Callable[[StreamChunk], None]
"""Where a generation sends the text deltas of its answer as they come."""

Work = Callable[[Emit], Coroutine[Any, Any, QueryResult]]
"""A request's body on the private loop: it emits deltas and returns the result."""

_Item = StreamChunk | BaseException | None
"""What a stream's producer hands its consumer: a chunk, the error, or None at the end."""


async def relay(task: asyncio.Task[T], chunks: asyncio.Queue[StreamChunk], emit: Emit) -> T:
    """Forward `chunks` to `emit` as they arrive until `task` ends, then the rest; return the
    task's result (raising its error). Used to adopt a speculative generation mid-answer."""
    while not task.done():
        getter = asyncio.ensure_future(chunks.get())
        try:
            await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            got = getter.done()
            if not got:
                getter.cancel()  # a cancelled get leaves its item in the queue
        if got:
            emit(getter.result())
    while not chunks.empty():
        emit(chunks.get_nowait())
    return task.result()


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
        loop.run(close())


class LoopCalls(abc.ABC):
    """`aquery`/`query`, `agenerate`/`generate`, `astream`/`stream`, written once over two
    async bodies that run on `self._loop` (module docstring). The sync calls block on the
    private loop, so they also work where the caller's thread runs an event loop (notebooks)."""

    _loop: LoopThread

    @abc.abstractmethod
    async def _query(
        self,
        question: str,
        search: SearchSource | None,
        top_k: int | None,
        sampling: SamplingConfig | None,
        emit: Emit | None,
    ) -> QueryResult:
        """Retrieve for `question` (with `search`, else the default source) and answer."""

    @abc.abstractmethod
    async def _answer(
        self,
        question: str,
        documents: Sequence[Document],
        sampling: SamplingConfig | None,
        emit: Emit | None,
    ) -> QueryResult:
        """Answer with the caller's `documents`."""

    async def aquery(
        self,
        question: str,
        *,
        search: SearchSource | None = None,
        top_k: int | None = None,
        sampling: SamplingConfig | None = None,
    ) -> QueryResult:
        """Retrieve the top-k documents for `question` and answer with them."""
        return await self._loop.arun(self._query(question, search, top_k, sampling, None))

    def query(
        self,
        question: str,
        *,
        search: SearchSource | None = None,
        top_k: int | None = None,
        sampling: SamplingConfig | None = None,
    ) -> QueryResult:
        """Blocking `aquery`."""
        return self._loop.run(self._query(question, search, top_k, sampling, None))

    async def agenerate(
        self,
        question: str,
        documents: Sequence[Document],
        *,
        sampling: SamplingConfig | None = None,
    ) -> QueryResult:
        """Answer with documents the caller already has (no retrieval)."""
        return await self._loop.arun(self._answer(question, documents, sampling, None))

    def generate(
        self,
        question: str,
        documents: Sequence[Document],
        *,
        sampling: SamplingConfig | None = None,
    ) -> QueryResult:
        """Blocking `agenerate`."""
        return self._loop.run(self._answer(question, documents, sampling, None))

    async def astream(
        self,
        question: str,
        *,
        documents: Sequence[Document] | None = None,
        search: SearchSource | None = None,
        top_k: int | None = None,
        sampling: SamplingConfig | None = None,
    ) -> AsyncGenerator[StreamChunk, None]:
        """Stream the answer as text deltas; the last chunk carries the `QueryResult`.
        With `documents` no retrieval runs. Closing the iterator early aborts the request."""

        def work(emit: Emit) -> Any:
            if documents is not None:
                return self._answer(question, documents, sampling, emit)
            return self._query(question, search, top_k, sampling, emit)

        async for chunk in astream_from(self._loop, work):
            yield chunk

    def stream(
        self,
        question: str,
        *,
        documents: Sequence[Document] | None = None,
        search: SearchSource | None = None,
        top_k: int | None = None,
        sampling: SamplingConfig | None = None,
    ) -> Iterator[StreamChunk]:
        """Blocking `astream`: an iterator of `StreamChunk`s."""
        chunks = self.astream(
            question, documents=documents, search=search, top_k=top_k, sampling=sampling
        )
        return iterate_on(self._loop, chunks)
