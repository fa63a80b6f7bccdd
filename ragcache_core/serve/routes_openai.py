"""`POST /v1/chat/completions` and `POST /v1/completions`, OpenAI-compatible.

    body ─► validated (schemas.py: 400 naming the field) ─► model checked (404)
         ─► a place in flight (429 / 503), before any work
         ─► on the renderer thread: a job (jobs.py): cached (question + documents) or
            uncached (token ids, and why); sampling, checked against the context (400)
         ─► the cache's stream (`astream` / `astream_uncached`) ─► whole JSON or SSE chunks

The extension fields and the `ragcache` report are described in schemas.py, openai_format.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, Request, Response

from ragcache_core.config import SamplingConfig
from ragcache_core.results import StreamChunk
from ragcache_core.serve import respond
from ragcache_core.serve.jobs import CachedJob, Job, chat_job, completion_job, sampling_for
from ragcache_core.serve.openai_format import Kind, Reply
from ragcache_core.serve.schemas import ChatRequest, CompletionRequest
from ragcache_core.serve.state import ServableCache, ServeState, state_of
from ragcache_core.serve.streams import event, final_result

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


async def chat_completions(body: ChatRequest, request: Request) -> Response:
    state = state_of(request)
    state.check_model(body.model)
    return await _serve(state, request, "chat", body, lambda: chat_job(body, state.renderer))


async def completions(body: CompletionRequest, request: Request) -> Response:
    state = state_of(request)
    state.check_model(body.model)
    return await _serve(
        state, request, "completion", body, lambda: completion_job(body, state.renderer)
    )


async def _serve(
    state: ServeState,
    request: Request,
    kind: Kind,
    body: ChatRequest | CompletionRequest,
    make_job: Callable[[], Job],
) -> Response:
    """A place first (a full server refuses before any work), then the job and its sampling
    on the renderer thread (tokenization stays off the event loop), then the answer."""
    route, param = (CHAT, "messages") if kind == "chat" else (COMPLETIONS, "prompt")
    place = state.enter(route)
    max_len = state.settings.config.max_model_len

    def prepare() -> tuple[Job, SamplingConfig]:
        job = make_job()
        return job, sampling_for(body, job, state.defaults, max_len)

    try:
        job, sampling = await state.render(prepare)
    except BaseException:
        place.release()
        raise
    reply = Reply(kind, state.settings.model_name, job, token_ids=body.return_token_ids)
    chunks = open_stream(state.cache, job, sampling)  # nothing runs until it is iterated
    if not isinstance(job, CachedJob):
        state.metrics.uncached.labels(job.reason).inc()
    if body.stream:
        events = _events(reply, chunks, body.include_usage)
        return respond.streamed(state, route, place, events, param)
    work = final_result(chunks)
    return await respond.whole(state, request, route, place, work, reply.whole, param)


def open_stream(
    cache: ServableCache, job: Job, sampling: SamplingConfig
) -> AsyncIterator[StreamChunk]:
    """The cache's stream for `job` (nothing runs until it is iterated)."""
    if isinstance(job, CachedJob):
        return cache.astream(job.question, documents=job.documents, sampling=sampling)
    return cache.astream_uncached(job.prompt_ids, sampling=sampling)


async def _events(
    reply: Reply, chunks: AsyncIterator[StreamChunk], include_usage: bool
) -> AsyncIterator[str]:
    """The OpenAI chunks of one streamed answer (the role first for chat, then the deltas,
    then the closing chunk with the cache report, then usage when asked)."""
    opening = reply.first()
    if opening is not None:
        yield event(opening)
    async with contextlib.aclosing(chunks):  # type: ignore[type-var]
        async for chunk in chunks:
            if chunk.delta:
                yield event(reply.delta(chunk.delta))
            if chunk.result is not None:
                yield event(reply.last(chunk.result))
                if include_usage:
                    yield event(reply.usage_chunk(chunk.result))


def router() -> APIRouter:
    """This module's routes (a new router per app: nothing is shared between apps)."""
    routes = APIRouter()
    routes.add_api_route(CHAT, chat_completions, methods=["POST"])
    routes.add_api_route(COMPLETIONS, completions, methods=["POST"])
    return routes
