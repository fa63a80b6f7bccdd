"""The RAGCache KV connector for vLLM (the data plane's vLLM side).

`RAGCacheConnector` is imported lazily so that the app can use `ConnectorConfig`,
`ConnectorResult` and the plan checks without importing vLLM.
"""

from __future__ import annotations

from typing import Any

from ragcache_core.engine.connector.config import (
    CONNECTOR_CLASS,
    CONNECTOR_MODULE,
    FAULT_KEY,
    RESULT_KEY,
    ConnectorConfig,
)
from ragcache_core.engine.connector.report import ConnectorResult

__all__ = [
    "CONNECTOR_CLASS",
    "CONNECTOR_MODULE",
    "FAULT_KEY",
    "RESULT_KEY",
    "ConnectorConfig",
    "ConnectorResult",
    "RAGCacheConnector",
]


def __getattr__(name: str) -> Any:
    if name == "RAGCacheConnector":
        from ragcache_core.engine.connector.connector import RAGCacheConnector

        return RAGCacheConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
