"""What the scheduler-side connector sends the worker each step, and what comes back.

`StepOps` rides in vLLM's `SchedulerOutput.kv_connector_metadata` (pickled to the worker);
`WorkerReport` rides back in `KVConnectorOutput.kv_connector_worker_meta`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from ragcache_core.engine.connector.step_costs import NO_STEPS, StepCosts
from ragcache_core.engine.connector.window import HostWrite
from ragcache_core.plan import LoadSpan, StoreSpan

__all__ = ["HostWrite", "RequestOps", "StepOps", "WorkerReport"]


@dataclass(frozen=True, slots=True)
class RequestOps:
    """One request's copies in one step. Loads cover prompt positions [load_lo, load_hi);
    stores are present only in the step whose forward pass completes the prompt."""

    req_id: str
    block_ids: tuple[int, ...]
    load: tuple[LoadSpan, ...] = ()
    load_lo: int = 0
    load_hi: int = 0
    store: tuple[StoreSpan, ...] = ()
    fail_load_span: tuple[int, ...] = ()
    """Test hook: indices of load spans whose copy raises (see `config.FAULT_KEY`)."""


@dataclass
class StepOps(KVConnectorMetadata):
    """All requests' copies of one engine step, in scheduling order, and the eviction-time
    copies of the window: `handout_writes` (documents vLLM handed blocks of out for this step:
    run first, before the loads and the forward pass write those blocks) and `host_writes`
    (the look-ahead's, after the forward pass)."""

    requests: list[RequestOps] = field(default_factory=list)
    handout_writes: list[HostWrite] = field(default_factory=list)
    host_writes: list[HostWrite] = field(default_factory=list)


@dataclass
class WorkerReport(KVConnectorWorkerMetadata):
    """What one step's copies did, per request id: the first load span that failed, whether
    the request's stores ran (`stored`), and the seconds the step spent copying before and
    after the forward pass (`copy_s`: (load side, store side), shared by the step's requests)."""

    load_failures: dict[str, int] = field(default_factory=dict)
    stored: set[str] = field(default_factory=set)
    copy_s: dict[str, tuple[float, float]] = field(default_factory=dict)
    host_written: set[int] = field(default_factory=set)
    """Keys of the step's `HostWrite`s that ran (the others failed)."""
    window_copy_s: float = 0.0
    """Seconds the step spent on the window's eviction-time copies (at hand-out, before the
    forward pass, and look-ahead, after it: they delay the output of every request in the
    step)."""
    steps: StepCosts = NO_STEPS
    """The worker's steps and copies since it started (cumulative)."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Merge the reports of several workers (tensor parallel): a failure anywhere counts,
        a store counts only where every worker ran it, copy time is the slowest worker's."""
        assert isinstance(other, WorkerReport)
        failures = dict(self.load_failures)
        for req_id, span in other.load_failures.items():
            failures[req_id] = min(span, failures.get(req_id, span))
        copy_s = dict(self.copy_s)
        for req_id, (load, store) in other.copy_s.items():
            mine = copy_s.get(req_id, (0.0, 0.0))
            copy_s[req_id] = (max(load, mine[0]), max(store, mine[1]))
        return WorkerReport(
            failures,
            self.stored & other.stored,
            copy_s,
            self.host_written & other.host_written,
            max(self.window_copy_s, other.window_copy_s),
            self.steps.slower(other.steps),
        )
