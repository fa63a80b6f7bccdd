"""What one server holds while it runs (`ServeState`, built at startup from `ServeSettings`),
and what it needs of the cache (`ServableCache`: `RAGCacheAPI` plus the uncached path, the
integrity check, the Prometheus registry and `close`; `RAGCache` is one).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from fastapi import Request

from ragcache_core.api import RAGCacheAPI
from ragcache_core.config import SamplingConfig
from ragcache_core.results import StreamChunk
from ragcache_core.serve.errors import ServeError
from ragcache_core.serve.jobs import GenerationDefaults
from ragcache_core.serve.metrics import ServeMetrics
from ragcache_core.serve.prompts import PromptRenderer
from ragcache_core.serve.queue import BoundedQueue, Place, Refusal
from ragcache_core.serve.settings import ServeSettings


class _Metrics(Protocol):
    @property
    def registry(self) -> Any: ...


class ServableCache(RAGCacheAPI, Protocol):
    """The cache a server runs over (see the module docstring)."""

    @property
    def metrics(self) -> _Metrics: ...

    def astream_uncached(
        self, prompt_ids: Sequence[int], *, sampling: SamplingConfig | None = None
    ) -> AsyncIterator[StreamChunk]: ...

    def check_integrity(self) -> None: ...

    def close(self) -> None: ...


CacheFactory = Callable[[ServeSettings], ServableCache]
T = TypeVar("T")


@dataclass
class ServeState:
    """The running server's parts. Used from the server's event loop only."""

    settings: ServeSettings
    cache: ServableCache
    renderer: PromptRenderer
    defaults: GenerationDefaults
    queue: BoundedQueue
    metrics: ServeMetrics
    has_index: bool
    started_at: float = field(default_factory=time.time)
    renderer_thread: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="ragcache-render")
    )
    """Tokenization and chat templates run here, off the event loop (one thread: the
    renderer's token caches are not thread-safe)."""

    async def render(self, work: Callable[[], T]) -> T:
        """`work()` on the renderer thread (prompt rendering and token counting)."""
        return await asyncio.get_running_loop().run_in_executor(self.renderer_thread, work)

    def check_model(self, model: str | None) -> None:
        """404 for a model this server does not serve (None: the served one), as vLLM."""
        if model is not None and model != self.settings.model_name:
            raise ServeError(404, f"the model `{model}` does not exist", param="model")

    def enter(self, route: str) -> Place:
        """A place in flight, or 429 (full: Retry-After) / 503 (shutting down)."""
        verdict = self.queue.try_enter()
        if isinstance(verdict, Place):
            return verdict
        status = _refusal_status(verdict)
        self.metrics.answered(route, status, 0.0)
        headers = {"Retry-After": str(verdict.retry_after_s)}
        if verdict.reason == "draining":
            raise ServeError(503, "the server is shutting down", headers=headers)
        raise ServeError(
            429,
            f"the server is at capacity ({self.queue.capacity} requests in flight): retry "
            f"after {verdict.retry_after_s} s",
            headers=headers,
        )


def state_of(request: Request) -> ServeState:
    state = getattr(request.app.state, "serve", None)
    if state is None:
        raise ServeError(503, "the server is starting")
    assert isinstance(state, ServeState)
    return state


def _refusal_status(refusal: Refusal) -> int:
    return 503 if refusal.reason == "draining" else 429
