"""One generation on vLLM's async engine: admission, the request lifecycle, retries.

    generate ── attempt ──► admission (a prefill slot; speculation brings its own)
        ▲          ├─► lifecycle.open_request: plan in the tree, checked as the connector will
        │          ├─► engine.stream(prompt, plan) ─► first token: lifecycle.first_token
        │          │                                  (confirm), then release the prefill slot
        │          └─► finished: lifecycle.settle + served_hits on the connector's report
        └── on a timeout or an engine death (engine restarted once): retry, unless text was
            streamed already (it cannot be taken back) or `max_retries` is spent

`Generator.finish` turns a `Generation` into the caller's `QueryResult` and records it in the
metrics. Runs on RAGCache's loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ragcache_core.bridges import Emit
from ragcache_core.config import CacheConfig, SamplingConfig
from ragcache_core.documents import Document
from ragcache_core.engine.async_engine import EngineDied, StreamEvent
from ragcache_core.engine.connector import ConnectorConfig, ConnectorResult
from ragcache_core.errors import InputError, RAGCacheError, check_fits_context
from ragcache_core.faults import EngineSupervisor
from ragcache_core.lifecycle import first_token, open_request, served_hits, settle
from ragcache_core.metrics import Metrics
from ragcache_core.pipeline.admission import Admission, Slot, Ticket
from ragcache_core.pipeline.prompt import BuiltPrompt, PromptBuilder
from ragcache_core.plan import PLAN_KEY
from ragcache_core.results import CacheHits, QueryResult, StreamChunk
from ragcache_core.tree import KnowledgeCache, RequestHandle

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Generation:
    """One finished generation (final or speculative)."""

    token_ids: tuple[int, ...]
    text: str
    first_token_at: float
    queue_wait_s: float
    hits: CacheHits
    prompt: BuiltPrompt
    finish_reason: str | None
    handle: RequestHandle
    doc_hit_tokens: int
    retries: int = 0
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class Progress:
    """What the engine has streamed for one request so far."""

    text: str = ""
    token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None
    report: Mapping[str, Any] | None = None
    first_token_at: float = 0.0


async def follow(
    events: AsyncGenerator[StreamEvent, None],
    timeout_s: float,
    emit: Emit | None,
    on_first_token: Callable[[float], None],
) -> Progress:
    """Follow one request's engine stream to its end (closing it on every path): each text
    delta to `emit`, `on_first_token(time)` once, at the first token. `timeout_s` bounds the
    wait for each event (the first token, then each next one), so a long healthy answer never
    times out; a stuck engine does (`TimeoutError`). Used by cached and uncached requests."""
    progress = Progress()
    loop = asyncio.get_running_loop()
    async with contextlib.aclosing(events), asyncio.timeout(timeout_s) as deadline:
        async for event in events:
            deadline.reschedule(loop.time() + timeout_s)
            if event.token_ids and not progress.first_token_at:
                progress.first_token_at = time.perf_counter()
                on_first_token(progress.first_token_at)
            if emit is not None and len(event.text) > len(progress.text):
                emit(StreamChunk(event.text[len(progress.text) :]))
            progress.text, progress.token_ids = event.text, event.token_ids
            progress.finish_reason = event.finish_reason
            if event.finished:
                progress.report = event.kv_transfer_params
    # No token at all: finishing is the first.
    progress.first_token_at = progress.first_token_at or time.perf_counter()
    return progress


class Generator:
    """Builds prompts and runs generations for one `RAGCache`."""

    def __init__(
        self,
        *,
        config: CacheConfig,
        prompts: PromptBuilder,
        tree: KnowledgeCache,
        admission: Admission,
        connector: ConnectorConfig,
        engines: EngineSupervisor,
        metrics: Metrics,
    ) -> None:
        self._config = config
        self._prompts = prompts
        self._tree = tree
        self._admission = admission
        self._connector = connector
        self._engines = engines
        self._metrics = metrics
        self._ids = itertools.count()

    # ------------------------------------------------------------------ prompts

    def build(
        self, question: str, documents: Sequence[Document], sampling: SamplingConfig
    ) -> BuiltPrompt:
        """The prompt's token ids; `InputError` (before anything is allocated) when it does not
        fit the context with the answer."""
        prompt = self._prompts.build(question, documents)
        check_fits_context(prompt.num_tokens, sampling.max_tokens, self._config.max_model_len)
        return prompt

    def score(self, prompt: BuiltPrompt) -> tuple[int, int]:
        """(cached tokens, tokens to compute): the admission queue's view of a prompt."""
        cached = self._tree.match(prompt.doc_specs).cached_tokens
        return cached, prompt.num_tokens - cached

    def blocked(self, prompt: BuiltPrompt) -> bool:
        """Whether the next document of the prompt's readable prefix is being written by a
        request in prefill (admission defers the prompt until it is readable)."""
        return self._tree.match(prompt.doc_specs).in_flight > 0

    # ------------------------------------------------------------------ requests

    async def answer(
        self,
        question: str,
        documents: tuple[Document, ...],
        sampling: SamplingConfig | None,
        emit: Emit | None,
    ) -> QueryResult:
        """Answer with documents the caller already has (no retrieval)."""
        for doc in documents:
            if not isinstance(doc, Document):
                raise InputError(
                    f"documents must be ragcache_core.Document, got {type(doc).__name__}"
                )
        started = time.perf_counter()
        sampling = sampling or self._config.sampling
        prompt = self.build(question, documents, sampling)
        generation = await self.generate(prompt, sampling, emit, final=True)
        return self.finish(generation, documents, started=started, search_done=started)

    def finish(
        self,
        generation: Generation,
        documents: tuple[Document, ...],
        *,
        started: float,
        search_done: float,
        retrieval_s: float = 0.0,
        speculative: bool = False,
    ) -> QueryResult:
        """The caller's result (TTFT from the call, counting a first token that came before
        the search ended as shown at its end); recorded in the metrics."""
        ttft = max(generation.first_token_at, search_done) - started
        prompt = generation.prompt
        self._metrics.record_request(
            generation.hits,
            num_docs=len(prompt.doc_specs),
            doc_tokens=sum(s.num_tokens for s in prompt.doc_specs),
            doc_hit_tokens=generation.doc_hit_tokens,
            queue_wait_s=generation.queue_wait_s,
            ttft_s=ttft,
        )
        return QueryResult(
            answer=generation.text,
            token_ids=generation.token_ids,
            sources=documents,
            ttft_s=ttft,
            retrieval_s=retrieval_s,
            queue_wait_s=generation.queue_wait_s,
            hits=generation.hits,
            prompt_tokens=prompt.num_tokens,
            finish_reason=generation.finish_reason,
            speculative=speculative,
            retries=generation.retries,
            timings=generation.timings,
        )

    async def generate(
        self,
        prompt: BuiltPrompt,
        sampling: SamplingConfig,
        emit: Emit | None,
        *,
        final: bool,
        slot: Slot | None = None,
    ) -> Generation:
        """Run one generation with retries on timeout and engine death. `slot`: a prefill slot
        the caller already holds (speculation); it is released on every path. A request that
        already streamed text is not retried (the text cannot be taken back)."""
        retries = 0
        while True:
            engine_generation = self._engines.generation
            streamed: list[str] = []
            sink = None if emit is None else _recording(emit, streamed)
            try:
                generation = await self._attempt(prompt, sampling, sink, final, slot)
                return replace(generation, retries=retries)
            except (TimeoutError, EngineDied) as exc:
                slot = None
                self._metrics.record_failure()
                if isinstance(exc, EngineDied):
                    await self._engines.restart(engine_generation)
                what = "timed out" if isinstance(exc, TimeoutError) else "lost its engine"
                if retries >= self._config.max_retries or streamed:
                    raise RAGCacheError(
                        f"the request {what} after {retries + 1} attempt(s)"
                        + (" and had streamed text already" if streamed else "")
                    ) from exc
                retries += 1
                self._metrics.record_retry()
                logger.warning("retrying a request that %s", what)

    # ------------------------------------------------------------------ one attempt

    async def _attempt(
        self,
        prompt: BuiltPrompt,
        sampling: SamplingConfig,
        emit: Emit | None,
        final: bool,
        slot: Slot | None,
    ) -> Generation:
        """One attempt through the lifecycle (module docstring). Whatever happens, the prefill
        slot is released and a handle left open is aborted (its copies dropped)."""
        ticket = Ticket(score=lambda: self.score(prompt), blocked=lambda: self.blocked(prompt))
        if slot is None:
            slot = await self._admission.acquire(ticket)
        else:
            ticket.admitted_at = ticket.enqueued_at
        handle: RequestHandle | None = None
        request_id = f"ragcache-{next(self._ids)}"
        engine_generation = self._engines.generation
        timings: dict[str, float] = {}
        try:
            started = time.perf_counter()
            handle, plan = open_request(self._tree, self._connector, prompt, final=final)
            self._metrics.record_tree(self._tree.counters)
            timings["plan"] = time.perf_counter() - started
            params = {PLAN_KEY: plan.to_json()} if plan is not None else None
            progress = await self._stream(
                request_id, prompt, sampling, params, handle, slot, emit, timings
            )
            generation = self._settle(handle, progress, prompt, ticket, timings)
            handle = None
            return generation
        except BaseException:
            if engine_generation == self._engines.generation and not self._engines.engine.is_dead:
                # Never let a failing abort hide the error that brought us here.
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._engines.engine.abort(request_id))
            raise
        finally:
            # Abort before releasing: the requests admission wakes must see the tree
            # without this request's copies. The room goes back even if the abort raises.
            try:
                if handle is not None and handle.is_open:
                    self._tree.abort(handle)
            finally:
                slot.release()

    async def _stream(
        self,
        request_id: str,
        prompt: BuiltPrompt,
        sampling: SamplingConfig,
        params: dict[str, Any] | None,
        handle: RequestHandle,
        slot: Slot,
        emit: Emit | None,
        timings: dict[str, float],
    ) -> Progress:
        """Submit the request and follow it to the end (`follow`: `request_timeout_s` per
        event).

        The request's copies are confirmed at its first token: the connector stores
        synchronously in the step that completes the prompt (before that step's token is
        sampled) and the plan was checked before it was sent, so the first token proves the
        stores ran. Pins and the prefill slot are released then, not at the end."""
        submitted = time.perf_counter()

        def confirm(first_token_at: float) -> None:
            timings["engine_first_token"] = first_token_at - submitted
            # Confirm before releasing: the requests admission wakes (deferred on this
            # request's documents) must see them readable.
            first_token(self._tree, handle)
            slot.release()

        stream = self._engines.engine.stream(request_id, prompt.token_ids, sampling, params)
        return await follow(stream, self._config.request_timeout_s, emit, confirm)

    def _settle(
        self,
        handle: RequestHandle,
        progress: Progress,
        prompt: BuiltPrompt,
        ticket: Ticket,
        timings: dict[str, float],
    ) -> Generation:
        """Apply the connector's final report (`lifecycle.settle`) and read what was served."""
        started = time.perf_counter()
        report = dict(progress.report) if progress.report else None
        result = ConnectorResult.from_transfer_params(report)
        timings["load_copy"] = result.load_copy_s
        timings["store_copy"] = result.store_copy_s
        settle(self._tree, handle, result)
        hits, doc_hit_tokens = served_hits(handle, result, prompt)
        timings["settle"] = time.perf_counter() - started
        return Generation(
            token_ids=progress.token_ids,
            text=progress.text,
            first_token_at=progress.first_token_at,
            queue_wait_s=ticket.wait_s,
            hits=hits,
            prompt=prompt,
            finish_reason=progress.finish_reason,
            handle=handle,
            doc_hit_tokens=doc_hit_tokens,
            timings=timings,
        )


def _recording(emit: Emit, streamed: list[str]) -> Emit:
    """`emit`, also noting each delta in `streamed` (text shown cannot be taken back)."""

    def record(chunk: StreamChunk) -> None:
        streamed.append(chunk.delta)
        emit(chunk)

    return record
