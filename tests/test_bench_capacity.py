"""Capacity-constrained workloads: the host tier sized on the measured stream's distinct
document tokens (issue 39), without an engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ragcache_core.bench.workloads import (
    CAPACITY_WORKLOADS,
    SHARED_WORKLOADS,
    WORKLOADS,
    Request,
    Workload,
    host_sizing,
    load_workload,
)
from ragcache_core.documents import Document
from ragcache_core.errors import InputError
from ragcache_core.search import StageResult


def _words(text: str) -> int:
    return len(text.split())


def _doc(name: str, words: int) -> Document:
    return Document(name, " ".join(["w"] * words))


A, B, C = _doc("a", 100), _doc("b", 300), _doc("c", 1000)


def test_capacity_workloads_are_named_and_shared() -> None:
    assert CAPACITY_WORKLOADS == {
        "long-shuffled-host25": ("long-shuffled", 0.25),
        "long-shuffled-host50": ("long-shuffled", 0.5),
        "long-zipf-host25": ("long-zipf", 0.25),
        "long-zipf-host50": ("long-zipf", 0.5),
        "short-host25": ("short", 0.25),
        "short-host50": ("short", 0.5),
    }
    assert set(CAPACITY_WORKLOADS) <= set(WORKLOADS) and set(CAPACITY_WORKLOADS) <= SHARED_WORKLOADS


def test_sizing_counts_each_document_of_the_measured_stream_once() -> None:
    """a and b repeat; c comes only after the measured stream (request 4), so it is not
    counted: 25% of 400 tokens."""
    requests = (
        Request("q1", (A, B)),
        Request("q2", (B,)),
        Request("q3", (A,)),
        Request("q4", (C,)),
    )
    workload = Workload("w", "", (A, B, C), requests, 2, host_share=0.25)
    sizing = host_sizing(workload, None, 3, _words, token_bytes=2 * 1024**2)
    assert (sizing.distinct_documents, sizing.distinct_tokens, sizing.host_tokens) == (2, 400, 100)
    assert sizing.host_gib == pytest.approx(100 * 2 / 1024)
    assert sizing.line() == (
        "host tier 100 tokens (0.20 GiB) = 25% of the 400 tokens of the 2 distinct documents of "
        "the measured stream (3 requests)"
    )
    # The stream repeats its pool past its end (as bench serve's does): 5 requests reach c.
    assert host_sizing(workload, None, 5, _words, 1).distinct_tokens == 1400


class _Lookup:
    """A search that answers each question with fixed documents (isolates the sizing from an
    index; the real search runs in the engine tests)."""

    def __init__(self, answers: dict[str, tuple[Document, ...]]) -> None:
        self.answers = answers
        self.asked: list[tuple[str, int]] = []

    def search_stages(self, question: str, k: int) -> Iterator[StageResult]:
        self.asked.append((question, k))
        found = self.answers[question][:k]
        yield StageResult(found, tuple(1.0 for _ in found), 0, True, 0.0)


def test_sizing_a_retrieving_stream_runs_its_search_at_its_top_k() -> None:
    source = _Lookup({"x": (C, A, B), "y": (B, C, A)})
    workload = Workload("w", "", (A, B, C), (Request("x"), Request("y")), 2, host_share=0.5)
    sizing = host_sizing(workload, source, 2, _words, 1)  # type: ignore[arg-type]
    assert source.asked == [("x", 2), ("y", 2)]
    assert (sizing.distinct_documents, sizing.distinct_tokens, sizing.host_tokens) == (3, 1400, 700)


def test_sizing_refuses_what_it_cannot_size() -> None:
    plain = Workload("plain", "", (A,), (Request("q", (A,)),), 1)
    with pytest.raises(InputError, match="not capacity-constrained"):
        host_sizing(plain, None, 1, _words, 1)
    retrieving = Workload("r", "", (A,), (Request("q"),), 1, host_share=0.5)
    with pytest.raises(InputError, match="no search source"):
        host_sizing(retrieving, None, 1, _words, 1)


def test_long_shuffled_host25_is_long_shuffled_with_a_host_share(shared_data: Path) -> None:
    base = load_workload("long-shuffled", _words, data_dir=shared_data)
    capped = load_workload("long-shuffled-host25", _words, data_dir=shared_data)
    assert capped.name == "long-shuffled-host25" and capped.host_share == 0.25
    assert base.host_share is None
    assert capped.requests == base.requests and capped.top_k == base.top_k == 1
    assert capped.description.startswith(base.description)


def test_long_zipf_draws_popular_chunks_again(shared_data: Path) -> None:
    """The stream with reuse: its first 104 requests ask about far fewer distinct chunks than
    `long-shuffled`'s, the most-drawn chunk is among the most-asked, and a seed fixes it."""
    from collections import Counter

    from ragcache_core.bench.data_dir import SQUAD_PARAGRAPHS, SQUAD_QUESTIONS
    from ragcache_core.bench.workloads import CHUNK_TOKENS, chunk_articles, read_jsonl

    zipf = load_workload("long-zipf", _words, data_dir=shared_data)
    shuffled = load_workload("long-shuffled", _words, data_dir=shared_data)
    assert zipf.documents == shuffled.documents and zipf.top_k == 1 and zipf.retrieves
    chunks = chunk_articles(read_jsonl(shared_data / SQUAD_PARAGRAPHS), _words, CHUNK_TOKENS)
    chunk_of = {pid: c["doc_id"] for c in chunks for pid in c["paragraph_ids"]}
    gold = {
        str(q["question"]): chunk_of[str(q["paragraph_id"])]
        for q in read_jsonl(shared_data / SQUAD_QUESTIONS)
        if str(q["paragraph_id"]) in chunk_of
    }
    asked = Counter(gold.values())

    def drawn(workload: Workload) -> Counter[str]:
        return Counter(gold[r.question] for r in workload.stream(104))

    zipf_drawn, shuffled_drawn = drawn(zipf), drawn(shuffled)
    assert len(zipf_drawn) < 0.8 * len(shuffled_drawn)
    top, count = zipf_drawn.most_common(1)[0]
    assert count >= 8 and asked[top] >= sorted(asked.values())[-10]
    again = load_workload("long-zipf", _words, data_dir=shared_data)
    other = load_workload("long-zipf", _words, seed=1, data_dir=shared_data)
    assert again.requests == zipf.requests and other.requests != zipf.requests
    capped = load_workload("long-zipf-host25", _words, data_dir=shared_data)
    assert capped.requests == zipf.requests and capped.host_share == 0.25


def test_xlong_shuffled_has_the_long_shuffled_questions_over_chunks_twice_as_long(
    shared_data: Path,
) -> None:
    """The host-tier issue's stream: each chunk is closed at 2,400 tokens or before 1.5 times
    that, so a prompt of one fits the bench model's 4,096-token context."""
    from ragcache_core.bench.workloads import XLONG_CHUNK_TOKENS

    xlong = load_workload("xlong-shuffled", _words, data_dir=shared_data)
    long = load_workload("long-shuffled", _words, data_dir=shared_data)
    sizes = [_words(d.text) for d in xlong.documents]
    assert max(sizes) < 1.5 * XLONG_CHUNK_TOKENS
    assert sum(s >= XLONG_CHUNK_TOKENS for s in sizes) > len(sizes) / 2
    assert len(xlong.documents) < len(long.documents) / 1.8
    assert {r.question for r in xlong.requests} == {r.question for r in long.requests}
    assert xlong.top_k == 1 and xlong.retrieves
