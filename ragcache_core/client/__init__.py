"""`RAGCacheClient`: the `RAGCacheAPI` over HTTP, for app processes that share one
`ragcache serve`. Importing it loads httpx and the shared types, nothing heavier (no engine,
no numpy): `client.py` (the client and its errors), `wire.py` (RAGCache's objects as JSON,
shared with the server), `affinity.py` (the document-affinity key for a router in front of
many replicas)."""

from __future__ import annotations

from ragcache_core.client.client import RAGCacheClient, RemoteError, ServerBusy

__all__ = ["RAGCacheClient", "RemoteError", "ServerBusy"]
