"""vLLM's async engine (`AsyncLLM`) in the app process: many concurrent requests on one event
loop, each streamed token by token, abortable, with vLLM's own TTFT.

The runtime is the only user (`runtime.supervisor.EngineSupervisor` starts and replaces it).
`EngineDied` tells it the engine core is gone (a crashed or killed process); it then closes
this engine and starts a new one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from typing import Any

from ragcache_core.config import SamplingConfig
from ragcache_core.engine.connector.config import FAULT_KEY
from ragcache_core.engine.settings import EngineSettings
from ragcache_core.errors import RAGCacheError
from ragcache_core.plan import PLAN_KEY
from ragcache_core.query_result import TokenLogprobs

ENGINE_EXIT_TIMEOUT_S = 30.0
"""How long `close` waits for the engine core to exit by itself before vLLM kills it. vLLM's
default (5 s) is shorter than the engine core's own wait for its worker (up to 5 s, then a
SIGTERM and 4 s more): killed mid-teardown, the engine core never unlinks its shared-memory
message queue and Python's resource tracker reports it as leaked at exit."""


class EngineDied(RAGCacheError):
    """The vLLM engine core stopped (crash or kill); requests in it are lost."""


@dataclass(frozen=True)
class StreamEvent:
    """One step of a streamed request: the tokens generated so far."""

    token_ids: tuple[int, ...]
    text: str
    finished: bool
    finish_reason: str | None
    first_token_latency_s: float | None
    kv_transfer_params: Mapping[str, Any] | None
    num_cached_tokens: int = 0
    """Prompt tokens vLLM found in its own prefix cache (or loaded through a connector)."""
    new_logprobs: tuple[TokenLogprobs, ...] = ()
    """The logprobs of the tokens new in this event (when the request asked for them)."""


class AsyncEngine:
    """A started `AsyncLLM`. Create it where no event loop runs and blocking is fine (start
    takes ~25 s on CPU; the supervisor uses a worker thread); use it from one event loop: built
    without a running loop, `AsyncLLM` starts its output handler at the first `stream`, on the
    loop that calls it."""

    def __init__(self, settings: EngineSettings) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from ragcache_core.engine.compat import check_vllm_version
        from ragcache_core.engine.logs import engine_output

        check_vllm_version()
        settings.apply_environment()
        self.settings = settings
        started = time.perf_counter()
        kwargs = settings.to_engine_kwargs()
        with engine_output():  # its processes write to vLLM's log file, where one is set
            self._engine: Any = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
        self.start_s = time.perf_counter() - started
        self._closed = False
        from ragcache_core.engine.sampling import SamplingChecker

        self.checker = SamplingChecker(self._engine.vllm_config)
        """vLLM's checks of a request's sampling against this model (usable after `close`)."""
        self.inject_fault: Mapping[str, Any] | None = None
        """Fault-injection tests only: sent as the connector's `FAULT_KEY` with every request
        that carries a plan (`connector/config.py` lists the faults). A restarted engine is a
        new `AsyncEngine`, without it."""

    @property
    def is_dead(self) -> bool:
        return bool(self._closed or self._engine is None or self._engine.errored)

    @property
    def unfinished_requests(self) -> int:
        """Requests vLLM still tracks (submitted, neither finished nor aborted)."""
        return 0 if self.is_dead else int(self._engine.get_num_unfinished_requests())

    def tokenizer(self) -> Any:
        return self._engine.get_tokenizer()

    async def stream(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: SamplingConfig,
        kv_transfer_params: Mapping[str, Any] | None = None,
        *,
        read_prefix_cache: bool = True,
        cache_salt: str = "",
    ) -> AsyncGenerator[StreamEvent, None]:
        """Submit one request and yield its progress. `read_prefix_cache=False` keeps vLLM's
        prefix cache (and every connector load) out of it: vLLM with caching off, the
        reference of the exactness tests. `cache_salt` keeps its prefix-cache blocks to
        requests of the same salt (a tenant, `compat.token_prompt`). Raises `EngineDied` if
        the engine core died; cancelling the iteration aborts the request in vLLM."""
        from vllm.v1.engine.exceptions import EngineDeadError

        from ragcache_core.engine.compat import first_token_latency, token_prompt
        from ragcache_core.engine.sampling import sampling_params, step_logprobs

        if self.inject_fault is not None and kv_transfer_params and PLAN_KEY in kv_transfer_params:
            kv_transfer_params = {**kv_transfer_params, FAULT_KEY: dict(self.inject_fault)}
        params = sampling_params(
            sampling,
            kv_transfer_params=kv_transfer_params,
            skip_reading_prefix_cache=not read_prefix_cache,
        )
        if self.is_dead:
            raise EngineDied("the vLLM engine is not running")
        seen = 0  # tokens whose logprobs were reported
        try:
            async for output in self._engine.generate(
                token_prompt(prompt_ids, cache_salt), params, request_id
            ):
                completion = output.outputs[0]
                new = step_logprobs(completion.logprobs, completion.token_ids, seen)
                seen = len(completion.token_ids)
                yield StreamEvent(
                    token_ids=tuple(completion.token_ids),
                    text=completion.text,
                    finished=bool(output.finished),
                    finish_reason=completion.finish_reason,
                    first_token_latency_s=first_token_latency(output),
                    kv_transfer_params=getattr(output, "kv_transfer_params", None),
                    num_cached_tokens=int(getattr(output, "num_cached_tokens", 0) or 0),
                    new_logprobs=new,
                )
        except EngineDeadError as exc:
            raise EngineDied(f"the vLLM engine core died: {exc}") from exc

    async def reset_prefix_cache(self) -> bool:
        """Empty vLLM's own prefix cache (when it is on). False when vLLM refused: a block is
        held (vLLM's `BlockPool.reset_prefix_cache`) by a running request. The connector lets
        go of the blocks its eviction window holds first (`reset_connector`: vLLM resets its
        pool before the connector, so a refused first try is tried once more)."""
        engine = self._engine
        if await engine.reset_prefix_cache(reset_connector=True):
            return True
        return bool(await engine.reset_prefix_cache())

    async def abort(self, request_id: str) -> None:
        if not self.is_dead:
            await self._engine.abort(request_id)

    def close(self) -> None:
        """Shut the engine down. Call it on the loop that used the engine (its output task
        lives there). Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        engine, self._engine = self._engine, None
        engine.shutdown(timeout=ENGINE_EXIT_TIMEOUT_S)
        # Drop the last reference now, while the interpreter is whole: AsyncLLM.__del__ shuts
        # down again and fails noisily if it runs at interpreter exit.
        del engine

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)
