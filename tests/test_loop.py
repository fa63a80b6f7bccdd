"""The private loop's bridges to callers (no engine): one async stream body, iterated from
another loop or from plain synchronous code, with errors and early exits carried across."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from ragcache_core.loop import Emit, LoopThread, astream_from, iterate_on
from ragcache_core.query_result import CacheHits, QueryResult, StreamChunk
from ragcache_core.runtime.speculation import relay


@pytest.fixture
def loop() -> Iterator[LoopThread]:
    thread = LoopThread("test-loop")
    yield thread
    thread.stop()


def _result(answer: str) -> QueryResult:
    return QueryResult(answer, (), (), 0.0, 0.0, 0.0, CacheHits(), 0)


async def _three_words(emit: Emit) -> QueryResult:
    for word in ("a", "b", "c"):
        emit(StreamChunk(word))
        await asyncio.sleep(0)
    return _result("abc")


async def _fails(emit: Emit) -> QueryResult:
    emit(StreamChunk("x"))
    raise ValueError("boom")


def test_async_and_sync_streams_share_one_body(loop: LoopThread) -> None:
    async def collect() -> list[StreamChunk]:
        return [chunk async for chunk in astream_from(loop, _three_words)]

    for chunks in (
        asyncio.run(collect()),
        list(iterate_on(loop, astream_from(loop, _three_words))),
    ):
        assert [c.delta for c in chunks] == ["a", "b", "c", ""]
        assert chunks[-1].result is not None and chunks[-1].result.answer == "abc"


def test_errors_cross_the_bridge(loop: LoopThread) -> None:
    seen = []
    with pytest.raises(ValueError, match="boom"):
        for chunk in iterate_on(loop, astream_from(loop, _fails)):
            seen.append(chunk.delta)
    assert seen == ["x"]


def test_leaving_a_stream_early_cancels_its_work(loop: LoopThread) -> None:
    finished = asyncio.Event()
    cancelled: list[bool] = []

    async def endless(emit: Emit) -> QueryResult:
        try:
            while True:
                emit(StreamChunk("."))
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        finally:
            finished.set()

    stream = iterate_on(loop, astream_from(loop, endless))
    assert next(stream).delta == "."
    stream.close()

    async def wait() -> None:
        await asyncio.wait_for(finished.wait(), 5)

    loop.run(wait())
    assert cancelled == [True]


def test_relay_forwards_buffered_then_live_chunks() -> None:
    async def main() -> tuple[list[str], str]:
        chunks: asyncio.Queue[StreamChunk] = asyncio.Queue()
        chunks.put_nowait(StreamChunk("early "))

        async def generation() -> str:
            await asyncio.sleep(0.01)
            chunks.put_nowait(StreamChunk("live"))
            await asyncio.sleep(0.01)
            return "done"

        got: list[str] = []
        result = await relay(
            asyncio.ensure_future(generation()), chunks, lambda c: got.append(c.delta)
        )
        return got, result

    got, result = asyncio.run(main())
    assert got == ["early ", "live"] and result == "done"
