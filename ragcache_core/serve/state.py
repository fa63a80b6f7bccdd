"""What one server is started with (`ServeSettings`, frozen; nothing is read from globals), what
it holds while it runs (`ServeState`, built at startup), and its own Prometheus collectors
(`ServeMetrics`, beside the cache's in a registry of their own; `/metrics` serves both; listed
in docs/configuration.md, "Metrics"):

| metric                              | type      | labels            |
|-------------------------------------|-----------|-------------------|
| ragcache_serve_requests             | counter   | route, status     |
| ragcache_serve_uncached             | counter   | reason            |
| ragcache_serve_disconnects          | counter   | route             |
| ragcache_serve_request_seconds      | histogram | route             |
| ragcache_serve_in_flight            | gauge     |                   |
| ragcache_serve_waiting              | gauge     |                   |

The server runs over a `RAGCache` (`CacheFactory` builds it; tests pass a stand-in).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from fastapi import Request

if TYPE_CHECKING:
    from ragcache_core.runtime.ragcache import RAGCache
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ragcache_core.config import CacheConfig
from ragcache_core.errors import ConfigError
from ragcache_core.serve.auth import ApiKey
from ragcache_core.serve.errors import ServeError
from ragcache_core.serve.jobs import GenerationDefaults, PromptRenderer
from ragcache_core.serve.limits import BoundedQueue, Place

DEFAULT_MAX_WAITING = 64
"""Requests that may wait beyond the engine's `max_num_seqs` running ones before 429."""
DEFAULT_MAX_BODY_BYTES = 8 * 2**20
"""A request body larger than this gets 413 (serve/limits.py says why 8 MiB)."""
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_READ_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ServeSettings:
    """One server: the model, its cache settings, where it listens, how it sheds load.

    - `index`: a folder written by `ragcache index`, searched by `/v1/rag/query` (None: that
      route needs `documents`).
    - `api_key`: when set, every `/v1/...` route and the OpenAPI pages want
      `Authorization: Bearer <key>` (401 otherwise); `/health` and `/metrics` stay open for
      probes, as in `vllm serve`. `api_keys` (a key file, `serve/auth.py`) accepts several
      keys, each with its tenant; `salt_per_key` salts every request with its tenant (no
      cross-tenant hits).
    - `admin_key`: when set, only it opens `/v1/cache/invalidate` and `/v1/cache/integrity`
      (403 for the API keys); without it the API keys open them (serve/auth.py).
    - `served_model_name`: the name in `/v1/models` and in responses (None: the model
      folder's name); a request's `model` may be it or the model path.
    - `max_waiting`: in flight at most `config.max_num_seqs + max_waiting` requests (running
      plus waiting in RAGCache's reordering queue); past it a request gets 429 with
      Retry-After at once, so the backlog is bounded.
    - `drain_timeout_s`: on SIGTERM/SIGINT the server stops accepting and waits this long for
      requests in flight, then cancels the rest, then closes the engine and the shared memory.
    - `max_body_bytes`, `header_timeout_s`, `read_timeout_s`: what one connection may cost
      before its request is parsed (413, 408; serve/limits.py).
    - `replica_id`: this server's name in the `X-RAGCache-Replica` response header (None:
      `host:port`); `peers`: the other replicas' URLs, to which an invalidation fans out
      (serve/replicas.py).
    """

    model: str
    config: CacheConfig = field(default_factory=CacheConfig)
    index: Path | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    api_keys: tuple[ApiKey, ...] = ()
    salt_per_key: bool = False
    served_model_name: str | None = None
    max_waiting: int = DEFAULT_MAX_WAITING
    drain_timeout_s: float = 30.0
    log_level: str = "warning"
    admin_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
    replica_id: str | None = None
    peers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for peer in self.peers:
            if not peer.startswith(("http://", "https://")):
                raise ConfigError(f"peer {peer!r} must be an http:// or https:// URL")
        if self.max_waiting < 0:
            raise ConfigError(f"max_waiting cannot be negative, got {self.max_waiting}")
        if self.drain_timeout_s < 0:
            raise ConfigError(f"drain_timeout_s cannot be negative, got {self.drain_timeout_s}")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in 0-65535, got {self.port}")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("api_key cannot be empty (omit it to serve without a key)")
        if self.admin_key is not None and not self.admin_key:
            raise ConfigError("admin_key cannot be empty (omit it: the API key opens admin routes)")
        if self.admin_key is not None and self.admin_key in {k.key for k in self.accepted_keys}:
            raise ConfigError("admin_key must differ from api_key (else every key holder is admin)")
        if self.max_body_bytes < 1:
            raise ConfigError(f"max_body_bytes must be positive, got {self.max_body_bytes}")
        for name in ("header_timeout_s", "read_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.salt_per_key and not self.accepted_keys:
            raise ConfigError("salt_per_key needs API keys (--api-key or --api-key-file)")

    @property
    def accepted_keys(self) -> tuple[ApiKey, ...]:
        """Every key the server accepts (`api_key` is the tenant "default")."""
        single = () if self.api_key is None else (ApiKey(self.api_key, "default"),)
        return single + self.api_keys

    @property
    def model_name(self) -> str:
        """The served name (`/v1/models`, responses): `served_model_name`, else the model
        folder's name."""
        return self.served_model_name or Path(self.model).name or self.model

    @property
    def model_names(self) -> frozenset[str]:
        """What a request's `model` may be: the served name or the model path."""
        path = Path(self.model)
        return frozenset({self.model_name, self.model, str(path.resolve())})

    @property
    def replica_name(self) -> str:
        """The id in `X-RAGCache-Replica`: `replica_id`, else `host:port`."""
        return self.replica_id or f"{self.host}:{self.port}"


CacheFactory = Callable[[ServeSettings], "RAGCache"]
"""Builds the server's cache from its settings (tests pass a stand-in)."""
T = TypeVar("T")


@dataclass
class ServeState:
    """The running server's parts. Used from the server's event loop only."""

    settings: ServeSettings
    cache: RAGCache
    renderer: PromptRenderer
    defaults: GenerationDefaults
    queue: BoundedQueue
    metrics: ServeMetrics
    has_index: bool
    started_at: float = field(default_factory=time.time)
    lanes: RenderLanes = field(default_factory=lambda: RenderLanes())
    """Tokenization and chat templates run there, off the event loop."""

    async def render(self, work: Callable[[], T], chars: int) -> T:
        """`work()` (prompt rendering and token counting for a request of `chars`
        characters of text) in its lane (`RenderLanes`)."""
        lane = self.lanes.lane_for(chars)
        return await asyncio.get_running_loop().run_in_executor(lane, work)

    def salt_for(self, request: Request, given: str | None) -> str | None:
        """The request's effective cache salt: with `salt_per_key`, its tenant's (combined
        with the request's own `cache_salt`, which then separates within the tenant); else
        the request's own."""
        tenant = request.scope.get("ragcache_tenant")
        if not self.settings.salt_per_key or tenant is None:
            return given
        return f"tenant:{tenant}" + ("" if given is None else f"\0{given}")

    def check_model(self, model: str | None) -> None:
        """404 for a model this server does not serve, as vLLM; the served name, the model
        path (as given or resolved: what a client of `vllm serve /path` sends), "" and None
        pass."""
        if model and model not in self.settings.model_names:
            raise ServeError(
                404,
                f"The model `{model}` does not exist. Valid aliases: {self.settings.model_name}.",
                param="model",
            )

    def enter(self, route: str) -> Place:
        """A place in flight, or 429 (full: Retry-After) / 503 (shutting down)."""
        verdict = self.queue.try_enter()
        if isinstance(verdict, Place):
            return verdict
        headers = {"Retry-After": str(verdict.retry_after_s)}
        if verdict.reason == "draining":
            raise ServeError(503, "the server is shutting down", headers=headers)
        raise ServeError(
            429,
            f"the server is at capacity ({self.queue.capacity} requests in flight): retry "
            f"after {verdict.retry_after_s} s",
            headers=headers,
        )


LARGE_RENDER_CHARS = 32 * 1024
"""A request with more characters of text than this renders in the large lane (tokenizing
32 Ki characters takes ~0.07 s with the tiny model's tokenizer on the 2-core test machine)."""


class RenderLanes:
    """Where prompts are rendered and tokenized, off the event loop, in two lanes so that a
    huge request never holds up small ones (no head-of-line blocking): requests of at most
    `LARGE_RENDER_CHARS` characters go to the small lane's `small_threads`, larger ones queue
    for the large lane's `large_threads`. Tokenizing releases the GIL, so the lanes run side
    by side. What they render is bounded anyway: a text longer than the context can hold is
    refused before it is tokenized (`PromptRenderer`)."""

    def __init__(self, small_threads: int = 2, large_threads: int = 1) -> None:
        self.small = ThreadPoolExecutor(small_threads, thread_name_prefix="ragcache-render")
        self.large = ThreadPoolExecutor(large_threads, thread_name_prefix="ragcache-render-large")

    def lane_for(self, chars: int) -> ThreadPoolExecutor:
        return self.large if chars > LARGE_RENDER_CHARS else self.small

    def shutdown(self) -> None:
        self.small.shutdown(wait=False, cancel_futures=True)
        self.large.shutdown(wait=False, cancel_futures=True)


def state_of(request: Request) -> ServeState:
    state = getattr(request.app.state, "serve", None)
    if state is None:
        raise ServeError(503, "the server is starting")
    assert isinstance(state, ServeState)
    return state


_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServeMetrics:
    """Requests by route and status, uncached requests by reason, disconnects, request time;
    the bounded queue's occupancy is read at scrape time."""

    def __init__(self, queue: BoundedQueue) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "ragcache_serve_requests", "HTTP requests answered", ["route", "status"], registry=r
        )
        self.uncached = Counter(
            "ragcache_serve_uncached", "Requests served without the cache", ["reason"], registry=r
        )
        self.found = Counter(
            "ragcache_serve_found_documents",
            "Requests without a documents field, by whether known documents were found in them",
            ["result"],
            registry=r,
        )
        self.disconnects = Counter(
            "ragcache_serve_disconnects", "Clients gone before the end", ["route"], registry=r
        )
        self.seconds = Histogram(
            "ragcache_serve_request_seconds",
            "Time from request to the end of its response",
            ["route"],
            buckets=_SECONDS,
            registry=r,
        )
        in_flight = Gauge("ragcache_serve_in_flight", "Requests in flight", registry=r)
        in_flight.set_function(lambda: queue.in_flight)
        waiting = Gauge("ragcache_serve_waiting", "In flight beyond max_num_seqs", registry=r)
        waiting.set_function(lambda: queue.waiting)

    def answered(self, route: str, status: int) -> None:
        """One response (every one, by `errors.CountedResponses`)."""
        self.requests.labels(route, str(status)).inc()

    def timed(self, route: str, seconds: float) -> None:
        """How long one answer of a generating route took, to the end of its response."""
        self.seconds.labels(route).observe(seconds)
