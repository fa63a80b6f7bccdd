"""A background event-loop thread that owns every engine and cache operation.

vLLM's `AsyncLLM` binds to the loop that first uses it and the knowledge tree is not
thread-safe, so all of RAGCache's work runs on one private loop. The public async API awaits it
from any loop (`submit` + `asyncio.wrap_future`), the sync API blocks on it (`run`): one body
for both, and the sync calls work inside notebooks whose loop is already running.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    def __init__(self, name: str = "ragcache-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        self.loop.run_forever()

    @property
    def is_current(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the loop and wait for it (never call from the loop's own thread)."""
        if self.is_current:
            coro.close()
            raise RuntimeError("LoopThread.run called from its own loop: await the coroutine")
        return self.submit(coro).result()

    async def arun(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await `coro` on the loop from any other loop (or directly when already on it)."""
        if self.is_current:
            return await coro
        return await asyncio.wrap_future(self.submit(coro))

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
        if not self.loop.is_running():
            self.loop.close()
