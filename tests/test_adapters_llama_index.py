"""LlamaIndex adapters: the staged source returns what LlamaIndex's own retriever returns.

Real llama-index-core `VectorStoreIndex` over `FaissVectorStore` (flat, IVF, HNSW) and over the
default `SimpleVectorStore`, on the shipped 300-document demo corpus (Wikipedia + SQuAD text) and
the shipped demo questions, embedded by our offline TF-IDF + SVD embedder.
"""

from __future__ import annotations

import logging
from importlib import resources
from pathlib import Path

import faiss
import pytest
from llama_index.core import StorageContext, VectorStoreIndex
from llama_index.core.schema import TextNode
from llama_index.core.vector_stores.simple import SimpleVectorStore
from llama_index.core.vector_stores.types import BasePydanticVectorStore, VectorStoreQueryResult
from llama_index.vector_stores.faiss import FaissVectorStore

from ragcache_core.errors import InputError
from ragcache_core.retrieval import TfidfSvdEmbedder, final_result, load_corpus, load_questions
from ragcache_core.retrieval.index_store import embedding_text
from ragcache_integrations.llama_index.adapters import OfflineEmbedding, search_source

DATA = Path(str(resources.files("ragcache_core") / "data"))
K = 3


@pytest.fixture(scope="module")
def docs():
    return load_corpus([DATA / "demo_corpus.jsonl"], id_fields="doc_id")


@pytest.fixture(scope="module")
def embed_model(docs) -> OfflineEmbedding:
    return OfflineEmbedding(TfidfSvdEmbedder.fit([embedding_text(d) for d in docs]))


@pytest.fixture(scope="module")
def nodes(docs) -> list[TextNode]:
    return [TextNode(id_=d.id, text=d.text, metadata=dict(d.metadata)) for d in docs]


@pytest.fixture(scope="module")
def questions() -> list[str]:
    return [q.text for q in load_questions(DATA / "demo_questions.jsonl")][::4]


def _faiss_index(kind: str, dim: int, embed_model: OfflineEmbedding, nodes) -> faiss.Index:
    if kind == "flat":
        return faiss.IndexFlatIP(dim)
    if kind == "hnsw":
        index = faiss.IndexHNSWFlat(dim, 16, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efSearch = 64
        return index
    quantizer = faiss.IndexFlatIP(dim)
    index = faiss.IndexIVFFlat(quantizer, dim, 24, faiss.METRIC_INNER_PRODUCT)
    index.cp.min_points_per_centroid = 1
    index.train(embed_model._embedder.embed([n.text for n in nodes]))
    index.nprobe = 6
    index.referenced_objects = [quantizer]
    return index


def _same_as_retriever(index: VectorStoreIndex, questions: list[str], speculates: bool) -> None:
    source = search_source(index)
    assert source.can_speculate == speculates
    retriever = index.as_retriever(similarity_top_k=K)
    saw_several_stages = False
    for question in questions:
        expected = retriever.retrieve(question)
        stages = list(source.search_stages(question, K))
        saw_several_stages |= len(stages) > 1
        final = stages[-1]
        assert final.is_last
        assert final.doc_ids == tuple(h.node.node_id for h in expected)
        assert [d.text for d in final.documents] == [h.node.get_content() for h in expected]
        assert final.scores == pytest.approx([h.score for h in expected], abs=1e-6)
    assert saw_several_stages == speculates


@pytest.mark.parametrize("kind", ["flat", "ivf", "hnsw"])
def test_faiss_vector_store(kind, embed_model, nodes, questions) -> None:
    faiss_index = _faiss_index(kind, embed_model._embedder.dimension, embed_model, nodes)
    store = FaissVectorStore(faiss_index=faiss_index)
    index = VectorStoreIndex(
        nodes,
        storage_context=StorageContext.from_defaults(vector_store=store),
        embed_model=embed_model,
    )
    _same_as_retriever(index, questions, speculates=kind != "flat")
    # No copy: the staged search holds the store's own Faiss object.
    source = search_source(index)
    if kind == "ivf":
        assert source.staged.index is faiss_index  # type: ignore[attr-defined]


def test_simple_vector_store_and_refresh(embed_model, nodes, questions) -> None:
    index = VectorStoreIndex(nodes[:250], embed_model=embed_model)
    assert isinstance(index.vector_store, SimpleVectorStore)
    _same_as_retriever(index, questions, speculates=False)
    source = search_source(index)
    target = nodes[280]
    assert final_result(source, target.text, 1).doc_ids != (target.node_id,)
    index.insert_nodes([target])  # the source sees nodes added after it was made
    assert final_result(source, target.text, 1).doc_ids == (target.node_id,)


def test_unknown_store_logs_once_and_matches_retriever(embed_model, nodes, caplog) -> None:
    inner = SimpleVectorStore()

    class ForeignStore(BasePydanticVectorStore):
        """A store the adapter has no staged path for (as any third-party store)."""

        stores_text: bool = False

        @property
        def client(self) -> None:
            return None

        def add(self, nodes, **kwargs):
            return inner.add(nodes, **kwargs)

        def delete(self, ref_doc_id, **kwargs) -> None:
            inner.delete(ref_doc_id, **kwargs)

        def query(self, query, **kwargs) -> VectorStoreQueryResult:
            return inner.query(query, **kwargs)

    index = VectorStoreIndex(
        nodes[:80],
        storage_context=StorageContext.from_defaults(vector_store=ForeignStore()),
        embed_model=embed_model,
    )
    source = search_source(index)
    assert not source.can_speculate
    question = "who plays joker in batman the dark knight"
    with caplog.at_level(logging.INFO, logger="ragcache_core.retrieval.source"):
        results = [list(source.search_stages(question, K)) for _ in range(2)]
    assert sum("cannot be searched in stages" in m for m in caplog.messages) == 1
    expected = index.as_retriever(similarity_top_k=K).retrieve(question)
    assert results[0][-1].doc_ids == tuple(h.node.node_id for h in expected)
    assert len(results[0]) == 1


def test_node_without_text_is_an_input_error(embed_model) -> None:
    index = VectorStoreIndex([TextNode(id_="n1", text="alpha beta")], embed_model=embed_model)
    index.docstore.add_documents([TextNode(id_="n1", text="")], allow_update=True)
    with pytest.raises(InputError, match="node 'n1' has no text"):
        list(search_source(index).search_stages("alpha", 1))
    empty = VectorStoreIndex([], embed_model=embed_model)
    with pytest.raises(InputError, match="empty"):
        list(search_source(empty).search_stages("alpha", 1))
