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

from ragcache_core.plan import LoadSpan, SlotCopy, StoreSpan


@dataclass(frozen=True, slots=True)
class RequestOps:
    """One request's copies in one step. Loads cover prompt positions [load_lo, load_hi);
    stores are present only in the step whose forward pass completes the prompt."""

    req_id: str
    block_ids: tuple[int, ...]
    swap_out: tuple[SlotCopy, ...] = ()
    promote: tuple[SlotCopy, ...] = ()
    load: tuple[LoadSpan, ...] = ()
    load_lo: int = 0
    load_hi: int = 0
    store: tuple[StoreSpan, ...] = ()
    fail_load_span: tuple[int, ...] = ()
    """Test hook: indices of load spans whose copy raises (see `config.FAULT_KEY`)."""


@dataclass
class StepOps(KVConnectorMetadata):
    """All requests' copies of one engine step, in scheduling order."""

    requests: list[RequestOps] = field(default_factory=list)


@dataclass
class WorkerReport(KVConnectorWorkerMetadata):
    """Load failures of one step: request id -> index of the first load span that failed."""

    load_failures: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, WorkerReport)
        merged = dict(self.load_failures)
        for req_id, span in other.load_failures.items():
            merged[req_id] = min(span, merged.get(req_id, span))
        return WorkerReport(merged)
