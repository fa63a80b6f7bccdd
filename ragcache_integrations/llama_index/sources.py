"""`RecordingSource`: one query's view of a `SearchSource` that keeps the final stage.

RAGCache's `QueryResult` names the documents it answered with but not their retrieval scores;
LlamaIndex's `NodeWithScore` wants them. The engine wraps its source in a fresh
`RecordingSource` per query (so concurrent queries never share one) and reads the scores back
once the query returns.
"""

from __future__ import annotations

from collections.abc import Iterator

from ragcache_core.search import SearchSource, StageResult


class RecordingSource:
    """A `SearchSource` passing every stage through and remembering the last one.

    `final` is written by the thread that runs the search and read by the caller after the
    query returned (or after its first streamed chunk: the search is over by then).
    """

    def __init__(self, inner: SearchSource) -> None:
        self.inner = inner
        self.final: StageResult | None = None

    @property
    def can_speculate(self) -> bool:
        return self.inner.can_speculate

    def search_stages(self, question: str, k: int) -> Iterator[StageResult]:
        stages = self.inner.search_stages(question, k)  # validates now, like the inner source
        return self._record(stages)

    def _record(self, stages: Iterator[StageResult]) -> Iterator[StageResult]:
        for stage in stages:
            if stage.is_last:
                self.final = stage
            yield stage

    def scores(self) -> dict[str, float]:
        """Document id -> score of the final stage (empty before it arrived)."""
        if self.final is None:
            return {}
        return dict(zip(self.final.doc_ids, self.final.scores, strict=True))
