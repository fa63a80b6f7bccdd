"""The suite's engine runs: commands, examples and scripts that start vLLM in processes of their
own (`ragcache demo`, `bench serve --smoke`, the example notebooks ...), each checked by one
test. They share nothing but the built model, so they need not wait for their tests' turn: all
of them start at the session's first test (`engine_runs`, a session fixture, started by
conftest's `_start_engine_runs`), two at a time, in the order their tests come, beside the rest
of the suite; the modules with runs come last (conftest's `pytest_collection_modifyitems`), so
their tests find their runs done or nearly. Most of a run is starting Python and vLLM's engine
processes, about one core each, and waiting on its own requests, so the runs fill the cores
the rest of the suite leaves idle.

A test module takes part with a module-level function `runners(model)`: for each of its tests
that checks a run (by test name, with its parameters if any), the function that does the run
given a fresh folder and returns what the test checks (one function under several names: one
run for those tests). The test, or a function-scoped fixture of it, asks
`engine_runs.result(request)`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

Runner = Callable[[Path], Any]
"""Does one run in the folder it is given; returns what its test checks."""
WORKERS = 2
"""Runs at a time (the project's machine has 2 cores; the rest of the suite runs beside)."""


class EngineRuns:
    """The runs of the selected tests, submitted at once, in the tests' order."""

    def __init__(
        self, items: Iterable[pytest.Item], model: Path, tmp: pytest.TempPathFactory
    ) -> None:
        self._pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="engine-run")
        self._runs: dict[tuple[str, str], Future[Any]] = {}
        self.seconds: dict[str, float] = {}
        """Each finished run's wall time, by its first test's name (the suite's summary)."""
        tables: dict[str, dict[str, Runner]] = {}
        started: dict[int, Future[Any]] = {}  # by runner: one run for the names it has
        for item in items:
            module = getattr(item, "module", None)
            runners = getattr(module, "runners", None)
            if module is None or runners is None:
                continue
            if module.__name__ not in tables:
                tables[module.__name__] = runners(model)
            table = tables[module.__name__]
            name = _name(item, table)
            if name not in table:
                continue
            runner = table[name]
            if id(runner) not in started:
                folder = tmp.mktemp(re.sub(r"\W+", "-", name)[:40])
                started[id(runner)] = self._pool.submit(self._timed, name, runner, folder)
            self._runs[(module.__name__, name)] = started[id(runner)]

    def _timed(self, name: str, runner: Runner, folder: Path) -> Any:
        began = time.monotonic()
        try:
            return runner(folder)
        finally:
            self.seconds[name] = time.monotonic() - began

    def result(self, request: pytest.FixtureRequest) -> Any:
        """What the requesting test's run returned (waits for it; re-raises its error)."""
        node = request.node
        assert isinstance(node, pytest.Item)
        names = {name for module, name in self._runs if module == request.module.__name__}
        key = (request.module.__name__, _name(node, dict.fromkeys(names)))
        if key not in self._runs:
            raise KeyError(f"{node.nodeid}: its module's runners() has no run for it")
        return self._runs[key].result()

    def close(self) -> None:
        """Waits for the runs already going (a stopped session: -x, Ctrl-C); drops the rest."""
        self._pool.shutdown(wait=True, cancel_futures=True)


def _name(item: pytest.Item, table: dict[str, Any]) -> str:
    """The item's run name: its name with parameters if the table has it, else without."""
    original = getattr(item, "originalname", item.name)
    return item.name if item.name in table else str(original)
