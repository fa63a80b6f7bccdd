"""The suite's heavy things, one alive at a time: a vLLM engine in the test process, or a thing
that owns one (a `RAGCache`, a `ragcache serve` process). An engine start costs 20-40 s on the
project's 2-core machine, so a thing is kept while the next test asks for the same key, and
closed only when a test asks for another (or starts its own: `close` first)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

from ragcache_core.engine.settings import EngineSettings

T = TypeVar("T")
E = TypeVar("E")


class EnginePool(Generic[E]):
    """Holds one engine, keyed by its settings; asking for other settings closes it first."""

    def __init__(self, factory: Callable[[EngineSettings], E], close: Callable[[E], None]) -> None:
        self._factory = factory
        self._close = close
        self._key: EngineSettings | None = None
        self._engine: E | None = None
        self.starts = 0
        self.start_seconds = 0.0

    def get(self, settings: EngineSettings) -> E:
        if self._engine is not None and self._key == settings:
            return self._engine
        self.close()
        started = time.monotonic()
        self._engine = self._factory(settings)
        self._key = settings
        self.starts += 1
        self.start_seconds += time.monotonic() - started
        return self._engine

    def close(self) -> None:
        engine, self._engine, self._key = self._engine, None, None
        if engine is not None:
            self._close(engine)


class Heavy:
    """`get(settings)`: the shared engine (as `EnginePool`); `hold(key, start)`: the thing
    `start()` enters (a context manager), kept under `key`; `close()`: whatever is alive."""

    def __init__(self, engines: EnginePool[Any]) -> None:
        self._engines = engines
        self._key: Hashable | None = None
        self._held: Any = None
        self._exit = contextlib.ExitStack()
        self.starts = 0
        """Things started by `hold` (engines by `get` are `engines_started`)."""
        self.start_seconds = 0.0
        """Seconds spent starting them (engines by `get`: `engine_start_seconds`)."""

    @property
    def engines_started(self) -> int:
        return self._engines.starts

    @property
    def engine_start_seconds(self) -> float:
        return self._engines.start_seconds

    def get(self, settings: EngineSettings) -> Any:
        self._release()
        return self._engines.get(settings)

    def hold(self, key: Hashable, start: Callable[[], contextlib.AbstractContextManager[T]]) -> T:
        if self._key is not None and self._key == key:
            return self._held  # type: ignore[no-any-return]
        self.close()
        started = time.monotonic()
        with contextlib.ExitStack() as stack:
            held = stack.enter_context(start())
            self._exit = stack.pop_all()
        self._key, self._held = key, held
        self.starts += 1
        self.start_seconds += time.monotonic() - started
        return held

    def _release(self) -> None:
        exit_, self._exit = self._exit, contextlib.ExitStack()
        self._key = self._held = None
        exit_.close()

    def close(self) -> None:
        self._release()
        self._engines.close()
