"""Every route of `ragcache serve` (one `router()` per app: nothing is shared between apps).

OpenAI-compatible (what `vllm serve` answers, plus the `"documents"` extension):

    POST /v1/chat/completions  messages (+ documents) -> a cached job (question + documents,
    POST /v1/completions       the tree) or an uncached one (token ids, plain vLLM); whole or
                               streamed (SSE), `jobs.py` maps the request, `responses.py` answers

RAGCache's own (what `RAGCacheClient` calls):

    POST /v1/rag/query         question (+ documents) in; answer, sources, hits, TTFT out
                               (`QueryResult` as JSON, client/wire.py); streamed: {"delta": ...}
                               events, the last with "result"
    GET  /v1/rag/config        the served model's name, its `CacheConfig`, and the number of
                               replicas (1 + --peers)
    GET  /v1/cache/stats       `RAGCache.stats()` plus the server's queue
    POST /v1/cache/invalidate  {"doc_id": ...} -> {"doc_id", "removed"}; with --peers also on
                               every peer, + {"replicas": {id or URL: removed}} (502 if a
                               peer failed; serve/replicas.py)
    POST /v1/cache/invalidate/local  the same on this replica only (what peers call)
    GET  /v1/cache/integrity   the knowledge tree's invariants checked (500 naming a violation)

Operations: `GET /health` (503 while starting, draining, or while the engine is dead or
restarting), `GET /metrics` (Prometheus text:
the cache's collectors and the server's), `GET /v1/models` (the one served model).

Every route but the three that generate is cheap and answers at once (no queue place needed).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from ragcache_core.app_prompt import AppPrompt, Framing
from ragcache_core.client.wire import config_to_json, logprobs_to_json, result_to_json
from ragcache_core.config import SamplingConfig
from ragcache_core.documents import Document
from ragcache_core.errors import InputError, PromptTooLong, check_fits_context
from ragcache_core.query_result import QueryResult, StreamChunk
from ragcache_core.serve import responses
from ragcache_core.serve.errors import ServeError, bad_request, error_body, require_json
from ragcache_core.serve.fields import lone_surrogate
from ragcache_core.serve.jobs import (
    CachedJob,
    Job,
    chat_job,
    completion_job,
    request_chars,
    request_param,
    sampling_for,
)
from ragcache_core.serve.replicas import LOCAL_INVALIDATE, invalidate_peers
from ragcache_core.serve.responses import Kind, LogprobsView, Reply, event
from ragcache_core.serve.schemas import (
    ChatRequest,
    CompletionRequest,
    InvalidateRequest,
    OpenAIRequest,
    RagQueryRequest,
)
from ragcache_core.serve.state import ServeState, state_of
from ragcache_core.tree import IntegrityError

if TYPE_CHECKING:
    from ragcache_core.runtime.ragcache import RAGCache

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


async def chat_completions(body: ChatRequest, request: Request) -> Response:
    state = state_of(request)
    _valid_text(body)
    state.check_model(body.model)
    salt = state.salt_for(request, body.cache_salt)
    return await _serve(state, request, "chat", body, lambda: chat_job(body, state.renderer, salt))


async def completions(body: CompletionRequest, request: Request) -> Response:
    state = state_of(request)
    _valid_text(body)
    state.check_model(body.model)
    salt = state.salt_for(request, body.cache_salt)
    return await _serve(
        state, request, "completion", body, lambda: completion_job(body, state.renderer, salt)
    )


def _valid_text(body: BaseModel) -> None:
    """400 naming the field for text that is not valid Unicode (a lone surrogate: JSON can
    escape one, no tokenizer can take it), before anything else runs."""
    found = lone_surrogate(body)
    if found is not None:
        path, index, code = found
        raise bad_request(
            f"{path} contains a lone surrogate (U+{code:04X}) at character {index}: not valid "
            "Unicode",
            path,
        )


async def _serve(
    state: ServeState,
    request: Request,
    kind: Kind,
    body: OpenAIRequest,
    make_job: Callable[[], Job],
) -> Response:
    """A place first (a full server refuses before any work), then the job, its sampling and
    vLLM's checks of it in a render lane (tokenization stays off the event loop; `RenderLanes`;
    a request vLLM would refuse is a 400 before anything is allocated, streamed or not), then
    the answer."""
    route, param = (CHAT, "messages") if kind == "chat" else (COMPLETIONS, "prompt")
    place = state.enter(route)
    max_len = state.settings.config.max_model_len

    def prepare() -> tuple[Job, SamplingConfig]:
        job = make_job()
        sampling = sampling_for(body, job, state.defaults, max_len)
        try:
            state.cache.check_sampling(sampling)
        except InputError as exc:
            raise bad_request(str(exc), request_param(body, exc.param)) from None
        return job, sampling

    try:
        job, sampling = await state.render(prepare, request_chars(body))
    except BaseException:
        place.release()
        raise
    reply = Reply(
        kind,
        state.settings.model_name,
        job,
        token_ids=bool(body.return_token_ids),
        logprobs=_logprobs_view(body),
        continuous_usage=body.continuous_usage,
        id=_response_id(request, body),
    )
    if not isinstance(job, CachedJob):
        state.metrics.uncached.labels(job.reason).inc()
        if job.reason == "no_documents":
            state.metrics.found.labels("none").inc()
    elif job.found:
        state.metrics.found.labels("found").inc()
    if body.streamed:
        chunks = open_stream(state.cache, job, sampling)  # nothing runs until it is iterated
        events = _completion_events(reply, chunks, body.include_usage)
        return responses.streamed(state, route, place, events, param)
    work = whole_answer(state.cache, job, sampling)
    return await responses.whole(state, request, route, place, work, reply.whole, param)


def _logprobs_view(body: OpenAIRequest) -> LogprobsView | None:
    if not body.wants_logprobs:
        return None
    top = body.top_logprobs if isinstance(body, ChatRequest) else body.logprobs
    return LogprobsView(
        top=int(top or 0),
        every_candidate=bool(body.value("logprob_token_ids")),
        as_token_ids=bool(body.return_tokens_as_token_ids),
    )


def _response_id(request: Request, body: OpenAIRequest) -> str:
    """The X-Request-Id header, else the body's `request_id`, else a random id (as vLLM)."""
    return request.headers.get("x-request-id") or body.request_id or uuid.uuid4().hex


def open_stream(cache: RAGCache, job: Job, sampling: SamplingConfig) -> AsyncIterator[StreamChunk]:
    """The cache's stream for `job` (nothing runs until it is iterated)."""
    if isinstance(job, CachedJob):
        return cache.astream(
            job.question,
            documents=job.documents,
            sampling=sampling,
            prompt=job.framing.prompt,
            cache_salt=job.framing.cache_salt,
            document_order=job.document_order,
        )
    return cache.astream_uncached(job.prompt_ids, sampling=sampling)


def whole_answer(cache: RAGCache, job: Job, sampling: SamplingConfig) -> Awaitable[QueryResult]:
    """The cache's whole answer for `job`. Not a stream read to its end: nothing reaches
    the client before the answer ends, so a try that loses its engine is retried like one
    before its first token (the cache knows no text was shown)."""
    if isinstance(job, CachedJob):
        return cache.agenerate(
            job.question,
            job.documents,
            sampling=sampling,
            prompt=job.framing.prompt,
            cache_salt=job.framing.cache_salt,
            document_order=job.document_order,
        )
    return cache.agenerate_uncached(job.prompt_ids, sampling=sampling)


async def _completion_events(
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
                yield event(reply.delta(chunk))
            if chunk.result is not None:
                yield event(reply.last(chunk.result))
                if include_usage:
                    yield event(reply.usage_chunk(chunk.result))


QUERY = "/v1/rag/query"


async def rag_query(body: RagQueryRequest, request: Request) -> Response:
    state = state_of(request)
    cache = state.cache
    _valid_text(body)
    if not body.question.strip():
        raise bad_request("the question is empty", "question")
    documents = None if body.documents is None else tuple(d.to_document() for d in body.documents)
    if documents is None and not state.has_index:
        raise bad_request("this server has no --index: send the documents", "documents")
    if documents is not None and body.top_k is not None:
        raise bad_request("top_k is for the server's search: with documents none runs", "top_k")
    sampling = _rag_sampling(body, cache.config.sampling, state.settings.config.max_model_len)
    try:
        prompt = None if body.prompt is None else AppPrompt.from_json(body.prompt)
        salt = state.salt_for(request, body.cache_salt)
        framing = Framing(prompt, salt, document_order=body.document_order)
    except InputError as exc:
        raise bad_request(str(exc), "prompt") from None
    place = state.enter(QUERY)  # a full server refuses before any work
    chars = len(body.question) + sum(len(d.text) for d in documents or ())

    def prepare() -> None:
        try:
            cache.check_sampling(sampling or cache.config.sampling)
        except InputError as exc:
            param = f"sampling.{exc.param}" if exc.param else "sampling"
            raise bad_request(str(exc), param) from None
        if documents is not None:
            _check_length(
                state, body.question, documents, sampling or cache.config.sampling, framing
            )

    try:
        await state.render(prepare, chars)
    except BaseException:
        place.release()
        raise
    prompt, salt, shown = framing.prompt, framing.cache_salt, body.return_prompt
    if body.stream:
        chunks = cache.astream(
            body.question,
            documents=documents,
            top_k=body.top_k,
            sampling=sampling,
            prompt=prompt,
            cache_salt=salt,
            return_prompt=shown,
            document_order=body.document_order,
        )
        return responses.streamed(state, QUERY, place, _rag_events(chunks), "question")
    if documents is None:
        work = cache.aquery(
            body.question,
            top_k=body.top_k,
            sampling=sampling,
            prompt=prompt,
            cache_salt=salt,
            return_prompt=shown,
            document_order=body.document_order,
        )
    else:
        work = cache.agenerate(
            body.question,
            documents,
            sampling=sampling,
            prompt=prompt,
            cache_salt=salt,
            return_prompt=shown,
            document_order=body.document_order,
        )
    return await responses.whole(state, request, QUERY, place, work, result_to_json, "question")


def _rag_sampling(
    body: RagQueryRequest, default: SamplingConfig, max_model_len: int
) -> SamplingConfig | None:
    """The request's sampling over the server's (400 naming `sampling.<field>`)."""
    if body.sampling is None:
        return None
    try:
        sampling = body.sampling.over(default)
    except InputError as exc:
        raise bad_request(str(exc), f"sampling.{exc.param}" if exc.param else "sampling") from None
    if sampling.max_tokens > max_model_len:
        raise bad_request(
            f"max_tokens={sampling.max_tokens} cannot be greater than "
            f"max_model_len={max_model_len}. Please request fewer output tokens.",
            "sampling.max_tokens",
        )
    return sampling


async def rag_config(request: Request) -> dict[str, Any]:
    state = state_of(request)
    return {
        "model": state.settings.model_name,
        "has_index": state.has_index,
        "admin_key": state.settings.admin_key is not None,
        "replicas": 1 + len(state.settings.peers),
        "config": config_to_json(state.cache.config),
    }


async def cache_stats(request: Request) -> dict[str, Any]:
    state = state_of(request)
    stats = await asyncio.to_thread(state.cache.stats)
    queue = state.queue
    stats["serve"] = {
        "in_flight": queue.in_flight,
        "waiting": queue.waiting,
        "capacity": queue.capacity,
        "refused": queue.refused,
    }
    return stats


async def cache_invalidate_local(body: InvalidateRequest, request: Request) -> dict[str, Any]:
    """Drop `doc_id` on this replica only (the peers' side of a fan-out)."""
    state = state_of(request)
    removed = await asyncio.to_thread(state.cache.invalidate, body.doc_id)
    return {"doc_id": body.doc_id, "removed": removed}


async def cache_invalidate(body: InvalidateRequest, request: Request) -> Response:
    """Drop `doc_id` here, then on every peer (serve/replicas.py); 502 naming the peers that
    failed (the others have dropped it; the caller retries)."""
    state = state_of(request)
    local = await cache_invalidate_local(body, request)
    settings = state.settings
    if not settings.peers:
        return JSONResponse(local)
    keys = settings.accepted_keys
    key = settings.admin_key or (keys[0].key if keys else None)  # the peers share the keys
    report = await invalidate_peers(settings.peers, body.doc_id, key)
    report.removed[settings.replica_name] = int(local["removed"])
    answer = report.to_json(body.doc_id)
    if not report.errors:
        return JSONResponse(answer)
    failed = ", ".join(sorted(report.errors))
    message = (
        f"{body.doc_id!r} was dropped here and on the reachable peers, but not on {failed}; "
        "retry the invalidation"
    )
    return JSONResponse({**error_body(502, message, "doc_id"), **answer}, status_code=502)


async def cache_integrity(request: Request) -> Response:
    state = state_of(request)
    try:
        await asyncio.to_thread(state.cache.check_integrity)
    except IntegrityError as exc:
        raise ServeError(500, f"integrity check failed: {exc}") from exc
    return JSONResponse({"ok": True})


def _check_length(
    state: ServeState,
    question: str,
    documents: tuple[Document, ...],
    sampling: SamplingConfig,
    framing: Framing,
) -> None:
    """400 (before anything runs) for a prompt that does not fit the context with the answer
    (refused before any of it is memoized: `PromptRenderer`; RAGCache's own API refuses it
    rather than clamp the answer, docs/deploy.md)."""
    try:
        tokens = state.renderer.cached_length(question, documents, framing)
        check_fits_context(tokens, sampling.max_tokens, state.settings.config.max_model_len)
    except PromptTooLong as exc:
        raise bad_request(str(exc), "documents") from None
    except InputError as exc:
        param = "sampling.max_tokens" if exc.param == "max_tokens" else "question"
        raise bad_request(str(exc), param) from None


async def _rag_events(chunks: AsyncIterator[StreamChunk]) -> AsyncIterator[str]:
    async with contextlib.aclosing(chunks):  # type: ignore[type-var]
        async for chunk in chunks:
            yield event(_chunk_json(chunk))


def _chunk_json(chunk: StreamChunk) -> dict[str, Any]:
    data: dict[str, Any] = {"delta": chunk.delta}
    if chunk.token_ids:
        data["token_ids"] = list(chunk.token_ids)
    if chunk.logprobs:
        data["logprobs"] = logprobs_to_json(chunk.logprobs)
    if chunk.result is not None:
        data["result"] = result_to_json(chunk.result)
    return data


async def health(request: Request) -> Response:
    """200 while serving; 503 while starting, draining, or while the engine is dead or
    restarting (`{"status": "engine_dead"}`, `"engine_restarting"`): a load balancer then
    sends requests elsewhere, as it would for `vllm serve`'s dead engine."""
    state = state_of(request)
    if state.queue.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    engine = state.cache.engine_state
    if engine != "running":
        return JSONResponse({"status": f"engine_{engine}"}, status_code=503)
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    state = state_of(request)
    text = generate_latest(state.cache.metrics.registry) + generate_latest(state.metrics.registry)
    return Response(text, media_type=CONTENT_TYPE_LATEST)


async def models(request: Request) -> dict[str, Any]:
    state = state_of(request)
    card = {
        "id": state.settings.model_name,
        "object": "model",
        "created": int(state.started_at),
        "owned_by": "ragcache",
        "root": state.settings.model,
        "max_model_len": state.settings.config.max_model_len,
    }
    return {"object": "list", "data": [card]}


def router() -> APIRouter:
    """Every route of the server (a new router per app: nothing is shared between apps)."""
    routes = APIRouter()
    json_body = [Depends(require_json)]
    routes.add_api_route(CHAT, chat_completions, methods=["POST"], dependencies=json_body)
    routes.add_api_route(COMPLETIONS, completions, methods=["POST"], dependencies=json_body)
    routes.add_api_route(QUERY, rag_query, methods=["POST"], dependencies=json_body)
    routes.add_api_route("/v1/rag/config", rag_config, methods=["GET"])
    routes.add_api_route("/v1/cache/stats", cache_stats, methods=["GET"])
    routes.add_api_route(
        "/v1/cache/invalidate", cache_invalidate, methods=["POST"], dependencies=json_body
    )
    routes.add_api_route(
        LOCAL_INVALIDATE, cache_invalidate_local, methods=["POST"], dependencies=json_body
    )
    routes.add_api_route("/v1/cache/integrity", cache_integrity, methods=["GET"])
    routes.add_api_route("/health", health, methods=["GET"])
    routes.add_api_route("/metrics", metrics, methods=["GET"])
    routes.add_api_route("/v1/models", models, methods=["GET"])
    return routes
