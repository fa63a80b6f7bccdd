"""Request traces: questions retrieved against an index, with token counts and Poisson arrivals.

One JSON object per line, the format the simulator reads (`ragcache_core.trace`, which
defines `TraceRequest` and `write_trace` for both):
`{"id": str, "arrival_s": float, "docs": [doc ids in prompt order], "doc_tokens": [int per doc],
"question_tokens": int}`. Document tokens count the document as the prompt shows it
(`render_document`), tokenized on its own; the question's, the question alone. The runtime
tokenizes each prompt whole (`runtime.prompt`), so a tree node's size differs from its
document's count by the seams with its neighbours: a few tokens (demo sample, tiny model: 3
fewer at the first document, at most 1 at the last), and its question piece holds the template.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from ragcache_core.documents import DEFAULT_DOC_TEMPLATE, DocumentTemplate, render_document
from ragcache_core.errors import ConfigError, InputError, ModelError
from ragcache_core.retrieval.base import StagedSearch
from ragcache_core.retrieval.corpus import Question
from ragcache_core.retrieval.index_store import LocalIndex
from ragcache_core.trace import TraceRequest


def poisson_arrivals(n: int, rate: float, seed: int) -> npt.NDArray[np.float64]:
    """Arrival times of n requests of a Poisson process at `rate` per second (seeded, pure)."""
    if not rate > 0:
        raise ConfigError(f"request rate must be > 0, got {rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)  # [n]
    return np.cumsum(gaps)


def tokenizer_counter(model: str) -> Callable[[str], int]:
    """Token counter of a model's tokenizer (no special tokens). Raises `ModelError`."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load a tokenizer from {model!r}: {exc}") from exc

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    return count


def build_trace(
    index: LocalIndex,
    questions: Sequence[Question],
    k: int,
    count_tokens: Callable[[str], int],
    *,
    rate: float,
    seed: int = 0,
    staged: StagedSearch | None = None,
    template: DocumentTemplate = DEFAULT_DOC_TEMPLATE,
    batch: int = 256,
) -> list[TraceRequest]:
    """Retrieve the final top-k of every question and build the trace (pure w.r.t. the index).

    Raises `InputError` for no questions or k larger than the index.
    """
    if not questions:
        raise InputError("no questions to build a trace from")
    if k > len(index.documents):
        raise InputError(f"top-k {k} is larger than the index ({len(index.documents)} documents)")
    search = staged or index.staged()
    arrivals = poisson_arrivals(len(questions), rate, seed)
    doc_tokens: dict[str, int] = {}
    records: list[TraceRequest] = []
    for start in range(0, len(questions), batch):
        chunk = questions[start : start + batch]
        vectors = index.embedder.embed([q.text for q in chunk])  # [b, d]
        final = search.search(vectors, k)
        for j, question in enumerate(chunk):
            docs = index.documents_for([int(r) for r in final.ids[j]])
            for doc in docs:
                if doc.id not in doc_tokens:
                    doc_tokens[doc.id] = count_tokens(render_document(doc, template))
            records.append(
                TraceRequest(
                    id=question.id,
                    arrival_s=float(arrivals[start + j]),
                    docs=tuple(d.id for d in docs),
                    doc_tokens=tuple(doc_tokens[d.id] for d in docs),
                    question_tokens=count_tokens(question.text),
                )
            )
    return records
