"""LangChain + RAGCache quickstart: the usual LCEL RAG chain with `prompt | llm` replaced.

Runs offline: the model is RAGCache's built-in random-weight Llama (so the answers are noise,
but the timings and cache hits are real) and the corpus is the Wikipedia sample shipped in
`ragcache_core/data/`. Swap in your own checkpoint folder and vector store for real answers.

    python examples/langchain_quickstart.py

Environment overrides (the tests use them to stay quick):
    RAGCACHE_EXAMPLE_MODEL_SIZE   bench (default) or tiny
    RAGCACHE_EXAMPLE_QUESTIONS    how many questions to ask (default 4)
"""

from __future__ import annotations

import os
import warnings
from importlib import resources
from pathlib import Path
from typing import Any

import faiss
import numpy as np

with warnings.catch_warnings():  # langchain-community's sunset notice (its FAISS store works)
    warnings.simplefilter("ignore", DeprecationWarning)
    from langchain_community.docstore.in_memory import InMemoryDocstore
    from langchain_community.vectorstores import FAISS
    from langchain_community.vectorstores.utils import DistanceStrategy
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import PromptTemplate
from langchain_core.runnables import RunnablePassthrough

from ragcache_core import RAGCache, quiet_vllm
from ragcache_core.config import CacheConfig, PromptConfig, SamplingConfig
from ragcache_core.retrieval.corpus import load_corpus, load_questions
from ragcache_core.retrieval.embedder import TfidfSvdEmbedder
from ragcache_core.testing import build_tiny_model
from ragcache_integrations.langchain import (
    EVENT_NAME,
    OfflineEmbeddings,
    RAGCacheLLM,
    RAGCacheRunnable,
)

MODEL_SIZE = os.environ.get("RAGCACHE_EXAMPLE_MODEL_SIZE", "bench")
NUM_QUESTIONS = int(os.environ.get("RAGCACHE_EXAMPLE_QUESTIONS", "4"))


def sample_file(name: str) -> Path:
    return Path(str(resources.files("ragcache_core") / "data" / name))


def ivf_lists(n: int) -> int:
    """IVF lists for `n` vectors: Faiss trains each list's centroid on at least 39 of them
    (fewer train noisy centroids, and Faiss warns), so 300 documents get 7 lists."""
    return max(1, n // 39)


def build_store() -> FAISS:
    """A LangChain FAISS store over the shipped sample, on a Faiss IVF index."""
    corpus = load_corpus([sample_file("demo_corpus.jsonl")])
    texts = [d.text for d in corpus]
    embeddings = OfflineEmbeddings(TfidfSvdEmbedder.fit(texts))  # offline stand-in embedder
    vectors = np.asarray(embeddings.embed_documents(texts), dtype=np.float32)
    dim = vectors.shape[1]
    # IVF: RAGCache searches it a few clusters at a time and starts generating on the
    # intermediate top-k (speculative pipelining); a flat index is searched in one step.
    lists = ivf_lists(len(texts))
    ivf = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, lists, faiss.METRIC_INNER_PRODUCT)
    ivf.train(vectors)
    ivf.nprobe = min(4, ivf.nlist)
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


def main() -> None:
    # vLLM's own log lines go to a file (RAGCACHE_VLLM_LOG chooses it); here only results.
    print(f"vLLM's log: {quiet_vllm()}")
    store = build_store()
    retriever = store.as_retriever(search_kwargs={"k": 2})
    questions = [q.text for q in load_questions(sample_file("demo_questions.jsonl"))]
    asked = questions[:NUM_QUESTIONS]
    model = build_tiny_model(size=MODEL_SIZE)  # or the folder of a real checkpoint

    config = CacheConfig(
        host_pool_tokens=32768,
        sampling=SamplingConfig(max_tokens=16),
        # RAGCache's own layout (used where the chain brings no prompt of its own), with
        # the question text verbatim.
        prompt=PromptConfig(question="{question}"),
    )
    with RAGCache(model, config) as cache:
        # 1. The usual LCEL chain; `RAGCacheRunnable` replaces `prompt | llm`.
        chain = (
            {"context": retriever, "question": RunnablePassthrough()}
            | RAGCacheRunnable(cache=cache)
            | StrOutputParser()
        )
        for question in [*asked, asked[0]]:  # the repeat finds its documents cached
            collect = Collect()
            answer = chain.invoke(question, config={"callbacks": [collect]})
            show(question, answer, collect.reports[-1])
        print("streamed:", "".join(chain.stream(asked[-1])))

        # 2. Retrieval inside RAGCache: the Faiss IVF store is searched in stages, and
        #    RAGCache speculates on the intermediate top-k.
        direct = RAGCacheRunnable.from_vectorstore(store, cache=cache, k=2)
        collect = Collect()
        answer = direct.invoke(asked[1], config={"callbacks": [collect]})
        show(asked[1], answer, collect.reports[-1])

        # 3. Only the LLM node can change: `RAGCacheLLM` finds the retrieved documents in
        #    the rendered prompt (it remembers what the watched retriever returned).
        llm = RAGCacheLLM(cache=cache)
        prompt = PromptTemplate.from_template(
            "Answer from the context.\n\n{context}\n\nQuestion: {question}\nAnswer:"
        )
        llm_chain = (
            {"context": llm.watch(retriever) | format_docs, "question": RunnablePassthrough()}
            | prompt
            | llm
            | StrOutputParser()
        )
        for question in asked[:2]:
            print(f"RAGCacheLLM: {question!r} -> {llm_chain.invoke(question)!r}")

        stats = cache.stats()
        print(
            f"requests {stats['requests']}, documents hit on GPU {stats['docs_hit_gpu']} / host "
            f"{stats['docs_hit_host']} of {stats['docs_requested']}, prompt tokens saved "
            f"{stats['tokens_saved']}"
        )


def format_docs(docs: list[Document]) -> str:
    return "\n\n".join(d.page_content for d in docs)


class Collect(BaseCallbackHandler):
    """A LangChain callback handler keeping RAGCache's report of each call (a custom event)."""

    def __init__(self) -> None:
        self.reports: list[dict[str, Any]] = []

    def on_custom_event(self, name: str, data: Any, **kwargs: Any) -> None:
        if name == EVENT_NAME:
            self.reports.append(data)


if __name__ == "__main__":  # vLLM's engine processes import this file again: guard the start
    main()
