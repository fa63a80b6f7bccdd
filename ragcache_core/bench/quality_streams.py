"""The question streams of `ragcache bench quality`: real questions, gold answers, top-3 contexts.

| stream  | questions (sampled, seeded)  | the 3 documents of each                           |
|---------|------------------------------|---------------------------------------------------|
| `squad` | SQuAD v1.1 dev (10,570)      | the gold paragraph and the two best-scoring other |
|         |                              | documents retrieved for the question; the gold at |
|         |                              | position 0, 1, 2 in turn (a seeded first one)     |
| `nq`    | NQ-open dev (3,610)          | the top-3 retrieved                               |

The retriever of both is the project's: the offline TF-IDF + SVD embedder with an IVF index
(`retrieval.index_store.build_index`, default settings, `bench.workloads.RETRIEVER`) over the
benchmark corpus of 12,100 documents (vital-article leads + SQuAD dev paragraphs,
`bench.workloads.benchmark_corpus`: `short`'s documents). So a `squad` distractor is a vital
article or another SQuAD paragraph (often of the same article), whichever scores best.

Every request brings its documents (`Request.documents`, in retrieval order, the gold placed):
each system reads the same documents, and the search runs once, here. SQuAD titles are shown
with spaces for underscores (`Super Bowl 50`), as the long-chunk workloads show them.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ragcache_core.bench.data_dir import (
    NQ_OPEN,
    SQUAD_PARAGRAPHS,
    SQUAD_QUESTIONS,
    VITAL_ARTICLES,
    require_data,
    resolve_data_dir,
)
from ragcache_core.bench.workloads import (
    CORPUS_FILES,
    RETRIEVER,
    Request,
    benchmark_corpus,
    corpus_id,
    read_jsonl,
)
from ragcache_core.documents import Document
from ragcache_core.errors import InputError
from ragcache_core.search import SearchSource, final_result

TOP_K = 3
STREAMS = ("squad", "nq")
STREAM_FILES = {
    "squad": (VITAL_ARTICLES, SQUAD_PARAGRAPHS, SQUAD_QUESTIONS),
    "nq": (VITAL_ARTICLES, SQUAD_PARAGRAPHS, NQ_OPEN),
}
"""The benchmark data files each stream reads (checked before anything is built)."""


@dataclass(frozen=True)
class QualityItem:
    """One question, its gold answers and the documents every system reads (prompt order)."""

    id: str
    """SQuAD's question id; for NQ-open (no ids) `NQ-open.dev:<line>`, its line from 0."""
    question: str
    answers: tuple[str, ...]
    documents: tuple[Document, ...]
    gold_position: int | None = None
    """`squad`: where the gold paragraph is among `documents`; None for `nq` (no gold)."""

    @property
    def request(self) -> Request:
        return Request(self.question, self.documents)


@dataclass(frozen=True)
class QualityStream:
    """A sampled stream of questions (see the module docstring)."""

    name: str
    description: str
    items: tuple[QualityItem, ...]
    seed: int
    retriever: str = RETRIEVER
    gold_in_top3: int | None = None
    """`squad`: questions whose gold paragraph the retriever itself ranked in its top-3."""

    def requests(self) -> list[Request]:
        return [item.request for item in self.items]


def stream_files(name: str) -> tuple[str, ...]:
    """The data files stream `name` reads. Raises `InputError` for an unknown stream."""
    if name not in STREAM_FILES:
        raise InputError(f"unknown stream {name!r}: choose from {', '.join(STREAMS)}")
    return STREAM_FILES[name]


@dataclass(frozen=True)
class Corpus:
    """The benchmark corpus by id, and the project's retriever over it."""

    documents: Mapping[str, Document]
    source: SearchSource


def corpus_search(data_dir: Path, *, progress: bool = False) -> Corpus:
    """The benchmark corpus indexed with the project's retriever (~15 s on the 2-core
    machine). Raises `InputError` when the folder lacks a corpus file."""
    from ragcache_core.retrieval.index_store import IndexSettings, build_index

    require_data(data_dir, CORPUS_FILES)
    index = build_index(benchmark_corpus(data_dir), IndexSettings(kind="ivf"), progress=progress)
    return Corpus({d.id: d for d in index.documents}, index.source())


def load_stream(
    name: str,
    questions: int,
    *,
    seed: int = 0,
    data_dir: Path | None = None,
    corpus: Corpus | None = None,
    progress: bool = False,
) -> QualityStream:
    """`questions` questions of stream `name`, sampled with `seed`, each with its documents.
    `corpus`: the indexed benchmark corpus (None: built here, `corpus_search`).
    Raises `InputError` for an unknown stream, a missing data file, or more questions than
    the dataset has."""
    folder = require_data(resolve_data_dir(data_dir), stream_files(name))
    if questions < 1:
        raise InputError(f"the question count must be positive, got {questions}")
    file = SQUAD_QUESTIONS if name == "squad" else NQ_OPEN
    records = read_jsonl(folder / file)
    if questions > len(records):
        raise InputError(f"{name} has {len(records):,} questions; {questions:,} were asked for")
    rng = random.Random(seed)
    order = list(range(len(records)))
    rng.shuffle(order)  # a larger sample of the same seed extends a smaller one
    picked = [(_question_id(file, i, records[i]), records[i]) for i in order[:questions]]
    search = corpus if corpus is not None else corpus_search(folder, progress=progress)
    bar = _bar(len(picked), progress)
    if name == "squad":
        return _squad_stream(picked, search, seed, rng.randrange(TOP_K), bar)
    return _nq_stream(picked, search, seed, bar)


Picked = Sequence[tuple[str, dict[str, Any]]]
"""The sampled questions: (`QualityItem.id`, the dataset's record)."""


def _squad_stream(
    picked: Picked, search: Corpus, seed: int, first: int, bar: Callable[[int], None]
) -> QualityStream:
    """Each question with its gold paragraph at position `first`, then the next, cycling."""
    items, in_top = [], 0
    for i, (qid, record) in enumerate(picked):
        item, ranked = _squad_item(qid, record, search, (first + i) % TOP_K)
        items.append(item)
        in_top += ranked
        bar(i + 1)
    return QualityStream(
        "squad",
        f"{len(items):,} SQuAD v1.1 dev questions (seed {seed}), each with its gold paragraph "
        f"and the two best-scoring other documents of the 12,100-document corpus, the gold at "
        f"position {first}, then the next, cycling over 0-2",
        tuple(items),
        seed,
        gold_in_top3=in_top,
    )


def _nq_stream(
    picked: Picked, search: Corpus, seed: int, bar: Callable[[int], None]
) -> QualityStream:
    items = []
    for i, (qid, record) in enumerate(picked):
        found = final_result(search.source, str(record["question"]), TOP_K)
        items.append(_item(qid, record["question"], record["answer"], found.documents, None))
        bar(i + 1)
    return QualityStream(
        "nq",
        f"{len(items):,} NQ-open dev questions (seed {seed}), each with its top-{TOP_K} "
        "retrieved from the 12,100-document corpus",
        tuple(items),
        seed,
    )


def _question_id(file: str, line: int, record: dict[str, Any]) -> str:
    return str(record["id"]) if "id" in record else f"{Path(file).stem}:{line}"


def _squad_item(
    qid: str, record: dict[str, Any], search: Corpus, position: int
) -> tuple[QualityItem, bool]:
    """The question with its gold paragraph at `position` among the two best-scoring other
    documents; and whether the retriever ranked the gold in its own top-3."""
    gold_id = corpus_id(SQUAD_PARAGRAPHS, str(record["paragraph_id"]))
    found = final_result(search.source, str(record["question"]), TOP_K)
    others = [d for d in found.documents if d.id != gold_id][: TOP_K - 1]
    gold = search.documents.get(gold_id)
    if gold is None:
        raise InputError(f"gold paragraph {gold_id!r} is not in the corpus")
    documents = [*others[:position], gold, *others[position:]]
    item = _item(qid, record["question"], record["answers"], documents, position)
    return item, any(d.id == gold_id for d in found.documents)


def _item(
    qid: str, question: object, answers: object, documents: Sequence[Document], position: int | None
) -> QualityItem:
    golds = tuple(dict.fromkeys(str(a) for a in answers)) if isinstance(answers, list) else ()
    if not golds:
        raise InputError(f"question {question!r} has no gold answer")
    shown = tuple(_readable(d) for d in documents)
    return QualityItem(qid, str(question), golds, shown, position)


def _readable(document: Document) -> Document:
    """SQuAD's titles with spaces for underscores (what the prompt shows; ids unchanged)."""
    title = document.title
    if "_" not in title:
        return document
    return replace(document, metadata={**document.metadata, "title": title.replace("_", " ")})


def _bar(total: int, progress: bool) -> Callable[[int], None]:
    """A callback given the questions done: a tqdm bar on stderr, or nothing."""
    if not progress:
        return lambda done: None
    from tqdm import tqdm

    bar = tqdm(total=total, desc="retrieve", unit="q", file=sys.stderr, leave=False)

    def update(done: int) -> None:
        bar.n = done
        bar.refresh()
        if done >= total:
            bar.close()

    return update
