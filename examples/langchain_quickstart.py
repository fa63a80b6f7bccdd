"""LangChain + RAGCache quickstart: an existing LCEL RAG chain, one line changed.

This file is the README's LangChain quickstart, as written (tests/test_examples.py checks
that the two are the same and runs it). It runs offline: RAGCache's built-in random-weight
model (answers are noise; timings and cache hits are real) and the Wikipedia sample shipped
in `ragcache_core/data/`. examples/langchain_quickstart.ipynb walks through more.

    python examples/langchain_quickstart.py
"""

import json
from importlib import resources

from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_core.vectorstores import InMemoryVectorStore

from ragcache_core import RAGCache, quiet_vllm
from ragcache_core.models import build_tiny_model
from ragcache_core.retrieval.embedder import TfidfSvdEmbedder
from ragcache_integrations.langchain import OfflineEmbeddings, RAGCacheRunnable

if __name__ == "__main__":  # vLLM's engine processes import this file again
    print("vLLM's log:", quiet_vllm())  # vLLM's own lines go to this file
    # The app: its documents, embeddings, retriever and prompt (a Wikipedia sample, offline).
    sample = resources.files("ragcache_core") / "data" / "demo_corpus.jsonl"
    texts = [json.loads(line)["text"] for line in sample.read_text().splitlines()]
    store = InMemoryVectorStore.from_texts(texts, OfflineEmbeddings(TfidfSvdEmbedder.fit(texts)))
    retriever = store.as_retriever(search_kwargs={"k": 2})
    prompt = ChatPromptTemplate.from_template("Context:\n{context}\n\nQuestion: {question}")
    with RAGCache(build_tiny_model()) as cache:  # or the folder of your checkpoint
        chain = (
            {"context": retriever, "question": RunnablePassthrough()}
            # was: | prompt | llm
            | RAGCacheRunnable(cache=cache, prompt=prompt)  # <- the one line RAGCache changes
            | StrOutputParser()
        )
        for question in ["who wrote a doll's house", "what is zero", "who wrote a doll's house"]:
            answer = chain.invoke(question)  # the repeat finds its documents cached
            hits = {k: v for k, v in cache.stats().items() if k.startswith("docs_hit_")}
            print(f"{question!r}: {answer!r}", hits)  # hits since start: the repeat adds 2
