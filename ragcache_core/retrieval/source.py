"""Search sources: question in, documents out, stage by stage (what the controller consumes).

A `SearchSource` wraps an embedder, a staged index and a document store. `search_stages(question,
k)` is a plain iterator of `StageResult`s; each `next()` runs one stage (Faiss releases the GIL),
so `astages()` runs it in a worker thread and the event loop keeps generating meanwhile. The last
result (`is_last=True`) is the final top-k.

Sources:
- `StagedSource`: embed + `StagedSearch` + row -> `Document` lookup (our own index, and the
  LlamaIndex / LangChain Faiss adapters).
- `CallableSource`: any store through its own query function, one stage (cannot speculate; it
  logs that once).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from ragcache_core.documents import Document
from ragcache_core.errors import InputError, RAGCacheError
from ragcache_core.retrieval.base import StagedSearch

logger = logging.getLogger(__name__)


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


class StagedSource:
    """Embedder + staged index + document lookup, as a `SearchSource`.

    `embed_query(question)` returns the query vector [dimension]; `documents_for(rows)` maps
    index rows to documents (it must be safe to call from a worker thread).
    """

    def __init__(
        self,
        embed_query: Callable[[str], npt.ArrayLike],
        staged: StagedSearch,
        documents_for: Callable[[Sequence[int]], Sequence[Document]],
    ) -> None:
        self._embed_query = embed_query
        self.staged = staged
        self._documents_for = documents_for

    @property
    def can_speculate(self) -> bool:
        return self.staged.can_speculate

    def search_stages(self, question: str, k: int) -> Iterator[StageResult]:
        check_query(question, k)
        return self._stages(question, k)

    def _stages(self, question: str, k: int) -> Iterator[StageResult]:
        start = time.perf_counter()
        vector = np.asarray(self._embed_query(question), dtype=np.float32)  # [d]
        for stage in self.staged.stages(vector.reshape(1, -1), k):
            rows = [int(r) for r in stage.ids[0]]
            documents = tuple(self._documents_for(rows))
            if len(documents) != len(rows):
                raise RAGCacheError(f"document lookup returned {len(documents)} of {len(rows)}")
            yield StageResult(
                documents=documents,
                scores=tuple(float(s) for s in stage.scores[0]),
                stage=stage.index,
                is_last=stage.is_last,
                elapsed_s=time.perf_counter() - start,
            )


class CallableSource:
    """A single-stage source over any store's own query function (no speculation).

    `search(question, k)` returns (document, score) pairs best first. The first search logs, once
    per source, that this store cannot be searched in stages.
    """

    def __init__(self, search: Callable[[str, int], Sequence[tuple[Document, float]]], name: str):
        self._search = search
        self.name = name
        self._warned = False

    @property
    def can_speculate(self) -> bool:
        return False

    def search_stages(self, question: str, k: int) -> Iterator[StageResult]:
        check_query(question, k)
        return self._stages(question, k)

    def _stages(self, question: str, k: int) -> Iterator[StageResult]:
        if not self._warned:
            self._warned = True
            logger.info(
                "%s cannot be searched in stages: retrieval runs as one step (no speculation)",
                self.name,
            )
        start = time.perf_counter()
        hits = list(self._search(question, k))
        yield StageResult(
            documents=tuple(d for d, _ in hits),
            scores=tuple(float(s) for _, s in hits),
            stage=0,
            is_last=True,
            elapsed_s=time.perf_counter() - start,
        )


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
