"""What a search source is: a question in, documents out, stage by stage.

The shared types of retrieval, light enough for every layer (the client and the
integrations included; no numpy): `StageResult`, the `SearchSource` protocol the runtime
consumes, `check_query`, `final_result` and `astages` (a source's stages on the event loop).
The sources themselves (`StagedSource` over a Faiss index, `CallableSource` over any store)
are in `ragcache_core.retrieval`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ragcache_core.documents import Document
from ragcache_core.errors import InputError, RAGCacheError


@dataclass(frozen=True)
class StageResult:
    """One question's top-k after one search stage, best first."""

    documents: tuple[Document, ...]
    scores: tuple[float, ...]
    stage: int  # 0-based
    is_last: bool
    elapsed_s: float  # since the search started (embedding included)

    @property
    def doc_ids(self) -> tuple[str, ...]:
        return tuple(d.id for d in self.documents)


@runtime_checkable
class SearchSource(Protocol):
    """Where a request's documents come from. Implementations are safe to share across threads."""

    @property
    def can_speculate(self) -> bool:
        """False when `search_stages` always yields a single stage."""
        ...

    def search_stages(self, question: str, k: int) -> Iterator[StageResult]:
        """Yield the current top-k after each stage; the last has `is_last=True`.

        Raises `InputError` for an empty question or a bad k (before the first stage).
        """
        ...


def check_query(question: object, k: object) -> None:
    """Raise `InputError` unless `question` is a non-empty string and `k` a positive int."""
    if not isinstance(question, str) or not question.strip():
        raise InputError(f"the question must be a non-empty string, got {question!r}")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise InputError(f"top-k must be a positive integer, got {k!r}")


def final_result(source: SearchSource, question: str, k: int) -> StageResult:
    """Run every stage and return the last one."""
    for result in source.search_stages(question, k):
        if result.is_last:
            return result
    raise RAGCacheError("the search source ended without a last stage")


async def astages(source: SearchSource, question: str, k: int) -> AsyncIterator[StageResult]:
    """Async view of `search_stages`: the whole search runs in one worker thread (Faiss releases
    the GIL) and hands each stage to the event loop as soon as it is ready, so the loop keeps
    generating meanwhile. One thread hop per search, not one per stage. Leaving the iteration
    early stops the search after its current stage."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[StageResult | BaseException | None] = asyncio.Queue()
    stop = threading.Event()

    def produce() -> None:
        try:
            for stage in source.search_stages(question, k):
                loop.call_soon_threadsafe(queue.put_nowait, stage)
                if stop.is_set():
                    break
        except BaseException as exc:  # handed to the consumer
            loop.call_soon_threadsafe(queue.put_nowait, exc)
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, None)

    worker = loop.run_in_executor(None, produce)
    try:
        while (item := await queue.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        await asyncio.shield(worker)
