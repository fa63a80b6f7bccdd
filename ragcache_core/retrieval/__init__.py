"""Staged vector search on Faiss, our offline index, search sources, traces and statistics.

- `base`: `StagedSearch` (stages(query_vectors, k) -> Stage ...), `Stage`, `Metric`.
- `ivf`, `hnsw`, `flat`: the staged searches; `staged_search_for(index)` picks one.
- `source`: `SearchSource` / `StageResult` (question -> documents per stage), `StagedSource`,
  `CallableSource` (single-stage fallback), `astages` (async stepping).
- `embedder`: the offline TF-IDF + SVD embedder. `corpus`: JSONL corpora and questions.
- `index_store`: `build_index`, `LocalIndex` (save/load). `trace`: request traces.
- `stats`: per-stage timing, recall, speculation chance and popularity skew.

Faiss and scikit-learn are imported lazily, when an index is built, loaded or searched.
"""

from __future__ import annotations

from ragcache_core.retrieval.base import Metric, Stage, StagedSearch
from ragcache_core.retrieval.corpus import Question, load_corpus, load_questions
from ragcache_core.retrieval.embedder import EmbedderConfig, TfidfSvdEmbedder
from ragcache_core.retrieval.flat import MatrixFlat, SingleStage, staged_search_for
from ragcache_core.retrieval.hnsw import StagedHNSW
from ragcache_core.retrieval.index_store import IndexSettings, LocalIndex, build_index
from ragcache_core.retrieval.ivf import (
    ListsPerStage,
    StagedIVF,
    StageSizing,
    TargetStageTime,
)
from ragcache_core.retrieval.source import CallableSource, StagedSource
from ragcache_core.search import SearchSource, StageResult, astages, final_result

__all__ = [
    "CallableSource",
    "EmbedderConfig",
    "IndexSettings",
    "ListsPerStage",
    "LocalIndex",
    "MatrixFlat",
    "Metric",
    "Question",
    "SearchSource",
    "SingleStage",
    "Stage",
    "StageResult",
    "StageSizing",
    "StagedHNSW",
    "StagedIVF",
    "StagedSearch",
    "StagedSource",
    "TargetStageTime",
    "TfidfSvdEmbedder",
    "astages",
    "build_index",
    "final_result",
    "load_corpus",
    "load_questions",
    "staged_search_for",
]
