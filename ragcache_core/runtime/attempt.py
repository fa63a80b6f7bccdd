"""A request in the app process: one record (`Request`, as mini-sglang's `Req`) from the
admission queue to its `QueryResult`, and its tries (`Attempt`).

    Request   prompt, sampling, final        what to generate (`final`: not a speculation)
              score, blocked, reorder        admission's view of it, asked again at each pick
                                             (the tree moves while it waits)
              caller, streamed               where its text goes; whether any reached it
              attempts                       its tries, oldest first; `attempt` is the current
    Attempt   request_id, epoch              its vLLM request, the engine epoch it ran on
              in_prefill, prefill_tokens     its place in prefill (`Admission`): taken at
                                             admission, given back at its first token or end
              prompt, handle, plan           as it opened: the tree's part of the request (the
                                             tree's `RequestHandle`: plan, hits, ledger) and
                                             the plan sent (`Lifecycle.open`)
              text, token_ids, ...           what the engine streamed (`generation.follow`)
              hits, doc_hit_tokens, timings  what the cache served, where the time went

A generation tries again (`Request.try_again`) on a timeout or an engine death
(`Generator.generate`), unless text reached the caller; the steps that move a try along are
`Admission`'s (admission.py) and `Generator`'s (generation.py), which builds the caller's
`QueryResult` once, from the last try (`Generator.finish`). An uncached request (uncached.py)
is a request with no documents and no plan.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ragcache_core.config import SamplingConfig
from ragcache_core.loop import Emit
from ragcache_core.plan import Plan
from ragcache_core.query_result import CacheHits, StreamChunk, TokenLogprobs
from ragcache_core.runtime.prompt import BuiltPrompt
from ragcache_core.tree import RequestHandle


def _never_blocked() -> bool:
    return False


def _future() -> asyncio.Future[None]:
    return asyncio.get_running_loop().create_future()


@dataclass(eq=False)
class Request:
    """One generation the app asked for (see the module docstring). Created and used on
    RAGCache's loop only; compared by identity. It is made with its first try."""

    prompt: BuiltPrompt
    """As built; a `document_order="cache"` request's tries open it again in the cache's order."""
    sampling: SamplingConfig
    score: Callable[[], tuple[int, int]]
    """(cached tokens, tokens to compute) as of now: the reordering queue's priority."""
    final: bool = True
    blocked: Callable[[], bool] = _never_blocked
    """Whether a document the request could read is being written by a request in prefill
    right now (it becomes readable at that request's first token): admission defers it."""
    caller: Emit | None = None
    """Where the answer's text deltas go (None: nobody streams them)."""
    reorder: Callable[[BuiltPrompt], BuiltPrompt] | None = None
    """A `document_order="cache"` request: its prompt in the order that follows the cached
    path when a try opens (`Generator.reordering`); None keeps `prompt` as built."""
    streamed: bool = False
    """Whether text reached the caller (it cannot be taken back: no further try)."""
    attempts: list[Attempt] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.attempts:
            self.try_again()

    @property
    def attempt(self) -> Attempt:
        """The current try (the last)."""
        return self.attempts[-1]

    @property
    def retries(self) -> int:
        """Tries before the current one."""
        return len(self.attempts) - 1

    def try_again(self) -> Attempt:
        """A new try, opening from `prompt` again; it becomes the current one."""
        attempt = Attempt(self, self.prompt)
        self.attempts.append(attempt)
        return attempt

    def emit(self, chunk: StreamChunk) -> None:
        """Send a text delta to the caller (and note that text was shown: it cannot be taken
        back, so the request is not tried again)."""
        if self.caller is not None:
            self.streamed = True
            self.caller(chunk)

    @property
    def sink(self) -> Emit | None:
        """`emit` when someone streams the answer, else None (the engine stream skips it)."""
        return None if self.caller is None else self.emit


@dataclass(eq=False)
class Attempt:
    """One try at a `Request` (see the module docstring). Created by the request; compared by
    identity."""

    request: Request
    prompt: BuiltPrompt
    """As the try opens it (`Request.reorder` may order its documents again)."""
    request_id: str = ""
    """Its vLLM request, named when the try starts."""
    epoch: int = 0

    # Admission (admission.py): waiting for prefill, then holding `prefill_tokens` of its budget.
    prefill_tokens: int = 0
    """Tokens to compute, as of admission (what the try takes from the budget)."""
    in_prefill: bool = False
    """Whether it holds its place (given back once: `Admission.release` is idempotent)."""
    wake: asyncio.Future[None] = field(default_factory=_future)
    """Set when a waiting try is admitted (cancelled when its wait is)."""
    enqueued_at: float = field(default_factory=time.perf_counter)
    admitted_at: float = 0.0

    # The tree's part of the request (`Lifecycle.open`).
    handle: RequestHandle | None = None
    plan: Plan | None = None
    """The plan sent with the request (None: none, it runs uncached)."""

    # What the engine streamed (`generation.follow`).
    text: str = ""
    token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None
    report: Mapping[str, Any] | None = None
    """The connector's final report (`kv_transfer_params` of the finished output)."""
    first_token_at: float = 0.0
    logprobs: tuple[TokenLogprobs, ...] = ()
    """One per generated token, when the request asked for logprobs."""
    cached_tokens: int = 0
    """vLLM's `num_cached_tokens`: prompt tokens its prefix cache served plus those the
    connector loaded."""

    # What the cache served (`Generator._settle`), and where the time went.
    hits: CacheHits = field(default_factory=CacheHits)
    doc_hit_tokens: int = 0
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def wait_s(self) -> float:
        """How long it waited for prefill."""
        return max(0.0, self.admitted_at - self.enqueued_at)
