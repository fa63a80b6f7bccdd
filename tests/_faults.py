"""Fault injection the tests reach into the engine for (the package has no such hook)."""

from __future__ import annotations

import os
import signal

from ragcache_core.engine.async_engine import AsyncEngine


def kill_engine_core(engine: AsyncEngine) -> None:
    """Kill `engine`'s engine core process with SIGKILL, as a crash would end it (vLLM's
    `AsyncLLM` notices and marks itself errored; the runtime's supervisor restarts it)."""
    core = getattr(engine._engine, "engine_core", None)
    manager = getattr(core, "resources", None)
    procs = getattr(getattr(manager, "engine_manager", None), "processes", None) or []
    pids = [int(p.pid) for p in procs if getattr(p, "pid", None)]
    assert pids, "cannot find the engine core process to kill"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
