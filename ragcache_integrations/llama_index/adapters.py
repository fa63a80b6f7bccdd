"""LlamaIndex vector stores as RAGCache search sources (staged where the store allows it).

`search_source(index)` turns a `VectorStoreIndex` into a `SearchSource`:
- `FaissVectorStore`: the store's own Faiss index searched in stages (IVF / HNSW; flat is one
  stage), no vectors copied; row r -> node id via `index.index_struct.nodes_dict[str(r)]`, the
  node from the index's docstore (the same path LlamaIndex's retriever takes).
- `SimpleVectorStore`: one exact cosine stage over its embeddings (`MatrixFlat`); the matrix is
  rebuilt when the store's node ids change.
- any other store: one stage through the index's own retriever (works; cannot speculate, and
  says so once in the log).
Metadata `filters` go to the store, which applies them before its top-k: through the index's own
retriever (one stage) for a store that takes them (`SimpleVectorStore`, most others); a
`FaissVectorStore` takes none (LlamaIndex's own retriever raises), so they are refused here by
name. They are never applied to the top-k afterwards (that would answer with fewer than k).
Query vectors come from the index's embed model, as in `VectorIndexRetriever`.

`OfflineEmbedding` wraps RAGCache's offline TF-IDF + SVD embedder as a LlamaIndex embed model.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from llama_index.core.base.embeddings.base import BaseEmbedding, Embedding
from llama_index.core.indices.vector_store.base import VectorStoreIndex
from llama_index.core.schema import BaseNode, MetadataMode
from llama_index.core.vector_stores.simple import SimpleVectorStore
from llama_index.core.vector_stores.types import MetadataFilters
from pydantic import PrivateAttr

from ragcache_core.documents import Document
from ragcache_core.errors import ConfigError, InputError, wrong_type
from ragcache_core.retrieval.embedder import TfidfSvdEmbedder
from ragcache_core.retrieval.flat import MatrixFlat, staged_search_for
from ragcache_core.retrieval.ivf import StageSizing
from ragcache_core.retrieval.source import CallableSource, StagedSource
from ragcache_core.search import SearchSource, StageResult


def node_to_document(node: BaseNode) -> Document:
    """A LlamaIndex node as a RAGCache `Document`: its text without metadata, its metadata,
    and as `prompt_text` the node as LlamaIndex shows it to the LLM
    (`get_content(MetadataMode.LLM)`, metadata included, stripped as the compact response mode
    strips each chunk)."""
    text = node.get_content(metadata_mode=MetadataMode.NONE)
    if not text:
        raise InputError(f"node {node.node_id!r} has no text")
    shown = node.get_content(metadata_mode=MetadataMode.LLM).strip()
    return Document(
        id=str(node.node_id), text=text, metadata=dict(node.metadata), prompt_text=shown or None
    )


class _NodeLookup:
    """Vector-store ids -> documents, the way `VectorIndexRetriever` resolves them."""

    def __init__(self, index: VectorStoreIndex) -> None:
        self._index = index

    def __call__(self, store_ids: Sequence[str]) -> list[Document]:
        nodes_dict = self._index.index_struct.nodes_dict
        try:
            node_ids = [nodes_dict[i] for i in store_ids]
        except KeyError as exc:
            raise InputError(f"vector store id {exc.args[0]} is not in the index") from None
        return [node_to_document(self._index.docstore.get_node(n)) for n in node_ids]


def search_source(
    index: VectorStoreIndex,
    *,
    embed_model: BaseEmbedding | None = None,
    nprobe: int | None = None,
    sizing: StageSizing | None = None,
    ef_search: int | None = None,
    filters: MetadataFilters | None = None,
) -> SearchSource:
    """A `SearchSource` over `index` (see the module docstring for what each store gets).

    `nprobe` / `sizing` (IVF) and `ef_search` (HNSW) default to the Faiss index's own settings,
    so the last stage equals the store's own query.
    `filters` go to the store (`ConfigError` for a `FaissVectorStore`, which has none;
    `TypeError` for anything but `MetadataFilters`).
    """
    if filters is not None:
        return _filtered_source(index, filters, embed_model)
    model = embed_model or index._embed_model
    store = index.vector_store
    lookup = _NodeLookup(index)

    def embed(question: str) -> npt.NDArray[np.float32]:
        return np.asarray(model.get_agg_embedding_from_queries([question]), dtype=np.float32)

    faiss_index = _faiss_index_of(store)
    if faiss_index is not None:
        staged = staged_search_for(faiss_index, nprobe=nprobe, sizing=sizing, ef_search=ef_search)
        return StagedSource(embed, staged, lambda rows: lookup([str(r) for r in rows]))
    if isinstance(store, SimpleVectorStore):
        return _SimpleStoreSource(store, embed, lookup)

    def retrieve(question: str, k: int) -> list[tuple[Document, float]]:
        hits = index.as_retriever(similarity_top_k=k).retrieve(question)
        return [(node_to_document(h.node), float(h.score or 0.0)) for h in hits]

    return CallableSource(retrieve, name=f"LlamaIndex {type(store).__name__}")


def _filtered_source(
    index: VectorStoreIndex, filters: MetadataFilters, embed_model: BaseEmbedding | None
) -> SearchSource:
    """One stage through the index's own retriever, with the filters given to the store."""
    if not isinstance(filters, MetadataFilters):
        raise wrong_type("as_query_engine(filters=...)", "llama_index MetadataFilters", filters)
    store = index.vector_store
    if _faiss_index_of(store) is not None:
        raise ConfigError(
            "filters=: LlamaIndex's FaissVectorStore does not support metadata filters (its own "
            "retriever raises too), and RAGCache never filters after the top-k. Use a store "
            "that filters (SimpleVectorStore, or any store whose retriever takes filters=), or "
            "drop filters="
        )

    def retrieve(question: str, k: int) -> list[tuple[Document, float]]:
        options: dict[str, Any] = {"embed_model": embed_model} if embed_model else {}
        retriever = index.as_retriever(similarity_top_k=k, filters=filters, **options)
        hits = retriever.retrieve(question)
        return [(node_to_document(h.node), float(h.score or 0.0)) for h in hits]

    return CallableSource(retrieve, name=f"LlamaIndex {type(store).__name__} with filters")


def _faiss_index_of(store: Any) -> Any:
    """The Faiss index of a `FaissVectorStore` (None for any other store)."""
    try:
        from llama_index.vector_stores.faiss import FaissVectorStore
    except ImportError:  # the Faiss integration is optional
        return None
    return store.client if isinstance(store, FaissVectorStore) else None


class _SimpleStoreSource:
    """Exact single-stage search over a `SimpleVectorStore`, refreshed when its ids change."""

    def __init__(self, store: SimpleVectorStore, embed: Any, lookup: _NodeLookup) -> None:
        self._store, self._embed, self._lookup = store, embed, lookup
        self._lock = threading.Lock()
        self._snapshot: tuple[tuple[str, ...], StagedSource] | None = None

    @property
    def can_speculate(self) -> bool:
        return False

    def _source(self) -> StagedSource:
        embeddings = self._store.data.embedding_dict
        with self._lock:
            keys = tuple(embeddings)
            if self._snapshot is None or self._snapshot[0] != keys:
                if not keys:
                    raise InputError("the SimpleVectorStore is empty")
                flat = MatrixFlat([embeddings[key] for key in keys])
                source = StagedSource(
                    self._embed, flat, lambda rows: self._lookup([keys[r] for r in rows])
                )
                self._snapshot = (keys, source)
            return self._snapshot[1]

    def search_stages(self, question: str, k: int) -> Iterator[StageResult]:
        return self._source().search_stages(question, k)


class OfflineEmbedding(BaseEmbedding):
    """RAGCache's offline TF-IDF + SVD embedder as a LlamaIndex embed model (deterministic)."""

    _embedder: TfidfSvdEmbedder = PrivateAttr()

    def __init__(self, embedder: TfidfSvdEmbedder, **kwargs: Any) -> None:
        super().__init__(model_name="ragcache-tfidf-svd", **kwargs)
        self._embedder = embedder

    def _get_query_embedding(self, query: str) -> Embedding:
        return [float(v) for v in self._embedder.embed_query(query)]

    async def _aget_query_embedding(self, query: str) -> Embedding:
        return self._get_query_embedding(query)

    def _get_text_embedding(self, text: str) -> Embedding:
        return [float(v) for v in self._embedder.embed_query(text)]

    def _get_text_embeddings(self, texts: list[str]) -> list[Embedding]:
        return [[float(v) for v in row] for row in self._embedder.embed(texts)]


__all__ = ["OfflineEmbedding", "node_to_document", "search_source"]
