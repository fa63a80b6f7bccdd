"""One generation on vLLM's async engine: a request's tries through admission and the
lifecycle, retries.

    generate ─► Request.attempt ─► admit   a place in prefill (a speculation comes holding one)
        ▲                        ├► open    Lifecycle.open: the plan in the tree, checked as
        │                        │          the connector will check it
        │                        ├► stream  engine.stream(prompt, plan); at the first token
        │                        │          Lifecycle.first_token (confirm), then the place
        │                        │          goes back
        │                        └► settle  Lifecycle.settle + served_hits on the report
        └── on a timeout or an engine death (engine restarted once): `Request.try_again`,
            unless text reached the caller already (it cannot be taken back) or
            `max_retries` is spent (`check_retry`, the rule uncached requests follow too: a
            whole answer shows nothing before it ends, so it is retried like a stream before
            its first token)

Whatever happens to a try, its place in prefill is given back and a handle left open is
aborted (`_release`). `Generator.finish` builds the caller's `QueryResult` from the request's
last try, once, and records it in the metrics. Runs on RAGCache's loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import replace

from ragcache_core.app_prompt import NO_FRAMING, Framing
from ragcache_core.config import CacheConfig, SamplingConfig
from ragcache_core.documents import Document, checked_documents
from ragcache_core.engine.async_engine import EngineDied, StreamEvent
from ragcache_core.engine.connector import ConnectorResult
from ragcache_core.errors import InputError, PromptTooLong, RAGCacheError, check_fits_context
from ragcache_core.loop import Emit
from ragcache_core.metrics import Metrics
from ragcache_core.plan import PLAN_KEY
from ragcache_core.query_result import CacheHits, QueryResult, StreamChunk
from ragcache_core.runtime.admission import Admission
from ragcache_core.runtime.attempt import Attempt, Request
from ragcache_core.runtime.lifecycle import Lifecycle, served_hits
from ragcache_core.runtime.prompt import BuiltPrompt, PromptBuilder
from ragcache_core.runtime.supervisor import EngineSupervisor

logger = logging.getLogger(__name__)


async def follow(
    events: AsyncGenerator[StreamEvent, None],
    timeout_s: float,
    attempt: Attempt,
    on_first_token: Callable[[float], None],
    interval: int = 1,
) -> None:
    """Follow one request's engine stream to its end (closing it on every path), writing what
    it streamed into `attempt`: text deltas (with their tokens and logprobs) to its caller
    (`Request.sink`), the first at once, then one per `interval` tokens at most
    (`SamplingConfig.stream_interval`, as vLLM's streams), and the rest at the end;
    `on_first_token(time)` once, at the first token. `timeout_s` bounds the wait for each
    event (the first token, then each next one), so a long healthy answer never times out; a
    stuck engine does (`TimeoutError`). Used by cached and uncached requests."""
    emit = attempt.request.sink
    loop = asyncio.get_running_loop()
    shown_tokens = shown_text = 0  # what was sent with a chunk
    async with contextlib.aclosing(events), asyncio.timeout(timeout_s) as deadline:
        async for event in events:
            deadline.reschedule(loop.time() + timeout_s)
            if event.token_ids and not attempt.first_token_at:
                attempt.first_token_at = time.perf_counter()
                on_first_token(attempt.first_token_at)
            attempt.logprobs += event.new_logprobs
            new_tokens = len(event.token_ids) - shown_tokens
            due = not shown_tokens or event.finished or new_tokens >= interval
            if emit is not None and len(event.text) > shown_text and due:
                tokens = event.token_ids[shown_tokens:]
                lps = attempt.logprobs[shown_tokens:] if attempt.logprobs else ()
                emit(StreamChunk(event.text[shown_text:], None, tokens, lps))
                shown_tokens, shown_text = len(event.token_ids), len(event.text)
            attempt.text, attempt.token_ids = event.text, event.token_ids
            attempt.finish_reason = event.finish_reason
            attempt.cached_tokens = max(attempt.cached_tokens, event.num_cached_tokens)
            if event.finished:
                attempt.report = event.kv_transfer_params
    # No token at all: finishing is the first.
    attempt.first_token_at = attempt.first_token_at or time.perf_counter()


def check_retry(exc: BaseException, retries: int, max_retries: int, *, shown: bool) -> None:
    """Whether a try that failed with `exc` (a timeout or an engine death) is tried again:
    the same rule for every request, cached or not, streamed or whole. It is, unless
    `max_retries` are spent or text already reached the caller (`shown`: it cannot be taken
    back). A whole answer shows nothing before it ends, so it is retried like a stream that
    failed before its first token. Raises the caller's `RAGCacheError` when it is not."""
    what = "timed out" if isinstance(exc, TimeoutError) else "lost its engine"
    if retries >= max_retries or shown:
        raise RAGCacheError(
            f"the request {what} after {retries + 1} attempt(s)"
            + (" and had streamed text already" if shown else "")
        ) from exc
    logger.warning("retrying a request that %s", what)


class Generator:
    """Builds prompts and runs generations for one `RAGCache`."""

    def __init__(
        self,
        *,
        config: CacheConfig,
        prompts: PromptBuilder,
        lifecycle: Lifecycle,
        admission: Admission,
        engines: EngineSupervisor,
        metrics: Metrics,
    ) -> None:
        self._config = config
        self._prompts = prompts
        self._lifecycle = lifecycle
        self._admission = admission
        self._engines = engines
        self._metrics = metrics
        self._ids = itertools.count()

    # ------------------------------------------------------------------ prompts

    def check_sampling(self, sampling: SamplingConfig) -> None:
        """`InputError` naming the field when vLLM's engine would refuse `sampling` for this
        model (before anything is allocated)."""
        self._engines.engine.checker.check(sampling)

    def build(
        self,
        question: str,
        documents: Sequence[Document],
        sampling: SamplingConfig,
        framing: Framing = NO_FRAMING,
    ) -> BuiltPrompt:
        """The prompt's token ids (the app's prompt of `framing`, its salt in the root key);
        `PromptTooLong` (before anything is allocated, and before any of it is memoized) when
        it does not fit the context with the answer."""
        max_len = self._config.max_model_len
        check_fits_context(0, sampling.max_tokens, max_len)  # names a max_tokens over the context
        limit = max_len - sampling.max_tokens
        try:
            prompt = self._prompts.build(
                question, documents, framing.prompt, framing.cache_salt, max_tokens=limit
            )
            order = self.served_order(prompt, documents, framing)
            if order is not None:
                served = [documents[rank] for rank in order]
                prompt = replace(
                    self._prompts.build(
                        question, served, framing.prompt, framing.cache_salt, max_tokens=limit
                    ),
                    order=order,
                )
        except PromptTooLong as exc:
            raise PromptTooLong(
                f"{exc} (max_model_len {max_len} - max_tokens {sampling.max_tokens})",
                tokens=exc.tokens,
                limit=exc.limit,
            ) from None
        self._metrics.record_prompt(
            moved_cuts=prompt.moved_cuts, unplaced_docs=prompt.unplaced_docs
        )
        return prompt

    def reordering(
        self,
        question: str,
        documents: Sequence[Document],
        sampling: SamplingConfig,
        framing: Framing = NO_FRAMING,
    ) -> Callable[[BuiltPrompt], BuiltPrompt] | None:
        """For a `document_order="cache"` request, what its attempt calls when it opens: the
        prompt again in the order that follows the cached path then (the tree moved while it
        waited; the queue scored it in that order, `Lifecycle.score_ordered`), or the same
        prompt when the order did not change. None for a request in retrieval order."""
        wanted = framing.document_order or self._config.document_order
        if wanted != "cache" or len(documents) < 2:
            return None

        def again(prompt: BuiltPrompt) -> BuiltPrompt:
            order = self.served_order(prompt, documents, framing)
            if order == prompt.order:
                return prompt
            try:
                return self.build(question, documents, sampling, framing)
            except InputError:  # another order a token longer than the context: keep it
                return prompt

        return again

    def served_order(
        self, prompt: BuiltPrompt, documents: Sequence[Document], framing: Framing
    ) -> tuple[int, ...] | None:
        """With `document_order="cache"` (the call's, else the config's), the order of
        `documents` that follows the cached path under `prompt`'s root now
        (`KnowledgeTree.cache_order`, by document id: a node's ids depend on what precedes it,
        so the keys of another order are known only once it is built); None when that is
        retrieval order or the call keeps retrieval order."""
        wanted = framing.document_order or self._config.document_order
        if wanted != "cache" or len(documents) < 2:
            return None
        ids = [doc.id for doc in documents]
        order = self._lifecycle.tree.cache_order(ids, prompt.root_key)
        return None if order == tuple(range(len(ids))) else order

    # ------------------------------------------------------------------ requests

    async def answer(
        self,
        question: str,
        documents: tuple[Document, ...],
        sampling: SamplingConfig | None,
        emit: Emit | None,
        framing: Framing = NO_FRAMING,
    ) -> QueryResult:
        """Answer with documents the caller already has (no retrieval)."""
        documents = checked_documents(documents)
        started = time.perf_counter()
        sampling = sampling or self._config.sampling
        self.check_sampling(sampling)
        prompt = self.build(question, documents, sampling, framing)
        reorder = self.reordering(question, documents, sampling, framing)
        request = await self.generate(self.request(prompt, sampling, emit, reorder=reorder))
        return self.finish(request, question, documents, framing, started, search_done=started)

    def finish(
        self,
        request: Request,
        question: str,
        documents: tuple[Document, ...],
        framing: Framing,
        started: float,
        *,
        search_done: float,
        scores: tuple[float, ...] = (),
        speculative: bool = False,
        order: tuple[int, ...] | None = None,
        search_hidden_s: float = 0.0,
    ) -> QueryResult:
        """The caller's result, built once from the request's last try (TTFT from the call,
        counting a first token that came before the search ended as shown at its end; the
        prompt's text when `framing` asks for it); recorded in the metrics. `documents`
        (and their search `scores`) are in retrieval order; the sources list them as served
        (`order`, else the prompt's)."""
        attempt = request.attempt
        ttft = max(attempt.first_token_at, search_done) - started
        prompt = attempt.prompt
        ranks = order or prompt.order or tuple(range(len(documents)))
        self._metrics.record_request(
            attempt.hits,
            num_docs=len(prompt.doc_specs),
            doc_tokens=sum(s.num_tokens for s in prompt.doc_specs),
            doc_hit_tokens=attempt.doc_hit_tokens,
            queue_wait_s=attempt.wait_s,
            ttft_s=ttft,
        )
        sources = tuple(documents[rank] for rank in ranks)
        # The prompt as the model saw it, rendered again from the same question, documents
        # and prompt (the text the ids came from): a chat-template pass, so only when asked.
        shown = (
            self._prompts.render(question, sources, framing.prompt)
            if framing.return_prompt
            else None
        )
        return QueryResult(
            answer=attempt.text,
            token_ids=attempt.token_ids,
            sources=sources,
            retrieval_ranks=ranks,
            ttft_s=ttft,
            retrieval_s=search_done - started,
            search_hidden_s=search_hidden_s,
            queue_wait_s=attempt.wait_s,
            hits=attempt.hits,
            prompt_tokens=prompt.num_tokens,
            finish_reason=attempt.finish_reason,
            speculative=speculative,
            retries=request.retries,
            scores=scores and tuple(scores[rank] for rank in ranks),
            timings=attempt.timings,
            logprobs=attempt.logprobs,
            prompt_text=shown,
        )

    def request(
        self,
        prompt: BuiltPrompt,
        sampling: SamplingConfig,
        emit: Emit | None,
        *,
        final: bool = True,
        reorder: Callable[[BuiltPrompt], BuiltPrompt] | None = None,
    ) -> Request:
        """A request to generate for `prompt`, with its first try (`emit`: where its text
        goes; `final`: not a speculation). `reorder` (`reordering`): a cache-ordered request,
        scored in the order of the tree at each pick and built again in it when a try
        opens."""
        lifecycle = self._lifecycle
        score = lifecycle.score if reorder is None else lifecycle.score_ordered
        return Request(
            prompt=prompt,
            sampling=sampling,
            score=functools.partial(score, prompt),
            final=final,
            blocked=functools.partial(lifecycle.blocked, prompt),
            caller=emit,
            reorder=reorder,
        )

    async def generate(self, request: Request) -> Request:
        """Run `request` from its current try, a new one per retry (on a timeout or an engine
        death); returns it once a try finished (`request.attempt`). The first try may come
        holding its place in prefill (speculation: `Admission.try_acquire`), which is given
        back on every path. A request that already streamed text is not tried again (the text
        cannot be taken back)."""
        while True:
            attempt = request.attempt
            attempt.request_id = f"ragcache-{next(self._ids)}"
            attempt.epoch = self._engines.epoch
            try:
                await self._run(attempt)
                return request
            except (TimeoutError, EngineDied) as exc:
                self._metrics.record_failure()
                if isinstance(exc, EngineDied):
                    await self._engines.restart(attempt.epoch)
                check_retry(exc, request.retries, self._config.max_retries, shown=request.streamed)
                self._metrics.record_retry()
                request.try_again()

    # ------------------------------------------------------------------ one attempt

    async def _run(self, attempt: Attempt) -> None:
        """One attempt, step by step (module docstring). Whatever happens, its place in
        prefill is given back and a handle left open is aborted (its copies dropped)."""
        await self._admit(attempt)
        try:
            self._open(attempt)
            await self._stream(attempt)
            self._settle(attempt)
        except BaseException:
            await self._abort_in_engine(attempt)
            raise
        finally:
            self._release(attempt)

    async def _admit(self, attempt: Attempt) -> None:
        """Wait for a restart under way, then for a place in prefill (unless the attempt
        came with one)."""
        await self._engines.wait_running()
        if attempt.in_prefill:
            attempt.admitted_at = attempt.enqueued_at
        else:
            await self._admission.acquire(attempt)
        attempt.epoch = self._engines.epoch

    def _open(self, attempt: Attempt) -> None:
        """Plan the request in the tree (`Lifecycle.open`)."""
        started = time.perf_counter()
        request = attempt.request
        if request.reorder is not None:
            attempt.prompt = request.reorder(attempt.prompt)
        attempt.handle, attempt.plan = self._lifecycle.open(attempt.prompt, final=request.final)
        self._metrics.record_tree(self._lifecycle.tree.counters)
        attempt.timings["plan"] = time.perf_counter() - started

    async def _stream(self, attempt: Attempt) -> None:
        """Submit the request and follow it to the end (`follow`: `request_timeout_s` per
        event).

        The request's copies are confirmed at its first token: the connector stores
        synchronously in the step that completes the prompt (before that step's token is
        sampled) and the plan was checked before it was sent, so the first token proves the
        stores ran. Pins and the place in prefill go then, not at the end."""
        handle = attempt.handle
        assert handle is not None  # set by _open
        submitted = time.perf_counter()

        def confirm(first_token_at: float) -> None:
            attempt.timings["engine_first_token"] = first_token_at - submitted
            # Confirm before releasing: the requests admission wakes (deferred on this
            # request's documents) must see them readable.
            self._lifecycle.first_token(handle)
            self._admission.release(attempt)

        plan = attempt.plan
        params = {PLAN_KEY: plan.to_json()} if plan is not None else None
        sampling = attempt.request.sampling
        stream = self._engines.engine.stream(
            attempt.request_id,
            attempt.prompt.token_ids,
            sampling,
            params,
            cache_salt=attempt.prompt.root_key.salt if attempt.prompt.root_key else "",
        )
        interval = sampling.stream_interval or 1
        await follow(stream, self._config.request_timeout_s, attempt, confirm, interval)

    def _settle(self, attempt: Attempt) -> None:
        """Apply the connector's final report (`Lifecycle.settle`) and read what was served."""
        handle, timings = attempt.handle, attempt.timings
        assert handle is not None  # set by _open
        started = time.perf_counter()
        report = dict(attempt.report) if attempt.report else None
        result = ConnectorResult.from_transfer_params(report)
        timings["load_copy"] = result.load_copy_s
        timings["store_copy"] = result.store_copy_s
        timings["window_copy"] = result.window_copy_s
        # No connector report after a first token: vLLM's front end ended the request (a
        # stop string) and the engine core saw an abort, which reports nothing. The first
        # token proved the stores ran, so its confirmation stands. Its hit counts read 0:
        # without the report vLLM's count cannot be split into its own hit and the loads.
        if report is not None or handle.is_open:
            self._lifecycle.settle(handle, result)
        if report is not None or attempt.plan is None:
            attempt.hits, attempt.doc_hit_tokens = served_hits(
                handle,
                result,
                attempt.prompt,
                attempt.cached_tokens,
                self._lifecycle.tree.block_size,
            )
        else:
            prompt = attempt.prompt
            attempt.hits = CacheHits(
                computed_docs=len(prompt.doc_specs), computed_tokens=prompt.num_tokens
            )
        timings["settle"] = time.perf_counter() - started

    async def _abort_in_engine(self, attempt: Attempt) -> None:
        """Abort the request in vLLM if its engine still runs (never hiding the error that
        brought us here)."""
        if attempt.epoch == self._engines.epoch and not self._engines.engine.is_dead:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._engines.engine.abort(attempt.request_id))

    def _release(self, attempt: Attempt) -> None:
        """Abort a handle left open, then give back the place in prefill: the requests
        admission wakes must see the tree without this request's copies. The place goes back
        even if the abort raises."""
        try:
            if attempt.handle is not None:
                self._lifecycle.abort(attempt.handle)
        finally:
            self._admission.release(attempt)
