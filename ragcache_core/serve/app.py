"""`create_app(settings)`: the FastAPI app of one `ragcache serve` process (no module-level app).

Startup (the lifespan): take the engine lock (owner.py: one process per server), build the
cache (a `RAGCache` over `--index`, ~25 s on CPU, in a worker thread), the tokenizer-side
renderer, the bounded queue and the server's metrics. Shutdown: refuse new requests (503),
then close the cache (engine stopped, shared-memory host pool removed). Draining requests in
flight happens before, in the runner (uvicorn's graceful shutdown, `drain_timeout_s`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI

from ragcache_core.serve import routes_openai, routes_ops, routes_rag
from ragcache_core.serve.auth import ApiKeyMiddleware
from ragcache_core.serve.errors import install_handlers
from ragcache_core.serve.jobs import GenerationDefaults
from ragcache_core.serve.metrics import ServeMetrics
from ragcache_core.serve.owner import sole_owner
from ragcache_core.serve.prompts import PromptRenderer
from ragcache_core.serve.queue import BoundedQueue
from ragcache_core.serve.settings import ServeSettings
from ragcache_core.serve.state import CacheFactory, ServableCache, ServeState

logger = logging.getLogger(__name__)


def create_app(settings: ServeSettings, *, cache_factory: CacheFactory | None = None) -> FastAPI:
    """The app for `settings`. `cache_factory` builds the cache at startup (default: a
    `RAGCache` over `settings.index`); the app closes it at shutdown."""
    factory = cache_factory or build_ragcache

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        with sole_owner(settings.host, settings.port):
            state = await asyncio.to_thread(build_state, settings, factory)
            app.state.serve = state
            logger.info("ready on http://%s:%s", settings.host, settings.port)
            try:
                yield
            finally:
                state.queue.close()
                await asyncio.to_thread(state.cache.close)
                state.renderer_thread.shutdown(wait=False)

    app = FastAPI(title="RAGCache", lifespan=lifespan)
    if settings.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    install_handlers(app)
    for routes in (routes_ops, routes_openai, routes_rag):
        app.include_router(routes.router())
    return app


def build_state(settings: ServeSettings, factory: CacheFactory) -> ServeState:
    """Everything the routes use, with the cache built by `factory` (blocking)."""
    from transformers import AutoTokenizer

    cache = factory(settings)
    try:
        config = cache.config
        assert config.dtype is not None  # resolved by the cache
        tokenizer = AutoTokenizer.from_pretrained(settings.model)
        renderer = PromptRenderer(tokenizer, config.prompt, settings.model, config.dtype)
        queue = BoundedQueue(config.max_num_seqs + settings.max_waiting, config.max_num_seqs)
        return ServeState(
            settings=settings,
            cache=cache,
            renderer=renderer,
            defaults=GenerationDefaults.of_model(settings.model),
            queue=queue,
            metrics=ServeMetrics(queue),
            has_index=settings.index is not None,
        )
    except BaseException:
        cache.close()
        raise


def build_ragcache(settings: ServeSettings) -> ServableCache:
    """The default cache: a `RAGCache` over the model, searching `settings.index`."""
    from ragcache_core.controller import RAGCache
    from ragcache_core.retrieval.index_store import LocalIndex

    search = LocalIndex.load(settings.index).source() if settings.index is not None else None
    return RAGCache(settings.model, settings.config, search=search)
