"""`Attempt`: one try at one generation, the single object the request path carries.

    prompt, sampling, final      what to generate (`final`: not a speculation)
    request_id, epoch            its vLLM request and the engine epoch it was admitted on
    ticket, lease                its wait for prefill and the place it holds there
    handle, plan                 what the knowledge tree planned for it (`Lifecycle.open`)
    progress, timings            what the engine streamed, and how long each step took
    streamed                     whether text reached the caller (then it cannot be retried)

A generation makes a new `Attempt` for each try (`Generator.generate` retries on a timeout or
an engine death); the steps that move it along are `Generator`'s (`generation.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ragcache_core.config import SamplingConfig
from ragcache_core.loop import Emit
from ragcache_core.plan import Plan
from ragcache_core.results import StreamChunk, TokenLogprobs
from ragcache_core.runtime.admission import PrefillLease, Ticket
from ragcache_core.runtime.prompt import BuiltPrompt
from ragcache_core.tree import RequestHandle


@dataclass
class Progress:
    """What the engine has streamed for one request so far."""

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


@dataclass
class Attempt:
    """One try at one generation (see the module docstring). Used from RAGCache's loop only."""

    prompt: BuiltPrompt
    sampling: SamplingConfig
    final: bool
    request_id: str
    ticket: Ticket
    caller: Emit | None = None
    """Where the answer's text deltas go (None: nobody streams them)."""
    reorder: Callable[[BuiltPrompt], BuiltPrompt] | None = None
    """A `document_order="cache"` request: its prompt in the order that follows the cached
    path when it opens (`Generator.reordering`); None keeps `prompt` as built."""
    epoch: int = 0
    lease: PrefillLease | None = None
    handle: RequestHandle | None = None
    plan: Plan | None = None
    progress: Progress = field(default_factory=Progress)
    timings: dict[str, float] = field(default_factory=dict)
    streamed: bool = False

    def emit(self, chunk: StreamChunk) -> None:
        """Send a text delta to the caller (and note that text was shown: it cannot be taken
        back, so the attempt is not retried)."""
        if self.caller is not None:
            self.streamed = True
            self.caller(chunk)

    @property
    def sink(self) -> Emit | None:
        """`emit` when someone streams the answer, else None (the engine stream skips it)."""
        return None if self.caller is None else self.emit
