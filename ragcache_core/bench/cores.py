"""A fair split of the cores between search and vLLM, the same for every system compared.

Search (Faiss, OpenMP) and vLLM's CPU worker are both CPU-bound here; overlapping two jobs on
the same cores hides nothing. So each gets its own cores:

    search cores  every thread of the benchmark's process: the event loops, RAGCache's
                  runtime and the search threads (Faiss on one OpenMP thread per search)
    engine cores  vLLM: the worker's OpenMP threads (`VLLM_CPU_OMP_THREADS_BIND`, vLLM's own
                  setting, read when the engine starts) and every thread of the engine's
                  processes (engine core and worker, by `sched_setaffinity` once started)

Linux only (`os.sched_setaffinity`); `CoreSplit.halves()` is None where a split is impossible.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ragcache_core.errors import ConfigError

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


@dataclass(frozen=True)
class CoreSplit:
    """Which CPUs search (and the app) use and which vLLM uses; disjoint, both non-empty."""

    search_cpus: frozenset[int]
    engine_cpus: frozenset[int]

    def __post_init__(self) -> None:
        if not self.search_cpus or not self.engine_cpus or self.search_cpus & self.engine_cpus:
            raise ConfigError(f"a core split needs two disjoint non-empty sets, got {self}")

    @classmethod
    def halves(cls) -> CoreSplit | None:
        """The first half of this process's CPUs for search, the second for vLLM (one each on
        two cores); None with fewer than two CPUs or without affinity support."""
        if not hasattr(os, "sched_getaffinity"):
            return None
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            return None
        half = len(cpus) // 2
        return cls(frozenset(cpus[:half]), frozenset(cpus[half:]))

    def describe(self) -> dict[str, object]:
        return {
            "search_cpus": sorted(self.search_cpus),
            "engine_cpus": sorted(self.engine_cpus),
            "search": "every thread of the benchmark process (app, runtime, search), "
            f"Faiss on {len(self.search_cpus)} OpenMP thread(s) per search",
            "engine": f"vLLM's worker by {BIND_ENV}={self._bind_value()} and every thread of "
            "the engine processes by sched_setaffinity",
        }

    def _bind_value(self) -> str:
        return ",".join(str(c) for c in sorted(self.engine_cpus))

    @contextlib.contextmanager
    def engine_environment(self) -> Iterator[None]:
        """Set vLLM's worker binding for the engines started inside (restored after)."""
        old = os.environ.get(BIND_ENV)
        os.environ[BIND_ENV] = self._bind_value()
        try:
            yield
        finally:
            if old is None:
                os.environ.pop(BIND_ENV, None)
            else:
                os.environ[BIND_ENV] = old

    def pin_engines(self) -> list[int]:
        """Move every thread of this process's descendants (the engines) to the engine CPUs;
        returns their pids. Call once the engines have started."""
        pids = _descendants(os.getpid())
        for pid in pids:
            _pin_process(pid, self.engine_cpus)
        return pids

    def pin_app(self) -> None:
        """Move every thread of this process to the search CPUs (threads started later inherit
        it from the thread that starts them). Call after `pin_engines`: an engine started
        later would inherit the search CPUs and vLLM could not bind its worker elsewhere."""
        _pin_process(os.getpid(), self.search_cpus)

    def pin_search_thread(self) -> None:
        """Run in a searching thread: pin it to the search CPUs and give Faiss as many OpenMP
        threads as there are search CPUs (`omp_set_num_threads` is per calling thread)."""
        import faiss

        os.sched_setaffinity(0, self.search_cpus)
        faiss.omp_set_num_threads(len(self.search_cpus))


def _pin_process(pid: int, cpus: frozenset[int]) -> None:
    """Every current thread of `pid` to `cpus` (threads that end meanwhile are skipped)."""
    for task in _tasks(pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.sched_setaffinity(task, cpus)


def _tasks(pid: int) -> list[int]:
    try:
        return [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
    except (FileNotFoundError, ProcessLookupError):
        return []


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, their children, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found: list[int] = []
    todo = list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(child)
        todo.extend(children.get(child, []))
    return sorted(found)
