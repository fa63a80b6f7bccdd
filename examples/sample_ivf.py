"""What the chat examples' sample index and store share: the shipped sample and a Faiss IVF
index over its vectors. (RAGCache searches an IVF index a few clusters at a time and starts
generating on the intermediate top-k: speculative pipelining; a flat index is searched in one
step.)"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import faiss
import numpy as np


def sample_file(name: str) -> Path:
    """A file of the sample shipped in `ragcache_core/data/`."""
    return Path(str(resources.files("ragcache_core") / "data" / name))


def ivf_index(vectors: np.ndarray) -> Any:
    """A trained, empty Faiss IVF index (inner product) for rows like `vectors`. Faiss trains
    each list's centroid on at least 39 vectors (fewer train noisy centroids, and Faiss warns),
    so 300 documents get 7 lists."""
    dim = vectors.shape[1]
    lists = max(1, len(vectors) // 39)
    ivf = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, lists, faiss.METRIC_INNER_PRODUCT)
    ivf.train(vectors)
    ivf.nprobe = min(4, ivf.nlist)
    return ivf
