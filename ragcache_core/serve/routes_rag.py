"""RAGCache's own routes (what `RAGCacheClient` calls):

    POST /v1/rag/query         question (+ documents) in; answer, sources, hits, TTFT out
                               (`QueryResult` as JSON, wire.py); streamed: {"delta": ...}
                               events, the last with "result"
    GET  /v1/rag/config        the served model's name and its `CacheConfig`
    GET  /v1/cache/stats       `RAGCache.stats()` plus the server's queue
    POST /v1/cache/invalidate  {"doc_id": ...} -> {"doc_id", "removed"}
    GET  /v1/cache/integrity   the knowledge tree's invariants checked (500 naming a violation)

Every route but `/v1/rag/query` is cheap and answers at once (no queue place needed).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from ragcache_core.config import SamplingConfig
from ragcache_core.documents import Document
from ragcache_core.errors import InputError, check_fits_context
from ragcache_core.results import QueryResult, StreamChunk
from ragcache_core.serve import respond
from ragcache_core.serve.errors import ServeError, bad_request
from ragcache_core.serve.schemas import InvalidateRequest, RagQueryRequest
from ragcache_core.serve.state import ServeState, state_of
from ragcache_core.serve.streams import event, final_result
from ragcache_core.serve.wire import config_to_json, result_to_json
from ragcache_core.tree import IntegrityError

QUERY = "/v1/rag/query"


async def rag_query(body: RagQueryRequest, request: Request) -> Response:
    state = state_of(request)
    cache = state.cache
    if not body.question.strip():
        raise bad_request("the question is empty", "question")
    documents = None if body.documents is None else tuple(d.to_document() for d in body.documents)
    if documents is None and not state.has_index:
        raise bad_request("this server has no --index: send the documents", "documents")
    sampling = body.sampling.over(cache.config.sampling) if body.sampling else None
    place = state.enter(QUERY)  # a full server refuses before any work
    if documents is not None:
        given = documents
        try:
            await state.render(
                lambda: _check_length(
                    state, body.question, given, sampling or cache.config.sampling
                )
            )
        except BaseException:
            place.release()
            raise
    chunks = cache.astream(body.question, documents=documents, top_k=body.top_k, sampling=sampling)
    if body.stream:
        return respond.streamed(state, QUERY, place, _events(chunks), "question")
    return await respond.whole(
        state, request, QUERY, place, final_result(chunks), result_to_json, "question"
    )


async def rag_config(request: Request) -> dict[str, Any]:
    state = state_of(request)
    return {
        "model": state.settings.model_name,
        "has_index": state.has_index,
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


async def cache_invalidate(body: InvalidateRequest, request: Request) -> dict[str, Any]:
    state = state_of(request)
    removed = await asyncio.to_thread(state.cache.invalidate, body.doc_id)
    return {"doc_id": body.doc_id, "removed": removed}


async def cache_integrity(request: Request) -> Response:
    state = state_of(request)
    try:
        await asyncio.to_thread(state.cache.check_integrity)
    except IntegrityError as exc:
        raise ServeError(500, f"integrity check failed: {exc}") from exc
    return JSONResponse({"ok": True})


def _check_length(
    state: ServeState, question: str, documents: tuple[Document, ...], sampling: SamplingConfig
) -> None:
    """400 (before anything runs) for a prompt that does not fit the context with the answer."""
    try:
        tokens = state.renderer.cached_length(question, documents)
    except InputError as exc:
        raise bad_request(str(exc), "question") from None
    try:
        check_fits_context(tokens, sampling.max_tokens, state.settings.config.max_model_len)
    except InputError as exc:
        raise bad_request(str(exc), "documents") from None


async def _events(chunks: AsyncIterator[StreamChunk]) -> AsyncIterator[str]:
    async with contextlib.aclosing(chunks):  # type: ignore[type-var]
        async for chunk in chunks:
            yield event(_chunk_json(chunk.delta, chunk.result))


def _chunk_json(delta: str, result: QueryResult | None) -> dict[str, Any]:
    data: dict[str, Any] = {"delta": delta}
    if result is not None:
        data["result"] = result_to_json(result)
    return data


def router() -> APIRouter:
    """This module's routes (a new router per app: nothing is shared between apps)."""
    routes = APIRouter()
    routes.add_api_route(QUERY, rag_query, methods=["POST"])
    routes.add_api_route("/v1/rag/config", rag_config, methods=["GET"])
    routes.add_api_route("/v1/cache/stats", cache_stats, methods=["GET"])
    routes.add_api_route("/v1/cache/invalidate", cache_invalidate, methods=["POST"])
    routes.add_api_route("/v1/cache/integrity", cache_integrity, methods=["GET"])
    return routes
