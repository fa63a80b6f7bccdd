"""Issue 20's findings that need HTTP but no engine: the real app under real uvicorn over
`HeldCache` (test_serve_http.py), so every answer is provably the server's own doing.

- every non-2xx response has the one error shape `{"error": {message, type, param, code}}`
  (parse errors, deep nesting, invalid UTF-8, a wrong content type, 404, 405, 413, 422), with
  `param` naming the field, and is counted in `ragcache_serve_requests{route, status}`;
- input vLLM would refuse is a 400 before anything runs, streamed or not (lone surrogates, an
  empty stop string, a seed out of range, non-finite or out-of-range sampling values);
- refused fields are 400s naming them, and pass at their defaults (what routers send);
- the model may be named by its served name or its path; /v1/models lists the served name.

The engine-backed parity (each field changes the tokens, equals vLLM's engine) is in
test_serve_parity.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _serve_helpers import held_socket, serve_in_thread
from fastapi import FastAPI
from starlette.exceptions import HTTPException
from test_serve_http import HeldCache

from ragcache_core.serve.app import create_app
from ragcache_core.serve.errors import CountedResponses, install_handlers
from ragcache_core.serve.state import ServeSettings

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
QUERY = "/v1/rag/query"
KEY = {"Authorization": "Bearer k"}
USER = [{"role": "user", "content": "Where is it?"}]
DOCS = [{"id": "d1", "text": "The tower is in Paris."}]


@pytest.fixture(scope="module")
def shared(tiny_model: Path) -> Iterator[tuple[str, HeldCache, Any]]:
    """One app for the module (its answers released at once: a request that passes gets its
    200), under real uvicorn in a thread."""
    cache = HeldCache(tiny_model)
    cache.release.set()
    with held_socket() as sock:
        port = sock.getsockname()[1]
        settings = ServeSettings(model=str(tiny_model), port=port, max_waiting=8, api_key="k")
        app = create_app(settings, cache_factory=lambda s: cache)
        with serve_in_thread(app, sock) as url:
            yield url, cache, app


@pytest.fixture
def server(shared: tuple[str, HeldCache, Any]) -> tuple[str, HeldCache, Any]:
    """The shared app (each test compares `cache.started` before and after)."""
    return shared


def _send(url: str, method: str, route: str, body: Any, **headers: str) -> httpx.Response:
    """`body`: JSON (dict), raw bytes, or None."""
    sent = {**KEY, **headers}
    if isinstance(body, bytes):
        sent.setdefault("content-type", "application/json")
        return httpx.request(method, url + route, content=body, headers=sent, timeout=60)
    if body is None:
        return httpx.request(method, url + route, headers=sent, timeout=60)
    return httpx.request(method, url + route, json=body, headers=sent, timeout=60)


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    data = response.json()
    assert set(data) == {"error"}, data
    error: dict[str, Any] = data["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == status and error["message"], error
    return error


NESTED = ("[" * 10_000 + "]" * 10_000).encode()
SHAPES = [
    # (method, route, body, headers, status, param, words)
    ("POST", CHAT, b"{not json", {}, 400, "body", "JSON"),
    ("POST", CHAT, b'{"messages": ' + NESTED + b"}", {}, 400, "body", "not valid JSON"),
    ("POST", CHAT, b'{"messages": "\xff\xfe"}', {}, 400, "body", "not valid JSON"),
    ("POST", CHAT, {"messages": USER}, {"content-type": "text/plain"}, 400, None, "json"),
    (
        "POST",
        CHAT,
        b'{"messages": []}',
        {"content-type": "application/x-www-form-urlencoded"},
        400,
        None,
        "application/json",
    ),
    ("GET", "/v1/nowhere", None, {}, 404, None, "/v1/nowhere"),
    ("GET", CHAT, None, {}, 405, None, "GET"),
    ("POST", CHAT, {"messages": USER}, {"Authorization": "Bearer wrong"}, 401, None, "key"),
]


@pytest.mark.parametrize(("method", "route", "body", "headers", "status", "param", "words"), SHAPES)
def test_every_error_has_the_one_shape(
    server: tuple[str, HeldCache, Any],
    method: str,
    route: str,
    body: Any,
    headers: dict[str, str],
    status: int,
    param: str | None,
    words: str,
) -> None:
    """Finding 3: parse errors, deep nesting, invalid UTF-8, a wrong content type, 404 and
    405 came back as `{"detail": ...}` (vllm serve itself answers those so)."""
    url, cache, _ = server
    before = cache.started
    response = _send(url, method, route, body, **headers)
    error = _error(response, status)
    assert error["param"] == param and words.lower() in error["message"].lower(), error
    if status == 405:
        assert "POST" in response.headers["allow"]
    assert cache.started == before


def test_413_and_422_have_the_shape_too() -> None:
    """The body-size limit (413) and any 422 leave in the same shape: Starlette's HTTP
    errors, however raised, go through the one handler."""
    from fastapi.testclient import TestClient

    app = FastAPI()
    install_handlers(app)
    app.add_middleware(CountedResponses)

    @app.post("/big")
    async def big() -> None:
        raise HTTPException(413, "the body is larger than 1024 bytes")

    @app.post("/odd")
    async def odd() -> None:
        raise HTTPException(422, "cannot process")

    with TestClient(app) as client:
        too_big = _error(client.post("/big"), 413)
        assert too_big["type"] == "RequestTooLargeError" and "1024" in too_big["message"]
        assert _error(client.post("/odd"), 422)["type"] == "UnprocessableEntityError"


def _chat(**fields: Any) -> dict[str, Any]:
    return {"messages": USER, "max_tokens": 4, **fields}


BAD_INPUT = [
    # (route, body, param, words): input vLLM would refuse (or that no tokenizer takes)
    (
        CHAT,
        {"messages": [{"role": "user", "content": "a\ud800b"}]},
        "messages.0.content",
        "lone surrogate (U+D800) at character 1",
    ),
    (CHAT, _chat(documents=[{"id": "d1", "text": "x\udfffy"}]), "documents.0.text", "surrogate"),
    (CHAT, _chat(documents=[{"title": "t", "text": "\ud800"}]), "documents.0.text", "surrogate"),
    (COMPLETIONS, {"prompt": "\ud800"}, "prompt", "surrogate"),
    (QUERY, {"question": "\ud800", "documents": DOCS}, "question", "surrogate"),
    (CHAT, _chat(stop=[""]), "stop", "stop cannot contain an empty string"),
    (CHAT, _chat(stop=["a", "b", "c", "d", "e"]), "stop", "at most 4"),
    (CHAT, _chat(seed=18446744073709551616), "seed", "less than or equal"),
    (COMPLETIONS, {"prompt": "x", "seed": -(2**63) - 1}, "seed", "greater than or equal"),
    (CHAT, _chat(temperature=1e308), "temperature", "[0, 2]"),
    (CHAT, _chat(top_p=0), "top_p", "(0, 1]"),
    (CHAT, _chat(top_k=-2), "top_k", "top_k"),
    (CHAT, _chat(min_p=1.5), "min_p", "[0, 1]"),
    (CHAT, _chat(presence_penalty=3), "presence_penalty", "[-2, 2]"),
    (CHAT, _chat(frequency_penalty=-3), "frequency_penalty", "[-2, 2]"),
    (CHAT, _chat(repetition_penalty=0), "repetition_penalty", "greater than zero"),
    (CHAT, _chat(min_tokens=10), "min_tokens", "max_tokens=4"),
    (CHAT, _chat(logit_bias={"x": 1}), "logit_bias", "integer token IDs"),
    (CHAT, _chat(bad_words=[""]), "bad_words", "empty string"),
    (CHAT, _chat(top_logprobs=2), "top_logprobs", "`logprobs` must be set to true"),
    (CHAT, _chat(logprobs=True, top_logprobs=-2), "top_logprobs", "positive value or -1"),
    (COMPLETIONS, {"prompt": "x", "logprobs": -2}, "logprobs", "positive value or -1"),
    (CHAT, _chat(stream_options={"include_usage": True}), "stream_options", "stream=True"),
    (CHAT, _chat(response_format={"type": "json_schema"}), "response_format", "json_schema"),
    (
        CHAT,
        _chat(structured_outputs={"regex": "a", "choice": ["b"]}),
        "structured_outputs",
        "exactly one",
    ),
    (CHAT, _chat(n=2), "n", "n=1"),
    (CHAT, _chat(max_tokens=5000), "max_tokens", "cannot be greater than max_model_len=4096"),
    (CHAT, _chat(max_completion_tokens=5000), "max_completion_tokens", "cannot be greater"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 4097}, "max_tokens", "cannot be greater"),
    (
        QUERY,
        {"question": "q", "documents": DOCS, "sampling": {"temperature": 1e308}},
        "sampling.temperature",
        "[0, 2]",
    ),
    (
        QUERY,
        {"question": "q", "documents": DOCS, "sampling": {"temperature": float("nan")}},
        "sampling.temperature",
        "finite",
    ),
    (
        QUERY,
        {"question": "q", "documents": DOCS, "sampling": {"stop": [""]}},
        "sampling.stop",
        "empty string",
    ),
    (
        QUERY,
        {"question": "q", "documents": DOCS, "sampling": {"max_tokens": 10**9}},
        "sampling.max_tokens",
        "max_tokens=1000000000 cannot be greater than max_model_len=4096",
    ),
    (QUERY, {"question": "q", "documents": DOCS, "top_k": 2}, "top_k", "with documents"),
    (
        CHAT,
        _chat(documents=[{"id": "a", "text": "t"}, {"text": "u"}]),
        "documents.1.id",
        "required",
    ),
    (COMPLETIONS, {"prompt": "q", "documents": [{"text": "u"}]}, "documents.0.id", "required"),
    (COMPLETIONS, {"prompt": [[1, 2], [3]]}, "prompt", "one prompt"),
]


def _json(body: Any) -> bytes:
    return json.dumps(body).encode()  # NaN as JSON's NaN literal, as Python clients send it


@pytest.mark.parametrize(("route", "body", "param", "words"), BAD_INPUT)
@pytest.mark.parametrize("stream", [False, True])
def test_input_vllm_refuses_is_a_400_before_anything_runs(
    server: tuple[str, HeldCache, Any],
    route: str,
    body: dict[str, Any],
    param: str,
    words: str,
    stream: bool,
) -> None:
    """Finding 2: these were 500s (with stream, a 200 and then an error event); the
    surrogates a plain-text 500 that was not counted."""
    url, cache, _ = server
    before = cache.started
    if stream and "stream_options" not in body:
        body = {**body, "stream": True}
    error = _error(_send(url, "POST", route, _json(body)), 400)
    assert error["param"] == param and words in error["message"], error
    assert cache.started == before  # nothing reached the cache


ROUTER_DEFAULTS: dict[str, Any] = {
    # Every refused or ignored field at the value routers such as vllm-router send.
    "n": None,
    "stream": None,
    "top_logprobs": None,
    "logprobs": False,
    "tools": None,
    "tool_choice": "none",
    "reasoning_effort": None,
    "thinking_token_budget": None,
    "include_reasoning": True,
    "parallel_tool_calls": True,
    "user": "someone",
    "use_beam_search": False,
    "truncate_prompt_tokens": None,
    "truncation_side": None,
    "prompt_logprobs": None,
    "echo": False,
    "add_generation_prompt": True,
    "continue_final_message": False,
    "add_special_tokens": False,
    "chat_template": None,
    "chat_template_kwargs": None,
    "media_io_kwargs": None,
    "mm_processor_kwargs": None,
    "priority": 0,
    "routed_experts_prompt_start": 0,
    "return_prompt_text": None,
    "cache_salt": None,
    "kv_transfer_params": None,
    "ec_transfer_params": None,
    "vllm_xargs": None,
    "watermarking": None,
    "length_penalty": 1.0,
    "session_id": None,
    "return_token_offsets": False,
    "mm_payload": "tensors",
    "return_mm_kwargs": None,
    "guided_json": None,
    "stop": [],
    "bad_words": [],
    "stop_token_ids": [],
}
COMPLETION_DEFAULTS = {
    **{k: v for k, v in ROUTER_DEFAULTS.items() if k in ("n", "stream", "user", "echo")},
    "logprobs": None,
    "suffix": None,
    "prompt_embeds": None,
    "add_special_tokens": True,
    "priority": 0,
    "kv_transfer_params": None,
    "cache_salt": None,
}


def test_refused_fields_at_their_defaults_pass(server: tuple[str, HeldCache, Any]) -> None:
    url, cache, _ = server
    before = cache.started
    chat = _send(url, "POST", CHAT, _chat(**ROUTER_DEFAULTS, documents=DOCS))
    assert chat.status_code == 200, chat.text
    completion = {"prompt": "x", "max_tokens": 2, **COMPLETION_DEFAULTS}
    assert _send(url, "POST", COMPLETIONS, completion).status_code == 200
    assert cache.started == before + 2


REFUSED = [
    (CHAT, "kv_transfer_params", {}),
    (CHAT, "kv_transfer_params", {"ragcache_plan": {"load": []}}),
    (CHAT, "ec_transfer_params", {"x": 1}),
    (CHAT, "vllm_xargs", {"kv_cache_report_mode": 1}),
    (COMPLETIONS, "kv_transfer_params", {"ragcache_plan": {}}),
    (COMPLETIONS, "vllm_xargs", {}),
    (CHAT, "tools", [{"type": "function", "function": {"name": "f"}}]),
    (CHAT, "tools", []),
    (CHAT, "tool_choice", "auto"),
    (CHAT, "use_beam_search", True),
    (CHAT, "prompt_logprobs", 1),
    (CHAT, "echo", True),
    (COMPLETIONS, "echo", True),
    (COMPLETIONS, "suffix", "x"),
    (COMPLETIONS, "prompt_embeds", "AAAA"),
    (COMPLETIONS, "add_special_tokens", False),
    (CHAT, "add_special_tokens", True),
    (CHAT, "add_generation_prompt", False),
    (CHAT, "continue_final_message", True),
    (CHAT, "chat_template", "{{ messages }}"),
    (CHAT, "chat_template_kwargs", {"enable_thinking": True}),
    (CHAT, "priority", 1),
    (CHAT, "truncate_prompt_tokens", 8),
    (CHAT, "thinking_token_budget", 10),
    (CHAT, "reasoning_effort", "low"),
    (CHAT, "routed_experts_prompt_start", 2),
    (CHAT, "return_prompt_text", True),
    (CHAT, "mm_processor_kwargs", {"a": 1}),
    (CHAT, "guided_json", {"type": "object"}),
    (COMPLETIONS, "guided_regex", "a+"),
]


@pytest.mark.parametrize(("route", "field", "value"), REFUSED)
def test_refused_fields_are_400s_naming_them(
    server: tuple[str, HeldCache, Any], route: str, field: str, value: Any
) -> None:
    url, cache, _ = server
    before = cache.started
    base = _chat() if route == CHAT else {"prompt": "x", "max_tokens": 2}
    error = _error(_send(url, "POST", route, {**base, field: value}), 400)
    assert error["param"] == field and field in error["message"], error
    assert cache.started == before


def test_the_model_by_its_served_name_or_its_path(server: tuple[str, HeldCache, Any]) -> None:
    url, _, app = server
    settings = app.state.serve.settings
    listed = httpx.get(f"{url}/v1/models", headers=KEY).json()["data"]
    assert [m["id"] for m in listed] == [Path(settings.model).name]  # the folder's name
    for name in (Path(settings.model).name, settings.model, "", None):
        assert _send(url, "POST", COMPLETIONS, {"prompt": "x", "model": name}).status_code == 200
    missing = _error(_send(url, "POST", COMPLETIONS, {"prompt": "x", "model": "gpt-4"}), 404)
    assert missing["param"] == "model" and "gpt-4" in missing["message"]


def _counts(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("ragcache_serve_requests_total")
    }


def test_every_response_is_counted(server: tuple[str, HeldCache, Any]) -> None:
    """Finding 2 and 3: 4xx answered before the queue (and 500s outside the routes) were
    missing from ragcache_serve_requests."""
    url, _, _ = server
    before = _counts(url)
    _send(url, "POST", CHAT, b"{not json")
    _send(url, "POST", CHAT, _json({"messages": [{"role": "user", "content": "\ud800"}]}))
    _send(url, "GET", "/v1/nowhere", None)
    _send(url, "GET", CHAT, None)
    _send(url, "POST", CHAT, {"messages": USER}, Authorization="Bearer wrong")
    _send(url, "POST", COMPLETIONS, {"prompt": "x", "max_tokens": 2})
    _send(url, "POST", COMPLETIONS, {"prompt": "x", "stream": True, "stop": [""]})
    after = _counts(url)

    def count(route: str, status: int) -> float:
        name = f'ragcache_serve_requests_total{{route="{route}",status="{status}"}}'
        return after.get(name, 0) - before.get(name, 0)

    assert count(CHAT, 400) == 2 and count(CHAT, 405) == 1 and count(CHAT, 401) == 1
    assert count("unmatched", 404) == 1
    assert count(COMPLETIONS, 200) == 1 and count(COMPLETIONS, 400) == 1
