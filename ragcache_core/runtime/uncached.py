"""Plain vLLM on given token ids, on RAGCache's engine: the cache is neither read nor written.

What `ragcache serve` answers for a request it cannot cache (no documents, or a system prompt
other than the tree's root), exactly as `vllm serve` would: the ids go to the engine with no
plan, and vLLM's own prefix caching is off in a RAGCache engine. It waits for prefill room in
RAGCache's admission like every request (nothing cached to reorder it by). Runs on RAGCache's
loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Sequence

from ragcache_core.config import CacheConfig, SamplingConfig
from ragcache_core.engine.async_engine import EngineDied
from ragcache_core.errors import InputError, RAGCacheError, check_fits_context
from ragcache_core.loop import Emit
from ragcache_core.results import CacheHits, QueryResult
from ragcache_core.runtime.admission import Admission, Ticket
from ragcache_core.runtime.generation import follow
from ragcache_core.runtime.supervisor import EngineSupervisor


class UncachedRunner:
    """Runs requests straight on the engine: no plan, no retry (text already streamed cannot
    be taken back, and a retry would not be what vLLM does), but through RAGCache's admission
    like every request, so uncached traffic counts in the prefill budget."""

    def __init__(
        self, config: CacheConfig, engines: EngineSupervisor, admission: Admission
    ) -> None:
        self._config = config
        self._engines = engines
        self._admission = admission
        self._ids = itertools.count()

    async def run(
        self, prompt_ids: Sequence[int], sampling: SamplingConfig, emit: Emit | None
    ) -> QueryResult:
        """Generate for `prompt_ids`; `InputError` (before anything runs) when they do not fit
        the context with the answer; `RAGCacheError` on a timeout or an engine death (the
        engine is replaced, the request is not retried)."""
        ids = _checked_ids(prompt_ids, sampling, self._config.max_model_len)
        self._engines.engine.checker.check(sampling)
        started = time.perf_counter()
        ticket = Ticket(score=lambda: (0, len(ids)))
        lease = await self._admission.acquire(ticket)
        request_id = f"uncached-{next(self._ids)}"
        epoch = self._engines.epoch
        timeout = self._config.request_timeout_s
        try:
            stream = self._engines.engine.stream(request_id, ids, sampling)
            interval = sampling.stream_interval or 1
            progress = await follow(stream, timeout, emit, lambda _: lease.release(), interval)
        except TimeoutError:
            await self._abort(request_id, epoch)
            raise RAGCacheError(f"the request timed out after {timeout} s") from None
        except EngineDied as exc:
            await self._engines.restart(epoch)
            raise RAGCacheError("the request lost its engine (restarted; not retried)") from exc
        except BaseException:
            await self._abort(request_id, epoch)
            raise
        finally:
            lease.release()
        return QueryResult(
            answer=progress.text,
            token_ids=progress.token_ids,
            sources=(),
            ttft_s=progress.first_token_at - started,
            retrieval_s=0.0,
            queue_wait_s=ticket.wait_s,
            hits=CacheHits(computed_tokens=len(ids)),
            prompt_tokens=len(ids),
            finish_reason=progress.finish_reason,
            logprobs=progress.logprobs,
        )

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
