"""Plain vLLM on given token ids, on RAGCache's engine: the knowledge tree is neither read nor
written.

What `ragcache serve` answers for a request it cannot cache (no documents, or a system prompt
other than the tree's root), exactly as `vllm serve` would: the ids go to the engine with no
plan and do not read vLLM's prefix cache (RAGCache's GPU tier): the tenant salt of such a
request is not known here, and an unsalted read would let one tenant probe another's prompts
through the cached-token count. The blocks they compute are cached unsalted, which no salted
request can match. It waits for prefill room in
RAGCache's admission like every request (nothing cached to reorder it by). A try that times
out or loses its engine is counted and retried by the rule cached requests follow
(`generation.check_retry`: unless text already reached the caller). Runs on RAGCache's loop
only.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Sequence

from ragcache_core.config import CacheConfig, SamplingConfig
from ragcache_core.engine.async_engine import EngineDied
from ragcache_core.errors import InputError, check_fits_context
from ragcache_core.loop import Emit
from ragcache_core.metrics import Metrics
from ragcache_core.query_result import CacheHits, QueryResult
from ragcache_core.runtime.admission import Admission
from ragcache_core.runtime.attempt import Attempt, Request
from ragcache_core.runtime.generation import check_retry, follow
from ragcache_core.runtime.prompt import BuiltPrompt
from ragcache_core.runtime.supervisor import EngineSupervisor


class UncachedRunner:
    """Runs requests straight on the engine: no plan, but through RAGCache's admission like
    every request, so uncached traffic counts in the prefill budget."""

    def __init__(
        self,
        config: CacheConfig,
        engines: EngineSupervisor,
        admission: Admission,
        metrics: Metrics,
    ) -> None:
        self._config = config
        self._engines = engines
        self._admission = admission
        self._metrics = metrics
        self._ids = itertools.count()

    async def run(
        self, prompt_ids: Sequence[int], sampling: SamplingConfig, emit: Emit | None
    ) -> QueryResult:
        """Generate for `prompt_ids`; `InputError` (before anything runs) when they do not fit
        the context with the answer; `RAGCacheError` on a timeout or an engine death that
        cannot be retried (the engine is replaced either way)."""
        ids = _checked_ids(prompt_ids, sampling, self._config.max_model_len)
        self._engines.engine.checker.check(sampling)
        started = time.perf_counter()
        # No documents and no plan: the whole prompt is the rest, all of it computed.
        prompt = BuiltPrompt(root_ids=(), doc_ids=(), question_ids=tuple(ids), doc_specs=())
        request = Request(prompt, sampling, score=lambda: (0, len(ids)), caller=emit)
        while True:
            try:
                await self._attempt(request.attempt)
                break
            except (TimeoutError, EngineDied) as exc:
                self._metrics.record_failure()
                check_retry(exc, request.retries, self._config.max_retries, shown=request.streamed)
                self._metrics.record_retry()
                request.try_again()
        attempt = request.attempt
        return QueryResult(
            answer=attempt.text,
            token_ids=attempt.token_ids,
            sources=(),
            ttft_s=attempt.first_token_at - started,
            retrieval_s=0.0,
            queue_wait_s=attempt.wait_s,
            hits=CacheHits(computed_tokens=len(ids)),
            prompt_tokens=len(ids),
            finish_reason=attempt.finish_reason,
            retries=request.retries,
            logprobs=attempt.logprobs,
        )

    async def _attempt(self, attempt: Attempt) -> None:
        """One try: the wait for prefill room and the engine's stream. A dead engine is
        restarted (once per death) before the error goes up."""
        await self._engines.wait_running()
        attempt.enqueued_at = time.perf_counter()  # its wait for prefill starts now
        await self._admission.acquire(attempt)
        attempt.request_id = f"uncached-{next(self._ids)}"
        attempt.epoch = self._engines.epoch
        release = self._admission.release
        try:
            stream = self._engines.engine.stream(
                attempt.request_id,
                attempt.prompt.token_ids,
                attempt.request.sampling,
                read_prefix_cache=False,
            )
            timeout = self._config.request_timeout_s
            interval = attempt.request.sampling.stream_interval or 1
            await follow(stream, timeout, attempt, lambda _: release(attempt), interval)
        except EngineDied:
            await self._engines.restart(attempt.epoch)
            raise
        except BaseException:
            await self._abort(attempt.request_id, attempt.epoch)
            raise
        finally:
            release(attempt)

    async def _abort(self, request_id: str, epoch: int) -> None:
        """Abort the request in vLLM (if its engine still runs); never hides the caller's
        error."""
        if epoch == self._engines.epoch and not self._engines.engine.is_dead:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._engines.engine.abort(request_id))


def _checked_ids(prompt_ids: Sequence[int], sampling: SamplingConfig, max_len: int) -> list[int]:
    ids = list(prompt_ids)
    if not ids:
        raise InputError("the prompt is empty")
    if any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in ids):
        raise InputError("prompt token ids must be non-negative integers")
    check_fits_context(len(ids), sampling.max_tokens, max_len)
    return ids
