"""The connector's report on one finished request (what was loaded, whether stores ran).

Built by the scheduler-side connector in `request_finished` and returned to the app inside
`RequestOutput.kv_transfer_params[RESULT_KEY]`. The app reads it to count hits per tier and to
decide what to confirm (see docs/data-plane.md, "Store/confirm protocol").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ragcache_core.engine.connector.config import RESULT_KEY
from ragcache_core.engine.connector.step_costs import NO_STEPS, StepCosts
from ragcache_core.plan import NO_LOSSES, WindowLosses


@dataclass(frozen=True, slots=True)
class ConnectorResult:
    """Outcome of one request's plan.

    `loaded_tokens` prompt tokens were loaded from the host pool (`host_tokens`, the same number),
    of the `external_tokens` vLLM accepted from the connector (fewer after a failed load).
    `gpu_tokens`: vLLM's own prefix-cache hit before them (the GPU tier, no copy), block-aligned, as
    vLLM presented it to the connector; vLLM's `num_cached_tokens` less `external_tokens` (both from
    the request's first scheduling) is the same hit to the token. The rest were computed.
    `store_scheduled`: the scheduler put the plan's stores into the step that completed the prompt.
    `stored`: those stores ran (what a confirmation needs; a store that raises fails the step
    instead): the worker reported it, or the request finished in the step that stored
    (`SchedulerSide.finished`; its copy times then read 0). `failed_load_spans` lists load spans
    whose copy failed (vLLM recomputed from the block holding the failed span's first token).
    `rejected` lists why a plan was ignored (then nothing was copied at all). `load_copy_s` /
    `store_copy_s`: seconds the worker spent copying in the steps that ran this request's copies
    (shared with the other requests of those steps); `window_copy_s`: seconds of the window's
    eviction-time copies in the steps that computed this request's prompt (they ran after
    those steps' forward passes, before its first token).
    `host_copied`: eviction-time copies done since the previous report, whichever request's
    plan kept them: (sequence number, keep key, host slots), in order; `host_dropped`: keep
    keys the engine let go of without a copy since then (evicted, a failed copy, a reset);
    `host_gone`: (keep key, plan version) of the kept documents whose blocks left vLLM's cache
    since then, or that the engine stopped following (a dropped key, a span it could not
    record): the tree stops counting them as held in vLLM's blocks (`Node.resident`).
    `host_overwritten`: the lease's victims (host copies the tree lent, `HostLease.victims`)
    the engine overwrote since then, (sequence number, victim id), numbered with the copies;
    `overwritten_tokens`: tokens past vLLM's hit that this request's plan would have loaded
    from such a victim, refused (vLLM computed them).
    `host_lost`: the kept documents that left vLLM's cache uncopied since the previous
    report (`WindowLosses`, deltas: each counted once).
    `stranded_blocks`: blocks the engine found held with no copy in flight, since it started
    (0 unless there is a bug; `check_integrity()` fails on it).
    `steps`: the engine's steps and their copies' time and bytes since it started
    (`StepCosts`, cumulative: the newest report has them all).
    `reported`: the result came from the connector's report (False: no report came, as for
    a request vLLM's front end aborted).
    """

    loaded_tokens: int = 0
    external_tokens: int = 0
    gpu_tokens: int = 0
    host_tokens: int = 0
    store_scheduled: bool = False
    stored: bool = False
    failed_load_spans: tuple[int, ...] = ()
    rejected: tuple[str, ...] = ()
    load_copy_s: float = 0.0
    store_copy_s: float = 0.0
    window_copy_s: float = 0.0
    host_copied: tuple[tuple[int, int, tuple[int, ...]], ...] = ()
    host_overwritten: tuple[tuple[int, int], ...] = ()
    overwritten_tokens: int = 0
    host_dropped: tuple[int, ...] = ()
    host_gone: tuple[tuple[int, int], ...] = ()
    host_lost: WindowLosses = NO_LOSSES
    stranded_blocks: int = 0
    steps: StepCosts = NO_STEPS
    reported: bool = field(default=False, compare=False)

    @property
    def load_failed(self) -> bool:
        return bool(self.failed_load_spans)

    def to_json(self) -> dict[str, Any]:
        return {
            "loaded_tokens": self.loaded_tokens,
            "external_tokens": self.external_tokens,
            "gpu_tokens": self.gpu_tokens,
            "host_tokens": self.host_tokens,
            "store_scheduled": self.store_scheduled,
            "stored": self.stored,
            "failed_load_spans": list(self.failed_load_spans),
            "rejected": list(self.rejected),
            "load_copy_s": self.load_copy_s,
            "store_copy_s": self.store_copy_s,
            "window_copy_s": self.window_copy_s,
            "host_copied": [[seq, key, list(slots)] for seq, key, slots in self.host_copied],
            "host_overwritten": [[seq, vid] for seq, vid in self.host_overwritten],
            "overwritten_tokens": self.overwritten_tokens,
            "host_dropped": list(self.host_dropped),
            "host_gone": [[key, version] for key, version in self.host_gone],
            "host_lost": self.host_lost.to_json(),
            "stranded_blocks": self.stranded_blocks,
            "steps": self.steps.to_json(),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ConnectorResult:
        return cls(
            loaded_tokens=int(data["loaded_tokens"]),
            external_tokens=int(data["external_tokens"]),
            gpu_tokens=int(data["gpu_tokens"]),
            host_tokens=int(data["host_tokens"]),
            store_scheduled=bool(data["store_scheduled"]),
            stored=bool(data["stored"]),
            failed_load_spans=tuple(int(i) for i in data["failed_load_spans"]),
            rejected=tuple(str(p) for p in data["rejected"]),
            load_copy_s=float(data["load_copy_s"]),
            store_copy_s=float(data["store_copy_s"]),
            window_copy_s=float(data.get("window_copy_s", 0.0)),
            host_copied=tuple(
                (int(seq), int(key), tuple(int(s) for s in slots))
                for seq, key, slots in data.get("host_copied", ())
            ),
            host_overwritten=tuple(
                (int(seq), int(vid)) for seq, vid in data.get("host_overwritten", ())
            ),
            overwritten_tokens=int(data.get("overwritten_tokens", 0)),
            host_dropped=tuple(int(k) for k in data.get("host_dropped", ())),
            host_gone=tuple((int(k), int(v)) for k, v in data.get("host_gone", ())),
            host_lost=WindowLosses.from_json(data.get("host_lost", (0, 0, 0))),
            stranded_blocks=int(data.get("stranded_blocks", 0)),
            steps=StepCosts.from_json(data["steps"]) if "steps" in data else NO_STEPS,
            reported=True,
        )

    @classmethod
    def from_transfer_params(cls, params: dict[str, Any] | None) -> ConnectorResult:
        """The report inside a `RequestOutput.kv_transfer_params`; an empty result (nothing
        loaded or stored) when the request carried no plan."""
        if not params or RESULT_KEY not in params:
            return cls()
        return cls.from_json(params[RESULT_KEY])
