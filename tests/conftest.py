"""Shared fixtures: offline models (built once, cached on disk), one heavy thing (a vLLM engine,
a RAGCache or a server) alive at a time and shared while tests agree on its settings, the
engine runs in processes of their own (started together, beside the suite), and the suite's
time at the end. tests/README.md says how a new real-engine test shares what already runs."""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest
from _heavy import EnginePool, Heavy
from _runs import EngineRuns

pytest_plugins = ("_serve_session", "_ragcache_shared")
"""The serve modules' shared server (`server`, `references`, `oai`, `idle_after`) and the
RAGCache modules' shared cache (`cache`, `settled_after`)."""


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The real benchmark data (`$RAGCACHE_DATA_DIR`, else `../shared/data`: bench.data_dir);
    tests that need it skip when it is absent."""
    from ragcache_core.bench.data_dir import resolve_data_dir

    folder = resolve_data_dir()
    if not folder.is_dir():
        pytest.skip(f"benchmark data folder {folder} is absent (set RAGCACHE_DATA_DIR)")
    return folder


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The multi-head tiny model (KV heads == heads)."""
    from ragcache_core.models import build_tiny_model

    return build_tiny_model(size="tiny", attention="mha")


@pytest.fixture(scope="session")
def tiny_model_gqa() -> Path:
    """The grouped-query tiny model (fewer KV heads than heads)."""
    from ragcache_core.models import build_tiny_model

    return build_tiny_model(size="tiny", attention="gqa")


@pytest.fixture(scope="session")
def engine_pool() -> Iterator[Heavy]:
    """One vLLM engine alive at a time, or one thing that owns one (a RAGCache, a server),
    shared by every test asking for the same settings (`_heavy.Heavy`). A fixture that starts
    an engine of its own calls `engine_pool.close()` first."""
    from ragcache_core.engine.llm import Engine

    heavy = Heavy(EnginePool(Engine, Engine.close))
    _POOLS.append(heavy)
    yield heavy
    heavy.close()


@pytest.fixture(scope="session")
def engine_runs(
    request: pytest.FixtureRequest, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineRuns]:
    """Every selected test's engine run (`_runs`), all started at the session's first test
    (`_start_engine_runs`), two at a time, beside the rest of the suite."""
    runs = EngineRuns(request.session.items, tiny_model, tmp_path_factory)
    _RUNS.append(runs)
    yield runs
    runs.close()


@pytest.fixture(scope="session", autouse=True)
def _start_engine_runs(request: pytest.FixtureRequest) -> None:
    """Start the engine runs with the session's first test, not with the first test that
    checks one: those come last (`pytest_collection_modifyitems`)."""
    if any("engine_runs" in getattr(item, "fixturenames", ()) for item in request.session.items):
        request.getfixturevalue("engine_runs")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules with engine runs (`_runs`: a module-level `runners`) go last, each whole
    and in its order. Their runs start with the first test and go on beside every other
    module, so by the time their tests come the runs are (mostly) done. First in the
    alphabet, their tests held the test process idle for ~300 s while the runs went."""
    items[:] = sorted(items, key=lambda item: hasattr(getattr(item, "module", None), "runners"))


SLOWEST_MODULES = 8
"""How many modules the closing summary names, slowest first."""
_MODULE_SECONDS: defaultdict[str, float] = defaultdict(float)
_STARTED = pytest.StashKey[float]()
_CPU_AT_START = pytest.StashKey["tuple[float, float] | None"]()
_POOLS: list[Heavy] = []
"""The session's `engine_pool`, for the closing summary's count of its starts."""
_RUNS: list[EngineRuns] = []
"""The session's `engine_runs`, for the closing summary's run times."""


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _machine_cpu() -> tuple[float, float] | None:
    """The machine's (busy, all) CPU seconds since boot, summed over its cores (Linux's
    /proc/stat; None elsewhere): every process counts, the suite's engines and other jobs."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
    except OSError:
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = (int(f) for f in fields)
    tick = os.sysconf("SC_CLK_TCK")
    busy = user + nice + system + irq + softirq + steal
    return busy / tick, (busy + idle + iowait) / tick


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_STARTED] = time.monotonic()
    session.config.stash[_CPU_AT_START] = _machine_cpu()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _MODULE_SECONDS[report.nodeid.split("::", 1)[0]] += report.duration


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The suite's wall time from session start (collection included) and its slowest modules
    (set-up, calls and tear-down summed), so that a change that adds an engine start shows:
    the suite's budget is 15 minutes on the project's 2-core machine."""
    wall = time.monotonic() - terminalreporter.config.stash[_STARTED]
    slowest = sorted(_MODULE_SECONDS.items(), key=lambda kv: -kv[1])[:SLOWEST_MODULES]
    terminalreporter.write_sep("=", f"suite time {wall:.1f} s ({wall / 60:.1f} min)")
    for module, seconds in slowest:
        terminalreporter.write_line(f"{seconds:8.1f} s  {module}")
    began, now = terminalreporter.config.stash[_CPU_AT_START], _machine_cpu()
    if began is not None and now is not None and now[1] > began[1]:
        busy, total = now[0] - began[0], now[1] - began[1]
        terminalreporter.write_line(
            f"machine CPU: {busy / 60:.1f} of {total / 60:.1f} core-min busy "
            f"({busy / total:.0%}; every process, other jobs included, {os.cpu_count()} cores)"
        )
    for pool in _POOLS:
        terminalreporter.write_line(
            f"engine_pool: {pool.engines_started} engines started in "
            f"{pool.engine_start_seconds:.0f} s, {pool.starts} held things "
            f"(RAGCache, server) in {pool.start_seconds:.0f} s"
        )
    for runs in _RUNS:
        slow = sorted(runs.seconds.items(), key=lambda kv: -kv[1])
        terminalreporter.write_line(
            f"engine_runs: {len(slow)} runs, {sum(runs.seconds.values()):.0f} s in all "
            f"(two at a time, beside the suite); slowest: "
            + ", ".join(f"{name} {seconds:.0f} s" for name, seconds in slow[:SLOWEST_MODULES])
        )
