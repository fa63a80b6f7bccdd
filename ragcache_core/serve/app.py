"""One `ragcache serve` process: `create_app(settings)` (the FastAPI app; no module-level app),
its API-key middleware, the engine lock, and `run` (uvicorn, one worker, draining on SIGTERM).

Startup (the lifespan): take the engine lock (`sole_owner`: one process per server), build the
cache (a `RAGCache` over `--index`, ~25 s on CPU, in a worker thread), the tokenizer-side
renderer, the bounded queue and the server's metrics. Shutdown: refuse new requests (503),
then close the cache (engine stopped, shared-memory host pool removed). Draining:

    SIGTERM ─► the queue refuses new requests (503) and uvicorn stops accepting connections
            ─► requests in flight finish (at most `drain_timeout_s`, then they are cancelled:
               each cancellation aborts its request in vLLM and releases its pins)
            ─► the lifespan closes the cache: engine stopped, shared-memory host pool removed

A second signal during the drain stops at once (uvicorn's force exit).

The API key (pure ASGI middleware, as `vllm serve`'s): when the server has a key, every
`/v1/...` request needs `Authorization: Bearer <key>`, else 401. `/health` and `/metrics` stay
open for load balancers and Prometheus.

The engine lock: a second process for the same port (another uvicorn worker, a second
`ragcache serve`) is refused at startup, before it starts an engine. The lock is an exclusive
`flock` on a file beside the host pools (`/dev/shm` on Linux); the kernel drops it when the
process ends, however it ends, so a crash never leaves it held. The owner removes the file
when it stops (while still holding the lock); a process that locked a file just removed that
way sees that the path no longer names its file and tries again.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import logging
import os
import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from ragcache_core.errors import ConfigError
from ragcache_core.serve.errors import error_body, install_handlers
from ragcache_core.serve.jobs import GenerationDefaults, PromptRenderer
from ragcache_core.serve.keys import ApiKey
from ragcache_core.serve.queue import BoundedQueue
from ragcache_core.serve.routes import router
from ragcache_core.serve.state import (
    CacheFactory,
    ServeMetrics,
    ServeSettings,
    ServeState,
)
from ragcache_core.storage.host_pool import shm_folder

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
            logger.info("ready on http://%s:%s", settings.host, settings.port)
            try:
                yield
            finally:
                state.queue.close()
                await asyncio.to_thread(state.cache.close)
                state.renderer_thread.shutdown(wait=False)

    app = FastAPI(title="RAGCache", lifespan=lifespan)
    if settings.accepted_keys:
        app.add_middleware(ApiKeyMiddleware, keys=settings.accepted_keys)
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


def build_ragcache(settings: ServeSettings) -> RAGCache:
    """The default cache: a `RAGCache` over the model, searching `settings.index`."""
    from ragcache_core.retrieval.index_store import LocalIndex
    from ragcache_core.runtime.ragcache import RAGCache

    search = LocalIndex.load(settings.index).source() if settings.index is not None else None
    return RAGCache(settings.model, settings.config, search=search)


GUARDED_PREFIX = "/v1"


class ApiKeyMiddleware:
    """Bearer keys for `/v1/...`; the tenant of the key a request presented goes in its
    scope (`scope["ragcache_tenant"]`), where `ServeState.salt_for` reads it."""

    def __init__(self, app: ASGIApp, keys: tuple[ApiKey, ...]) -> None:
        self.app = app
        self._keys = [(hashlib.sha256(k.key.encode()).digest(), k.tenant) for k in keys]

    def _tenant(self, headers: Headers) -> str | None:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return None
        given = hashlib.sha256(token.strip().encode()).digest()
        tenant = None
        for digest, name in self._keys:  # every key compared, in constant time each
            if secrets.compare_digest(given, digest):
                tenant = name
        return tenant

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        guarded = (
            scope["type"] == "http"
            and scope.get("method") != "OPTIONS"
            and str(scope["path"]).startswith(GUARDED_PREFIX)
        )
        if guarded:
            tenant = self._tenant(Headers(scope=scope))
            if tenant is None:
                body = error_body(401, "a valid API key is required (Authorization: Bearer <key>)")
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
            scope["ragcache_tenant"] = tenant
        await self.app(scope, receive, send)


@contextlib.contextmanager
def sole_owner(host: str, port: int) -> Iterator[None]:
    """Hold the engine lock of `port` for the block; `ConfigError` if another process holds
    it. Keyed by the port alone: 0.0.0.0:8000 and 127.0.0.1:8000 cannot both bind, and the
    second must fail before it builds an engine. Port 0 (any free port) is never shared, so
    it takes no lock."""
    if port == 0:
        yield
        return
    path = shm_folder() / f"ragcache-serve-port-{port}.lock"
    fd = _lock(path, f"{host}:{port}")
    try:
        os.write(fd, str(os.getpid()).encode())
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        os.close(fd)  # releases the lock


def _lock(path: Path, where: str) -> int:
    """An fd holding the exclusive lock on the file `path` names now."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(
                f"another ragcache serve process already serves {where}: one process owns the "
                "engine (run one server with one worker; scale with more GPUs, not more "
                "workers)"
            ) from None
        try:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)  # the owner removed this file as we locked it: lock the new one


logger = logging.getLogger(__name__)


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, closing the bounded queue as soon as the exit signal arrives (uvicorn
    alone would keep answering requests on open keep-alive connections while it drains)."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        state = getattr(getattr(self.config.app, "state", None), "serve", None)
        if isinstance(state, ServeState):
            state.queue.close()
            logger.info("draining %d request(s) in flight", state.queue.in_flight)
        super().handle_exit(sig, frame)


def run(settings: ServeSettings) -> None:
    """Serve until a signal; returns after the drain and the cache's close."""
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        workers=1,  # one process owns the engine
        lifespan="on",  # a failed startup (no engine) is fatal
        log_level=settings.log_level,
        timeout_graceful_shutdown=max(1, round(settings.drain_timeout_s)),
    )
    _DrainingServer(config).run()
