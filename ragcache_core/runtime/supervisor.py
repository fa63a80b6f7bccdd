"""The running vLLM engine and its replacement when it dies.

`EngineSupervisor` owns the `AsyncEngine` of one `RAGCache`. Its epoch counts
restarts, so that however many requests see the same engine die, it is replaced once. An
engine starts in a worker thread (`asyncio.to_thread`, ~25 s on CPU): RAGCache's loop keeps
serving the tree, stats and other requests meanwhile. Starting it off the loop is safe because
vLLM's `AsyncLLM` binds to an event loop lazily: built where no loop runs, it starts its output
handler (and its engine-core client's output task) at the first `generate`, on the loop that
calls it, which is always RAGCache's own.

A death is noticed without a request: vLLM's engine-core client watches its process and marks
the engine errored, and the supervisor's watch task (every `WATCH_S`) starts the restart at
once, so an idle server is not dead until its next request. `state` says where the engine is
(`starting`, `running`, `dead`, `restarting`, `stopped`); `ragcache serve`'s `/health` answers
503 unless it is `running`. A request admitted while a restart runs waits for it
(`wait_running`) instead of spending a try on the dead engine.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Literal

from ragcache_core.config import CacheConfig
from ragcache_core.engine.async_engine import AsyncEngine
from ragcache_core.engine.settings import EngineSettings
from ragcache_core.errors import RAGCacheError
from ragcache_core.metrics import Metrics
from ragcache_core.runtime.lifecycle import Lifecycle

logger = logging.getLogger(__name__)

EngineState = Literal["starting", "running", "dead", "restarting", "stopped"]
WATCH_S = 0.5
"""How often the supervisor looks for a dead engine."""
RETRY_START_S = 5.0
"""How long the watch waits after a restart that failed before it tries again."""


class EngineSupervisor:
    """Starts, replaces and closes the engine. Use from RAGCache's loop only (`state` may be
    read from any thread)."""

    def __init__(
        self,
        settings: EngineSettings,
        config: CacheConfig,
        lifecycle: Lifecycle,
        metrics: Metrics,
    ) -> None:
        self.settings = settings
        self._config = config
        self._lifecycle = lifecycle
        self._metrics = metrics
        self._engine: AsyncEngine | None = None
        self.epoch = 0
        """Incremented by each restart; a request remembers the epoch it ran on."""
        self._restart_lock = asyncio.Lock()
        self._restarting = False
        self._not_restarting = asyncio.Event()
        self._not_restarting.set()
        self._closed = False
        self._watch: asyncio.Task[None] | None = None

    @property
    def engine(self) -> AsyncEngine:
        if self._engine is None:
            raise RAGCacheError("the vLLM engine is not started")
        return self._engine

    @property
    def state(self) -> EngineState:
        """Where the engine is (module docstring); safe to read from any thread."""
        engine = self._engine
        if self._closed:
            return "stopped"
        if self._restarting:
            return "restarting"
        if engine is None:
            return "starting"
        return "dead" if engine.is_dead else "running"

    async def start(self) -> None:
        """Start the engine without blocking the loop (see the module docstring), then watch
        it."""
        self._engine = await asyncio.to_thread(AsyncEngine, self.settings)
        if self._watch is None:
            self._watch = asyncio.ensure_future(self._watch_engine())

    async def wait_running(self) -> None:
        """Return once no restart is under way (at once when none is)."""
        await self._not_restarting.wait()

    async def restart(self, dead_epoch: int) -> None:
        """Replace the engine of `dead_epoch` (once, however many requests saw it die).
        vLLM's prefix cache (the GPU tier) is gone with the engine; confirmed host-pool copies
        survive in the app's shared memory. Raises `RAGCacheError` when `restart_engine` is off."""
        async with self._restart_lock:
            if dead_epoch != self.epoch:
                return  # another request restarted it already
            if not self._config.restart_engine:
                raise RAGCacheError("the vLLM engine died and restart_engine is off")
            logger.warning("the vLLM engine died; restarting it")
            self._restarting = True
            self._not_restarting.clear()
            try:
                self.close_engine()
                self._lifecycle.lose_gpu_tier()
                await self.start()
                self.epoch += 1
                self._metrics.record_restart()
            finally:
                self._restarting = False
                self._not_restarting.set()

    async def _watch_engine(self) -> None:
        """Restart a dead engine as soon as vLLM reports it dead (no request needed)."""
        while True:
            await asyncio.sleep(WATCH_S)
            engine = self._engine
            if engine is None or not engine.is_dead or not self._config.restart_engine:
                continue
            try:
                await self.restart(self.epoch)
            except Exception:
                logger.exception("restarting the vLLM engine failed; trying again soon")
                await asyncio.sleep(RETRY_START_S)

    def close_engine(self) -> None:
        """Stop the current engine (on the loop that used it: its output task lives there)."""
        if self._engine is not None:
            self._engine.close()

    def close(self) -> None:
        """Stop watching and stop the engine for good."""
        self._closed = True
        if self._watch is not None:
            self._watch.cancel()
        self.close_engine()
