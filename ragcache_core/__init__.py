"""RAGCache: a knowledge cache for retrieval-augmented generation on vLLM.

The package tree follows the pipeline (see docs/architecture.md):
`tree/`, `policy/`, `cost/`, `scheduler/` (control plane, pure Python), `storage/` and
`engine/` (data plane on vLLM), `retrieval/` (staged vector search), `pipeline/` and
`controller` (the RAG request lifecycle), `sim/` and `bench/` (measurement), `cli/`.
"""

from __future__ import annotations

from ragcache_core.errors import ConfigError, InputError, ModelError, RAGCacheError

__version__ = "0.1.0"

__all__ = ["ConfigError", "InputError", "ModelError", "RAGCacheError", "__version__"]
