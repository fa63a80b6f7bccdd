"""Shared pieces of the LangChain integration modules (test_integration_langchain.py: the
runnable and the LLM wrapper; test_integration_langchain_chat.py: conversations, the chat
model and the guide): the sample corpus as LangChain documents, the stores as module-scoped
fixtures (a flat FAISS and an IVF one, searched in stages), a callback handler that records
what LangChain reports, and the chain's own chat prompt."""

from __future__ import annotations

import warnings
from typing import Any

import faiss
import numpy as np
import pytest
from _integration_helpers import corpus, questions
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document as LCDocument
from langchain_core.prompts import ChatPromptTemplate

from ragcache_core.retrieval.embedder import TfidfSvdEmbedder
from ragcache_integrations.langchain import EVENT_NAME, OfflineEmbeddings

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # "langchain-community is being sunset"
    from langchain_community.docstore.in_memory import InMemoryDocstore
    from langchain_community.vectorstores import FAISS
    from langchain_community.vectorstores.utils import DistanceStrategy

DOCS = corpus()
QUESTIONS = questions()
LC_DOCS = [LCDocument(page_content=d.text, metadata={"title": d.title}) for d in DOCS]
IDS = [d.id for d in DOCS]

RETRIEVAL_PROMPT = ChatPromptTemplate.from_messages(
    [
        ("system", "Use the given context to answer the question. Context: {context}"),
        ("human", "{input}"),
    ]
)


# Module-scoped fixtures: a module takes them by name (`flat_store = _langchain_helpers.flat_store`)
# and builds its own.


@pytest.fixture(scope="module")
def embeddings() -> OfflineEmbeddings:
    return OfflineEmbeddings(TfidfSvdEmbedder.fit([d.text for d in DOCS]))


@pytest.fixture(scope="module")
def flat_store(embeddings: OfflineEmbeddings) -> FAISS:
    return FAISS.from_documents(LC_DOCS, embeddings, ids=IDS)


@pytest.fixture(scope="module")
def ivf_store(embeddings: OfflineEmbeddings) -> FAISS:
    vectors = np.asarray(embeddings.embed_documents([d.text for d in DOCS]), dtype=np.float32)
    dim = vectors.shape[1]
    ivf = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, 4, faiss.METRIC_INNER_PRODUCT)
    ivf.train(vectors)
    ivf.nprobe = 2
    store = FAISS(
        embeddings,
        ivf,
        InMemoryDocstore(),
        {},
        distance_strategy=DistanceStrategy.MAX_INNER_PRODUCT,
    )
    store.add_documents(LC_DOCS, ids=IDS)
    return store


class Record(BaseCallbackHandler):
    """Collects what LangChain reports to a callback handler."""

    def __init__(self) -> None:
        self.starts: list[str] = []
        self.ends = 0
        self.reports: list[dict[str, Any]] = []

    def on_chain_start(self, serialized: Any, inputs: Any, **kwargs: Any) -> None:
        self.starts.append(str(kwargs.get("name")))

    def on_chain_end(self, outputs: Any, **kwargs: Any) -> None:
        self.ends += 1

    def on_custom_event(self, name: str, data: Any, **kwargs: Any) -> None:
        if name == EVENT_NAME:
            self.reports.append(data)
