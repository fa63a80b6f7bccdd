"""The sample index of the LlamaIndex chat example: the Wikipedia sample shipped in
`ragcache_core/data/` in a `VectorStoreIndex` over a Faiss IVF index, with the offline stand-in
embedder. (RAGCache searches an IVF index a few clusters at a time and speculates on the
intermediate top-k; examples/llama_index_quickstart.ipynb walks through it.)
"""

from __future__ import annotations

import numpy as np
from llama_index.core import StorageContext, VectorStoreIndex
from llama_index.core.schema import TextNode
from llama_index.vector_stores.faiss import FaissVectorStore
from sample_ivf import ivf_index

from ragcache_core.documents import Document
from ragcache_core.retrieval.embedder import TfidfSvdEmbedder
from ragcache_integrations.llama_index import OfflineEmbedding


def build_index(documents: tuple[Document, ...]) -> VectorStoreIndex:
    """A LlamaIndex VectorStoreIndex over a Faiss IVF index (what an app already has)."""
    texts = [d.text for d in documents]
    embed_model = OfflineEmbedding(TfidfSvdEmbedder.fit(texts))  # offline stand-in embedder
    ivf = ivf_index(np.asarray(embed_model.get_text_embedding_batch(texts), dtype=np.float32))
    nodes = [TextNode(id_=d.id, text=d.text, metadata={"title": d.title}) for d in documents]
    storage = StorageContext.from_defaults(vector_store=FaissVectorStore(faiss_index=ivf))
    return VectorStoreIndex(nodes, storage_context=storage, embed_model=embed_model)
