"""Answering one request: whole (JSON) or streamed (SSE), its queue place held to the end, its
outcome counted, and the OpenAI bodies it is written in. Shared by every route that generates.

- `whole` / `streamed`: a whole answer's work is cancelled if the client disconnects
  (`until_disconnect`, the pattern of vLLM's `with_cancellation`); a failure becomes the OpenAI
  error JSON (400 for bad input, naming `param`; 500 otherwise). A streamed answer has sent its
  status line before it fails, so its failure is its last event (`{"error": ...}`), then
  `[DONE]`, as `vllm serve` does. `PlacedStream` holds the queue place until the stream has
  ended, however it ends (finished, failed, or the client went away: Starlette cancels the
  body iterator on `http.disconnect`, which closes the cache's stream, which aborts the request
  in vLLM and the tree; see `loop.astream_from`). A whole answer is the cache's whole call
  (`agenerate`), never a stream read to its end: the cache then knows that no text reached
  the client, and retries a try that lost its engine.
- `Reply`: OpenAI response bodies (chat and text completions, whole and as stream chunks),
  with the `ragcache` extension: whether the request was cached (and why not), its hits and
  TTFT. A stream carries it on its last choice chunk (the one with `finish_reason`):

    "ragcache": {"cached": true, "uncached_reason": null, "documents": ["d1", "d2"],
                 "retrieval_ranks": [0, 1], "found_documents": false, "cache_hits": {...},
                 "ttft_s": 0.05, "queue_wait_s": 0.0, "prompt_tokens": 212}

  Every `usage` (a whole answer's, and a stream's closing usage chunk when
  `stream_options.include_usage` asks for one) carries `prompt_tokens_details.cached_tokens`,
  the standard field for the prompt tokens the cache served (`QueryResult.openai_usage`); the
  per-chunk usage of `continuous_usage_stats` has the counts only, as vLLM's.
  A whole answer also carries the counts as headers (`report_headers`: x-ragcache-cached,
  -found-documents, -documents, -hit-documents, -cached-tokens); a stream's headers are sent
  before its hits are known, so it has them in its last chunk only.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from ragcache_core.query_result import QueryResult, StreamChunk, TokenLogprobs
from ragcache_core.serve.errors import STATUS_KEY, ServeError, as_serve_error
from ragcache_core.serve.jobs import CachedJob, Job
from ragcache_core.serve.limits import Place
from ragcache_core.serve.state import ServeState

T = TypeVar("T")


async def whole(
    state: ServeState,
    request: Request,
    route: str,
    place: Place,
    work: Awaitable[T],
    render: Callable[[T], dict[str, Any]],
    param: str | None,
) -> JSONResponse:
    """`render(await work)` as JSON; the place is released on every path."""
    started = time.perf_counter()
    try:
        result = await until_disconnect(request, work)
    except ClientGone:
        state.metrics.disconnects.labels(route).inc()
        raise
    except Exception as exc:
        raise as_serve_error(exc, param) from exc
    finally:
        place.release()
        state.metrics.timed(route, time.perf_counter() - started)
    body = render(result)
    return JSONResponse(body, headers=report_headers(body.get("ragcache")))


def report_headers(report: object) -> dict[str, str]:
    """The `ragcache` report's counts as response headers (for clients that drop unknown body
    fields, such as `ChatOpenAI(include_response_headers=True)`); none without a report."""
    if not isinstance(report, dict):
        return {}
    hits = report.get("cache_hits") or {}
    return {
        "x-ragcache-cached": str(bool(report.get("cached"))).lower(),
        "x-ragcache-found-documents": str(bool(report.get("found_documents"))).lower(),
        "x-ragcache-documents": str(len(report.get("documents") or ())),
        "x-ragcache-hit-documents": str(
            int(hits.get("gpu_docs", 0)) + int(hits.get("host_docs", 0))
        ),
        "x-ragcache-cached-tokens": str(int(hits.get("cached_tokens", 0))),
    }


def streamed(
    state: ServeState,
    route: str,
    place: Place,
    events: AsyncIterator[str],
    param: str | None,
) -> PlacedStream:
    """`events` as SSE, a failure as the last event, then `[DONE]`. The outcome is counted
    with the failure's status, or 499 when the client left (the 200 already sent cannot be
    taken back, the metric can: `errors.STATUS_KEY`)."""
    started = time.perf_counter()
    failed: list[int] = []  # the status of the failure that ended the stream, if any

    def ended(completed: bool) -> int:
        if not completed:
            state.metrics.disconnects.labels(route).inc()
        state.metrics.timed(route, time.perf_counter() - started)
        return (failed[0] if failed else 200) if completed else 499

    return PlacedStream(_closed_by_done(events, param, failed), place, ended)


async def _closed_by_done(
    events: AsyncIterator[str], param: str | None, failed: list[int]
) -> AsyncIterator[str]:
    try:
        async for item in events:
            yield item
    except Exception as exc:  # the status line is out: the error is the stream's last event
        error = as_serve_error(exc, param)
        failed.append(error.status)
        yield event(error.body())
    finally:
        await events.aclose()  # type: ignore[attr-defined]
    yield DONE


DONE = "data: [DONE]\n\n"


def event(data: dict[str, Any]) -> str:
    """One server-sent event carrying `data` as JSON."""
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


class ClientGone(ServeError):
    """The client disconnected before its response (499, never delivered)."""

    def __init__(self) -> None:
        super().__init__(499, "the client closed the request")


class PlacedStream(StreamingResponse):
    """An SSE response that releases its queue place (and closes its events) when it ends.
    `on_end(completed)` tells whether the events ran to their end and returns the status the
    answer really had (recorded in the scope for the request counter)."""

    def __init__(
        self,
        events: AsyncIterator[str],
        place: Place,
        on_end: Callable[[bool], int],
    ) -> None:
        self._events = events
        self._place = place
        self._on_end = on_end
        self._completed = False
        super().__init__(
            self._tracked(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def _tracked(self) -> AsyncIterator[str]:
        async for item in self._events:
            yield item
        self._completed = True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Cancelled before the first event, a generator's body never ran: close it anyway.
            with contextlib.suppress(Exception):
                await self._events.aclose()  # type: ignore[attr-defined]
            self._place.release()
            scope[STATUS_KEY] = self._on_end(self._completed)


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or `ClientGone` once the client disconnected (`work` is cancelled)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _disconnected(request: Request) -> None:
    # The body has been read (FastAPI parsed it), so receive() now only reports a disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


Kind = Literal["chat", "completion"]


@dataclass(frozen=True)
class LogprobsView:
    """How a response shows logprobs, as vLLM: `top` alternatives per token (chat:
    `top_logprobs`; completions: `logprobs`, which lists top + 1), every candidate when
    `logprob_token_ids` were asked for, tokens as 'token_id:N' when asked."""

    top: int
    every_candidate: bool = False
    as_token_ids: bool = False

    def name(self, token_id: int, text: str | None) -> str:
        if self.as_token_ids or text is None:
            return f"token_id:{token_id}"
        return text

    def chat(self, entries: Sequence[TokenLogprobs]) -> dict[str, Any]:
        """`choice.logprobs` of a chat completion (or of one chunk's tokens)."""
        content = []
        for entry in entries:
            token = self.name(entry.token_id, entry.text)
            if entry.logprob is None:
                raw = list(token.encode("utf-8", errors="replace"))
                content.append(
                    {"token": token, "logprob": -9999.0, "bytes": raw, "top_logprobs": []}
                )
                continue
            tops = [
                {
                    "token": (name := self.name(c.token_id, c.text)),
                    "logprob": max(c.logprob, -9999.0),
                    "bytes": list(name.encode("utf-8", errors="replace")),
                }
                for i, c in enumerate(entry.candidates)
                if self.every_candidate or self.top == -1 or i < self.top
            ]
            content.append(
                {
                    "token": token,
                    "logprob": max(entry.logprob, -9999.0),
                    "bytes": (
                        None
                        if entry.text is None
                        else list(entry.text.encode("utf-8", errors="replace"))
                    ),
                    "top_logprobs": tops,
                }
            )
        return {"content": content}

    def completion(self, entries: Sequence[TokenLogprobs], offset: int = 0) -> dict[str, Any]:
        """`choice.logprobs` of a text completion; `offset` is where its text starts."""
        offsets: list[int] = []
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        for entry in entries:
            token = self.name(entry.token_id, entry.text)
            offsets.append(offset)
            offset += len(token)
            tokens.append(token)
            values.append(None if entry.logprob is None else max(entry.logprob, -9999.0))
            tops.append(
                {
                    self.name(c.token_id, c.text): max(c.logprob, -9999.0)
                    for i, c in enumerate(entry.candidates)
                    if self.every_candidate or self.top == -1 or self.top >= i
                }
            )
        return {
            "text_offset": offsets,
            "token_logprobs": values,
            "tokens": tokens,
            "top_logprobs": tops,
        }


@dataclass
class Reply:
    """What every body of one response shares: its id, creation time, model and kind, and what
    the request asked to see (token ids, logprobs, usage on every chunk). A streamed reply
    remembers what it has sent (tokens, text offset)."""

    kind: Kind
    model: str
    job: Job
    token_ids: bool = False
    """Include the generated token ids and the prompt's (vLLM's `return_token_ids`)."""
    logprobs: LogprobsView | None = None
    continuous_usage: bool = False
    id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    _sent_tokens: int = 0
    _text_offset: int = 0

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

    def _logprobs(self, entries: Sequence[TokenLogprobs], offset: int = 0) -> Any:
        view = self.logprobs
        if view is None:
            return None
        return view.chat(entries) if self.kind == "chat" else view.completion(entries, offset)

    def whole(self, result: QueryResult) -> dict[str, Any]:
        """The non-streamed response."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": result.finish_reason}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": result.answer}
        else:
            choice["text"] = result.answer
        choice["logprobs"] = self._logprobs(result.logprobs)
        body = {**self._head(chunk=False), "choices": [choice]}
        if self.token_ids:
            choice["token_ids"] = list(result.token_ids)
            prompt = list(self.job.prompt_ids)
            if self.kind == "chat":
                body["prompt_token_ids"] = prompt
            else:
                choice["prompt_token_ids"] = prompt
        return {**body, "usage": result.openai_usage(), "ragcache": cache_report(self.job, result)}

    def first(self) -> dict[str, Any] | None:
        """The chunk that opens a chat stream (the assistant role; the prompt's ids when
        asked), None for completions (their first delta carries the prompt's ids)."""
        if self.kind != "chat":
            return None
        chunk = self._chunk({"delta": {"role": "assistant", "content": ""}}, 0)
        if self.token_ids:
            chunk["prompt_token_ids"] = list(self.job.prompt_ids)
        return chunk

    def delta(self, piece: StreamChunk) -> dict[str, Any]:
        """One chunk of text, with its tokens' ids and logprobs when asked for."""
        return self._piece(piece.delta, piece.token_ids, piece.logprobs, None)

    def last(self, result: QueryResult) -> dict[str, Any]:
        """The closing chunk: finish reason, the tokens not sent yet, the cache report."""
        rest = result.token_ids[self._sent_tokens :]
        rest_logprobs = result.logprobs[self._sent_tokens :] if result.logprobs else ()
        chunk = self._piece("", rest, rest_logprobs, result.finish_reason)
        return {**chunk, "ragcache": cache_report(self.job, result)}

    def _piece(
        self,
        text: str,
        token_ids: Sequence[int],
        logprobs: Sequence[TokenLogprobs],
        finish_reason: str | None,
    ) -> dict[str, Any]:
        first = self._sent_tokens == 0 and self.kind == "completion"
        self._sent_tokens += len(token_ids)
        choice: dict[str, Any] = {"delta": {"content": text}} if self.kind == "chat" else {}
        if self.kind == "completion":
            choice["text"] = text
        if finish_reason is not None and self.kind == "chat" and not text:
            choice["delta"] = {}
        if self.logprobs is not None:
            choice["logprobs"] = self._logprobs(logprobs, self._text_offset)
            if self.kind == "completion" and logprobs:
                last = choice["logprobs"]
                self._text_offset = last["text_offset"][-1] + len(last["tokens"][-1])
        if self.token_ids:
            choice["token_ids"] = list(token_ids)
            if first:
                choice["prompt_token_ids"] = list(self.job.prompt_ids)
        choice["finish_reason"] = finish_reason
        return self._chunk(choice, self._sent_tokens)

    def usage_chunk(self, result: QueryResult) -> dict[str, Any]:
        """`stream_options.include_usage`: an extra chunk with no choices, as OpenAI sends."""
        return {**self._head(chunk=True), "choices": [], "usage": result.openai_usage()}

    def _chunk(self, choice: dict[str, Any], generated: int) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            **self._head(chunk=True),
            "choices": [{"index": 0, "finish_reason": None, **choice}],
        }
        if self.continuous_usage:
            prompt = self.job.prompt_tokens
            chunk["usage"] = {
                "prompt_tokens": prompt,
                "completion_tokens": generated,
                "total_tokens": prompt + generated,
            }
        return chunk


def cache_report(job: Job, result: QueryResult) -> dict[str, Any]:
    """The `ragcache` extension; `documents` as the model read them (`document_order`)."""
    cached = isinstance(job, CachedJob)
    return {
        "cached": cached,
        "uncached_reason": None if isinstance(job, CachedJob) else job.reason,
        "documents": [d.id for d in result.sources] if cached else list(job.doc_ids),
        "retrieval_ranks": list(result.retrieval_ranks),
        "found_documents": isinstance(job, CachedJob) and job.found,
        "cache_hits": dataclasses.asdict(result.hits),
        "ttft_s": result.ttft_s,
        "queue_wait_s": result.queue_wait_s,
        "prompt_tokens": result.prompt_tokens,
    }
