"""The sample index of the LlamaIndex chat example: the Wikipedia sample shipped in
`ragcache_core/data/` in a `VectorStoreIndex` over a Faiss IVF index, with the offline stand-in
embedder. (RAGCache searches an IVF index a few clusters at a time and speculates on the
intermediate top-k; examples/llama_index_quickstart.ipynb walks through it.)
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import faiss
import numpy as np
from llama_index.core import StorageContext, VectorStoreIndex
from llama_index.core.schema import TextNode
from llama_index.vector_stores.faiss import FaissVectorStore

from ragcache_core.documents import Document
from ragcache_core.retrieval.embedder import TfidfSvdEmbedder
from ragcache_integrations.llama_index import OfflineEmbedding


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
