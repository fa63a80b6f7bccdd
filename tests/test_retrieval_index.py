"""Corpus loading, the offline embedder, index build/save/load, sources, traces, stats and CLI."""

from __future__ import annotations

import asyncio
import itertools
import json
from importlib import resources
from pathlib import Path

import numpy as np
import pytest

from ragcache_core.cli import main
from ragcache_core.documents import (
    DEFAULT_DOC_TEMPLATE,
    Document,
    DocumentTemplate,
    render_document,
)
from ragcache_core.errors import InputError
from ragcache_core.retrieval import (
    CallableSource,
    IndexSettings,
    LocalIndex,
    TfidfSvdEmbedder,
    astages,
    build_index,
    final_result,
    load_corpus,
    load_questions,
)
from ragcache_core.retrieval.stats import QueryStages, popularity_skew, record_queries, summarize
from ragcache_core.retrieval.trace import build_trace, poisson_arrivals, tokenizer_counter

DATA = Path(str(resources.files("ragcache_core") / "data"))
DEMO_CORPUS = DATA / "demo_corpus.jsonl"
DEMO_QUESTIONS = DATA / "demo_questions.jsonl"


def _write(path: Path, records: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def demo_docs() -> tuple[Document, ...]:
    return load_corpus([DEMO_CORPUS], id_fields="doc_id")


@pytest.fixture(scope="module")
def demo_index(demo_docs) -> LocalIndex:
    return build_index(demo_docs, IndexSettings(kind="ivf", nprobe=8, lists_per_stage=2))


def test_shipped_demo_sample_is_small_and_attributed(demo_docs) -> None:
    questions = load_questions(DEMO_QUESTIONS)
    assert len(demo_docs) == 300 and len(questions) == 200
    size = sum((DATA / f).stat().st_size for f in ("demo_corpus.jsonl", "demo_questions.jsonl"))
    assert size < 1_000_000
    attribution = (DATA / "ATTRIBUTION.md").read_text(encoding="utf-8")
    for needle in ("demo_corpus.jsonl", "demo_questions.jsonl", "ShareAlike 3.0", "MIT"):
        assert needle in attribution
    assert "Attribution-ShareAlike 4.0" in (DATA / "LICENSE-CC-BY-SA-4.0.txt").read_text()


def test_render_document_uses_title_only_when_present() -> None:
    titled = Document("a", "Body.", {"title": "Paris"})
    assert render_document(titled) == "Title: Paris\nBody.\n\n"
    assert render_document(Document("b", "Body.")) == "Body.\n\n"
    assert render_document(Document("c", "x {y}", {"title": ""})) == "x {y}\n\n"
    custom = DocumentTemplate(titled="<{title}> {text}|", untitled="{text}|")
    assert render_document(titled, custom) == "<Paris> Body.|"
    with pytest.raises(InputError, match="text"):
        DocumentTemplate(titled="{title}")
    assert DEFAULT_DOC_TEMPLATE.titled.startswith("Title: ")


def test_corpus_candidates_and_namespacing(tmp_path) -> None:
    a = _write(tmp_path / "wiki.jsonl", [{"doc_id": 1, "text": "alpha", "title": "A"}])
    b = _write(tmp_path / "squad.jsonl", [{"paragraph_id": "x::0", "context": "beta"}])
    docs = load_corpus([a, b], text_fields="text,context", id_fields="doc_id,paragraph_id")
    assert [d.id for d in docs] == ["wiki:1", "squad:x::0"]
    assert docs[0].title == "A" and docs[0].metadata["source"] == "wiki.jsonl"
    assert docs[1].text == "beta"
    assert [d.id for d in load_corpus([a], id_fields="doc_id")] == ["1"]


@pytest.mark.parametrize(
    ("records", "message"),
    [
        ([], "empty corpus"),
        ([{"id": "1", "text": "a"}, {"id": "1", "text": "b"}], r"c.jsonl:2: duplicate id '1'"),
        (
            [{"id": "1", "body": "a"}],
            r"c.jsonl:1: no text field \(looked for text; the record has id, body\)",
        ),
        ([{"id": "1", "text": "  "}], "empty or not a string"),
        ([{"text": "a"}], "no id field"),
    ],
)
def test_bad_corpora_name_the_problem(tmp_path, records, message) -> None:
    path = _write(tmp_path / "c.jsonl", records)
    with pytest.raises(InputError, match=message):
        load_corpus([path])


def test_bad_json_and_missing_files(tmp_path) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text('{"id": "1", "text": "a"}\n{oops\n', encoding="utf-8")
    with pytest.raises(InputError, match=r"c.jsonl:2: invalid JSON"):
        load_corpus([path])
    with pytest.raises(InputError, match="cannot open"):
        load_corpus([tmp_path / "missing.jsonl"])
    with pytest.raises(InputError, match="no question field"):
        load_questions(_write(tmp_path / "q.jsonl", [{"query": "x"}]))


def test_embedder_is_deterministic_and_round_trips(tmp_path, demo_docs) -> None:
    texts = [d.text for d in demo_docs]
    first = TfidfSvdEmbedder.fit(texts)
    vectors = first.embed(texts[:20])
    assert vectors.shape == (20, first.dimension) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
    np.testing.assert_array_equal(TfidfSvdEmbedder.fit(texts).embed(texts[:20]), vectors)
    first.save(tmp_path)
    np.testing.assert_array_equal(TfidfSvdEmbedder.load(tmp_path).embed(texts[:20]), vectors)
    assert not first.embed_query("qwxz zzzq").any()  # no known word: the zero vector
    # A real embedder: each document is its own nearest neighbour far more often than chance.
    all_vectors = first.embed(texts)
    hits = np.mean(np.argmax(all_vectors @ all_vectors.T, axis=1) == np.arange(len(texts)))
    assert hits > 0.95


@pytest.mark.parametrize("kind", ["ivf", "hnsw", "flat"])
def test_index_round_trip_and_source(tmp_path, demo_docs, kind) -> None:
    index = build_index(demo_docs, IndexSettings(kind=kind, nprobe=8, lists_per_stage=2))
    index.save(tmp_path / kind)
    loaded = LocalIndex.load(tmp_path / kind)
    assert [d.id for d in loaded.documents] == [d.id for d in demo_docs]
    question = "who plays joker in batman the dark knight"
    before = final_result(index.source(), question, 2)
    after = final_result(loaded.source(), question, 2)
    assert before.doc_ids == after.doc_ids and before.scores == after.scores
    stages = list(loaded.source().search_stages(question, 2))
    assert stages[-1].is_last and all(len(s.documents) == 2 for s in stages)
    assert (len(stages) > 1) == (kind != "flat")


def test_source_finds_a_document_by_its_own_text(demo_index, demo_docs) -> None:
    doc = demo_docs[123]
    result = final_result(demo_index.source(), doc.text, 1)
    assert result.documents[0] == doc and result.documents[0].metadata["title"] == doc.title


def test_astages_yields_the_same_stages(demo_index) -> None:
    source = demo_index.source()
    question = "what is the capital of france"

    async def collect() -> list:
        return [r async for r in astages(source, question, 3)]

    async_results = asyncio.run(collect())
    sync_results = list(source.search_stages(question, 3))
    assert [r.doc_ids for r in async_results] == [r.doc_ids for r in sync_results]
    assert async_results[-1].is_last


def test_source_bad_input(demo_index) -> None:
    source = demo_index.source()
    with pytest.raises(InputError, match="non-empty string"):
        source.search_stages("  ", 2)
    with pytest.raises(InputError, match="positive integer"):
        source.search_stages("q", 0)
    with pytest.raises(InputError, match="larger than the index"):
        list(source.search_stages("q", 301))
    with pytest.raises(InputError, match="unknown document id"):
        demo_index.row_of("nope")


def test_callable_source_is_one_stage_and_logs_once(caplog) -> None:
    doc = Document("d", "text")
    source = CallableSource(lambda q, k: [(doc, 0.5)] * k, name="some store")
    with caplog.at_level("INFO", logger="ragcache_core.retrieval.source"):
        results = [list(source.search_stages("q", 2)) for _ in range(3)]
    assert all(len(r) == 1 and r[0].is_last and len(r[0].documents) == 2 for r in results)
    assert sum("cannot be searched in stages" in m for m in caplog.messages) == 1
    assert not source.can_speculate


def test_poisson_arrivals_are_seeded_with_the_right_rate() -> None:
    times = poisson_arrivals(20_000, rate=4.0, seed=3)
    assert np.all(np.diff(times) > 0)
    assert abs(len(times) / times[-1] - 4.0) < 0.15
    np.testing.assert_array_equal(times, poisson_arrivals(20_000, 4.0, 3))
    assert not np.array_equal(times, poisson_arrivals(20_000, 4.0, 4))


SEAM_TOKENS = 4
"""How far a tree node's size may be from its document tokenized alone: the runtime tokenizes
the prompt whole, so a few tokens move across each seam with a neighbour (measured on the demo
sample with the tiny model: 3 at the first document, at most 1 at the last)."""


def test_trace_counts_the_documents_the_runtime_caches(tmp_path, demo_index, tiny_model) -> None:
    """A trace's document sizes are its documents as the runtime renders them (the runtime's
    own document template, `PromptConfig().document`), tokenized alone, and they are within
    the seams of the tree nodes `PromptBuilder` builds for the same request."""
    from transformers import AutoTokenizer

    from ragcache_core.config import PromptConfig
    from ragcache_core.runtime.prompt import PromptBuilder

    questions = load_questions(DEMO_QUESTIONS, limit=12)
    count = tokenizer_counter(str(tiny_model))
    records = build_trace(demo_index, questions, 2, count, rate=2.0)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    config = PromptConfig()
    builder = PromptBuilder(tokenizer, config, str(tiny_model), "float32")
    assert [r.id for r in records] == [q.id for q in questions]
    for record, question in zip(records, questions, strict=True):
        docs = [demo_index.documents[demo_index.row_of(i)] for i in record.docs]
        assert list(record.doc_tokens) == [
            len(tokenizer.encode(render_document(d, config.document), add_special_tokens=False))
            for d in docs
        ]
        nodes = [spec.num_tokens for spec in builder.build(question.text, docs).doc_specs]
        seams = [abs(a - b) for a, b in zip(record.doc_tokens, nodes, strict=True)]
        assert max(seams) <= SEAM_TOKENS, (record.doc_tokens, nodes)
        assert (
            record.question_tokens
            == len(tokenizer.encode(question.text, add_special_tokens=False))
            > 0
        )
        assert record.docs == final_result(demo_index.source(), question.text, 2).doc_ids
    assert all(b.arrival_s > a.arrival_s for a, b in itertools.pairwise(records))


def test_stats_on_known_records() -> None:
    records = [
        QueryStages((0.001, 0.002), ((1, 2), (1, 2)), (0.5, 0.5)),
        QueryStages((0.001, 0.001, 0.002), ((3, 4), (4, 3), (4, 5)), (0.4, 0.5, 0.6)),
    ]
    stats = summarize(records, k=2, corpus_size=100)
    assert stats.first_final_stage == (1, 0, 1)
    assert stats.first_final_set_stage == (1, 0, 1)
    assert stats.recall_at_stage == (0.75, 0.75, 1.0)
    assert stats.final_before_last_share == 0.5
    assert stats.monotone_violations == 0
    assert stats.stage_time_mean_s[2] == pytest.approx(0.002)
    assert summarize(records[1:], 2, 100, higher_is_better=False).monotone_violations == 2
    skew = popularity_skew([[1, 1], [1, 2], [3, 1]], corpus_size=100)
    assert skew == {"top_1%": 4 / 6, "top_5%": 1.0, "top_10%": 1.0}


def test_record_queries_on_a_real_index(demo_index) -> None:
    vectors = demo_index.embedder.embed([q.text for q in load_questions(DEMO_QUESTIONS)])
    records = record_queries(demo_index.staged(), vectors[:30], 2)
    stats = summarize(records, 2, len(demo_index.documents))
    assert stats.queries == 30 and stats.recall_at_stage[-1] == 1.0
    assert sum(stats.first_final_stage) == 30 and stats.monotone_violations == 0


def test_cli_index_trace_and_search_stats(tmp_path, tiny_model, capsys) -> None:
    out = tmp_path / "idx"
    args = ["index", "--corpus", str(DEMO_CORPUS), "--id-field", "doc_id", "--out", str(out)]
    assert main([*args, "--no-progress"]) == 0
    assert "indexed 300 documents" in capsys.readouterr().out
    assert main([*args, "--no-progress"]) == 2  # refuses to overwrite silently
    assert "already holds an index" in capsys.readouterr().err
    trace = tmp_path / "t.jsonl"
    code = main(
        ["trace", "--index", str(out), "--questions", str(DEMO_QUESTIONS), "--top-k", "2",
         "--model", str(tiny_model), "--rate", "5", "--out", str(trace), "--limit", "20"]
    )  # fmt: skip
    assert code == 0
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(lines) == 20
    assert set(lines[0]) == {"id", "arrival_s", "docs", "doc_tokens", "question_tokens"}
    assert all(len(r["docs"]) == len(r["doc_tokens"]) == 2 for r in lines)
    capsys.readouterr()
    stats_args = ["search-stats", "--index", str(out), "--questions", str(DEMO_QUESTIONS)]
    assert main([*stats_args, "--limit", "25", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["queries"] == 25 and sum(stats["first_final_stage"]) == 25
    assert main([*stats_args, "--top-k", "400"]) == 2
    assert "larger than the index" in capsys.readouterr().err


def test_cli_bad_corpus_is_one_line(tmp_path, capsys) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert main(["index", "--corpus", str(empty), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "empty corpus" in err[0]
