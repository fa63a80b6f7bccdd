"""`bench quality`'s streams on the real benchmark data (skipped without it): SQuAD questions
with their gold paragraph placed among the retriever's two best other documents, at a cycling
position; NQ-open questions with the retriever's top-3; both sampled with a seed. One index of
the 12,100-document corpus (~15 s) serves the module. No engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ragcache_core.bench.data_dir import NQ_OPEN, SQUAD_PARAGRAPHS, SQUAD_QUESTIONS
from ragcache_core.bench.quality_streams import (
    STREAMS,
    TOP_K,
    Corpus,
    QualityStream,
    corpus_search,
    load_stream,
)
from ragcache_core.bench.scoring import retrieval_recall
from ragcache_core.bench.workloads import corpus_id, read_jsonl
from ragcache_core.errors import InputError
from ragcache_core.search import final_result

N = 30


@pytest.fixture(scope="module")
def corpus(shared_data: Path) -> Corpus:
    return corpus_search(shared_data)


@pytest.fixture(scope="module")
def squad(corpus: Corpus, shared_data: Path) -> QualityStream:
    return load_stream("squad", N, seed=5, data_dir=shared_data, corpus=corpus)


def _by_id(path: Path) -> dict[str, dict[str, Any]]:
    """Records by `QualityItem.id` (SQuAD's ids; NQ-open's by line)."""
    return {str(r.get("id", f"{path.stem}:{i}")): r for i, r in enumerate(read_jsonl(path))}


def test_squad_places_the_gold_among_the_retrievers_two_best_others(
    squad: QualityStream, corpus: Corpus, shared_data: Path
) -> None:
    records = _by_id(shared_data / SQUAD_QUESTIONS)
    assert len(squad.items) == N and len({i.id for i in squad.items}) == N
    for item in squad.items:
        record = records[item.id]
        assert item.question == record["question"]
        gold_id = corpus_id(SQUAD_PARAGRAPHS, str(record["paragraph_id"]))
        ids = [d.id for d in item.documents]
        assert len(ids) == TOP_K == len(set(ids))
        assert item.gold_position is not None and ids[item.gold_position] == gold_id
        found = final_result(corpus.source, item.question, TOP_K).doc_ids
        assert [i for i in ids if i != gold_id] == [i for i in found if i != gold_id][:2]
        assert item.answers == tuple(dict.fromkeys(record["answers"]))
        gold_text = item.documents[item.gold_position].text
        assert retrieval_recall([gold_text], item.answers) == 1.0  # SQuAD answers are spans
        assert "_" not in item.documents[item.gold_position].title  # "Super Bowl 50"
    assert squad.gold_in_top3 is not None and 0 < squad.gold_in_top3 <= N


def test_squad_gold_positions_cycle_from_a_seeded_start(
    squad: QualityStream, corpus: Corpus, shared_data: Path
) -> None:
    positions = [i.gold_position for i in squad.items]
    first = positions[0]
    assert first is not None
    assert positions == [(first + i) % TOP_K for i in range(N)]
    starts = {
        load_stream("squad", 3, seed=s, data_dir=shared_data, corpus=corpus).items[0].gold_position
        for s in range(8)
    }
    assert len(starts) > 1  # the start is drawn, not fixed


def test_nq_is_the_retrievers_top3(corpus: Corpus, shared_data: Path) -> None:
    stream = load_stream("nq", N, seed=5, data_dir=shared_data, corpus=corpus)
    records = _by_id(shared_data / NQ_OPEN)
    for item in stream.items:
        assert item.question == records[item.id]["question"]
        found = final_result(corpus.source, item.question, TOP_K)
        assert [d.id for d in item.documents] == list(found.doc_ids)
        assert item.answers == tuple(records[item.id]["answer"])
        assert item.gold_position is None
    assert stream.gold_in_top3 is None and stream.name == "nq"


def test_the_sample_follows_the_seed(
    squad: QualityStream, corpus: Corpus, shared_data: Path
) -> None:
    again = load_stream("squad", N, seed=5, data_dir=shared_data, corpus=corpus)
    assert again == squad
    other = load_stream("squad", N, seed=6, data_dir=shared_data, corpus=corpus)
    assert {i.id for i in other.items} != {i.id for i in squad.items}
    first = load_stream("nq", 5, seed=5, data_dir=shared_data, corpus=corpus)
    longer = load_stream("nq", 10, seed=5, data_dir=shared_data, corpus=corpus)
    assert longer.items[:5] == first.items  # more questions extend the same sample


def test_bad_requests_are_input_errors(corpus: Corpus, shared_data: Path, tmp_path: Path) -> None:
    assert STREAMS == ("squad", "nq")
    with pytest.raises(InputError, match="unknown stream 'mmlu'"):
        load_stream("mmlu", 5, data_dir=shared_data, corpus=corpus)
    with pytest.raises(InputError, match="3,610 questions; 5,000 were asked for"):
        load_stream("nq", 5000, data_dir=shared_data, corpus=corpus)
    with pytest.raises(InputError, match="--data-dir"):
        load_stream("squad", 5, data_dir=tmp_path)
