"""Shared pieces of the LlamaIndex integration modules (test_integration_llama_index.py: the
query and chat engines; test_integration_llama_index_conventions.py: LlamaIndex's own
keywords, prompt keys, postprocessors, filters, LLM events and the guide): the sample corpus as
nodes, the indexes as module-scoped fixtures (Faiss IVF, searched in stages, and
SimpleVectorStore), and what a response's source nodes say."""

from __future__ import annotations

from typing import Any

import faiss
import numpy as np
import pytest
from _integration_helpers import corpus, questions
from llama_index.core import StorageContext, VectorStoreIndex
from llama_index.core.schema import TextNode
from llama_index.vector_stores.faiss import FaissVectorStore

from ragcache_core.retrieval.embedder import TfidfSvdEmbedder
from ragcache_integrations.llama_index import OfflineEmbedding, node_to_document

DOCS = corpus()
QUESTIONS = questions()


def text_nodes() -> list[TextNode]:
    return [TextNode(id_=d.id, text=d.text, metadata={"title": d.title}) for d in DOCS]


# Module-scoped fixtures: a module takes them by name (`ivf_index = _llama_index_helpers.ivf_index`)
# and builds its own.


@pytest.fixture(scope="module")
def embed_model() -> OfflineEmbedding:
    return OfflineEmbedding(TfidfSvdEmbedder.fit([d.text for d in DOCS]))


@pytest.fixture(scope="module")
def ivf_index(embed_model: OfflineEmbedding) -> VectorStoreIndex:
    vectors = np.asarray(embed_model.get_text_embedding_batch([d.text for d in DOCS]), "float32")
    dim = vectors.shape[1]
    ivf = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, 4, faiss.METRIC_INNER_PRODUCT)
    ivf.train(vectors)
    ivf.nprobe = 2
    storage = StorageContext.from_defaults(vector_store=FaissVectorStore(faiss_index=ivf))
    return VectorStoreIndex(text_nodes(), storage_context=storage, embed_model=embed_model)


@pytest.fixture(scope="module")
def simple_index(embed_model: OfflineEmbedding) -> VectorStoreIndex:
    return VectorStoreIndex(text_nodes(), embed_model=embed_model)


def source_ids(response: Any) -> list[str]:
    return [n.node.node_id for n in response.source_nodes]


def response_documents(response: Any) -> tuple[Any, ...]:
    """The response's source nodes as the documents RAGCache was given."""
    return tuple(node_to_document(n.node) for n in response.source_nodes)
