"""LangChain adapters: the staged source returns what the store's own retriever returns.

Real langchain-community `FAISS` (its default flat index, with and without `normalize_L2`, and
IVF / HNSW indexes passed in) on the shipped demo corpus; a real in-memory store of
langchain-core for the single-stage fallback. Embeddings: our offline TF-IDF + SVD embedder.
"""

from __future__ import annotations

import logging
from importlib import resources
from pathlib import Path

import faiss
import pytest
from langchain_community.docstore.in_memory import InMemoryDocstore
from langchain_community.vectorstores import FAISS
from langchain_community.vectorstores.utils import DistanceStrategy
from langchain_core.vectorstores import InMemoryVectorStore

from ragcache_core.retrieval import TfidfSvdEmbedder, load_corpus, load_questions
from ragcache_core.retrieval.index_store import embedding_text
from ragcache_integrations.langchain.adapters import OfflineEmbeddings, search_source

DATA = Path(str(resources.files("ragcache_core") / "data"))
K = 3


@pytest.fixture(scope="module")
def docs():
    return load_corpus([DATA / "demo_corpus.jsonl"], id_fields="doc_id")


@pytest.fixture(scope="module")
def embeddings(docs) -> OfflineEmbeddings:
    return OfflineEmbeddings(TfidfSvdEmbedder.fit([embedding_text(d) for d in docs]))


@pytest.fixture(scope="module")
def questions() -> list[str]:
    return [q.text for q in load_questions(DATA / "demo_questions.jsonl")][1::4]


def _texts(docs):
    return [d.text for d in docs], [dict(d.metadata) for d in docs], [d.id for d in docs]


def _check_same(store, questions: list[str], speculates: bool) -> None:
    source = search_source(store)
    assert source.can_speculate == speculates
    retriever = store.as_retriever(search_kwargs={"k": K})
    several = False
    for question in questions:
        expected = retriever.invoke(question)
        stages = list(source.search_stages(question, K))
        several |= len(stages) > 1
        assert stages[-1].is_last
        assert stages[-1].doc_ids == tuple(d.id for d in expected)
        assert [d.text for d in stages[-1].documents] == [d.page_content for d in expected]
        assert [dict(d.metadata) for d in stages[-1].documents] == [d.metadata for d in expected]
    assert several == speculates


@pytest.mark.parametrize("normalize", [False, True])
def test_default_faiss_store(docs, embeddings, questions, normalize) -> None:
    texts, metadatas, ids = _texts(docs)
    store = FAISS.from_texts(
        texts, embeddings, metadatas=metadatas, ids=ids, normalize_L2=normalize
    )
    _check_same(store, questions, speculates=False)


@pytest.mark.parametrize("kind", ["ivf", "hnsw"])
def test_faiss_store_with_staged_index(docs, embeddings, questions, kind) -> None:
    texts, metadatas, ids = _texts(docs)
    dim = len(embeddings.embed_query("probe"))
    if kind == "ivf":
        quantizer = faiss.IndexFlatIP(dim)
        index = faiss.IndexIVFFlat(quantizer, dim, 20, faiss.METRIC_INNER_PRODUCT)
        index.cp.min_points_per_centroid = 1
        index.train(embeddings._embedder.embed(texts))
        index.nprobe = 5
    else:
        index = faiss.IndexHNSWFlat(dim, 16, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efSearch = 64
    store = FAISS(
        embeddings,
        index,
        InMemoryDocstore(),
        {},
        distance_strategy=DistanceStrategy.MAX_INNER_PRODUCT,
    )
    store.add_texts(texts, metadatas=metadatas, ids=ids)
    _check_same(store, questions, speculates=True)
    if kind == "ivf":
        assert search_source(store).staged.index is index  # the store's own index, no copy


def test_other_store_is_one_stage_and_logs_once(docs, embeddings, questions, caplog) -> None:
    texts, metadatas, ids = _texts(docs[:120])
    store = InMemoryVectorStore(embeddings)
    store.add_texts(texts, metadatas=metadatas, ids=ids)
    source = search_source(store)
    with caplog.at_level(logging.INFO, logger="ragcache_core.retrieval.source"):
        _check_same(store, questions[:10], speculates=False)
        list(source.search_stages(questions[0], K))
        list(source.search_stages(questions[1], K))
    assert sum("cannot be searched in stages" in m for m in caplog.messages) == 2  # one/source
