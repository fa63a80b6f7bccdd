"""`ragcache serve`: one engine and one knowledge tree behind HTTP, shared by many app processes.

    app.py        create_app(settings): the FastAPI app (lifespan: engine lock, cache, parts),
                  the API key, the engine lock, `run` (uvicorn, one worker, draining on SIGTERM)
    routes.py     every route: /v1/chat/completions, /v1/completions (OpenAI-compatible +
                  "documents"), /v1/rag/query, /v1/rag/config, /v1/cache/*, /health,
                  /metrics, /v1/models
    jobs.py       an OpenAI request -> a cached or an uncached job, its sampling, and the
                  server's tokenizer-side prompts (uncached ids, cached lengths)
    responses.py  answering whole or streamed (SSE, disconnects) and the OpenAI bodies
                  (+ the "ragcache" report)
    limits.py     what the server takes on: body size and header time (413/408), and the
                  bounded queue (429 + Retry-After past it)
    auth.py       the API keys (and their key file), the admin key, the routes each opens
    watchdog.py   the engine lock (one server per port) and the watchdog (the engine dies
                  with the server)
    state.py      ServeSettings, ServeState, the server's collectors
    errors.py     OpenAI-shaped errors; schemas.py: the request bodies; fields.py: what the
                  server does with each of their fields; sampling_in.py: the sampling
                  bodies, derived from `SamplingConfig`

The client is `ragcache_core.client.RAGCacheClient` (it needs only httpx; re-exported here);
the server needs the `serve` extra (FastAPI, uvicorn).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ragcache_core.client import RAGCacheClient, RemoteError, ServerBusy
    from ragcache_core.serve.state import ServeSettings

_LAZY = {
    "RAGCacheClient": "ragcache_core.client",
    "RemoteError": "ragcache_core.client",
    "ServerBusy": "ragcache_core.client",
    "ServeSettings": "ragcache_core.serve.state",
    "create_app": "ragcache_core.serve.app",
}

__all__ = ["RAGCacheClient", "RemoteError", "ServeSettings", "ServerBusy", "create_app"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ragcache_core.serve' has no attribute {name!r}")
