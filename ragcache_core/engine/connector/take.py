"""How deep into vLLM's free queue each step reaches: the eviction window's size under load.

A step takes its new blocks from the head of vLLM's free queue (`FreeKVCacheBlockQueue`): as
many as it computes (at most `max_num_batched_tokens`), plus those for the tokens the connector
loads (which vLLM's token budget does not count), plus a block per running request whose last
one filled. A window of one step's computed tokens is therefore too short under load: a step
that also loads host copies reaches past it, and the documents there leave vLLM's cache
before the window saw them (`WindowLosses.missed`). `StepTake` measures each step's reach
and the window watches the largest of the recent ones (never less than its configured floor).

The measure: at each scan the positions of the queue's first `horizon` blocks are marked;
at the next scan the first marked block still in the queue gives how many blocks before it
left the head since (a block leaves the middle only when a request hits it, which makes the
measure larger, never smaller). Blocks handed back to the head after a copy were held while
marked, so they carry no mark and are skipped. O(horizon) a step; pure Python over vLLM's
block objects, no vLLM import.
"""

from __future__ import annotations

from collections import deque
from typing import Any

RECENT_STEPS = 16
"""Steps whose reach the window covers (the load of the last few seconds under load)."""


class StepTake:
    """The reach of recent steps into vLLM's free queue. `floor`: the window's configured
    blocks (the least it watches); `horizon`: the most it marks, so the most it ever watches."""

    def __init__(self, floor: int, horizon: int) -> None:
        self.floor = floor
        self.horizon = max(horizon, floor)
        self._marks: dict[int, int] = {}
        self._recent: deque[int] = deque(maxlen=RECENT_STEPS)

    @property
    def window(self) -> int:
        """Blocks the next scan watches: the largest recent reach, at least `floor`."""
        return max(self.floor, max(self._recent, default=0))

    def measure(self, queue: Any) -> None:
        """Before a scan: how far the step(s) since the last `mark` reached into `queue`."""
        if not self._marks:
            return
        reach = len(self._marks)  # every marked block left: at least that many
        for block in queue.iter_blocks_after(None):
            position = self._marks.get(block.block_id)
            if position is not None:
                reach = position
                break
        self._recent.append(reach)
        self._marks = {}

    def mark(self, queue: Any) -> None:
        """After a scan (its held blocks are out of the queue): mark the head's positions."""
        marks: dict[int, int] = {}
        for position, block in enumerate(queue.iter_blocks_after(None)):
            if position >= self.horizon:
                break
            marks[block.block_id] = position
        self._marks = marks

    def reset(self) -> None:
        """vLLM's prefix cache was reset: the queue's order says nothing of the steps."""
        self._marks = {}
        self._recent.clear()
