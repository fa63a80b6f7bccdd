"""`RAGCache`: the product. Retrieval + knowledge cache + vLLM, one request at a time or many.

One request's life (docs/architecture.md walks it through the modules):

    aquery(question) ─► staged search ─► (speculate on each new intermediate top-k) ─► final top-k
        ─► prompt ids (root + documents + question) ─► admission queue (reordering)
        ─► knowledge tree: match, pin, evict, plan ─► vLLM with the plan in kv_transfer_params
        ─► connector loads cached KV, vLLM computes the rest, connector stores new documents
        ─► stream tokens ─► on finish: the connector's report confirms the stores (readable now)

Every engine and tree operation runs on one private event loop (`LoopThread`); the async API
awaits it from the caller's loop, the sync API blocks on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import queue
import time
import uuid
import weakref
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ragcache_core.config import CacheConfig, SamplingConfig
from ragcache_core.documents import Document
from ragcache_core.engine.async_engine import AsyncEngine, EngineDied
from ragcache_core.engine.config import check_model_folder
from ragcache_core.errors import InputError, RAGCacheError
from ragcache_core.metrics import Metrics
from ragcache_core.pipeline.admission import Admission, Slot, Ticket
from ragcache_core.pipeline.loop import LoopThread
from ragcache_core.pipeline.prompt import BuiltPrompt, PromptBuilder
from ragcache_core.plan import PLAN_KEY, Tier
from ragcache_core.results import CacheHits, QueryResult, StreamChunk
from ragcache_core.retrieval.source import SearchSource, StageResult, astages
from ragcache_core.tree.request import RequestHandle, RequestState

logger = logging.getLogger(__name__)

__all__ = ["CacheHits", "QueryResult", "RAGCache", "StreamChunk"]


_Item = StreamChunk | BaseException | None
"""What a stream's producer hands its consumer: a chunk, the error, or None at the end."""


@dataclass
class _Run:
    """One generation (final or speculative) in flight on the engine."""

    documents: tuple[Document, ...]
    task: asyncio.Task[_Generation]
    started_at: float
    chunks: asyncio.Queue[_Item]
    """Text of the speculative generation, held back until it is adopted."""


@dataclass
class _Generation:
    token_ids: tuple[int, ...]
    text: str
    first_token_at: float
    queue_wait_s: float
    hits: CacheHits
    prompt_tokens: int
    finish_reason: str | None
    handle: RequestHandle
    doc_tokens: int
    doc_hit_tokens: int
    num_docs: int
    retries: int = 0
    timings: dict[str, float] = dataclasses.field(default_factory=dict)


class RAGCache:
    """A knowledge cache over a vLLM engine.

    `model` is a local checkpoint folder (or a model name where a hub is reachable).
    `search` is the default `SearchSource` for `query`/`aquery` (per-call `search=` wins).
    The engine starts in the constructor (about 25 s on CPU). Close with `close()` or `with`.
    """

    def __init__(
        self,
        model: str | Path,
        config: CacheConfig | None = None,
        *,
        search: SearchSource | None = None,
    ) -> None:
        from transformers import AutoTokenizer

        from ragcache_core.cost import CostProfile, InterpolatedCostModel, default_cost_model
        from ragcache_core.engine.connector import ConnectorConfig
        from ragcache_core.engine.settings import (
            build_settings,
            cache_engine_spec,
            detect_device,
            resolve_device_defaults,
        )
        from ragcache_core.storage.host_pool import HostPool, remove_pool
        from ragcache_core.storage.layout import layout_for_model
        from ragcache_core.tree.cache import KnowledgeCache

        self.device = detect_device()
        self.config = config = resolve_device_defaults(config or CacheConfig(), self.device)
        assert config.dtype is not None and config.max_num_batched_tokens is not None
        self.model = str(model)
        if Path(self.model).expanduser().exists() or os.sep in self.model[:2]:
            check_model_folder(self.model)
        self.search = search
        self.metrics = Metrics()
        tokenizer = AutoTokenizer.from_pretrained(self.model)
        self.prompts = PromptBuilder(tokenizer, config.prompt, self.model, config.dtype)
        self._closed = False
        self._loop = LoopThread()
        self._ids = itertools.count()

        layout = layout_for_model(self.model, dtype=config.dtype, page_size=config.page_size)
        gpu_slots = config.gpu_pool_tokens // config.page_size
        host_slots = config.host_pool_tokens // config.page_size
        self._host_pool = None
        name = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        if host_slots:
            self._host_pool = HostPool.create(name, layout, host_slots, reuse=False)
            # Remove the shared-memory file even if close() is never called.
            self._pool_finalizer = weakref.finalize(self, remove_pool, name)
        self.connector = ConnectorConfig(
            layout=layout,
            gpu_slots=gpu_slots,
            host_slots=host_slots,
            host_pool_name=name if host_slots else "",
        )
        cost_model = (
            InterpolatedCostModel(CostProfile.load(config.cost_profile))
            if config.cost_profile
            else default_cost_model()
        )
        self.tree = KnowledgeCache(
            self.prompts.root_key,
            gpu_slots=gpu_slots,
            host_slots=host_slots,
            page_size=config.page_size,
            policy=config.policy,
            cost_model=cost_model,
            max_depth=config.max_cached_depth,
            backup_root=True,  # the system prompt survives a worker failure (paper 2.6)
            store_policy=config.store_policy,
        )
        self.admission = Admission(
            config.max_prefill_bs,
            "cache_aware" if config.reorder else "fcfs",
            config.reorder_window,
            token_budget=config.max_num_batched_tokens,
        )
        self.engine_settings = build_settings(
            cache_engine_spec(
                self.model,
                config,
                connector=self.connector.kv_transfer_config(),
                gpu_pool_bytes=layout.pool_bytes(gpu_slots),
            ),
            self.device,
        )
        self._engine_generation = 0
        self._restart_lock: asyncio.Lock | None = None
        try:
            # Start vLLM on RAGCache's own loop: AsyncLLM binds its output task to the loop
            # running where it is created (in a notebook the caller's thread runs one).
            self.engine = self._loop.run(self._start_engine())
        except BaseException:
            self._loop.stop()
            self._release_resources()
            raise

    # ------------------------------------------------------------------ public API

    async def aquery(
        self,
        question: str,
        *,
        search: SearchSource | None = None,
        top_k: int | None = None,
        sampling: SamplingConfig | None = None,
    ) -> QueryResult:
        """Retrieve the top-k documents for `question` (staged, speculating on intermediate
        results) and answer with them."""
        return await self._loop.arun(self._query(question, search, top_k, sampling, None))

    def query(
        self,
        question: str,
        *,
        search: SearchSource | None = None,
        top_k: int | None = None,
        sampling: SamplingConfig | None = None,
    ) -> QueryResult:
        """Blocking `aquery` (works inside notebooks: it runs on RAGCache's own loop)."""
        return self._loop.run(self._query(question, search, top_k, sampling, None))

    async def agenerate(
        self,
        question: str,
        documents: Sequence[Document],
        *,
        sampling: SamplingConfig | None = None,
    ) -> QueryResult:
        """Answer with documents the caller already has (no retrieval)."""
        return await self._loop.arun(self._answer(question, tuple(documents), sampling, None))

    def generate(
        self,
        question: str,
        documents: Sequence[Document],
        *,
        sampling: SamplingConfig | None = None,
    ) -> QueryResult:
        """Blocking `agenerate`."""
        return self._loop.run(self._answer(question, tuple(documents), sampling, None))

    async def astream(
        self,
        question: str,
        *,
        documents: Sequence[Document] | None = None,
        search: SearchSource | None = None,
        top_k: int | None = None,
        sampling: SamplingConfig | None = None,
    ) -> AsyncGenerator[StreamChunk, None]:
        """Stream the answer as text deltas; the last chunk carries the `QueryResult`.
        With `documents` no retrieval runs."""
        caller = asyncio.get_running_loop()
        items: asyncio.Queue[_Item] = asyncio.Queue()

        def emit(item: _Item) -> None:
            caller.call_soon_threadsafe(items.put_nowait, item)

        future = self._loop.submit(
            self._produce(question, documents, search, top_k, sampling, emit)
        )
        try:
            while (item := await items.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            future.cancel()

    def stream(
        self,
        question: str,
        *,
        documents: Sequence[Document] | None = None,
        search: SearchSource | None = None,
        top_k: int | None = None,
        sampling: SamplingConfig | None = None,
    ) -> Iterator[StreamChunk]:
        """Blocking `astream`: an iterator of `StreamChunk`s. The work runs on RAGCache's own
        loop, so this also works where the caller's thread runs an event loop (notebooks)."""
        items: queue.Queue[_Item] = queue.Queue()
        future = self._loop.submit(
            self._produce(question, documents, search, top_k, sampling, items.put)
        )
        try:
            while (item := items.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            future.cancel()

    async def _produce(
        self,
        question: str,
        documents: Sequence[Document] | None,
        search: SearchSource | None,
        top_k: int | None,
        sampling: SamplingConfig | None,
        emit: Callable[[_Item], None],
    ) -> None:
        """The body of `astream` and `stream`: chunks, then the result, then None."""
        try:
            if documents is not None:
                result = await self._answer(question, tuple(documents), sampling, emit)
            else:
                result = await self._query(question, search, top_k, sampling, emit)
            emit(StreamChunk("", result))
        except BaseException as exc:  # surfaced to the consumer
            emit(exc)
        finally:
            emit(None)

    def stats(self) -> dict[str, Any]:
        """Counters (hits per tier, tokens saved, speculation, TTFT) and tree occupancy."""

        async def snapshot() -> dict[str, Any]:
            data = self.metrics.counters.as_dict()
            tree = self.tree.stats()
            data["tree"] = {
                "nodes": tree.nodes,
                "gpu_slots": tree.gpu_slots,
                "gpu_used_slots": tree.gpu_used_slots,
                "host_slots": tree.host_slots,
                "host_used_slots": tree.host_used_slots,
                "pinned_nodes": tree.pinned_nodes,
                "page_size": tree.page_size,
            }
            data["queue_waiting"] = self.admission.waiting
            data["in_prefill"] = self.admission.in_prefill
            return data

        return self._loop.run(snapshot())

    def invalidate(self, doc_id: str) -> int:
        """Drop every cached node of `doc_id` (and what was computed after it). Returns the
        number of nodes dropped. In-flight readers keep their pins; nothing stale is served."""

        async def drop() -> int:
            return self.tree.invalidate(doc_id)

        return self._loop.run(drop())

    def clear(self) -> None:
        """Forget every cached document and reset the counters."""

        async def clear() -> None:
            self.tree.clear()
            self.metrics.reset()

        self._loop.run(clear())

    def close(self) -> None:
        """Stop the engine, remove the host pool, stop the loop. Safe to call twice."""
        if self._closed:
            return
        self._closed = True

        async def shutdown() -> None:
            # Requests still running end with CancelledError instead of hanging their callers.
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)
            self.engine.close()
            await asyncio.sleep(0)  # let the engine's output task see its cancellation

        try:
            self._loop.run(shutdown())
        finally:
            self._loop.stop()
            self._release_resources()

    def __enter__(self) -> RAGCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ retrieval + speculation

    async def _query(
        self,
        question: str,
        search: SearchSource | None,
        top_k: int | None,
        sampling: SamplingConfig | None,
        emit: Callable[[_Item], None] | None,
    ) -> QueryResult:
        """Algorithm 2 (dynamic speculative pipelining) around `_generate`."""
        source = search or self.search
        if source is None:
            raise InputError("no search source: pass search= or build RAGCache(search=...)")
        if not isinstance(question, str) or not question.strip():
            raise InputError(f"the question must be a non-empty string, got {question!r}")
        k = top_k or self.config.top_k
        sampling = sampling or self.config.sampling
        started = time.perf_counter()
        counters = self.metrics.counters
        speculate = self.config.speculation and source.can_speculate
        current: tuple[str, ...] = ()
        spec: _Run | None = None
        final: StageResult | None = None
        try:
            async for stage in astages(source, question, k):
                if stage.is_last:
                    final = stage
                    break
                if not speculate or stage.doc_ids == current:
                    continue
                if spec is not None:
                    await self._cancel(spec)
                    counters.speculation_aborted += 1
                    self.metrics.speculation.labels("aborted").inc()
                    spec = None
                current = stage.doc_ids
                spec = self._start_speculation(question, stage.documents, sampling)
                if spec is not None:
                    counters.speculation_started += 1
                    self.metrics.speculation.labels("started").inc()
        except BaseException:
            if spec is not None:
                await self._cancel(spec)
            raise
        if final is None:
            raise RAGCacheError("the search source ended without a final stage")
        search_done = time.perf_counter()
        retrieval_s = search_done - started

        generation: _Generation | None = None
        speculative = False
        if spec is not None and tuple(d.id for d in spec.documents) == final.doc_ids:
            generation = await self._adopt(spec, emit)
            if generation is not None:
                speculative = True
                counters.speculation_used += 1
                self.metrics.speculation.labels("used").inc()
                # A used speculation counts toward PGDSF frequency like a final request.
                self.tree.mark_final(generation.handle)
                counters.search_hidden_s += max(0.0, search_done - spec.started_at)
        elif spec is not None:
            await self._cancel(spec)
            counters.speculation_aborted += 1
            self.metrics.speculation.labels("aborted").inc()
        if generation is None:
            prompt = self._build(question, final.documents, sampling)
            generation = await self._generate(prompt, sampling, emit, True)
        result = self._result(
            generation, final.documents, started, retrieval_s, speculative, search_done
        )
        return dataclasses.replace(result, scores=final.scores)

    def _start_speculation(
        self, question: str, documents: tuple[Document, ...], sampling: SamplingConfig | None
    ) -> _Run | None:
        """Start a speculative generation only if prefill has room for it now and nobody waits
        (Algorithm 2: wrong guesses use only idle capacity). Its text is buffered until
        adopted."""
        sampling = sampling or self.config.sampling
        try:
            prompt = self._build(question, documents, sampling)
        except InputError:
            return None  # e.g. an intermediate top-k too long for the context: wait for the final
        slot = self.admission.try_acquire(self._score(prompt)[1])
        if slot is None:
            return None
        chunks: asyncio.Queue[_Item] = asyncio.Queue()
        task = asyncio.ensure_future(
            self._generate(prompt, sampling, chunks.put_nowait, False, slot=slot)
        )
        # A task cancelled before its first step never runs its cleanup: free the slot here.
        task.add_done_callback(lambda _: slot.release())
        return _Run(documents, task, time.perf_counter(), chunks)

    async def _adopt(self, run: _Run, emit: Callable[[_Item], None] | None) -> _Generation | None:
        """Use a speculative generation whose documents turned out final: stream its text live
        from now on. None when it failed (the caller then runs the final generation)."""
        while not run.task.done():
            getter = asyncio.ensure_future(run.chunks.get())
            await asyncio.wait({getter, run.task}, return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                if emit is not None:
                    emit(getter.result())
            else:
                getter.cancel()
        while not run.chunks.empty():
            item = run.chunks.get_nowait()
            if emit is not None:
                emit(item)
        try:
            return run.task.result()
        except (RAGCacheError, asyncio.CancelledError):
            logger.warning("a speculative generation failed; running the final one")
            return None

    async def _cancel(self, run: _Run) -> None:
        run.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, RAGCacheError):
            await run.task

    async def _answer(
        self,
        question: str,
        documents: tuple[Document, ...],
        sampling: SamplingConfig | None,
        emit: Callable[[_Item], None] | None,
    ) -> QueryResult:
        for doc in documents:
            if not isinstance(doc, Document):
                raise InputError(
                    f"documents must be ragcache_core.Document, got {type(doc).__name__}"
                )
        started = time.perf_counter()
        sampling = sampling or self.config.sampling
        prompt = self._build(question, documents, sampling)
        generation = await self._generate(prompt, sampling, emit, True)
        return self._result(generation, documents, started, 0.0, False, started)

    def _result(
        self,
        generation: _Generation,
        documents: tuple[Document, ...],
        started: float,
        retrieval_s: float,
        speculative: bool,
        search_done: float,
    ) -> QueryResult:
        ttft = max(generation.first_token_at, search_done) - started
        self._count(generation)
        counters = self.metrics.counters
        counters.ttfts.append(ttft)
        self.metrics.ttft.observe(ttft)
        return QueryResult(
            answer=generation.text,
            token_ids=generation.token_ids,
            sources=documents,
            ttft_s=ttft,
            retrieval_s=retrieval_s,
            queue_wait_s=generation.queue_wait_s,
            hits=generation.hits,
            prompt_tokens=generation.prompt_tokens,
            finish_reason=generation.finish_reason,
            speculative=speculative,
            retries=generation.retries,
            timings=generation.timings,
        )

    # ------------------------------------------------------------------ one generation

    def _build(
        self, question: str, documents: Sequence[Document], sampling: SamplingConfig
    ) -> BuiltPrompt:
        """The prompt's token ids; `InputError` (before anything is allocated) when it does not
        fit the context with the answer."""
        prompt = self.prompts.build(question, documents)
        limit = self.config.max_model_len - sampling.max_tokens
        if prompt.num_tokens > limit:
            raise InputError(
                f"the prompt has {prompt.num_tokens} tokens but at most {limit} fit "
                f"(max_model_len {self.config.max_model_len} - max_tokens {sampling.max_tokens})"
            )
        return prompt

    async def _generate(
        self,
        prompt: BuiltPrompt,
        sampling: SamplingConfig,
        emit: Callable[[_Item], None] | None,
        final: bool,
        *,
        slot: Slot | None = None,
    ) -> _Generation:
        """Run one generation with retries on timeout and engine death. `slot`: a prefill slot
        the caller already holds (speculation); it is released on every path. A request that
        already streamed text is not retried (the text cannot be taken back)."""
        retries = 0
        while True:
            engine_generation = self._engine_generation
            emitted: list[str] = []

            def tracked_emit(item: _Item, sink: Any = emit, seen: list[str] = emitted) -> None:
                if isinstance(item, StreamChunk):
                    seen.append(item.delta)
                sink(item)

            try:
                generation = await self._generate_once(
                    prompt, sampling, tracked_emit if emit is not None else None, final, slot
                )
                generation.retries = retries
                return generation
            except (TimeoutError, EngineDied) as exc:
                slot = None
                self.metrics.counters.requests_failed += 1
                self.metrics.failures.inc()
                if isinstance(exc, EngineDied):
                    await self._restart_engine(engine_generation)
                what = "timed out" if isinstance(exc, TimeoutError) else "lost its engine"
                if retries >= self.config.max_retries or emitted:
                    raise RAGCacheError(
                        f"the request {what} after {retries + 1} attempt(s)"
                        + (" and had streamed text already" if emitted else "")
                    ) from exc
                retries += 1
                self.metrics.counters.retries += 1
                logger.warning("retrying a request that %s", what)

    async def _generate_once(
        self,
        prompt: BuiltPrompt,
        sampling: SamplingConfig,
        emit: Callable[[_Item], None] | None,
        final: bool,
        slot: Slot | None,
    ) -> _Generation:
        """One attempt. `request_timeout_s` bounds the wait for each event (the first token,
        then each next one), so a long healthy answer never times out; a stuck engine does.

        The request's copies are confirmed at its first token: the connector stores
        synchronously in the step that completes the prompt (before that step's token is
        sampled) and the plan was checked here before it was sent, so the first token proves
        the stores ran. Pins are released then, not at the end of the answer."""
        ticket = Ticket(score=lambda: self._score(prompt))
        if slot is None:
            slot = await self.admission.acquire(ticket)
        else:
            ticket.admitted_at = ticket.enqueued_at
        handle: RequestHandle | None = None
        request_id = f"ragcache-{next(self._ids)}"
        generation_of_engine = self._engine_generation
        timings: dict[str, float] = {}
        try:
            started = time.perf_counter()
            handle = self.tree.begin_request(
                len(prompt.root_ids), prompt.doc_specs, len(prompt.question_ids), final=final
            )
            params = self._plan_params(handle, prompt)
            submitted = time.perf_counter()
            timings["plan"] = submitted - started
            text, first_at, reason, report = "", 0.0, None, None
            tokens: tuple[int, ...] = ()
            stream = self.engine.stream(request_id, prompt.token_ids, sampling, params)
            loop = asyncio.get_running_loop()
            async with asyncio.timeout(self.config.request_timeout_s) as deadline:
                async for event in stream:
                    deadline.reschedule(loop.time() + self.config.request_timeout_s)
                    if event.token_ids and not first_at:
                        first_at = time.perf_counter()
                        timings["engine_first_token"] = first_at - submitted
                        slot.release()
                        if handle.is_open:  # (aborted when its plan was refused)
                            self.tree.confirm(handle)
                    if event.text != text:
                        delta = event.text[len(text) :]
                        if emit is not None and delta:
                            emit(StreamChunk(delta))
                    text, tokens, reason = event.text, event.token_ids, event.finish_reason
                    if event.finished:
                        report = event.kv_transfer_params
            first_at = first_at or time.perf_counter()  # no token at all: finished is the first
            settle_started = time.perf_counter()
            hits, doc_hit_tokens = self._settle(handle, report, prompt, timings)
            timings["settle"] = time.perf_counter() - settle_started
            settled, handle = handle, None
            return _Generation(
                token_ids=tokens,
                text=text,
                first_token_at=first_at,
                queue_wait_s=ticket.wait_s,
                hits=hits,
                prompt_tokens=prompt.num_tokens,
                finish_reason=reason,
                handle=settled,
                doc_tokens=sum(s.num_tokens for s in prompt.doc_specs),
                doc_hit_tokens=doc_hit_tokens,
                num_docs=len(prompt.doc_specs),
                timings=timings,
            )
        except BaseException:
            if generation_of_engine == self._engine_generation and not self.engine.is_dead:
                # Never let a failing abort hide the error that brought us here.
                with contextlib.suppress(Exception):
                    await asyncio.shield(self.engine.abort(request_id))
            raise
        finally:
            slot.release()
            if handle is not None and handle.is_open:
                self.tree.abort(handle)

    def _plan_params(self, handle: RequestHandle, prompt: BuiltPrompt) -> dict[str, Any] | None:
        """The request's `kv_transfer_params`, after checking its plan exactly as the
        connector will (`plan_problems`): a plan the connector would ignore is never sent, so
        the first token can confirm it. An invalid plan is a bug: logged, and the request runs
        uncached (its handle aborted)."""
        from ragcache_core.engine.connector.spans import plan_problems

        if handle.plan.is_empty:
            return None
        problems = plan_problems(
            handle.plan,
            prompt_len=prompt.num_tokens,
            page_size=self.connector.page_size,
            gpu_slots=self.connector.gpu_slots,
            host_slots=self.connector.host_slots,
        )
        if problems:
            logger.error("RAGCache built an invalid plan (%s); running uncached", problems)
            self.tree.abort(handle)
            return None
        return {PLAN_KEY: handle.plan.to_json()}

    def _score(self, prompt: BuiltPrompt) -> tuple[int, int]:
        cached = self.tree.match(prompt.doc_specs).cached_tokens
        return cached, prompt.num_tokens - cached

    def _settle(
        self, handle: RequestHandle, report: Any, prompt: BuiltPrompt, timings: dict[str, float]
    ) -> tuple[CacheHits, int]:
        """Apply the connector's final report (see `engine.single.settle`: a failed load
        removes the node it read); return what the request read (hits, document tokens hit)."""
        from ragcache_core.engine.connector import ConnectorResult
        from ragcache_core.engine.single import settle

        result = ConnectorResult.from_transfer_params(dict(report) if report else None)
        timings["load_copy"] = result.load_copy_s
        timings["store_copy"] = result.store_copy_s
        if handle.state is RequestState.ABORTED:
            computed = CacheHits(
                computed_docs=len(prompt.doc_specs), computed_tokens=prompt.num_tokens
            )
            return computed, 0
        settle(self.tree, handle, result)
        served = not result.rejected and not result.load_failed
        doc_hits = handle.hits.doc_hits if served else ()
        gpu = sum(1 for h in doc_hits if h.tier is Tier.GPU)
        host = sum(1 for h in doc_hits if h.tier is Tier.HOST)
        hits = CacheHits(
            gpu_docs=gpu,
            host_docs=host,
            computed_docs=len(prompt.doc_specs) - gpu - host,
            root_cached=served and handle.hits.root_cached,
            cached_tokens=result.loaded_tokens,
            computed_tokens=prompt.num_tokens - result.loaded_tokens,
        )
        return hits, sum(h.num_tokens for h in doc_hits)

    def _count(self, generation: _Generation) -> None:
        hits = generation.hits
        c = self.metrics.counters
        c.requests += 1
        c.docs_requested += generation.num_docs
        c.docs_hit_gpu += hits.gpu_docs
        c.docs_hit_host += hits.host_docs
        c.doc_tokens_requested += generation.doc_tokens
        c.doc_tokens_hit += generation.doc_hit_tokens
        self.metrics.queue_wait.observe(generation.queue_wait_s)
        c.tokens_saved += hits.cached_tokens
        c.tokens_computed += hits.computed_tokens
        self.metrics.hits.labels("gpu").inc(hits.gpu_docs)
        self.metrics.hits.labels("host").inc(hits.host_docs)
        self.metrics.misses.inc(hits.computed_docs)
        self.metrics.tokens_saved.inc(hits.cached_tokens)

    # ------------------------------------------------------------------ faults

    async def _start_engine(self) -> AsyncEngine:
        return AsyncEngine(self.engine_settings)

    async def _restart_engine(self, dead_generation: int) -> None:
        """Replace the engine of `dead_generation` (once, however many requests saw it die).
        GPU-pool copies are gone with the worker; confirmed host-pool copies survive in the
        app's shared memory."""
        if self._restart_lock is None:
            self._restart_lock = asyncio.Lock()
        async with self._restart_lock:
            if dead_generation != self._engine_generation:
                return  # another request restarted it already
            if not self.config.restart_engine:
                raise RAGCacheError("the vLLM engine died and restart_engine is off")
            logger.warning("the vLLM engine died; restarting it")
            self.engine.close()
            self.tree.drop_tier(Tier.GPU)
            self.engine = await self._start_engine()
            self._engine_generation += 1
            self.metrics.counters.engine_restarts += 1
            self.metrics.restarts.inc()

    def _release_resources(self) -> None:
        if self._host_pool is not None:
            self._host_pool.unlink()
            self._host_pool = None
            self._pool_finalizer.detach()
