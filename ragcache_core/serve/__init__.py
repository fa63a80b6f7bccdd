"""`ragcache serve`: one engine and one knowledge tree behind HTTP, shared by many app processes.

    settings.py        ServeSettings (what one server is started with)
    app.py             create_app(settings): the FastAPI app (lifespan: engine lock, cache, parts)
    runner.py          uvicorn, one worker, draining on SIGTERM/SIGINT
    routes_openai.py   /v1/chat/completions, /v1/completions (OpenAI-compatible + "documents")
    routes_rag.py      /v1/rag/query, /v1/rag/config, /v1/cache/{stats,invalidate,integrity}
    routes_ops.py      /health, /metrics, /v1/models
    jobs.py            an OpenAI request -> a cached or an uncached job, and its sampling
    prompts.py         the server's tokenizer-side prompts (uncached ids, cached lengths)
    openai_format.py   OpenAI response bodies and stream chunks (+ the "ragcache" report)
    queue.py           the bounded queue (429 + Retry-After past it)
    respond.py         answering whole or streamed; streams.py: SSE, disconnects
    auth.py, owner.py  the API key; one process per server
    errors.py          OpenAI-shaped errors; metrics.py: the server's collectors
    wire.py            RAGCache's objects as JSON; client.py: RAGCacheClient

`RAGCacheClient` needs only httpx; the server needs the `serve` extra (FastAPI, uvicorn).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ragcache_core.serve.client import RAGCacheClient, RemoteError, ServerBusy
    from ragcache_core.serve.settings import ServeSettings

_LAZY = {
    "RAGCacheClient": "ragcache_core.serve.client",
    "RemoteError": "ragcache_core.serve.client",
    "ServerBusy": "ragcache_core.serve.client",
    "ServeSettings": "ragcache_core.serve.settings",
    "create_app": "ragcache_core.serve.app",
}

__all__ = ["RAGCacheClient", "RemoteError", "ServeSettings", "ServerBusy", "create_app"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ragcache_core.serve' has no attribute {name!r}")
