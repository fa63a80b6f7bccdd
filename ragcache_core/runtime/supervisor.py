"""The running vLLM engine and its replacement when it dies.

`EngineSupervisor` owns the `AsyncEngine` of one `RAGCache`. Its epoch counts
restarts, so that however many requests see the same engine die, it is replaced once. An
engine starts in a worker thread (`asyncio.to_thread`, ~25 s on CPU): RAGCache's loop keeps
serving the tree, stats and other requests meanwhile. Starting it off the loop is safe because
vLLM's `AsyncLLM` binds to an event loop lazily: built where no loop runs, it starts its output
handler (and its engine-core client's output task) at the first `generate`, on the loop that
calls it, which is always RAGCache's own.
"""

from __future__ import annotations

import asyncio
import logging

from ragcache_core.config import CacheConfig
from ragcache_core.engine.async_engine import AsyncEngine
from ragcache_core.engine.settings import EngineSettings
from ragcache_core.errors import RAGCacheError
from ragcache_core.metrics import Metrics
from ragcache_core.runtime.lifecycle import Lifecycle

logger = logging.getLogger(__name__)


class EngineSupervisor:
    """Starts, replaces and closes the engine. Use from RAGCache's loop only."""

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

    @property
    def engine(self) -> AsyncEngine:
        if self._engine is None:
            raise RAGCacheError("the vLLM engine is not started")
        return self._engine

    async def start(self) -> None:
        """Start the engine without blocking the loop (see the module docstring)."""
        self._engine = await asyncio.to_thread(AsyncEngine, self.settings)

    async def restart(self, dead_epoch: int) -> None:
        """Replace the engine of `dead_epoch` (once, however many requests saw it die).
        GPU-pool copies are gone with the worker; confirmed host-pool copies survive in the
        app's shared memory. Raises `RAGCacheError` when `restart_engine` is off."""
        async with self._restart_lock:
            if dead_epoch != self.epoch:
                return  # another request restarted it already
            if not self._config.restart_engine:
                raise RAGCacheError("the vLLM engine died and restart_engine is off")
            logger.warning("the vLLM engine died; restarting it")
            self.close()
            self._lifecycle.lose_gpu_tier()
            await self.start()
            self.epoch += 1
            self._metrics.record_restart()

    def close(self) -> None:
        """Stop the engine (on the loop that used it: its output task lives there)."""
        if self._engine is not None:
            self._engine.close()
