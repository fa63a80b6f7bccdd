"""The in-flight state of one request between `begin_request` and `confirm`/`abort`."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from ragcache_core.plan import Plan, Tier
from ragcache_core.tree.match import MatchResult
from ragcache_core.tree.node import Node
from ragcache_core.tree.shadow import Shadow


class RequestState(StrEnum):
    OPEN = "open"
    CONFIRMED = "confirmed"
    ABORTED = "aborted"


@dataclass(slots=True)
class RequestLedger:
    """What one request holds in the tree: bookkeeping of `ragcache_core.tree` only (the
    planner and the placement append to it; `KnowledgeTree` releases it at confirm/abort).

    - `path`: the nodes it reached (hits, in-flight nodes, nodes it stores), root first;
    - `pins`: one entry per pin it holds: the slots it reads or writes are held while it runs;
    - `pending`: the copies it writes (write-through stores), readable only once it confirms;
    - `keeps`: the paths its plan keeps (eviction-time host writes), root first: vLLM's blocks
      hold them once it confirms (`HostWrites.settle`);
    - `computing`: the keys of those it computes (vLLM's blocks did not hold them, as last
      heard), until it ends (`HostWrites.end`): what `concurrent_computes` counts against.
    """

    path: list[Node] = field(default_factory=list)
    pins: list[Node] = field(default_factory=list)
    pending: list[tuple[Node, Tier]] = field(default_factory=list)
    keeps: list[Shadow] = field(default_factory=list)
    computing: list[int] = field(default_factory=list)


class RequestHandle:
    """What `KnowledgeTree.begin_request` decided for one request.

    Read `plan` (for the connector), `hits`, `cached_tokens`, `computed_tokens`,
    `stored_docs`, `stored_root`. `ledger` is the tree's private bookkeeping (see
    `RequestLedger`): never read or changed outside `ragcache_core.tree`.
    """

    def __init__(self, request_id: int, *, final: bool, page_size: int) -> None:
        self.request_id = request_id
        self.final = final
        self.state = RequestState.OPEN
        self.plan = Plan(page_size=page_size)
        self.hits = MatchResult(hits=(), in_flight=0)
        self.cached_tokens = 0
        self.computed_tokens = 0
        self.stored_docs = 0
        self.stored_root = False
        self.ledger = RequestLedger()
        self.engine_generation = 0
        """The tree's engine generation when the request was planned
        (`KnowledgeTree.engine_generation`): its report comes from that engine."""

    @property
    def is_open(self) -> bool:
        return self.state is RequestState.OPEN

    def __repr__(self) -> str:
        return (
            f"RequestHandle(#{self.request_id}, {self.state}, cached={self.cached_tokens}, "
            f"computed={self.computed_tokens}, stored_docs={self.stored_docs})"
        )
