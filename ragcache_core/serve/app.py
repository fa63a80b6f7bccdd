"""One `ragcache serve` process: `create_app(settings)` (the FastAPI app; no module-level app),
its middleware, its lifespan, and `run` (uvicorn, one worker, draining on SIGTERM).

Startup (`run`, then the lifespan): bind the listening socket (serve/listen.py: the port is
held from the first moment; a taken port fails at once; port 0 takes any free one), remove
what crashed servers left (host pools and vLLM segments of processes that are gone, stale
engine locks: one line says what), start the watchdog (serve/watchdog.py: the engine dies
with this process, even on SIGKILL), take the engine lock (serve/watchdog.py: one process per
port), build the cache (a `RAGCache` over `--index`, ~25 s on CPU, in a worker thread), the
render lanes, the bounded queue and the server's metrics; then uvicorn listens on the socket
and "ready on URL" is logged, with the bound port. Shutdown: refuse new requests (503), then
close the cache (engine stopped, shared-memory host pool removed). Draining:

    SIGTERM ─► the queue refuses new requests (503) and uvicorn stops accepting connections
            ─► requests in flight finish (at most `drain_timeout_s`, then they are cancelled:
               each cancellation aborts its request in vLLM and releases its pins)
            ─► the lifespan closes the cache: engine stopped, shared-memory host pool removed

A second signal during the drain stops at once (uvicorn's force exit).

Each response carries `X-RAGCache-Replica` (serve/replicas.py, outermost). Each request
passes, outermost first: the keys (serve/auth.py: 401/403 before the body is
read), the body limit (serve/limits.py: 413/408, the body read whole), then the routes. The
header timeout sits below, in uvicorn's HTTP protocol (`guarded_protocol`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
from collections.abc import AsyncIterator
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI

from ragcache_core.runtime.prompt import PromptBuilder
from ragcache_core.serve.auth import KeyMiddleware
from ragcache_core.serve.errors import CountedResponses, install_handlers
from ragcache_core.serve.jobs import GenerationDefaults, PromptRenderer
from ragcache_core.serve.known import KnownDocuments
from ragcache_core.serve.limits import BodyLimitMiddleware, BoundedQueue, guarded_protocol
from ragcache_core.serve.listen import bind_socket, bound_port
from ragcache_core.serve.replicas import ReplicaHeaderMiddleware
from ragcache_core.serve.routes import router
from ragcache_core.serve.state import (
    CacheFactory,
    ServeMetrics,
    ServeSettings,
    ServeState,
)
from ragcache_core.serve.watchdog import Watchdog, reclaim_locks, sole_owner
from ragcache_core.storage.host_pool import shm_folder
from ragcache_core.storage.reclaim import reclaim_shared_memory

if TYPE_CHECKING:
    from ragcache_core.runtime.ragcache import RAGCache

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
            try:
                yield
            finally:
                state.queue.close()
                await asyncio.to_thread(state.cache.close)
                state.lanes.shutdown()

    app = FastAPI(title="RAGCache", lifespan=lifespan)
    # Added innermost first: the keys are checked before the body is read, and every
    # response, the 401s and 413s included, is counted.
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=settings.max_body_bytes,
        read_timeout_s=settings.read_timeout_s,
    )
    if settings.accepted_keys or settings.admin_key is not None:
        app.add_middleware(KeyMiddleware, keys=settings.accepted_keys, admin_key=settings.admin_key)
    app.add_middleware(CountedResponses)
    app.add_middleware(ReplicaHeaderMiddleware, replica_id=settings.replica_name)  # outermost
    install_handlers(app)
    app.include_router(router())
    return app


def build_state(settings: ServeSettings, factory: CacheFactory) -> ServeState:
    """Everything the routes use, with the cache built by `factory` (blocking)."""
    from transformers import AutoTokenizer

    cache = factory(settings)
    try:
        config = cache.config
        assert config.dtype is not None  # resolved by the cache
        tokenizer = AutoTokenizer.from_pretrained(settings.model)
        builder = getattr(cache, "prompts", None)  # the cache's own: one memo for both
        known = KnownDocuments()
        if settings.index is not None:
            from ragcache_core.retrieval.index_store import load_documents

            known.add_index(load_documents(settings.index))
        renderer = PromptRenderer(
            tokenizer,
            config.prompt,
            settings.model,
            config.dtype,
            max_model_len=config.max_model_len,
            builder=builder if isinstance(builder, PromptBuilder) else None,
            known=known,
        )
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


def build_ragcache(settings: ServeSettings) -> RAGCache:
    """The default cache: a `RAGCache` over the model, searching `settings.index`."""
    from ragcache_core.retrieval.index_store import LocalIndex
    from ragcache_core.runtime.ragcache import RAGCache

    search = LocalIndex.load(settings.index).source() if settings.index is not None else None
    return RAGCache(settings.model, settings.config, search=search)


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, closing the bounded queue as soon as the exit signal arrives (uvicorn
    alone would keep answering requests on open keep-alive connections while it drains), and
    saying "ready on" once it listens with the engine running."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            logger.info("ready on %s", _url(self.config.host, self.config.port))

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        state = getattr(getattr(self.config.app, "state", None), "serve", None)
        if isinstance(state, ServeState):
            state.queue.close()
            logger.info("draining %d request(s) in flight", state.queue.in_flight)
        super().handle_exit(sig, frame)


def run(settings: ServeSettings, sock: socket.socket | None = None) -> None:
    """Serve until a signal; returns after the drain and the cache's close. This process is
    the server: the port is bound first (or `sock`, bound by a supervisor, is used; its
    address wins over `settings`' host and port), what crashed servers left is reclaimed, and
    a watchdog makes sure the engine ends with this process. `ConfigError` (before any engine
    starts) if the port cannot be bound."""
    if sock is None:
        sock = bind_socket(settings.host, settings.port)
    # Port 0 became a real port: the engine lock and the replica name use it.
    settings = dataclasses.replace(settings, port=bound_port(sock))
    logger.info("bound %s; starting the engine", _url(settings.host, settings.port))
    reclaim_leftovers()
    watchdog = Watchdog.start()  # lives until this process is gone, then stops the engine
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,  # (for its messages: it serves on `sock`)
        workers=1,  # one process owns the engine
        lifespan="on",  # a failed startup (no engine) is fatal
        log_level=settings.log_level,
        timeout_graceful_shutdown=max(1, round(settings.drain_timeout_s)),
        http=guarded_protocol(settings.header_timeout_s),
    )
    try:
        _DrainingServer(config).run(sockets=[sock])
    finally:
        sock.close()
    del watchdog  # (it exits on its own once this process has ended)


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def reclaim_leftovers() -> None:
    """Remove the host pools and vLLM segments of processes that are gone and the engine
    locks nobody holds (storage/reclaim.py, serve/watchdog.py); one line says what."""
    reclaimed = reclaim_shared_memory()
    locks = reclaim_locks()
    if not (reclaimed or locks):
        return
    owners = sorted({p.name.split("-")[1] for p in reclaimed.pools})
    logger.warning(
        "reclaimed what crashed processes left in %s: %d host pool file(s) of pid(s) %s, %d "
        "vLLM shared-memory segment(s) no process uses, %.0f MiB in all; %d stale engine "
        "lock(s)",
        shm_folder(),
        len(reclaimed.pools),
        ", ".join(owners) or "-",
        len(reclaimed.segments),
        reclaimed.nbytes / 2**20,
        len(locks),
    )
