"""LangChain vector stores as RAGCache search sources (staged where the store allows it).

`search_source(vectorstore)` turns a vector store into a `SearchSource`:
- langchain-community `FAISS`: its own Faiss index (`vectorstore.index`) searched in stages (IVF
  / HNSW; the default flat index is one stage), no vectors copied; query vectors from the store's
  embedding function, L2-normalized when the store was built with `normalize_L2`; row r ->
  `index_to_docstore_id[r]` -> the docstore's document (the path `similarity_search` takes).
- any other store: one stage through `similarity_search_with_score` (works; cannot speculate,
  and says so once in the log).

`OfflineEmbeddings` wraps RAGCache's offline TF-IDF + SVD embedder as LangChain `Embeddings`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from langchain_core.documents import Document as LCDocument
from langchain_core.embeddings import Embeddings
from langchain_core.vectorstores import VectorStore

from ragcache_core.documents import Document
from ragcache_core.errors import InputError
from ragcache_core.retrieval.embedder import TfidfSvdEmbedder
from ragcache_core.retrieval.flat import staged_search_for
from ragcache_core.retrieval.ivf import StageSizing
from ragcache_core.retrieval.source import CallableSource, StagedSource
from ragcache_core.search import SearchSource


def to_document(doc: LCDocument, doc_id: str | None = None) -> Document:
    """A LangChain document as a RAGCache `Document`.

    The id is `doc_id`, else `doc.id`, else a hash of the content (stable across runs, so the
    cache can still recognise the document).
    """
    if not doc.page_content:
        raise InputError(f"document {doc_id or doc.id!r} has no text")
    ident = doc_id or doc.id or "sha1:" + hashlib.sha1(doc.page_content.encode()).hexdigest()
    return Document(id=str(ident), text=doc.page_content, metadata=dict(doc.metadata))


def search_source(
    vectorstore: VectorStore,
    *,
    nprobe: int | None = None,
    sizing: StageSizing | None = None,
    ef_search: int | None = None,
) -> SearchSource:
    """A `SearchSource` over `vectorstore` (see the module docstring).

    `nprobe` / `sizing` (IVF) and `ef_search` (HNSW) default to the Faiss index's own settings,
    so the last stage equals the store's own `similarity_search`.
    """
    if _is_community_faiss(vectorstore):
        return _faiss_source(vectorstore, nprobe=nprobe, sizing=sizing, ef_search=ef_search)

    def search(question: str, k: int) -> list[tuple[Document, float]]:
        try:
            hits = vectorstore.similarity_search_with_score(question, k=k)
        except NotImplementedError:  # scores are optional in LangChain: NaN means "not given"
            hits = [(d, math.nan) for d in vectorstore.similarity_search(question, k=k)]
        return [(to_document(d), float(s)) for d, s in hits]

    return CallableSource(search, name=f"LangChain {type(vectorstore).__name__}")


def _is_community_faiss(store: object) -> bool:
    try:
        from langchain_community.vectorstores import FAISS
    except ImportError:  # langchain-community is optional
        return False
    return isinstance(store, FAISS)


def _faiss_source(store: Any, **options: Any) -> StagedSource:
    import faiss

    normalize = bool(getattr(store, "_normalize_L2", False))

    def embed(question: str) -> npt.NDArray[np.float32]:
        vector = np.array([store._embed_query(question)], dtype=np.float32)  # [1, d]
        if normalize:
            faiss.normalize_L2(vector)
        return vector[0]

    def documents_for(rows: Sequence[int]) -> list[Document]:
        out = []
        for row in rows:
            doc_id = store.index_to_docstore_id[row]
            doc = store.docstore.search(doc_id)
            if not isinstance(doc, LCDocument):
                raise InputError(f"the docstore has no document for id {doc_id!r}")
            out.append(to_document(doc, str(doc_id)))
        return out

    return StagedSource(embed, staged_search_for(store.index, **options), documents_for)


class OfflineEmbeddings(Embeddings):
    """RAGCache's offline TF-IDF + SVD embedder as LangChain `Embeddings` (deterministic)."""

    def __init__(self, embedder: TfidfSvdEmbedder) -> None:
        self._embedder = embedder

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return [[float(v) for v in row] for row in self._embedder.embed(texts)]

    def embed_query(self, text: str) -> list[float]:
        return [float(v) for v in self._embedder.embed_query(text)]


__all__ = ["OfflineEmbeddings", "search_source", "to_document"]
