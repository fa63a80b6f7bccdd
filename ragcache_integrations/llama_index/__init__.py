"""RAGCache for LlamaIndex (llama-index-core 0.14): a query engine over an existing index.

    from ragcache_integrations.llama_index import as_query_engine
    engine = as_query_engine(index, cache=cache, similarity_top_k=3)
    response = engine.query("...")        # Response: source_nodes, metadata (TTFT, cache hits)
    chat = as_chat_engine(index, cache=cache)   # context / condense_plus_context chat modes

(`index.as_query_engine(cache=cache)` would silently ignore `cache=`: see `query_engine`.)
The installed llama-index-core is checked first, so an unsupported version fails here with one
clear `UnsupportedFrameworkError` instead of somewhere inside LlamaIndex.
"""

from __future__ import annotations

from ragcache_integrations.llama_index._compat import UnsupportedFrameworkError, check_version

check_version()

from ragcache_integrations.llama_index.adapters import (  # noqa: E402
    OfflineEmbedding,
    node_to_document,
    search_source,
)
from ragcache_integrations.llama_index.chat_engine import (  # noqa: E402
    RAGCacheChatEngine,
    as_chat_engine,
)
from ragcache_integrations.llama_index.prompt import prompt_config  # noqa: E402
from ragcache_integrations.llama_index.query_engine import (  # noqa: E402
    RAGCacheQueryEngine,
    as_query_engine,
)

__all__ = [
    "OfflineEmbedding",
    "RAGCacheChatEngine",
    "RAGCacheQueryEngine",
    "UnsupportedFrameworkError",
    "as_chat_engine",
    "as_query_engine",
    "node_to_document",
    "prompt_config",
    "search_source",
]
