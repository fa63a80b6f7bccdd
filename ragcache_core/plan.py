"""Plans: what the control plane asks the data plane to copy for one request.

A plan is decided in the app process (the knowledge tree, owned by `runtime.lifecycle`, holds
the slot allocators) and executed by the KV connector inside vLLM: its worker side copies, its
scheduler side puts each copy in its step (and, with eviction-time writes, picks the kept
documents its window sees leaving within the lease the plan lends). It travels
with its request as JSON in `SamplingParams.extra_args["kv_transfer_params"]`.

Pools are addressed by *slot*: one page of `page_size` tokens holding K and V of every layer.
A node of n tokens owns ceil(n / page_size) slots; its last page may be partly used.

Token positions are positions in the request's prompt (0 = first template/system token):

    prompt:  [ root (system) | doc 1 | doc 2 | doc 3 | question ]
              <---- load spans ----><- store span ->   computed
              cached (pool -> paged KV)   computed, then paged KV -> host pool

The GPU tier is vLLM's own block pool with its prefix caching on (docs/design.md 2.2): vLLM
matches its cached blocks first, and the connector loads from the host pool only the tokens
past vLLM's hit (none on a full GPU hit: no byte moves). Plans therefore load the host tier
and either store it (write-through) or keep documents for the eviction window with a lease of
host slots (`keep`, `lease`: the default). Nothing is ever loaded from or stored to the GPU
tier (`Tier.GPU`: it has no slots of the tree's); the connector refuses such a span
(`engine.connector.spans.plan_problems`).

Execution order in the worker (docs/design.md 3.2):
  1. load:     host slots -> the request's token positions in vLLM's paged cache,
  2. (forward pass computes the remaining tokens)
  3. store:    the request's token range -> host slots (write-through), or
     keep:     nothing now; the scheduler side's window copies the kept documents into the
               lease's host slots as they leave vLLM's blocks.
Frees are allocator bookkeeping in the app process and never appear here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

PLAN_KEY = "ragcache_plan"
"""Key of the plan inside a request's `kv_transfer_params` dict."""


class Tier(StrEnum):
    """Where a node's KV lives: vLLM's blocks (`GPU`: vLLM's own, held and evicted by vLLM,
    known to the tree as `Node.resident`; no slots of the tree's) or a slot tier below them
    (`SLOT_TIERS`: the tree's own slots, each with its write rule). A node may be in several."""

    GPU = "gpu"
    HOST = "host"


SLOT_TIERS: tuple[Tier, ...] = (Tier.HOST,)
"""The tiers of the tree's own slots, top first (a disk tier would follow the host tier)."""


@dataclass(frozen=True, slots=True)
class LoadSpan:
    """Load `num_tokens` tokens from `slots` of `tier` into prompt positions
    [token_start, token_start + num_tokens). Token t of the span sits in
    slot `slots[t // page_size]`, offset `t % page_size`."""

    tier: Tier
    slots: tuple[int, ...]
    token_start: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class StoreSpan:
    """After the forward pass, copy prompt positions [token_start, token_start + num_tokens)
    into `slots` of `tier` (same page layout as `LoadSpan`). The engine's plans store to the
    host tier only: its GPU tier is vLLM's own KV cache, which keeps computed blocks itself."""

    tier: Tier
    slots: tuple[int, ...]
    token_start: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class KeepSpan:
    """Eviction-time host writes (`CacheConfig.host_write="eviction"`, docs/design.md 2.2):
    prompt positions [token_start, token_start + num_tokens) are a document (or the root) the
    tree wants on the host tier once it leaves vLLM's blocks. `key` names its path (root key
    and documents) in the tree; `parent` is the key of the keep span before it in the same
    plan, whose host copy it needs (None: its parent is on the host already, or it is a root)."""

    key: int
    parent: int | None
    token_start: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class HostLease:
    """The host slots the tree lends the engine for eviction-time copies: the whole set, stated
    anew by every plan. The engine takes the lease of the highest `version` it has seen, less
    the slots its copies consumed that the tree has not applied yet (copy reports with a
    sequence number above `applied`) and those of copies in flight. `epoch` names the tree
    that lends it: a lease of another epoch (a new tree on the same engine) replaces everything
    the engine knew of the previous one, whose keys mean nothing to the new tree.

    `victims` (the lease of victims, docs/design.md 2.2): host copies the tree still holds and
    serves, least wanted first, as (victim id, their slots), which the engine may overwrite
    when `slots` are used up. A victim the engine overwrites is reported
    (`ConnectorResult.host_overwritten`, numbered with the copies) and its slots are the
    lease's from then on; the engine refuses any load from its slots by a plan that predates
    the tree's hearing of it (`HostLease.applied` below the overwrite's number)."""

    epoch: int
    version: int
    applied: int
    slots: tuple[int, ...]
    victims: tuple[tuple[int, tuple[int, ...]], ...] = ()


@dataclass(frozen=True, slots=True)
class WindowLosses:
    """Kept documents (a plan's keep spans, recorded at their request's finish) whose blocks
    left vLLM's cache without a host copy, by cause (eviction-time host writes, design.md 2.2),
    each counted once: `missed`: the eviction window never saw them whole (a step took some of
    their blocks from beyond it: the window too slow or too small); `no_lease`: the window
    refused them at least once for lack of lease room for their copy; `broken`: let go in the
    window because an ancestor's copy was impossible (its blocks had left uncopied). And
    `unapplied`: documents a plan computed although the window had copied them to the host
    and vLLM had evicted them, because the tree had not applied the copy when it planned (the
    report that carries a copy is the next request's finish)."""

    missed: int = 0
    no_lease: int = 0
    broken: int = 0
    unapplied: int = 0

    def __add__(self, other: WindowLosses) -> WindowLosses:
        return WindowLosses(
            self.missed + other.missed,
            self.no_lease + other.no_lease,
            self.broken + other.broken,
            self.unapplied + other.unapplied,
        )

    def to_json(self) -> list[int]:
        return [self.missed, self.no_lease, self.broken, self.unapplied]

    @classmethod
    def from_json(cls, data: Any) -> WindowLosses:
        return cls(*(int(n) for n in data))


NO_LOSSES = WindowLosses()
"""No kept document lost (an immutable value, shared as a default)."""


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything the connector does for one request, in execution order. `keep` and `lease`
    are the eviction-time host writes' parts (`KeepSpan`, `HostLease`, docs/design.md 2.2):
    such a plan has no `store`. The plan is the policy's decision on the host tier only: what
    leaves vLLM's blocks is vLLM's LRU's to decide."""

    page_size: int
    load: tuple[LoadSpan, ...] = ()
    store: tuple[StoreSpan, ...] = ()
    keep: tuple[KeepSpan, ...] = ()
    lease: HostLease | None = None

    @property
    def num_loaded_tokens(self) -> int:
        """Tokens the connector will load; they form a prefix of the prompt."""
        return sum(span.num_tokens for span in self.load)

    @property
    def is_empty(self) -> bool:
        return not (self.load or self.store or self.keep or self.lease)

    def to_json(self) -> dict[str, Any]:
        return {
            "page_size": self.page_size,
            "load": [[str(s.tier), list(s.slots), s.token_start, s.num_tokens] for s in self.load],
            "store": [
                [str(s.tier), list(s.slots), s.token_start, s.num_tokens] for s in self.store
            ],
            "keep": [[s.key, s.parent, s.token_start, s.num_tokens] for s in self.keep],
            "lease": None
            if self.lease is None
            else [
                self.lease.epoch,
                self.lease.version,
                self.lease.applied,
                _runs(self.lease.slots),
                [[vid, list(slots)] for vid, slots in self.lease.victims],
            ],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Plan:
        return cls(
            page_size=int(data["page_size"]),
            load=tuple(
                LoadSpan(Tier(t), tuple(slots), int(start), int(n))
                for t, slots, start, n in data["load"]
            ),
            store=tuple(
                StoreSpan(Tier(t), tuple(slots), int(start), int(n))
                for t, slots, start, n in data["store"]
            ),
            keep=tuple(
                KeepSpan(int(key), None if parent is None else int(parent), int(start), int(n))
                for key, parent, start, n in data.get("keep", ())
            ),
            lease=None
            if data.get("lease") is None
            else HostLease(
                int(data["lease"][0]),
                int(data["lease"][1]),
                int(data["lease"][2]),
                _slots_of_runs(data["lease"][3]),
                tuple(
                    (int(vid), tuple(int(s) for s in slots))
                    for vid, slots in (data["lease"][4] if len(data["lease"]) > 4 else ())
                ),
            ),
        )

    def dumps(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"))


def _runs(slots: tuple[int, ...]) -> list[list[int]]:
    """Sorted slots as [first, count] runs (a lease of thousands of contiguous free slots is a
    few numbers in a plan's JSON)."""
    runs: list[list[int]] = []
    for slot in slots:
        if runs and runs[-1][0] + runs[-1][1] == slot:
            runs[-1][1] += 1
        else:
            runs.append([slot, 1])
    return runs


def _slots_of_runs(runs: Any) -> tuple[int, ...]:
    return tuple(s for first, count in runs for s in range(int(first), int(first) + int(count)))
