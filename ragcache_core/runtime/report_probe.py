"""The report probe: the engine's eviction-time host writes reach the tree without waiting for
a request to finish.

The scheduler-side connector hands over what its window copied or let go with the next report
of any request (`SchedulerSide.finished`, docs/design.md 2.2, "The path back"). That report does
not come while the requests in the engine run without finishing (long answers), nor after the
last one finished: its final step's copies ride on the report of a request that has not come
yet. Meanwhile the copies are no host copies, and the lease's slots they used are not given
back.

`ReportProbe` watches the tree's count of applied reports (`HostWrites.reports`). When none has
come for `CacheConfig.host_report_interval_s` while the engine has unfinished requests, or once
after the last report, it sends a one-token request with an empty plan: the connector tracks it
like any planned request, and its report carries the changes (`probe_report`). A probe costs
one prompt token and one sampled token, and takes no place in admission.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

from ragcache_core.config import CacheConfig, SamplingConfig
from ragcache_core.engine.async_engine import AsyncEngine, EngineDied
from ragcache_core.engine.connector.report import ConnectorResult
from ragcache_core.plan import PLAN_KEY, Plan
from ragcache_core.runtime.lifecycle import Lifecycle
from ragcache_core.runtime.supervisor import EngineSupervisor

logger = logging.getLogger(__name__)

PROBE_PROMPT = (0,)
"""The probe's prompt: one token id, in every vocabulary; shorter than a block, so vLLM
caches nothing of it."""
PROBE_SAMPLING = SamplingConfig(max_tokens=1, temperature=0.0)


async def probe_report(
    engine: AsyncEngine, request_id: str, page_size: int
) -> ConnectorResult | None:
    """Run one probe request on `engine`; the connector's report on it, None when none came
    (the connector did not track it)."""
    params = {PLAN_KEY: Plan(page_size=page_size).to_json()}
    report = None
    async for event in engine.stream(request_id, list(PROBE_PROMPT), PROBE_SAMPLING, params):
        if event.finished:
            report = event.kv_transfer_params
    result = ConnectorResult.from_transfer_params(dict(report) if report else None)
    return result if result.reported else None


class ReportProbe:
    """Sends a probe when a report is due (module docstring). `run` loops on RAGCache's loop
    until cancelled; `tick` is one look."""

    def __init__(
        self, lifecycle: Lifecycle, engines: EngineSupervisor, config: CacheConfig
    ) -> None:
        self._lifecycle = lifecycle
        self._engines = engines
        self._interval_s = config.host_report_interval_s
        self._page_size = config.page_size
        self._ids = itertools.count()
        writes = lifecycle.tree.host_writes
        self._seen = writes.reports if writes is not None else 0
        self._owed = False
        self.probes = 0
        """Probes whose report was applied (counter)."""
        self.lock = asyncio.Lock()
        """Held while a probe runs: `RAGCache.clear` takes it, so that no probe holds a block
        when vLLM's prefix cache is reset."""

    @property
    def enabled(self) -> bool:
        """Only with eviction-time host writes, and a nonzero interval."""
        return self._lifecycle.tree.host_writes is not None and self._interval_s > 0

    async def run(self) -> None:
        """Look every interval until cancelled; a probe that fails is logged, never raised."""
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("RAGCache: the report probe failed")

    async def tick(self) -> bool:
        """Send a probe if a report is due: none came since the last look, and either the
        engine has unfinished requests or a report came the look before (its request's last
        step may have copied). Whether a probe's report was applied."""
        writes = self._lifecycle.tree.host_writes
        if writes is None:
            return False
        if writes.reports != self._seen:  # a report came: look again after one interval
            self._seen, self._owed = writes.reports, True
            return False
        if self._engines.state != "running":
            return False
        engine = self._engines.engine
        if not (self._owed or engine.unfinished_requests):
            return False
        self._owed = False
        before = writes.reports
        generation = self._lifecycle.tree.engine_generation  # the engine the probe runs on
        try:
            async with self.lock:
                request_id = f"report-probe-{next(self._ids)}"
                result = await probe_report(engine, request_id, self._page_size)
        except EngineDied:
            return False  # the supervisor restarts it; the tree forgets that engine's copies
        if result is None:
            logger.error("RAGCache: the connector sent no report on a report probe")
            return False
        self._lifecycle.apply_host_writes(result, generation)
        # A request's report that came while the probe ran owes a look of its own.
        self._owed = writes.reports > before + 1
        self._seen = writes.reports
        self.probes += 1
        return True
