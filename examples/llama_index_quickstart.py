"""LlamaIndex + RAGCache quickstart: an existing VectorStoreIndex, answered through the cache.

Runs offline: the model is RAGCache's built-in random-weight Llama (so the answers are noise,
but the timings and cache hits are real) and the corpus is the Wikipedia sample shipped in
`ragcache_core/data/`. Swap in your own checkpoint folder and index for real answers.

    python examples/llama_index_quickstart.py

Environment overrides (the tests use them to stay quick):
    RAGCACHE_EXAMPLE_MODEL_SIZE   bench (default) or tiny
    RAGCACHE_EXAMPLE_QUESTIONS    how many questions to ask (default 4)
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

import faiss
import numpy as np
from llama_index.core import StorageContext, VectorStoreIndex
from llama_index.core.schema import TextNode
from llama_index.vector_stores.faiss import FaissVectorStore

from ragcache_core import RAGCache, quiet_vllm
from ragcache_core.config import CacheConfig, SamplingConfig
from ragcache_core.documents import Document
from ragcache_core.retrieval.corpus import load_corpus, load_questions
from ragcache_core.retrieval.embedder import TfidfSvdEmbedder
from ragcache_core.testing import build_tiny_model
from ragcache_integrations.llama_index import OfflineEmbedding, as_query_engine

MODEL_SIZE = os.environ.get("RAGCACHE_EXAMPLE_MODEL_SIZE", "bench")
NUM_QUESTIONS = int(os.environ.get("RAGCACHE_EXAMPLE_QUESTIONS", "4"))


def sample_file(name: str) -> Path:
    return Path(str(resources.files("ragcache_core") / "data" / name))


def ivf_lists(n: int) -> int:
    """IVF lists for `n` vectors: Faiss trains each list's centroid on at least 39 of them
    (fewer train noisy centroids, and Faiss warns), so 300 documents get 7 lists."""
    return max(1, n // 39)


def build_index(documents: tuple[Document, ...]) -> VectorStoreIndex:
    """A LlamaIndex VectorStoreIndex over a Faiss IVF index (what an app already has)."""
    texts = [d.text for d in documents]
    embed_model = OfflineEmbedding(TfidfSvdEmbedder.fit(texts))  # offline stand-in embedder
    vectors = np.asarray(embed_model.get_text_embedding_batch(texts), dtype=np.float32)
    dim = vectors.shape[1]
    # IVF: RAGCache searches it a few clusters at a time and starts generating on the
    # intermediate top-k (speculative pipelining); a flat index is searched in one step.
    lists = ivf_lists(len(texts))
    ivf = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, lists, faiss.METRIC_INNER_PRODUCT)
    ivf.train(vectors)
    ivf.nprobe = min(4, ivf.nlist)
    nodes = [TextNode(id_=d.id, text=d.text, metadata={"title": d.title}) for d in documents]
    storage = StorageContext.from_defaults(vector_store=FaissVectorStore(faiss_index=ivf))
    return VectorStoreIndex(nodes, storage_context=storage, embed_model=embed_model)


def main() -> None:
    # vLLM's own log lines go to a file (RAGCACHE_VLLM_LOG chooses it); here only results.
    print(f"vLLM's log: {quiet_vllm()}")
    documents = load_corpus([sample_file("demo_corpus.jsonl")])
    questions = [q.text for q in load_questions(sample_file("demo_questions.jsonl"))]
    index = build_index(documents)
    model = build_tiny_model(size=MODEL_SIZE)  # or the folder of a real checkpoint

    config = CacheConfig(
        host_pool_tokens=32768,
        sampling=SamplingConfig(max_tokens=16),
    )
    with RAGCache(model, config) as cache:
        # The one line that changes: instead of index.as_query_engine(similarity_top_k=2).
        engine = as_query_engine(index, cache=cache, similarity_top_k=2)

        asked = questions[:NUM_QUESTIONS]
        for question in [*asked, asked[0]]:  # the repeat finds its documents cached
            response = engine.query(question)
            hits = response.metadata["cache_hits"]
            print(f"Q: {question}")
            print(f"A: {response.response!r}")
            print("   sources:", [n.node.node_id for n in response.source_nodes])
            print(
                f"   TTFT {response.metadata['ttft_s'] * 1000:.0f} ms, cache hits: "
                f"{hits['gpu_docs']} GPU + {hits['host_docs']} host of "
                f"{hits['gpu_docs'] + hits['host_docs'] + hits['computed_docs']} documents"
            )

        streaming = as_query_engine(index, cache=cache, similarity_top_k=2, streaming=True)
        response = streaming.query(asked[-1])
        print("streamed:", end=" ")
        response.print_response_stream()
        print()

        stats = cache.stats()
        print(
            f"requests {stats['requests']}, documents hit on GPU {stats['docs_hit_gpu']} / host "
            f"{stats['docs_hit_host']} of {stats['docs_requested']}, prompt tokens saved "
            f"{stats['tokens_saved']}"
        )


if __name__ == "__main__":  # vLLM's engine processes import this file again: guard the start
    main()
