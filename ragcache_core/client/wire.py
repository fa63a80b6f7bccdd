"""RAGCache's typed objects as JSON and back: what `/v1/rag/...` sends and `RAGCacheClient`
reads. Pure functions (no HTTP, no FastAPI), so the client needs only `httpx`.

    Document      {"id", "text", "metadata", "prompt_text" (only when set)}
    AppPrompt     `AppPrompt.to_json` (app_prompt.py)
    QueryResult   {"answer", "token_ids", "sources" (as served), "retrieval_ranks", "scores",
                   "ttft_s", "retrieval_s",
                   "queue_wait_s", "cache_hits", "prompt_tokens", "finish_reason",
                   "speculative", "retries", "timings", "logprobs", "prompt_text" (only
                   when asked for: `return_prompt`)}
    SamplingConfig every field by name (logit_bias keys as strings; structured_outputs and
                   repetition_detection as objects)
    CacheConfig   dataclasses.asdict, tuples as lists
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ragcache_core.config import (
    CacheConfig,
    PromptConfig,
    RepetitionDetection,
    SamplingConfig,
    StructuredOutputs,
)
from ragcache_core.documents import Document, DocumentTemplate
from ragcache_core.errors import InputError
from ragcache_core.query_result import CacheHits, Candidate, QueryResult, TokenLogprobs


def jsonable(value: Any) -> Any:
    """`value` with tuples as lists and anything JSON cannot hold as its `str`."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return str(value)


def document_to_json(doc: Document) -> dict[str, Any]:
    data = {"id": doc.id, "text": doc.text, "metadata": jsonable(dict(doc.metadata))}
    if doc.prompt_text is not None:
        data["prompt_text"] = doc.prompt_text
    return data


def document_from_json(data: Mapping[str, Any]) -> Document:
    shown = data.get("prompt_text")
    return Document(
        str(data["id"]),
        str(data["text"]),
        dict(data.get("metadata") or {}),
        prompt_text=None if shown is None else str(shown),
    )


def result_to_json(result: QueryResult) -> dict[str, Any]:
    return {
        "answer": result.answer,
        "token_ids": list(result.token_ids),
        "sources": [document_to_json(d) for d in result.sources],
        "scores": list(result.scores),
        "retrieval_ranks": list(result.retrieval_ranks),
        "ttft_s": result.ttft_s,
        "retrieval_s": result.retrieval_s,
        "queue_wait_s": result.queue_wait_s,
        "cache_hits": dataclasses.asdict(result.hits),
        "prompt_tokens": result.prompt_tokens,
        "finish_reason": result.finish_reason,
        "speculative": result.speculative,
        "retries": result.retries,
        "timings": dict(result.timings),
        "logprobs": logprobs_to_json(result.logprobs),
        **({} if result.prompt_text is None else {"prompt_text": result.prompt_text}),
    }


def result_from_json(data: Mapping[str, Any]) -> QueryResult:
    return QueryResult(
        answer=str(data["answer"]),
        token_ids=tuple(int(t) for t in data["token_ids"]),
        sources=tuple(document_from_json(d) for d in data["sources"]),
        ttft_s=float(data["ttft_s"]),
        retrieval_s=float(data["retrieval_s"]),
        queue_wait_s=float(data["queue_wait_s"]),
        hits=CacheHits(**data["cache_hits"]),
        prompt_tokens=int(data["prompt_tokens"]),
        finish_reason=data.get("finish_reason"),
        speculative=bool(data.get("speculative", False)),
        retries=int(data.get("retries", 0)),
        scores=tuple(float(s) for s in data.get("scores", ())),
        retrieval_ranks=tuple(int(r) for r in data.get("retrieval_ranks", ())),
        timings={str(k): float(v) for k, v in (data.get("timings") or {}).items()},
        logprobs=logprobs_from_json(data.get("logprobs")),
        prompt_text=None if data.get("prompt_text") is None else str(data["prompt_text"]),
    )


def sampling_to_json(sampling: SamplingConfig) -> dict[str, Any]:
    """Every field of `SamplingConfig` (what `/v1/rag/query`'s `sampling` takes)."""
    data: dict[str, Any] = {}
    for f in dataclasses.fields(SamplingConfig):
        value = getattr(sampling, f.name)
        if f.name == "logit_bias" and value is not None:
            value = {str(k): v for k, v in value.items()}
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = {k: jsonable(v) for k, v in dataclasses.asdict(value).items()}
        data[f.name] = jsonable(value)
    return data


def sampling_from_json(data: Mapping[str, Any]) -> SamplingConfig:
    """`sampling_to_json`'s inverse (fields left out take `SamplingConfig`'s defaults);
    `SamplingError` naming a field out of range."""
    fields = dict(data)
    for name in ("stop", "stop_token_ids", "bad_words"):
        if name in fields:
            fields[name] = tuple(fields[name] or ())
    for name in ("allowed_token_ids", "logprob_token_ids"):
        if fields.get(name) is not None:
            fields[name] = tuple(fields[name])
    structured = fields.get("structured_outputs")
    if isinstance(structured, Mapping):
        fields["structured_outputs"] = StructuredOutputs(**structured)
    repetition = fields.get("repetition_detection")
    if isinstance(repetition, Mapping):
        fields["repetition_detection"] = RepetitionDetection(**repetition)
    return SamplingConfig(**fields)


def logprobs_to_json(logprobs: tuple[TokenLogprobs, ...]) -> list[dict[str, Any]]:
    return [
        {
            "token_id": t.token_id,
            "logprob": t.logprob,
            "text": t.text,
            "candidates": [[c.token_id, c.logprob, c.rank, c.text] for c in t.candidates],
        }
        for t in logprobs
    ]


def logprobs_from_json(data: Any) -> tuple[TokenLogprobs, ...]:
    return tuple(
        TokenLogprobs(
            token_id=int(t["token_id"]),
            logprob=None if t["logprob"] is None else float(t["logprob"]),
            text=t["text"],
            candidates=tuple(
                Candidate(int(c[0]), float(c[1]), None if c[2] is None else int(c[2]), c[3])
                for c in t["candidates"]
            ),
        )
        for t in data or ()
    )


def config_to_json(config: CacheConfig) -> dict[str, Any]:
    data: dict[str, Any] = jsonable(dataclasses.asdict(config))
    return data


def config_from_json(data: Mapping[str, Any]) -> CacheConfig:
    """The server's `CacheConfig` (what an integration reads: prompt, sampling, top-k)."""
    try:
        prompt = dict(data["prompt"])
        prompt["document"] = DocumentTemplate(**prompt["document"])
        fields = {f.name for f in dataclasses.fields(CacheConfig)}
        # A key this client does not know (a newer server's, or a removed one) is ignored.
        skip = ("prompt", "sampling")
        rest = {k: v for k, v in data.items() if k in fields and k not in skip}
        return CacheConfig(
            **rest,
            prompt=PromptConfig(**prompt),
            sampling=sampling_from_json(data["sampling"]),
        )
    except (KeyError, TypeError) as exc:
        raise InputError(f"the server sent a configuration this client cannot read: {exc}") from exc
