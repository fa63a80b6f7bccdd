"""The in-flight state of one request between `begin_request` and `confirm`/`abort`."""

from __future__ import annotations

from enum import StrEnum

from ragcache_core.plan import Plan, SlotCopy, Tier
from ragcache_core.tree.node import Node
from ragcache_core.tree.results import MatchResult


class RequestState(StrEnum):
    OPEN = "open"
    CONFIRMED = "confirmed"
    ABORTED = "aborted"


class RequestHandle:
    """What `KnowledgeCache.begin_request` decided for one request.

    Read `plan` (for the connector), `hits`, `cached_tokens`, `computed_tokens`,
    `stored_docs`. The rest is the cache's private bookkeeping: the pins this request holds,
    the copies it writes (readable only after `confirm`) and the GPU slots freed by its
    swap-outs, which only this request may reuse until it completes (its own plan reads them
    before it writes them; anyone else might write them first).
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
        # Private bookkeeping (KnowledgeCache only).
        self._path: list[Node] = []
        self._pins: list[Node] = []
        self._pending: list[tuple[Node, Tier]] = []
        self._reusable_gpu: list[int] = []
        self._swap_out: list[SlotCopy] = []

    @property
    def is_open(self) -> bool:
        return self.state is RequestState.OPEN

    def __repr__(self) -> str:
        return (
            f"RequestHandle(#{self.request_id}, {self.state}, cached={self.cached_tokens}, "
            f"computed={self.computed_tokens}, stored_docs={self.stored_docs})"
        )
