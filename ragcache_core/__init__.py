"""RAGCache: a knowledge cache for retrieval-augmented generation on vLLM.

The package tree follows the pipeline (see docs/architecture.md): shared types at the top
(`api`, `config`, `documents`, `errors`, `plan`, `query_result`, `search`, `loop`, ...); `tree/`,
`policy/`, `cost/` (control plane, pure Python); `storage/` and `engine/` (data plane on
vLLM); `retrieval/` (staged vector search); `runtime/` (the request path: the `RAGCache`
facade, admission, speculation, the lifecycle); `client/` (the same API over HTTP); `serve/`
(the server); `sim/` and `bench/` (measurement); `cli/`. The design: docs/design.md.

The public API is importable from here: `RAGCache`, `RAGCacheClient` (the same API over
HTTP, `ragcache serve`), `RAGCacheAPI` (the abstract base both implement), `CacheConfig`,
`PromptConfig`, `SamplingConfig`, `Document`, `AppPrompt` (the app's own prompt, with the
`CONTEXT` and `QUESTION` markers), `QueryResult`, `quiet_vllm` (vLLM's output to a log file)
and the errors (`RAGCacheError` and its subclasses; the classes are loaded on first use, so
`import ragcache_core` stays light).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ragcache_core.errors import (
    CacheClosedError,
    ConfigError,
    InputError,
    MainGuardError,
    ModelError,
    RAGCacheError,
)

if TYPE_CHECKING:
    from ragcache_core.api import RAGCacheAPI
    from ragcache_core.app_prompt import CONTEXT, QUESTION, AppPrompt
    from ragcache_core.client import RAGCacheClient
    from ragcache_core.config import CacheConfig, PromptConfig, SamplingConfig
    from ragcache_core.documents import Document
    from ragcache_core.engine.logs import quiet_vllm
    from ragcache_core.query_result import CacheHits, QueryResult, StreamChunk
    from ragcache_core.runtime.ragcache import RAGCache

__version__ = "0.1.0"

_LAZY = {
    "RAGCache": "ragcache_core.runtime.ragcache",
    "QueryResult": "ragcache_core.query_result",
    "CacheHits": "ragcache_core.query_result",
    "StreamChunk": "ragcache_core.query_result",
    "CacheConfig": "ragcache_core.config",
    "PromptConfig": "ragcache_core.config",
    "SamplingConfig": "ragcache_core.config",
    "Document": "ragcache_core.documents",
    "RAGCacheAPI": "ragcache_core.api",
    "RAGCacheClient": "ragcache_core.client",
    "quiet_vllm": "ragcache_core.engine.logs",
    "AppPrompt": "ragcache_core.app_prompt",
    "CONTEXT": "ragcache_core.app_prompt",
    "QUESTION": "ragcache_core.app_prompt",
}

__all__ = [
    "CONTEXT",
    "QUESTION",
    "AppPrompt",
    "CacheClosedError",
    "CacheConfig",
    "CacheHits",
    "ConfigError",
    "Document",
    "InputError",
    "MainGuardError",
    "ModelError",
    "PromptConfig",
    "QueryResult",
    "RAGCache",
    "RAGCacheAPI",
    "RAGCacheClient",
    "RAGCacheError",
    "SamplingConfig",
    "StreamChunk",
    "__version__",
    "quiet_vllm",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ragcache_core' has no attribute {name!r}")
