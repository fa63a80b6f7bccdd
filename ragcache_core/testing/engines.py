"""Share vLLM engines across tests: at most one engine alive at a time, reused while the
requested settings stay the same (an engine start costs ~25 s on 2 CPU cores)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from ragcache_core.engine.settings import EngineSettings

E = TypeVar("E")


class EnginePool(Generic[E]):
    """Holds one engine, keyed by its settings; asking for other settings closes it first."""

    def __init__(self, factory: Callable[[EngineSettings], E], close: Callable[[E], None]) -> None:
        self._factory = factory
        self._close = close
        self._key: EngineSettings | None = None
        self._engine: E | None = None
        self.starts = 0

    def get(self, settings: EngineSettings) -> E:
        if self._engine is not None and self._key == settings:
            return self._engine
        self.close()
        self._engine = self._factory(settings)
        self._key = settings
        self.starts += 1
        return self._engine

    def close(self) -> None:
        engine, self._engine, self._key = self._engine, None, None
        if engine is not None:
            self._close(engine)
