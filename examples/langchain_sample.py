"""The sample store of the LangChain chat example: the Wikipedia sample shipped in
`ragcache_core/data/` in a LangChain `FAISS` store on a Faiss IVF index, with the offline
stand-in embedder; and a callback handler that keeps RAGCache's report of each call.
(examples/langchain_quickstart.ipynb walks through the store, `from_vectorstore` and
`RAGCacheLLM`.)
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
from sample_ivf import ivf_index, sample_file

with warnings.catch_warnings():  # langchain-community's sunset notice (its FAISS store works)
    warnings.simplefilter("ignore", DeprecationWarning)
    from langchain_community.docstore.in_memory import InMemoryDocstore
    from langchain_community.vectorstores import FAISS
    from langchain_community.vectorstores.utils import DistanceStrategy
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document

from ragcache_core.retrieval.corpus import load_corpus
from ragcache_core.retrieval.embedder import TfidfSvdEmbedder
from ragcache_integrations.langchain import EVENT_NAME, OfflineEmbeddings


def build_store() -> FAISS:
    """A LangChain FAISS store over the shipped sample, on a Faiss IVF index."""
    corpus = load_corpus([sample_file("demo_corpus.jsonl")])
    texts = [d.text for d in corpus]
    embeddings = OfflineEmbeddings(TfidfSvdEmbedder.fit(texts))  # offline stand-in embedder
    ivf = ivf_index(np.asarray(embeddings.embed_documents(texts), dtype=np.float32))
    store = FAISS(
        embeddings,
        ivf,
        InMemoryDocstore(),
        {},
        distance_strategy=DistanceStrategy.MAX_INNER_PRODUCT,
    )
    docs = [Document(page_content=d.text, metadata={"title": d.title}) for d in corpus]
    store.add_documents(docs, ids=[d.id for d in corpus])
    return store


def show(question: str, answer: str, report: dict[str, Any]) -> None:
    hits = report["cache_hits"]
    print(f"Q: {question}")
    print(f"A: {answer!r}")
    print("   sources:", [d.id for d in report["sources"]])
    print(
        f"   TTFT {report['ttft_s'] * 1000:.0f} ms, cache hits: {hits['gpu_docs']} GPU + "
        f"{hits['host_docs']} host of "
        f"{hits['gpu_docs'] + hits['host_docs'] + hits['computed_docs']} documents"
    )


class Collect(BaseCallbackHandler):
    """A LangChain callback handler keeping RAGCache's report of each call (a custom event)."""

    def __init__(self) -> None:
        self.reports: list[dict[str, Any]] = []

    def on_custom_event(self, name: str, data: Any, **kwargs: Any) -> None:
        if name == EVENT_NAME:
            self.reports.append(data)
