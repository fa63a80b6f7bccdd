"""Search sources: question in, documents out, stage by stage (what the runtime consumes).

A `SearchSource` wraps an embedder, a staged index and a document store. `search_stages(question,
k)` is a plain iterator of `StageResult`s; each `next()` runs one stage (Faiss releases the GIL),
so `astages()` runs it in a worker thread and the event loop keeps generating meanwhile. The last
result (`is_last=True`) is the final top-k.

Sources (each a `SourceFrame`: the query checked at the call, the stages a lazy iterator):
- `StagedSource`: embed + `StagedSearch` + row -> `Document` lookup (our own index, and the
  LlamaIndex / LangChain Faiss adapters).
- `CallableSource`: any store through its own query function, one stage (cannot speculate; it
  logs that once).
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import numpy.typing as npt

from ragcache_core.documents import Document
from ragcache_core.errors import RAGCacheError
from ragcache_core.retrieval.base import StagedSearch
from ragcache_core.search import StageResult, check_query

logger = logging.getLogger(__name__)


class SourceFrame(ABC):
    """The frame of a `SearchSource` here: `search_stages` checks the question and k when it is
    called (an `InputError` before any stage runs), then returns `_stages`, the subclass's
    generator, which runs a stage per `next()`. `can_speculate` is the staged search's, for a
    subclass that sets `staged`."""

    staged: StagedSearch

    @property
    def can_speculate(self) -> bool:
        return self.staged.can_speculate

    def search_stages(self, question: str, k: int) -> Iterator[StageResult]:
        check_query(question, k)
        return self._stages(question, k)

    @abstractmethod
    def _stages(self, question: str, k: int) -> Iterator[StageResult]:
        """The stages of one checked query, the last with `is_last=True`."""


class StagedSource(SourceFrame):
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


class CallableSource(SourceFrame):
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
