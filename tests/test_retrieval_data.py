"""Staged search on real benchmark data from ../shared/data (skipped when the folder is absent)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from ragcache_core.documents import Document
from ragcache_core.retrieval import IndexSettings, build_index, load_questions
from ragcache_core.retrieval.stats import record_queries, summarize

pytestmark = pytest.mark.data


@pytest.mark.parametrize("kind", ["ivf", "hnsw"])
def test_staged_equals_plain_on_wikipedia_and_nq(shared_data, kind) -> None:
    docs = []
    for name, text_field, id_field in (
        ("vital_articles_en_corpus.jsonl", "text", "doc_id"),
        ("squad_v1.1_dev_paragraphs.jsonl", "context", "paragraph_id"),
    ):
        with (shared_data / name).open(encoding="utf-8") as lines:
            for line in itertools.islice(lines, 1500):
                r = json.loads(line)
                docs.append(Document(f"{name}:{r[id_field]}", r[text_field], {"title": r["title"]}))
    index = build_index(docs, IndexSettings(kind=kind))
    questions = load_questions(shared_data / "NQ-open.dev.jsonl", limit=300)
    vectors = index.embedder.embed([q.text for q in questions])
    staged = index.staged()
    for k in (1, 2, 5):
        _, expected = index.faiss_index.search(vectors, k)
        np.testing.assert_array_equal(staged.search(vectors, k).ids, expected)
    stats = summarize(record_queries(staged, vectors, 2), 2, len(docs))
    assert stats.monotone_violations == 0
    assert stats.recall_at_stage[-1] == 1.0 and stats.stages_max > 1
