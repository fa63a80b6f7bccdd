"""`RAGCacheClient`: `RAGCacheAPI` over HTTP, to a `ragcache serve` process many apps share.

    client = RAGCacheClient("http://127.0.0.1:8000", api_key=...)   # admin_key=... to invalidate
                                                                    # on a server with --admin-key
    client.generate("Who wrote it?", [Document("d1", "...")])   # POST /v1/rag/query + documents
    client.query("Who wrote it?")                               # the server searches --index
    client.query("Who wrote it?", search=my_source)             # searched here, then generate

A `SearchSource` is Python code in this process: it cannot cross HTTP, so with `search=` the
client runs the whole search here and sends the final documents (no speculation across the
wire; `retrieval_s` is the local search, `ttft_s` adds it to the server's TTFT).

As in `RAGCache`, the public calls come from `RAGCacheAPI` (api.py) over two async bodies here
(`_query`, `_answer`) on a private event loop (`LoopThread`, which also owns the HTTP
connection pool): the async API awaits them, the sync API blocks on them, so the sync calls
work inside notebooks. Errors:
400/404 raise `InputError` (the server's message; `param` the field), 429 is retried after
its Retry-After (`busy_retries` times, then `ServerBusy`), anything else `RemoteError`.
Needs only `httpx`.

Behind a router in front of many replicas, each `/v1/rag/query` with documents carries the
document-affinity key of its first document in `X-Session-Id`, re-keyed past a load bound
(client/affinity.py; `affinity=False` sends none).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Sequence
from typing import Any

import httpx

from ragcache_core.api import RAGCacheAPI
from ragcache_core.app_prompt import NO_FRAMING, Framing
from ragcache_core.client.affinity import (
    AFFINITY_HEADER,
    REPLICA_HEADER,
    AffinityKeys,
    affinity_key,
)
from ragcache_core.client.wire import (
    config_from_json,
    document_to_json,
    logprobs_from_json,
    result_from_json,
    sampling_to_json,
)
from ragcache_core.config import CacheConfig, SamplingConfig
from ragcache_core.documents import Document, checked_documents
from ragcache_core.errors import InputError, RAGCacheError
from ragcache_core.loop import Emit, LoopThread
from ragcache_core.query_result import QueryResult, StreamChunk
from ragcache_core.search import SearchSource, final_result

QUERY = "/v1/rag/query"


class RemoteError(RAGCacheError):
    """The server answered with an error (`status`, and the field it names, `param`)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(f"{message} (HTTP {status})")
        self.status = status
        self.param = param


class ServerBusy(RemoteError):
    """429: the server's queue is full; try again after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(429, message)
        self.retry_after_s = retry_after_s


class RAGCacheClient(RAGCacheAPI):
    """The same API as `RAGCache`, served by `ragcache serve` at `url` (module docstring).

    The constructor reads the server's configuration (`GET /v1/rag/config`), so a wrong URL
    or key fails here, at once. `admin_key` is the server's `--admin-key`, sent only on the
    admin calls (`invalidate`, `check_integrity`); a server without one lets the API key
    make them. `affinity`: send the document-affinity key (client/affinity.py) with the load
    bound `load_factor`. Close with `close()` or `with`.
    """

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        *,
        admin_key: str | None = None,
        timeout_s: float = 600.0,
        busy_retries: int = 2,
        affinity: bool = True,
        load_factor: float = 1.25,
    ) -> None:
        self.url = url.rstrip("/")
        self.busy_retries = busy_retries
        self.affinity: AffinityKeys | None = AffinityKeys(load_factor) if affinity else None
        self._admin_headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else None
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        timeout = httpx.Timeout(timeout_s, connect=10.0)
        self._http = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=timeout)
        self._loop = LoopThread("ragcache-client", owner="RAGCacheClient")
        try:
            info = self._loop.run(self._request("GET", "/v1/rag/config"))
        except BaseException:
            self.close()
            raise
        self.model: str = str(info["model"])
        self.config: CacheConfig = config_from_json(info["config"])
        self.has_index = bool(info["has_index"])
        self.needs_admin_key = bool(info.get("admin_key", False))
        """Whether the server's admin calls need its admin key (it has `--admin-key`)."""
        if self.affinity is not None:
            self.affinity.replicas = int(info.get("replicas", 1))

    # ------------------------------------------------------------------ RAGCacheAPI

    def stats(self) -> dict[str, Any]:
        """The server's `stats()`, plus its queue under `"serve"`."""
        data: dict[str, Any] = self._loop.run(self._request("GET", "/v1/cache/stats"))
        return data

    def invalidate(self, doc_id: str) -> int:
        """Drop every cached node of `doc_id` on the server; the number dropped. On a server
        with `--admin-key`, this needs `admin_key=` (else `RemoteError` 403, at once)."""
        body = {"doc_id": doc_id}
        headers = self._admin("invalidate")
        data = self._loop.run(self._request("POST", "/v1/cache/invalidate", body, headers))
        return int(data["removed"])

    def check_integrity(self) -> None:
        """The server's knowledge tree checked (`RemoteError` 500 naming a violation); an
        admin call, as `invalidate`."""
        headers = self._admin("check_integrity")
        self._loop.run(self._request("GET", "/v1/cache/integrity", None, headers))

    def _admin(self, call: str) -> dict[str, str] | None:
        """The headers of an admin call (None: the client's own)."""
        if self._admin_headers is None and self.needs_admin_key:
            raise RemoteError(
                403,
                f"{call} is an admin call and this server has an admin key (ragcache serve "
                "--admin-key): pass it as RAGCacheClient(..., admin_key=...)",
            )
        return self._admin_headers

    def close(self) -> None:
        """Close the connections and the private loop. Safe to call twice; every call
        afterwards raises `CacheClosedError`."""
        if self._loop.closed:
            return
        self._loop.stop(self._http.aclose())

    # ------------------------------------------------------------------ bodies (on the loop)

    async def _query(
        self,
        question: str,
        search: SearchSource | None,
        top_k: int | None,
        sampling: SamplingConfig | None,
        emit: Emit | None,
        framing: Framing = NO_FRAMING,
    ) -> QueryResult:
        if search is None:
            return await self._ask(question, None, top_k, sampling, emit, framing)
        if not isinstance(search, SearchSource):
            raise InputError(f"search must be a SearchSource, got {type(search).__name__}")
        started = time.perf_counter()
        final = await asyncio.to_thread(final_result, search, question, top_k or self.config.top_k)
        retrieval_s = time.perf_counter() - started
        result = await self._ask(question, final.documents, None, sampling, emit, framing)
        return dataclasses.replace(
            result, retrieval_s=retrieval_s, ttft_s=result.ttft_s + retrieval_s, scores=final.scores
        )

    async def _answer(
        self,
        question: str,
        documents: Sequence[Document],
        sampling: SamplingConfig | None,
        emit: Emit | None,
        framing: Framing = NO_FRAMING,
    ) -> QueryResult:
        return await self._ask(question, documents, None, sampling, emit, framing)

    async def _ask(
        self,
        question: str,
        documents: Sequence[Document] | None,
        top_k: int | None,
        sampling: SamplingConfig | None,
        emit: Emit | None,
        framing: Framing = NO_FRAMING,
    ) -> QueryResult:
        """`POST /v1/rag/query`, whole or streamed into `emit`."""
        body: dict[str, Any] = {"question": question, "stream": emit is not None}
        if documents is not None:
            body["documents"] = [document_to_json(d) for d in _checked(documents)]
        if top_k is not None:
            body["top_k"] = top_k
        if sampling is not None:
            body["sampling"] = sampling_to_json(sampling)
        if framing.prompt is not None:
            body["prompt"] = framing.prompt.to_json()
        if framing.cache_salt is not None:
            body["cache_salt"] = framing.cache_salt
        if framing.return_prompt:
            body["return_prompt"] = True
        if framing.document_order is not None:
            body["document_order"] = framing.document_order
        key = self._routing_key(documents)
        headers = {AFFINITY_HEADER: key} if key is not None else None
        if emit is None:
            return result_from_json(await self._request("POST", QUERY, body, headers, key))
        return await self._stream(body, emit, headers, key)

    def _routing_key(self, documents: Sequence[Document] | None) -> str | None:
        """The affinity key to send (None: no documents, or affinity off)."""
        base = affinity_key(documents or ())
        if base is None or self.affinity is None:
            return None
        return self.affinity.key_for(base)

    def _observe(self, response: httpx.Response, key: str | None) -> None:
        """Count the replica that answered a query (the load bound's input)."""
        if self.affinity is not None:
            self.affinity.observe(key, response.headers.get(REPLICA_HEADER))

    async def _stream(
        self,
        body: dict[str, Any],
        emit: Emit,
        headers: dict[str, str] | None = None,
        key: str | None = None,
    ) -> QueryResult:
        """A streamed `POST /v1/rag/query`; 429 retried as in `_request`."""
        for attempt in range(self.busy_retries + 1):
            try:
                async with self._http.stream("POST", QUERY, json=body, headers=headers) as response:
                    self._observe(response, key)
                    if response.status_code == 200:
                        return await _read_events(response, emit)
                    await response.aread()
                    error = _response_error(response)
            except httpx.HTTPError as exc:
                raise RAGCacheError(f"cannot reach ragcache serve at {self.url}: {exc}") from exc
            await self._wait_or_raise(error, attempt)
        raise AssertionError("unreachable")

    async def _request(
        self,
        method: str,
        path: str,
        body: Any = None,
        headers: dict[str, str] | None = None,
        key: str | None = None,
    ) -> Any:
        """One JSON request, 429 retried after its Retry-After (`busy_retries` times); a
        query's answer is counted for the load bound (`key`: the affinity key it was sent)."""
        for attempt in range(self.busy_retries + 1):
            try:
                response = await self._http.request(method, path, json=body, headers=headers)
            except httpx.HTTPError as exc:
                raise RAGCacheError(f"cannot reach ragcache serve at {self.url}: {exc}") from exc
            if path == QUERY:
                self._observe(response, key)
            if response.status_code == 200:
                return response.json()
            await self._wait_or_raise(_response_error(response), attempt)
        raise AssertionError("unreachable")

    async def _wait_or_raise(self, error: RAGCacheError, attempt: int) -> None:
        if not isinstance(error, ServerBusy) or attempt >= self.busy_retries:
            raise error
        await asyncio.sleep(error.retry_after_s)


async def _read_events(response: httpx.Response, emit: Emit) -> QueryResult:
    """The deltas of a `/v1/rag/query` stream into `emit`; its final `QueryResult`."""
    result: QueryResult | None = None
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            break
        data = json.loads(line[len("data: ") :])
        if "error" in data:
            raise _error(500, data)
        if data.get("delta"):
            tokens = tuple(int(t) for t in data.get("token_ids") or ())
            emit(StreamChunk(data["delta"], None, tokens, logprobs_from_json(data.get("logprobs"))))
        if "result" in data:
            result = result_from_json(data["result"])
    if result is None:
        raise RAGCacheError("the server's stream ended without a result")
    return result


def _checked(documents: Sequence[Document]) -> Sequence[Document]:
    """The documents checked here, before anything is sent (`checked_documents`)."""
    return checked_documents(documents)


def _response_error(response: httpx.Response) -> RAGCacheError:
    try:
        data = response.json()
    except ValueError:
        data = {"error": {"message": response.text or response.reason_phrase}}
    if response.status_code == 429:
        message = str(data.get("error", {}).get("message", "the server is busy"))
        return ServerBusy(message, float(response.headers.get("retry-after", "1")))
    return _error(response.status_code, data)


def _error(status: int, data: Any) -> RAGCacheError:
    error = data.get("error") if isinstance(data, dict) else None
    if not isinstance(error, dict):
        return RemoteError(status, str(data))
    status = int(error.get("code") or status)
    message, param = str(error.get("message", "")), error.get("param")
    if status in (400, 404):
        return InputError(message, param=param)
    return RemoteError(status, message, param)
