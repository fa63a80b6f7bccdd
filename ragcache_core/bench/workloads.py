"""Request streams of `ragcache bench serve` and `ragcache demo`: real text, real questions.

A `Workload` is a document set (what the index holds), an ordered pool of requests and a top-k.
A request either retrieves its documents (`documents is None`: the search runs inside the
request, for every system) or brings them (`documents` given: no search, as `agenerate`).

| name            | documents                                        | questions                 |
|-----------------|--------------------------------------------------|---------------------------|
| `short`         | 12,100: vital-article leads + SQuAD paragraphs   | NQ-open dev + MMLU val    |
| `long`          | SQuAD dev articles in ~1,024-token chunks        | SQuAD dev, dataset order  |
| `long-shuffled` | same                                             | SQuAD dev, shuffled       |
| `long-zipf`     | same                                             | SQuAD dev, Zipf draws     |
| `xlong-shuffled` | SQuAD dev articles in ~2,400-token chunks       | SQuAD dev, shuffled       |
| `noreuse`       | same chunks, each given to exactly one request   | SQuAD dev (gold chunk)    |
| `demo`          | the shipped long-chunk sample (package data)     | its SQuAD questions       |
| `demo-short`    | the shipped 300-document sample (package data)   | its NQ-open + MMLU        |
| `long-shuffled-host25`, `-host50` | `long-shuffled`, capacity-constrained (below) |             |
| `long-zipf-host25`, `-host50` | `long-zipf`, the same                     |             |
| `short-host25`, `-host50` | `short` (top-2 short documents, real questions), the same |         |

The shared-data workloads read the benchmark data folder (`--data-dir`, `$RAGCACHE_DATA_DIR`,
else `../shared/data`: `bench.data_dir`); the two `demo` ones need nothing outside the package.

**Capacity-constrained** workloads (issue 39) are a base workload whose host tier is sized to
25% or 50% of the distinct document tokens of the *measured stream* (warm-up plus measured
requests, not the corpus), counted with the model's tokenizer; vLLM's KV cache stays as set,
on top. `host_sizing` computes it (the search runs once over the stream's questions) and
`bench serve` prints it in tokens and GiB before starting that workload's engines.
**`long-zipf`** is the stream with reuse that reordering, the policy and the whole need (issue 39):
`long-shuffled`'s 104 requests draw 89 distinct chunks, so almost nothing can hit. Here chunk
popularity follows Zipf's law (exponent `ZIPF_EXPONENT`: the rank-r chunk is asked with weight
1 / r), ranked by how many SQuAD dev questions ask about it (the most-asked first, ties in a
seeded order), so the popular chunks have the most distinct questions; each draw takes that
chunk's next unused question (its questions in a seeded order, again from the first once all
are used). The search still runs in every request, so a question may retrieve another chunk
than its own: with the bench model's tokenizer (458 chunks) the first 104 requests retrieve 64
distinct chunks at top-1 (seed 0), `long-shuffled`'s 89.

Retriever for every retrieving workload: the project's offline TF-IDF + SVD embedder with an IVF
index (`retrieval.index_store.build_index`, default settings).
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from ragcache_core.bench.data_dir import (
    MMLU,
    NQ_OPEN,
    SQUAD_PARAGRAPHS,
    SQUAD_QUESTIONS,
    VITAL_ARTICLES,
    require_data,
    resolve_data_dir,
)
from ragcache_core.documents import Document
from ragcache_core.errors import InputError
from ragcache_core.retrieval.corpus import load_corpus, load_questions
from ragcache_core.search import SearchSource

RETRIEVER = "offline TF-IDF + SVD embedder, IVF index (ragcache_core.retrieval)"
RETRIEVERS = {
    "tfidf": RETRIEVER,
    "minilm": "all-MiniLM-L6-v2 sentence embedder (retrieval.sentence), IVF index",
}
"""`--retriever` choices: the offline default, and a real sentence embedder (the `embed`
extra), which pulls fewer questions onto the same "hub" documents."""
CHUNK_TOKENS = 1024
DEMO_CHUNK_TOKENS = 384
"""`demo`'s chunk target (the shipped sample's paragraphs joined again): chunks of 384-575 of
the model's tokens, most of each prompt still, and short enough that the real model's demo,
four engines on two cores, ends in a few minutes (README, "The demo")."""
XLONG_CHUNK_TOKENS = 2400
"""`xlong-shuffled`'s chunk target: with the bench model's tokenizer 221 chunks of 2,281 tokens
on average (an article's remainder shorter), none over 2,959, so a prompt of one fits a
4,096-token context. The host-tier issue's stream: bursts of such prefills take more blocks in
one step than a step's budget (docs/benchmarks.md, "Copies at hand-out")."""
ZIPF_EXPONENT = 1.0
"""`long-zipf`: the rank-r chunk is drawn with weight 1 / r ** ZIPF_EXPONENT."""
ZIPF_REQUESTS = 4096
"""`long-zipf`'s pool: requests drawn (a stream longer than this repeats the pool)."""
CAPACITY_WORKLOADS = {
    f"{base}-host{round(share * 100)}": (base, share)
    for base in ("long-shuffled", "long-zipf", "short")
    for share in (0.25, 0.5)
}
"""Capacity-constrained workload -> (its base workload, the host tier's share of the measured
stream's distinct document tokens)."""
WORKLOADS = (
    "short",
    "long",
    "long-shuffled",
    "long-zipf",
    "xlong-shuffled",
    "noreuse",
    "demo",
    "demo-short",
    *CAPACITY_WORKLOADS,
)
SHIPPED_WORKLOADS = frozenset({"demo", "demo-short"})
"""The workloads built from the samples shipped in the package (no data folder needed)."""
SHARED_WORKLOADS = frozenset(WORKLOADS) - SHIPPED_WORKLOADS


def workload_files(name: str) -> tuple[str, ...]:
    """The benchmark data files a workload reads (none for the shipped `demo` ones)."""
    base = CAPACITY_WORKLOADS[name][0] if name in CAPACITY_WORKLOADS else name
    if base == "short":
        return (VITAL_ARTICLES, SQUAD_PARAGRAPHS, NQ_OPEN, MMLU)
    if base in SHARED_WORKLOADS:
        return (SQUAD_PARAGRAPHS, SQUAD_QUESTIONS)
    return ()


@dataclass(frozen=True)
class Request:
    """One request of a stream: a question, when it brings them its documents, and the gold
    answers when the stream has them (what `demo` scores its answers against)."""

    question: str
    documents: tuple[Document, ...] | None = None
    answers: tuple[str, ...] = ()


@dataclass(frozen=True)
class Workload:
    """A document set, the requests in stream order, and how many documents each retrieves."""

    name: str
    description: str
    documents: tuple[Document, ...]
    requests: tuple[Request, ...]
    top_k: int
    retriever: str = RETRIEVER
    """What finds the documents of a retrieving request (a `RETRIEVERS` description)."""
    host_share: float | None = None
    """Capacity-constrained: the host tier is this share of the measured stream's distinct
    document tokens (`host_sizing`); None: the host tier is the run's `--host-pool-tokens`."""

    @property
    def retrieves(self) -> bool:
        return any(r.documents is None for r in self.requests)

    def stream(self, n: int) -> list[Request]:
        """The first n requests (the pool repeated when it is shorter)."""
        if not self.requests:
            raise InputError(f"workload {self.name!r} has no requests")
        return [self.requests[i % len(self.requests)] for i in range(n)]


def package_data(name: str) -> Path:
    """A file shipped in `ragcache_core/data/`."""
    return Path(str(resources.files("ragcache_core") / "data" / name))


def chunk_articles(
    paragraphs: Iterable[dict[str, Any]],
    count_tokens: Callable[[str], int],
    target: int = CHUNK_TOKENS,
) -> list[dict[str, Any]]:
    """Join consecutive paragraphs of one article until a chunk reaches about `target` tokens.

    A chunk closes as soon as it holds >= `target` tokens or would pass 1.5 x `target` with the
    next paragraph; the article's remainder is kept as a shorter chunk. Each chunk is
    `{"doc_id", "title", "text", "paragraph_ids", "tokens"}`, in article then paragraph order.
    """
    articles: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in paragraphs:
        articles[str(record["title"])].append(record)
    chunks: list[dict[str, Any]] = []
    for title, group in articles.items():
        group.sort(key=lambda r: int(r["paragraph_index"]))
        current: list[dict[str, Any]] = []
        tokens = 0
        for paragraph in group:
            size = count_tokens(str(paragraph["context"]))
            if current and tokens + size > 1.5 * target:
                chunks.append(_chunk(title, current, tokens))
                current, tokens = [], 0
            current.append(paragraph)
            tokens += size
            if tokens >= target:
                chunks.append(_chunk(title, current, tokens))
                current, tokens = [], 0
        if current:
            chunks.append(_chunk(title, current, tokens))
    return chunks


def _chunk(title: str, paragraphs: list[dict[str, Any]], tokens: int) -> dict[str, Any]:
    first = int(paragraphs[0]["paragraph_index"])
    return {
        "doc_id": f"{title}::{first}",
        "title": title.replace("_", " "),
        "text": "\n".join(str(p["context"]) for p in paragraphs),
        "paragraph_ids": [str(p["paragraph_id"]) for p in paragraphs],
        "tokens": tokens,
    }


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every record of a JSON Lines file."""
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _shipped_paragraphs() -> list[dict[str, Any]]:
    """The paragraphs of the shipped long-chunk sample (three whole SQuAD dev articles), as the
    benchmark data's paragraph records (`chunk_articles` joins them again)."""
    paragraphs = []
    for chunk in read_jsonl(package_data("demo_long_corpus.jsonl")):
        texts = str(chunk["text"]).split("\n")
        for pid, text in zip(chunk["paragraph_ids"], texts, strict=True):
            title, index = str(pid).rsplit("::", 1)
            paragraphs.append(
                {
                    "paragraph_id": pid,
                    "title": title,
                    "paragraph_index": int(index),
                    "context": text,
                }
            )
    return paragraphs


def _as_document(chunk: dict[str, Any]) -> Document:
    return Document(chunk["doc_id"], chunk["text"], {"title": chunk["title"]})


def load_workload(
    name: str,
    count_tokens: Callable[[str], int],
    *,
    seed: int = 0,
    top_k: int | None = None,
    data_dir: Path | None = None,
) -> Workload:
    """Build a named workload (see the module docstring). `data_dir`: the benchmark data folder
    (None: `$RAGCACHE_DATA_DIR`, else `../shared/data`). Raises `InputError` for an unknown
    name or when the data folder is needed and lacks a file."""
    if name not in WORKLOADS:
        raise InputError(f"unknown workload {name!r}: choose from {', '.join(WORKLOADS)}")
    folder = resolve_data_dir(data_dir)
    if name in SHARED_WORKLOADS:
        require_data(folder, workload_files(name))
    if name in CAPACITY_WORKLOADS:
        from dataclasses import replace

        base, share = CAPACITY_WORKLOADS[name]
        workload = load_workload(base, count_tokens, seed=seed, top_k=top_k, data_dir=folder)
        return replace(
            workload,
            name=name,
            description=f"{workload.description}; host tier {share:.0%} of the measured "
            "stream's distinct document tokens",
            host_share=share,
        )
    if name == "short":
        return _short(folder, seed, top_k or 2)
    if name == "demo-short":
        return _demo_short(seed, top_k or 2)
    if name == "demo":
        chunks = chunk_articles(_shipped_paragraphs(), count_tokens, DEMO_CHUNK_TOKENS)
        questions = read_jsonl(package_data("demo_long_questions.jsonl"))
        return _long(
            name,
            chunks,
            questions,
            "shuffled",
            seed,
            top_k or 1,
            "shipped sample",
            DEMO_CHUNK_TOKENS,
        )
    target = XLONG_CHUNK_TOKENS if name == "xlong-shuffled" else CHUNK_TOKENS
    chunks = chunk_articles(read_jsonl(folder / SQUAD_PARAGRAPHS), count_tokens, target)
    questions = read_jsonl(folder / SQUAD_QUESTIONS)
    if name == "noreuse":
        return _noreuse(chunks, questions, seed)
    if name == "long-zipf":
        return _long_zipf(chunks, questions, seed, top_k or 1)
    order = "dataset" if name == "long" else "shuffled"
    return _long(
        name, chunks, questions, order, seed, top_k or 1, "all 48 SQuAD dev articles", target
    )


CORPUS_FILES = (VITAL_ARTICLES, SQUAD_PARAGRAPHS)
"""The benchmark corpus: 12,100 documents, vital-article leads then SQuAD dev paragraphs."""


def benchmark_corpus(data_dir: Path) -> tuple[Document, ...]:
    """The 12,100 documents of `CORPUS_FILES` (ids namespaced by file: a SQuAD paragraph is
    `squad_v1.1_dev_paragraphs:{paragraph_id}`, `corpus_id`)."""
    files = [data_dir / name for name in CORPUS_FILES]
    return load_corpus(files, text_fields="text,context", id_fields="doc_id,paragraph_id")


def corpus_id(file_name: str, raw_id: str) -> str:
    """The id `benchmark_corpus` gives the record `raw_id` of `file_name`."""
    return f"{Path(file_name).stem}:{raw_id}"


def _short(data_dir: Path, seed: int, top_k: int) -> Workload:
    documents = benchmark_corpus(data_dir)
    nq = load_questions(data_dir / NQ_OPEN, question_fields="question")
    mmlu = load_questions(data_dir / MMLU, question_fields="input")
    pool = [Request(q.text, answers=q.answers) for q in (*nq, *mmlu)]
    random.Random(seed).shuffle(pool)  # NQ and MMLU interleaved; MMLU is grouped by subject
    return Workload(
        "short",
        f"{len(documents):,} documents (vital-article leads + SQuAD dev paragraphs, ~120-170 "
        f"tokens), NQ-open dev + MMLU val questions shuffled (seed {seed}), top-{top_k}",
        documents,
        tuple(pool),
        top_k,
    )


def _demo_short(seed: int, top_k: int) -> Workload:
    documents = load_corpus([package_data("demo_corpus.jsonl")])
    pool = [
        Request(q.text, answers=q.answers)
        for q in load_questions(package_data("demo_questions.jsonl"))
    ]
    random.Random(seed).shuffle(pool)
    return Workload(
        "demo-short",
        f"the shipped 300-document sample (~200 tokens each), its 200 NQ-open + MMLU "
        f"questions shuffled (seed {seed}), top-{top_k}",
        documents,
        tuple(pool),
        top_k,
    )


def _long(
    name: str,
    chunks: Sequence[dict[str, Any]],
    questions: Sequence[dict[str, Any]],
    order: str,
    seed: int,
    top_k: int,
    what: str,
    target: int = CHUNK_TOKENS,
) -> Workload:
    covered = {pid for c in chunks for pid in c["paragraph_ids"]}
    pool = [
        Request(str(q["question"]), answers=tuple(str(a) for a in q.get("answers", ())))
        for q in questions
        if q["paragraph_id"] in covered
    ]
    if order == "shuffled":
        random.Random(seed).shuffle(pool)
    mean = sum(int(c["tokens"]) for c in chunks) / max(1, len(chunks))
    return Workload(
        name,
        f"{len(chunks)} chunks of {what} (~{target:,}-token targets, mean {mean:.0f} "
        f"tokens), {len(pool):,} SQuAD dev questions in {order} order"
        + (f" (seed {seed})" if order == "shuffled" else " (grouped by article)")
        + f", top-{top_k}",
        tuple(_as_document(c) for c in chunks),
        tuple(pool),
        top_k,
    )


def _long_zipf(
    chunks: Sequence[dict[str, Any]], questions: Sequence[dict[str, Any]], seed: int, top_k: int
) -> Workload:
    """Questions drawn so that chunk popularity follows Zipf's law (the module docstring)."""
    chunk_of = {pid: c["doc_id"] for c in chunks for pid in c["paragraph_ids"]}
    asked: dict[str, list[str]] = defaultdict(list)
    for q in questions:
        doc_id = chunk_of.get(str(q["paragraph_id"]))
        if doc_id is not None:
            asked[doc_id].append(str(q["question"]))
    rng = random.Random(seed)
    ranked = sorted(asked)
    rng.shuffle(ranked)
    ranked.sort(key=lambda doc_id: -len(asked[doc_id]))  # stable: ties keep the seeded order
    for doc_id in ranked:
        rng.shuffle(asked[doc_id])
    weights = [1.0 / rank**ZIPF_EXPONENT for rank in range(1, len(ranked) + 1)]
    drawn = rng.choices(range(len(ranked)), weights=weights, k=ZIPF_REQUESTS)
    served: dict[int, int] = defaultdict(int)
    pool: list[str] = []
    for index in drawn:
        pool_of = asked[ranked[index]]
        pool.append(pool_of[served[index] % len(pool_of)])
        served[index] += 1
    mean = sum(int(c["tokens"]) for c in chunks) / max(1, len(chunks))
    return Workload(
        "long-zipf",
        f"{len(chunks)} chunks of all 48 SQuAD dev articles (~{CHUNK_TOKENS:,}-token targets, "
        f"mean {mean:.0f} tokens), {len(pool):,} SQuAD dev questions drawn with Zipf "
        f"popularity over the {len(ranked)} asked chunks (exponent {ZIPF_EXPONENT:g}, the "
        f"most-asked first; seed {seed}), top-{top_k}",
        tuple(_as_document(c) for c in chunks),
        tuple(Request(q) for q in pool),
        top_k,
    )


def _noreuse(
    chunks: Sequence[dict[str, Any]], questions: Sequence[dict[str, Any]], seed: int
) -> Workload:
    """Each request brings the chunk holding its question's gold paragraph, and no chunk serves
    two requests: nothing but the system prompt can ever be reused."""
    chunk_of = {pid: c for c in chunks for pid in c["paragraph_ids"]}
    shuffled = list(questions)
    random.Random(seed).shuffle(shuffled)
    used: set[str] = set()
    requests: list[Request] = []
    for q in shuffled:
        chunk = chunk_of.get(str(q["paragraph_id"]))
        if chunk is None or chunk["doc_id"] in used:
            continue
        used.add(chunk["doc_id"])
        requests.append(Request(str(q["question"]), (_as_document(chunk),)))
    return Workload(
        "noreuse",
        f"{len(requests)} requests, each bringing its own ~{CHUNK_TOKENS:,}-token SQuAD chunk "
        "(the one holding its question's gold paragraph; no chunk twice, no search), top-1",
        tuple(_as_document(c) for c in chunks),
        tuple(requests),
        1,
    )


def file_workload(
    corpus: Sequence[Path],
    questions: Path,
    *,
    text_fields: str = "text,context",
    id_fields: str = "doc_id,paragraph_id,id",
    question_fields: str = "question,input",
    seed: int = 0,
    top_k: int = 2,
) -> Workload:
    """A retrieving workload from the caller's JSONL files, questions shuffled (seeded)."""
    documents = load_corpus(corpus, text_fields=text_fields, id_fields=id_fields)
    pool = list(load_questions(questions, question_fields=question_fields))
    random.Random(seed).shuffle(pool)
    return Workload(
        "files",
        f"{len(documents):,} documents from {', '.join(p.name for p in corpus)}, "
        f"{len(pool):,} questions from {questions.name} shuffled (seed {seed}), top-{top_k}",
        documents,
        tuple(Request(q.text, answers=q.answers) for q in pool),
        top_k,
    )


def index_source(
    workload: Workload, retriever: str = "tfidf", *, progress: bool = True
) -> tuple[Workload, SearchSource | None]:
    """The workload (its `retriever` set) and a staged search over its documents, built with
    the named retriever (`RETRIEVERS`); no source when its requests bring their documents.
    Raises `InputError` for an unknown retriever, `ConfigError` when its package is missing."""
    from dataclasses import replace

    from ragcache_core.retrieval.index_store import IndexSettings, build_index

    if retriever not in RETRIEVERS:
        raise InputError(f"unknown retriever {retriever!r}: choose from {', '.join(RETRIEVERS)}")
    if not workload.retrieves:
        return workload, None
    embedder = None
    if retriever == "minilm":
        from ragcache_core.retrieval.sentence import SentenceEmbedder

        embedder = SentenceEmbedder.from_package()
    index = build_index(
        workload.documents, IndexSettings(kind="ivf"), progress=progress, embedder=embedder
    )
    return replace(workload, retriever=RETRIEVERS[retriever]), index.source()


@dataclass(frozen=True)
class HostSizing:
    """The host tier of a capacity-constrained workload, and what it was sized from."""

    share: float
    requests: int
    """Requests of the stream it was sized on (warm-up plus measured)."""
    distinct_documents: int
    distinct_tokens: int
    host_tokens: int
    host_gib: float

    def line(self) -> str:
        return (
            f"host tier {self.host_tokens:,} tokens ({self.host_gib:.2f} GiB) = {self.share:.0%} "
            f"of the {self.distinct_tokens:,} tokens of the {self.distinct_documents:,} distinct "
            f"documents of the measured stream ({self.requests} requests)"
        )


def host_sizing(
    workload: Workload,
    source: SearchSource | None,
    requests: int,
    count_tokens: Callable[[str], int],
    token_bytes: int,
) -> HostSizing:
    """Size a capacity-constrained workload's host tier on its first `requests` requests:
    `host_share` of the tokens of their distinct documents (each retrieving request's search
    runs once here, as every system will run it). Raises `InputError` for a workload without
    a `host_share`, or a retrieving one without a source."""
    from ragcache_core.search import final_result

    if workload.host_share is None:
        raise InputError(f"workload {workload.name!r} is not capacity-constrained")
    seen: dict[str, int] = {}
    for request in workload.stream(requests):
        documents = request.documents
        if documents is None:
            if source is None:
                raise InputError(f"workload {workload.name!r} retrieves but has no search source")
            documents = final_result(source, request.question, workload.top_k).documents
        for document in documents:
            if document.id not in seen:
                seen[document.id] = count_tokens(document.text)
    distinct = sum(seen.values())
    host = max(1, round(workload.host_share * distinct))
    return HostSizing(
        workload.host_share, requests, len(seen), distinct, host, host * token_bytes / 1024**3
    )
