"""`RAGCacheAPI`: the one interface an application codes against, in process or over HTTP.

Two classes satisfy it:

    RAGCache          (controller.py)     the engine, the tree and the pools in this process
    RAGCacheClient    (serve/client.py)   a `ragcache serve` process shared by many apps

The framework integrations (`ragcache_integrations`) accept either: they call the methods
below and read `config` (the prompt the cache renders, the default sampling and top-k) and
`model`. One difference is inherent: a `SearchSource` is Python code in the caller's process,
so `RAGCacheClient` runs it locally and sends the final documents (no speculation across the
wire); without `search=` the server searches its own `--index`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ragcache_core.config import CacheConfig, SamplingConfig
from ragcache_core.documents import Document
from ragcache_core.results import QueryResult, StreamChunk
from ragcache_core.retrieval.source import SearchSource

__all__ = ["RAGCacheAPI"]


@runtime_checkable
class RAGCacheAPI(Protocol):
    """What `RAGCache` and `RAGCacheClient` both offer (see the module docstring).

    Every call raises `InputError` for bad input (an empty question, documents that are not
    `Document`s, a prompt longer than the context) and `RAGCacheError` when the request failed
    (timed out, lost its engine, or the server refused it); nothing already cached is harmed.
    """

    @property
    def config(self) -> CacheConfig:
        """The cache's settings (the prompt it renders, default sampling and top-k)."""
        ...

    @property
    def model(self) -> str:
        """The model's name (a folder path in process; the served name over HTTP)."""
        ...

    async def aquery(
        self,
        question: str,
        *,
        search: SearchSource | None = None,
        top_k: int | None = None,
        sampling: SamplingConfig | None = None,
    ) -> QueryResult:
        """Retrieve the top-k documents for `question` and answer with them."""
        ...

    def query(
        self,
        question: str,
        *,
        search: SearchSource | None = None,
        top_k: int | None = None,
        sampling: SamplingConfig | None = None,
    ) -> QueryResult:
        """Blocking `aquery`."""
        ...

    async def agenerate(
        self,
        question: str,
        documents: Sequence[Document],
        *,
        sampling: SamplingConfig | None = None,
    ) -> QueryResult:
        """Answer with documents the caller already has (no retrieval)."""
        ...

    def generate(
        self,
        question: str,
        documents: Sequence[Document],
        *,
        sampling: SamplingConfig | None = None,
    ) -> QueryResult:
        """Blocking `agenerate`."""
        ...

    def astream(
        self,
        question: str,
        *,
        documents: Sequence[Document] | None = None,
        search: SearchSource | None = None,
        top_k: int | None = None,
        sampling: SamplingConfig | None = None,
    ) -> AsyncIterator[StreamChunk]:
        """Stream the answer as text deltas; the last chunk carries the `QueryResult`.
        With `documents` no retrieval runs. Closing the iterator early aborts the request."""
        ...

    def stream(
        self,
        question: str,
        *,
        documents: Sequence[Document] | None = None,
        search: SearchSource | None = None,
        top_k: int | None = None,
        sampling: SamplingConfig | None = None,
    ) -> Iterator[StreamChunk]:
        """Blocking `astream`."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counters (hits per tier, tokens saved, TTFT) and tree occupancy."""
        ...

    def invalidate(self, doc_id: str) -> int:
        """Drop every cached node of `doc_id`; returns the number of nodes dropped."""
        ...


if TYPE_CHECKING:
    # mypy checks here that both implementations satisfy the protocol.
    from ragcache_core.controller import RAGCache
    from ragcache_core.serve.client import RAGCacheClient

    def _in_process(cache: RAGCache) -> RAGCacheAPI:
        return cache

    def _over_http(client: RAGCacheClient) -> RAGCacheAPI:
        return client
