"""Dynamic speculative pipelining (the paper's Algorithm 2) around one query.

    staged search ─► after each stage whose top-k changed: abort the stale speculation and
        │            start one on the new top-k if prefill has room nobody waits for (only
        │            when this source's recent searches took speculation_min_search_s or more)
        ▼  final top-k
    the speculation had exactly these documents ─► adopt it: its buffered text is streamed,
        │                                          then the rest live
        └─ else (or it failed) ─► abort it, run the final generation

A speculative generation stores like any other (its KV is correct for its document sequence);
only an adopted one counts toward the policy's frequency (`Lifecycle.adopt`). Runs on
RAGCache's loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from dataclasses import dataclass
from typing import TypeVar

from ragcache_core.app_prompt import NO_FRAMING, Framing
from ragcache_core.config import CacheConfig, SamplingConfig
from ragcache_core.documents import Document
from ragcache_core.errors import InputError, RAGCacheError
from ragcache_core.loop import Emit
from ragcache_core.metrics import Metrics
from ragcache_core.query_result import QueryResult, StreamChunk
from ragcache_core.runtime.admission import Admission
from ragcache_core.runtime.attempt import Request
from ragcache_core.runtime.generation import Generator
from ragcache_core.runtime.lifecycle import Lifecycle
from ragcache_core.search import SearchSource, StageResult, astages

logger = logging.getLogger(__name__)

T = TypeVar("T")


class SearchClock:
    """A moving mean of each search source's recent search times: speculation's gate.

    `observe` after every search (mutates the source's mean); `slow_enough` says whether a
    search of that source is worth speculating on. A source not measured yet is (the first
    search measures it). Sources are held weakly; one that cannot be is measured with every
    other such source together."""

    WEIGHT = 0.2
    """The newest search's weight in the mean (about the last 5-10 searches count)."""

    def __init__(self) -> None:
        self._means: weakref.WeakKeyDictionary[SearchSource, float] = weakref.WeakKeyDictionary()
        self._shared: float | None = None

    def mean_s(self, source: SearchSource) -> float | None:
        """The source's mean search time in seconds; None before its first search."""
        try:
            return self._means.get(source)
        except TypeError:  # not weakly referenceable
            return self._shared

    def observe(self, source: SearchSource, seconds: float) -> None:
        old = self.mean_s(source)
        new = seconds if old is None else old + self.WEIGHT * (seconds - old)
        try:
            self._means[source] = new
        except TypeError:
            self._shared = new

    def slow_enough(self, source: SearchSource, threshold_s: float) -> bool:
        mean = self.mean_s(source)
        return threshold_s <= 0 or mean is None or mean >= threshold_s


@dataclass(frozen=True)
class _Run:
    """One speculative generation in flight on the engine (its `Request` runs in `task`)."""

    documents: tuple[Document, ...]
    """As retrieved at the stage it speculated on."""
    served_ids: tuple[str, ...]
    """The documents' ids in the order its prompt serves them."""
    any_order: bool
    """`document_order="cache"`: final documents in another retrieval order may reuse it."""
    task: asyncio.Task[Request]
    started_at: float
    chunks: asyncio.Queue[StreamChunk]
    """Text of the generation, held back until it is adopted."""


class SpeculativeQuery:
    """Answers questions through a search source, speculating on intermediate top-k."""

    def __init__(
        self,
        *,
        config: CacheConfig,
        generator: Generator,
        admission: Admission,
        lifecycle: Lifecycle,
        metrics: Metrics,
    ) -> None:
        self._config = config
        self._generator = generator
        self._admission = admission
        self._lifecycle = lifecycle
        self._metrics = metrics
        self.clock = SearchClock()
        """Search times per source, for the gate (`CacheConfig.speculation_min_search_s`)."""

    async def run(
        self,
        question: str,
        source: SearchSource | None,
        top_k: int | None,
        sampling: SamplingConfig | None,
        emit: Emit | None,
        framing: Framing = NO_FRAMING,
    ) -> QueryResult:
        """Search for `question`'s top-k documents and answer with them (in `framing`'s
        prompt, under its salt)."""
        if source is None:
            raise InputError("no search source: pass search= or build RAGCache(search=...)")
        if not isinstance(question, str) or not question.strip():
            raise InputError(f"the question must be a non-empty string, got {question!r}")
        sampling = sampling or self._config.sampling
        self._generator.check_sampling(sampling)
        started = time.perf_counter()
        k = top_k or self._config.top_k
        final, spec = await self._search(question, source, k, sampling, framing)
        search_done = time.perf_counter()
        self.clock.observe(source, search_done - started)
        request = await self._use(spec, final, emit, search_done)
        speculative = request is not None
        order = served_order(spec, final.documents) if spec and speculative else None
        hidden = (
            max(0.0, search_done - max(started, spec.started_at)) if spec and speculative else 0.0
        )
        if request is None:
            generator = self._generator
            prompt = generator.build(question, final.documents, sampling, framing)
            reorder = generator.reordering(question, final.documents, sampling, framing)
            request = await generator.generate(
                generator.request(prompt, sampling, emit, reorder=reorder)
            )
        return self._generator.finish(
            request,
            question,
            final.documents,
            framing,
            started,
            search_done=search_done,
            scores=final.scores,
            speculative=speculative,
            order=order,
            search_hidden_s=hidden,
        )

    async def _search(
        self,
        question: str,
        source: SearchSource,
        k: int,
        sampling: SamplingConfig,
        framing: Framing,
    ) -> tuple[StageResult, _Run | None]:
        """Run the staged search; returns the final stage and the speculation still running
        (on the last intermediate top-k), if any."""
        speculate = self._config.speculation and source.can_speculate
        if speculate and not self.clock.slow_enough(source, self._config.speculation_min_search_s):
            speculate = False
            self._metrics.record_speculation("gated")
        current: tuple[str, ...] = ()
        spec: _Run | None = None
        try:
            async for stage in astages(source, question, k):
                if stage.is_last:
                    return stage, spec
                if not speculate or stage.doc_ids == current:
                    continue
                if spec is not None:
                    await self._abort(spec)
                    spec = None
                current = stage.doc_ids
                spec = self._start(question, stage.documents, sampling, framing)
        except BaseException:
            if spec is not None:
                await _cancel(spec)
            raise
        if spec is not None:
            await _cancel(spec)
        raise RAGCacheError("the search source ended without a final stage")

    def _start(
        self,
        question: str,
        documents: tuple[Document, ...],
        sampling: SamplingConfig,
        framing: Framing,
    ) -> _Run | None:
        """Start a speculative generation only if prefill has room for it now, nobody waits
        (Algorithm 2: wrong guesses use only idle capacity) and no request is computing its
        documents already. Its text is buffered until adopted."""
        try:
            prompt = self._generator.build(question, documents, sampling, framing)
        except InputError:
            return None  # e.g. an intermediate top-k too long for the context: wait for the final
        if self._lifecycle.blocked(prompt):
            return None  # another request is computing these documents: never twice
        chunks: asyncio.Queue[StreamChunk] = asyncio.Queue()
        request = self._generator.request(prompt, sampling, chunks.put_nowait, final=False)
        first = request.attempt
        if not self._admission.try_acquire(first):
            return None
        task = asyncio.ensure_future(self._generator.generate(request))
        # A task cancelled before its first step never runs its cleanup: give the place back
        # here (a no-op when the try did).
        task.add_done_callback(lambda _: self._admission.release(first))
        self._metrics.record_speculation("started")
        ranks = prompt.order or range(len(documents))
        served = tuple(documents[rank].id for rank in ranks)
        any_order = (framing.document_order or self._config.document_order) == "cache"
        return _Run(documents, served, any_order, task, time.perf_counter(), chunks)

    async def _use(
        self, spec: _Run | None, final: StageResult, emit: Emit | None, search_done: float
    ) -> Request | None:
        """The speculation's request, finished, when its documents are the final ones and it
        succeeded; otherwise it is aborted and None returned (run the final generation)."""
        if spec is None:
            return None
        if served_order(spec, final.documents) is None:
            await self._abort(spec)
            return None
        try:
            request = await relay(spec.task, spec.chunks, emit or _discard)
        except asyncio.CancelledError:
            if not spec.task.cancelled():  # the query itself was cancelled
                await _cancel(spec)
                raise
            logger.warning("a speculative generation was cancelled; running the final one")
            return None
        except RAGCacheError:
            logger.warning("a speculative generation failed; running the final one")
            return None
        self._metrics.record_speculation(
            "used", search_hidden_s=max(0.0, search_done - spec.started_at)
        )
        # A used speculation counts toward the policy's frequency like a final request.
        handle = request.attempt.handle
        assert handle is not None  # a finished try opened in the tree
        self._lifecycle.adopt(handle)
        return request

    async def _abort(self, run: _Run) -> None:
        await _cancel(run)
        in_flight = time.perf_counter() - run.started_at
        self._metrics.record_speculation("aborted", in_flight_s=in_flight)


def served_order(spec: _Run, final: tuple[Document, ...]) -> tuple[int, ...] | None:
    """The final documents' retrieval ranks in the order the speculation's prompt serves
    them when that prompt is the final one's, else None. In retrieval order the ids must match
    one for one; with `document_order="cache"` the final documents, arranged as the
    speculation ordered its own, must give the same prompt: the same ids, in any retrieval
    order (the documents are compared by id, as the search stages name them)."""
    ids = [doc.id for doc in final]
    if not spec.any_order:
        return tuple(range(len(ids))) if tuple(ids) == spec.served_ids else None
    if sorted(ids) != sorted(spec.served_ids):
        return None
    free = list(range(len(ids)))
    order = []
    for doc_id in spec.served_ids:
        rank = next(r for r in free if ids[r] == doc_id)
        free.remove(rank)
        order.append(rank)
    return tuple(order)


async def _cancel(run: _Run) -> None:
    run.task.cancel()
    with contextlib.suppress(asyncio.CancelledError, RAGCacheError):
        await run.task


def _discard(chunk: StreamChunk) -> None:
    """The sink of a non-streamed request's text."""


async def relay(task: asyncio.Task[T], chunks: asyncio.Queue[StreamChunk], emit: Emit) -> T:
    """Forward `chunks` to `emit` as they arrive until `task` ends, then the rest; return the
    task's result (raising its error). Used to adopt a speculative generation mid-answer."""
    while not task.done():
        getter = asyncio.ensure_future(chunks.get())
        try:
            await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            got = getter.done()
            if not got:
                getter.cancel()  # a cancelled get leaves its item in the queue
        if got:
            emit(getter.result())
    while not chunks.empty():
        emit(chunks.get_nowait())
    return task.result()
