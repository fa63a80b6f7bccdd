"""`RAGCache`: the product. Retrieval + knowledge cache + vLLM, one request at a time or many.

A small facade over the modules of `runtime/` that do the work (docs/architecture.md walks one
request through them):

    assembly.py     the parts, built from the config: pools, tree, admission, engine settings
    speculation.py  aquery: staged search, speculating on intermediate top-k (Algorithm 2)
    generation.py   one generation: attempts through admission and the lifecycle, retries
    lifecycle.py    the one owner of the knowledge tree (request path and admin calls)
    supervisor.py   the engine, started off the loop, replaced once when it dies
    uncached.py     plain vLLM on given token ids (the tree untouched)

Every engine and tree operation runs on one private event loop (`ragcache_core.loop`); each
public call has one async body there, which the async API awaits from the caller's loop and
the sync API blocks on (`query`/`generate`/`stream` and their async forms are written once in
`RAGCacheAPI`, api.py, shared with `RAGCacheClient`).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import weakref
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ragcache_core.api import RAGCacheAPI
from ragcache_core.app_prompt import NO_FRAMING, AppPrompt, Framing
from ragcache_core.config import CacheConfig, SamplingConfig
from ragcache_core.documents import Document
from ragcache_core.engine.async_engine import AsyncEngine
from ragcache_core.engine.hub import check_hub_model, load_tokenizer
from ragcache_core.engine.settings import check_model_folder
from ragcache_core.errors import wrong_type
from ragcache_core.loop import Emit, LoopThread, astream_from
from ragcache_core.metrics import Metrics
from ragcache_core.query_result import CacheHits, QueryResult, StreamChunk
from ragcache_core.runtime.generation import Generator
from ragcache_core.runtime.lifecycle import Lifecycle
from ragcache_core.runtime.main_guard import check_main_guard, vllm_spawns
from ragcache_core.runtime.prompt import PromptBuilder
from ragcache_core.runtime.report_probe import ReportProbe
from ragcache_core.runtime.speculation import SpeculativeQuery
from ragcache_core.runtime.supervisor import EngineState, EngineSupervisor
from ragcache_core.runtime.uncached import UncachedRunner
from ragcache_core.search import SearchSource
from ragcache_core.tree import KnowledgeTree

__all__ = ["CacheHits", "QueryResult", "RAGCache", "StreamChunk"]

logger = logging.getLogger(__name__)


class RAGCache(RAGCacheAPI):
    """A knowledge cache over a vLLM engine.

    `model` is a local checkpoint folder, or a Hugging Face model name (found in the local
    Hugging Face cache or on a reachable hub; else `ModelError` at once, engine/hub.py).
    `search` is the default `SearchSource` for `query`/`aquery` (per-call `search=` wins).
    The engine starts in the constructor (about 25 s on CPU), in processes that import the
    calling script again: create it under `if __name__ == "__main__":` (`MainGuardError`
    otherwise, runtime/main_guard.py). Close with `close()` or `with`; after that every call
    raises `CacheClosedError`. One never closed is closed at interpreter exit. Wrong objects
    (a `model` that is not a path or name, a `config` that is not a `CacheConfig`, a `search`
    that is not a `SearchSource`) raise `TypeError` naming what was expected and given.
    """

    def __init__(
        self,
        model: str | Path,
        config: CacheConfig | None = None,
        *,
        search: SearchSource | None = None,
    ) -> None:
        from ragcache_core.engine.settings import detect_device, resolve_device_defaults

        check_arguments(model, config, search)
        self.device = detect_device()
        check_main_guard("RAGCache", spawns=vllm_spawns(self.device))
        self.config = config = resolve_device_defaults(config or CacheConfig(), self.device)
        assert config.dtype is not None
        self.model = str(model)
        if Path(self.model).expanduser().exists() or os.sep in self.model[:2]:
            check_model_folder(self.model)
        else:
            check_hub_model(self.model)  # a name: fail now if no hub can give it
        self.search = search
        self.metrics = Metrics()
        tokenizer = load_tokenizer(self.model)
        self.prompts = PromptBuilder(tokenizer, config.prompt, self.model, config.dtype)
        # The integrations read whether prompts go through the model's chat template.
        chat = self.prompts.uses_chat_template
        self.config = config = config.with_(prompt=replace(config.prompt, chat_template=chat))
        self._closed = False
        self._build_parts()
        self._loop = LoopThread(owner="RAGCache")
        try:
            self._loop.run(self._engines.start())
        except BaseException:
            self._loop.stop()
            self._release_resources()
            raise
        if self._report_probe.enabled:
            self._loop.submit(self._report_probe.run())
        # A program that forgets close() still shuts the engine down cleanly at exit (before
        # multiprocessing's own exit hook, which atexit runs later: it was registered first).
        atexit.register(self._close_at_exit)

    def _build_parts(self) -> None:
        """Pools, tree, admission, engine settings (`runtime/assembly.py`), and the modules that run
        requests over them."""
        from ragcache_core.runtime.assembly import (
            build_admission,
            build_engine_settings,
            build_tree,
            open_pools,
        )
        from ragcache_core.storage.host_pool import remove_pool

        config = self.config
        pools = open_pools(self.model, config)
        self._host_pool = pools.host_pool
        if pools.host_pool is not None:
            # Remove the shared-memory file even if close() is never called.
            self._pool_finalizer = weakref.finalize(self, remove_pool, pools.name)
        self.connector = pools.connector
        self.engine_settings = build_engine_settings(
            self.model, config, self.connector, self.device
        )
        self.lifecycle = Lifecycle(
            build_tree(config, self.prompts.root_key, self.connector, self.engine_settings),
            self.connector,
        )
        self.metrics.watch_roots(lambda: self.lifecycle.tree.num_roots)
        self.admission = build_admission(config)
        self._engines = EngineSupervisor(self.engine_settings, config, self.lifecycle, self.metrics)
        self._generator = Generator(
            config=config,
            prompts=self.prompts,
            lifecycle=self.lifecycle,
            admission=self.admission,
            engines=self._engines,
            metrics=self.metrics,
        )
        self._queries = SpeculativeQuery(
            config=config,
            generator=self._generator,
            admission=self.admission,
            lifecycle=self.lifecycle,
            metrics=self.metrics,
        )
        self._uncached = UncachedRunner(config, self._engines, self.admission, self.metrics)
        self._report_probe = ReportProbe(self.lifecycle, self._engines, config)

    @property
    def tree(self) -> KnowledgeTree:
        """The knowledge tree (read it freely; `lifecycle` is the one that changes it)."""
        return self.lifecycle.tree

    @property
    def engine(self) -> AsyncEngine:
        """The running vLLM engine (replaced after an engine death)."""
        return self._engines.engine

    @property
    def engine_state(self) -> EngineState:
        """`running`, or why not: `starting`, `dead` (restarted at once unless
        `restart_engine` is off), `restarting`, `stopped` (closed). Safe to read from any
        thread (`ragcache serve`'s /health reads it)."""
        return self._engines.state

    # ------------------------------------------------------------------ public API
    # (aquery/query, agenerate/generate, astream/stream: RAGCacheAPI, api.py, over the
    # bodies below)

    async def astream_uncached(
        self, prompt_ids: Sequence[int], *, sampling: SamplingConfig | None = None
    ) -> AsyncGenerator[StreamChunk, None]:
        """Plain vLLM on `prompt_ids` on this cache's engine: the knowledge tree is neither read
        nor written, and vLLM's prefix cache is not read (`runtime/uncached.py`: no tenant salt
        here; what `ragcache serve` answers without documents). Streams
        like `astream`; the last chunk carries the `QueryResult` (no sources, no hits)."""
        ids = tuple(prompt_ids)

        def work(emit: Emit) -> Any:
            return self._uncached.run(ids, sampling or self.config.sampling, emit)

        async for chunk in astream_from(self._loop, work):
            yield chunk

    async def agenerate_uncached(
        self, prompt_ids: Sequence[int], *, sampling: SamplingConfig | None = None
    ) -> QueryResult:
        """`astream_uncached`'s answer, whole: nothing reaches the caller before it ends, so
        a try that loses its engine is retried as one that failed before its first token."""
        ids = tuple(prompt_ids)
        work = self._uncached.run(ids, sampling or self.config.sampling, None)
        return await self._loop.arun(work)

    def check_sampling(self, sampling: SamplingConfig) -> None:
        """`InputError` naming the field when this cache's engine would refuse `sampling`
        (vLLM's checks that need the model: token ids in the vocabulary, the logprobs limit,
        grammars, bad words). Every request runs it before anything is allocated; callers
        may run it earlier (`ragcache serve` does, before a stream's status line). Safe from
        any thread."""
        self.engine.checker.check(sampling)

    def check_integrity(self) -> None:
        """Verify the knowledge tree's invariants (on RAGCache's loop, so it is safe while
        requests run); raises `IntegrityError` naming the first violation."""

        async def check() -> None:
            self.lifecycle.check_integrity()

        self._loop.run(check())

    def stats(self) -> dict[str, Any]:
        """Counters (hits per tier, tokens saved, speculation, TTFT) and tree occupancy."""
        return self._loop.run(self._stats())

    def conversation_prompt(self, history: Sequence[Mapping[str, Any]]) -> AppPrompt:
        """`RAGCacheAPI.conversation_prompt` with this model's chat template (a template
        without a system role puts the documents in the first user turn)."""
        return self.prompts.conversation(history)

    def invalidate(self, doc_id: str) -> int:
        """Drop every cached node of `doc_id` (and what was computed after it). Returns the
        number of nodes dropped. In-flight readers keep their pins; nothing stale is served."""

        async def drop() -> int:
            return self.lifecycle.invalidate(doc_id)

        return self._loop.run(drop())

    def clear(self) -> None:
        """Forget every cached document and reset the counters: the host tier and vLLM's
        prefix cache (the GPU tier) unless a running request holds blocks
        (then vLLM keeps it, which is logged: its blocks are keyed by token ids, so they are
        never wrong)."""

        async def clear() -> None:
            async with self._report_probe.lock:  # no probe in the engine while it resets
                self.metrics.record_tree(self.tree.counters)  # evictions before the clear
                self.lifecycle.clear()
                if not self.engine.is_dead:
                    reset = await self.engine.reset_prefix_cache()
                    if not reset:
                        logger.warning(
                            "RAGCache.clear(): vLLM kept its prefix cache (requests are running)"
                        )
                self.metrics.reset()

        self._loop.run(clear())

    def close(self) -> None:
        """Stop the engine, remove the host pool, stop the loop. Safe to call twice. Every
        call afterwards raises `CacheClosedError` (calls still running get it too)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._close_at_exit)

        async def shutdown() -> None:
            # Requests still running are cancelled instead of hanging their callers, who get
            # CacheClosedError (the loop is stopping: loop.py).
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)
            self._engines.close()
            await asyncio.sleep(0)  # let the engine's output task see its cancellation

        try:
            self._loop.stop(shutdown())
        finally:
            self._release_resources()

    def _close_at_exit(self) -> None:
        """At interpreter exit, for a cache nobody closed: close it, quietly (the program is
        over; a traceback now would only alarm)."""
        with contextlib.suppress(Exception):
            self.close()

    # ------------------------------------------------------------------ bodies (on the loop)

    async def _query(
        self,
        question: str,
        search: SearchSource | None,
        top_k: int | None,
        sampling: SamplingConfig | None,
        emit: Emit | None,
        framing: Framing = NO_FRAMING,
    ) -> QueryResult:
        return await self._queries.run(
            question, search or self.search, top_k, sampling, emit, framing
        )

    async def _answer(
        self,
        question: str,
        documents: Sequence[Document],
        sampling: SamplingConfig | None,
        emit: Emit | None,
        framing: Framing = NO_FRAMING,
    ) -> QueryResult:
        return await self._generator.answer(question, tuple(documents), sampling, emit, framing)

    async def _stats(self) -> dict[str, Any]:
        self.metrics.record_tree(self.tree.counters)
        data = self.metrics.counters.as_dict()
        tree = self.tree.stats()
        counted = self.tree.counters
        data["tree"] = {
            "nodes": tree.nodes,
            "host_slots": tree.host_slots,
            "host_used_slots": tree.host_used_slots,
            "pinned_nodes": tree.pinned_nodes,
            "open_requests": tree.open_requests,
            "page_size": tree.page_size,
            "roots": tree.roots,
            "evictions_host": counted.evictions_host,
        }
        writes = self.tree.host_writes
        if writes is not None:  # eviction-time host writes: where kept documents went
            data["host_writes"] = {
                "copies": writes.copies,
                "copies_wasted": writes.wasted,
                "keys_dropped": writes.dropped,
                "lost_missed": writes.lost.missed,
                "lost_no_lease": writes.lost.no_lease,
                "lost_broken": writes.lost.broken,
                "unapplied_copies": writes.lost.unapplied,
                "concurrent_computes": writes.concurrent_computes,
                "lease_slots": writes.lease_slots,
                "lease_peak_slots": writes.lease_peak,
                "victim_slots": self.tree.host_victim_slots,
                "victims_overwritten": writes.overwritten,
                "stale_reports": writes.stale_reports,
                "report_probes": self._report_probe.probes,
            }
        data["engine_steps"] = self.lifecycle.engine_steps.summary()
        data["queue_waiting"] = self.admission.waiting
        data["in_prefill"] = self.admission.in_prefill
        data["deferrals"] = self.admission.deferrals
        data["engine_requests"] = self.engine.unfinished_requests
        return data

    def _release_resources(self) -> None:
        if self._host_pool is not None:
            self._host_pool.unlink()
            self._host_pool = None
            self._pool_finalizer.detach()


def check_arguments(model: object, config: object, search: object) -> None:
    """`TypeError` naming what was expected and what was given, before anything starts."""
    if not isinstance(model, str | Path):
        raise wrong_type("RAGCache(model)", "a model folder (str or Path) or a hub name", model)
    if config is not None and not isinstance(config, CacheConfig):
        raise wrong_type("RAGCache(model, config)", "a ragcache_core.CacheConfig", config)
    if search is not None and not isinstance(search, SearchSource):
        raise wrong_type(
            "RAGCache(search=)",
            "a ragcache_core SearchSource (e.g. an index's .source())",
            search,
            "for a LlamaIndex index or a LangChain store use ragcache_integrations "
            "(as_query_engine(index, cache=cache), RAGCacheRunnable.from_vectorstore(store, "
            "cache=cache))",
        )
