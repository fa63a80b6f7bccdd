"""What one server holds while it runs (`ServeState`, built at startup from `ServeSettings`),
and what it needs of the cache (`ServableCache`: `RAGCacheAPI` plus the uncached path, the
integrity check, the Prometheus registry and `close`; `RAGCache` is one).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

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
