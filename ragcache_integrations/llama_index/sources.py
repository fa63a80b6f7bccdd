"""`RecordingSource`: one query's view of a `SearchSource` that keeps the final stage, and runs
the app's node postprocessors on it.

RAGCache's `QueryResult` names the documents it answered with but not their retrieval scores;
LlamaIndex's `NodeWithScore` wants them. The engine wraps its source in a fresh
`RecordingSource` per query (so concurrent queries never share one) and reads the scores back
once the query returns.

With `node_postprocessors` (rerankers, similarity cutoffs, ...) the source runs the search to
its end, hands the final top-k to the postprocessors as `NodeWithScore`s (the index's own
nodes, the store's scores) and yields their output as its one and only stage. So the cache
sees only the postprocessed nodes, and speculation is off (`can_speculate` is False): a
speculation is reused only when its documents equal the final ones, and those exist only once
the postprocessors ran; running them at every intermediate stage would multiply a reranker's
cost by the number of stages.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore, QueryBundle

from ragcache_core.documents import Document
from ragcache_core.search import SearchSource, StageResult
from ragcache_integrations.llama_index.adapters import node_to_document


class RecordingSource:
    """A `SearchSource` passing every stage through and remembering the last one (and, with
    `postprocessors`, yielding only the postprocessed last one: see the module docstring).

    `final` and `nodes` are written by the thread that runs the search and read by the caller
    after the query returned (or after its first streamed chunk: the search is over by then).
    `node_for` turns a searched document back into the LlamaIndex node the postprocessors get.
    """

    def __init__(
        self,
        inner: SearchSource,
        postprocessors: Sequence[BaseNodePostprocessor] = (),
        node_for: Callable[[Document], BaseNode] | None = None,
    ) -> None:
        if postprocessors and node_for is None:
            raise ValueError("postprocessors need node_for")
        self.inner = inner
        self.postprocessors = tuple(postprocessors)
        self._node_for = node_for
        self.final: StageResult | None = None
        self.nodes: list[NodeWithScore] | None = None
        """The postprocessors' output (None without postprocessors)."""

    @property
    def can_speculate(self) -> bool:
        return self.inner.can_speculate and not self.postprocessors

    def search_stages(self, question: str, k: int) -> Iterator[StageResult]:
        stages = self.inner.search_stages(question, k)  # validates now, like the inner source
        if self.postprocessors:
            return self._postprocessed(question, stages)
        return self._record(stages)

    def _record(self, stages: Iterator[StageResult]) -> Iterator[StageResult]:
        for stage in stages:
            if stage.is_last:
                self.final = stage
            yield stage

    def _postprocessed(self, question: str, stages: Iterator[StageResult]) -> Iterator[StageResult]:
        last = None
        for stage in stages:
            if stage.is_last:
                last = stage
        if last is None:
            return  # the runtime names a source that ended without a last stage
        assert self._node_for is not None
        nodes = [
            NodeWithScore(node=self._node_for(d), score=s)
            for d, s in zip(last.documents, last.scores, strict=True)
        ]
        started = time.perf_counter()
        bundle = QueryBundle(question)
        for postprocessor in self.postprocessors:
            nodes = postprocessor.postprocess_nodes(nodes, query_bundle=bundle)
        self.nodes = nodes
        originals = {d.id: d for d in last.documents}
        self.final = StageResult(
            documents=tuple(_document(n.node, originals) for n in nodes),
            scores=tuple(float(n.score or 0.0) for n in nodes),
            stage=last.stage,
            is_last=True,
            elapsed_s=last.elapsed_s + time.perf_counter() - started,
        )
        yield self.final

    def scores(self) -> dict[str, float]:
        """Document id -> score of the final stage (empty before it arrived)."""
        if self.final is None:
            return {}
        return dict(zip(self.final.doc_ids, self.final.scores, strict=True))


def _document(node: BaseNode, originals: dict[str, Document]) -> Document:
    """The searched document of `node` when a postprocessor left its text and metadata as they
    were (so it is shown exactly as without postprocessors, even when `node_for` could only
    rebuild a plain node of it), else `node` as a new document (e.g. a metadata replacement)."""
    original = originals.get(str(node.node_id))
    if (
        original is not None
        and node.get_content(metadata_mode=MetadataMode.NONE) == original.text
        and dict(node.metadata) == dict(original.metadata)
    ):
        return original
    return node_to_document(node)
