"""OpenAI response bodies (chat and text completions, whole and as stream chunks), with the
`ragcache` extension: whether the request was cached (and why not), its hits and TTFT.

    "ragcache": {"cached": true, "uncached_reason": null, "documents": ["d1", "d2"],
                 "cache_hits": {...}, "ttft_s": 0.05, "queue_wait_s": 0.0, "prompt_tokens": 212}

A stream carries it on its last choice chunk (the one with `finish_reason`). Pure functions.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from ragcache_core.results import QueryResult
from ragcache_core.serve.jobs import CachedJob, Job

Kind = Literal["chat", "completion"]


@dataclass(frozen=True)
class Reply:
    """What every body of one response shares: its id, creation time, model and kind."""

    kind: Kind
    model: str
    job: Job
    token_ids: bool = False
    """Include the generated token ids (vLLM's `return_token_ids`)."""
    id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    def _head(self, chunk: bool) -> dict[str, Any]:
        if self.kind == "chat":
            kind = "chat.completion.chunk" if chunk else "chat.completion"
            prefix = "chatcmpl"
        else:
            kind, prefix = "text_completion", "cmpl"
        return {
            "id": f"{prefix}-{self.id}",
            "object": kind,
            "created": self.created,
            "model": self.model,
        }

    def whole(self, result: QueryResult) -> dict[str, Any]:
        """The non-streamed response."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": result.finish_reason}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": result.answer}
        else:
            choice["text"] = result.answer
        if self.token_ids:
            choice["token_ids"] = list(result.token_ids)
        return {
            **self._head(chunk=False),
            "choices": [choice],
            "usage": usage(result),
            "ragcache": cache_report(self.job, result),
        }

    def first(self) -> dict[str, Any] | None:
        """The chunk that opens a chat stream (the assistant role), None for completions."""
        if self.kind != "chat":
            return None
        return self._chunk({"delta": {"role": "assistant", "content": ""}})

    def delta(self, text: str) -> dict[str, Any]:
        if self.kind == "chat":
            return self._chunk({"delta": {"content": text}})
        return self._chunk({"text": text})

    def last(self, result: QueryResult) -> dict[str, Any]:
        """The closing chunk: finish reason, token ids when asked, the cache report."""
        choice: dict[str, Any] = {"delta": {}} if self.kind == "chat" else {"text": ""}
        choice["finish_reason"] = result.finish_reason
        if self.token_ids:
            choice["token_ids"] = list(result.token_ids)
        return {**self._chunk(choice), "ragcache": cache_report(self.job, result)}

    def usage_chunk(self, result: QueryResult) -> dict[str, Any]:
        """`stream_options.include_usage`: an extra chunk with no choices, as OpenAI sends."""
        return {**self._head(chunk=True), "choices": [], "usage": usage(result)}

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        return {
            **self._head(chunk=True),
            "choices": [{"index": 0, "finish_reason": None, **choice}],
        }


def usage(result: QueryResult) -> dict[str, int]:
    completion = len(result.token_ids)
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": result.prompt_tokens + completion,
    }


def cache_report(job: Job, result: QueryResult) -> dict[str, Any]:
    return {
        "cached": isinstance(job, CachedJob),
        "uncached_reason": None if isinstance(job, CachedJob) else job.reason,
        "documents": list(job.doc_ids),
        "cache_hits": dataclasses.asdict(result.hits),
        "ttft_s": result.ttft_s,
        "queue_wait_s": result.queue_wait_s,
        "prompt_tokens": result.prompt_tokens,
    }
