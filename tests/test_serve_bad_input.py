"""Bad input on the real server (`_serve_session`, shared with test_serve.py): each gets its
status and names the field, harms nothing cached or in flight; and what it costs the server:
bodies over the limit, headers that never end, huge documents beside a small request.
"""

from __future__ import annotations

import json
import random
import socket
import string
import threading
import time
from typing import Any

import httpx
import openai
import pytest
from _serve_helpers import ServerProcess, sse_data
from _serve_session import (
    CASES,
    _chat,
    _docs_json,
)

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("idle_after")]


# ---------------------------------------------------------------------- bad input


def _ids(name: str) -> list[dict[str, Any]]:
    return _docs_json(CASES[name][1])


BAD = [
    # (route, body or raw text, status, param, words in the message)
    ("/v1/chat/completions", "{not json", 400, "body", "JSON"),
    ("/v1/chat/completions", {}, 400, "messages", "required"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "at least 1"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages.0.role",
        "",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "q"}], "documents": "d1"},
        400,
        "documents",
        "list",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "q"}], "documents": [{"id": "d1"}]},
        400,
        "documents.0.text",
        "required",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "q"}], "documents": [{"id": "", "text": "t"}]},
        400,
        "documents.0.id",
        "at least 1",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "q"}], "documents": [{"id": 7, "text": "t"}]},
        400,
        "documents.0.id",
        "string",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "q"}],
            "documents": [{"id": "a", "txt": "t", "text": "t"}],
        },
        400,
        "documents.0.txt",
        "Extra",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "q"}],
            "documents": [{"id": "a", "text": "word " * 5000}],
        },
        400,
        "messages",
        "maximum context length",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "q"}],
            "documents": [{"id": "a", "text": "t"}],
            "max_tokens": 5000,
        },
        400,
        "max_tokens",
        "cannot be greater than max_model_len=4096",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
            "documents": [{"id": "a", "text": "t"}],
        },
        400,
        "messages",
        "the last message",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages.0.content",
        "text",
    ),
    (
        "/v1/chat/completions",
        {"model": "gpt-4", "messages": [{"role": "user", "content": "q"}]},
        404,
        "model",
        "does not exist",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "q"}], "n": 2},
        400,
        "n",
        "n=1",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "q"}], "temperature": -1},
        400,
        "temperature",
        "",
    ),
    (
        "/v1/completions",
        {"prompt": "x" * 30000, "max_tokens": 4},
        400,
        "prompt",
        "maximum context length",
    ),
    ("/v1/completions", {"prompt": [1, 2, 99999]}, 400, "prompt", "vocabulary"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt", "one prompt"),
    (
        "/v1/completions",
        {"prompt": [1, 2], "documents": [{"id": "a", "text": "t"}]},
        400,
        "prompt",
        "question",
    ),
    ("/v1/rag/query", {"question": "  "}, 400, "question", "empty"),
    ("/v1/rag/query", {"question": "q", "top_k": 0}, 400, "top_k", ""),
    ("/v1/rag/query", {"question": "q", "top_k": 1000}, 400, "top_k", "larger than the index"),
    (
        "/v1/rag/query",
        {"question": "q", "sampling": {"max_tokens": 10**9}},
        400,
        "sampling.max_tokens",
        "max_tokens=1000000000 cannot be greater than max_model_len=4096",
    ),
    (
        "/v1/rag/query",
        {"question": "q", "sampling": {"max_tokens": 0}},
        400,
        "sampling.max_tokens",
        "",
    ),
    (
        "/v1/rag/query",
        {"question": "q", "documents": [{"id": "a", "text": "word " * 5000}]},
        400,
        "documents",
        "fit",
    ),
    ("/v1/rag/query", {"question": "q", "colour": "red"}, 400, "colour", "Extra"),
    ("/v1/cache/invalidate", {}, 400, "doc_id", "required"),
]


def _post(http: httpx.Client, route: str, body: Any) -> httpx.Response:
    if isinstance(body, str):  # a raw (malformed) body
        return http.post(route, content=body, headers={"content-type": "application/json"})
    return http.post(route, json=body)


@pytest.mark.parametrize(("route", "body", "status", "param", "words"), BAD)
def test_bad_input_gets_its_status_and_names_the_field(
    server: ServerProcess, route: str, body: Any, status: int, param: str, words: str
) -> None:
    with server.admin_client() as http:  # (the admin key opens every route)
        response = _post(http, route, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["param"] == param, error
    assert words in error["message"], error


def test_bad_input_harms_nothing_cached_or_in_flight(
    server: ServerProcess, oai: openai.OpenAI, references: dict[str, Any]
) -> None:
    _chat(oai, "harmless")  # cached now
    question, docs = CASES["harmless"]
    body = {
        "messages": [{"role": "user", "content": question}],
        "documents": _docs_json(docs),
        "max_tokens": 400,
        "temperature": 0,
        "return_token_ids": True,
        "stream": True,
    }
    events: list[Any] = []

    def long_stream() -> None:
        with server.client() as http, http.stream("POST", "/v1/chat/completions", json=body) as r:
            events.extend(sse_data(r.iter_lines()))

    worker = threading.Thread(target=long_stream)
    worker.start()
    with server.admin_client() as http:
        for route, bad, status, _, _ in BAD:
            assert _post(http, route, bad).status_code == status
    worker.join(120)
    ids = [t for e in events if e.get("choices") for t in e["choices"][0].get("token_ids") or ()]
    assert tuple(ids[:8]) == references["harmless"]
    assert len(ids) == 400
    again = _chat(oai, "harmless")
    assert again["ragcache"]["cache_hits"]["gpu_docs"] == 2  # still cached
    assert tuple(again["choices"][0]["token_ids"]) == references["harmless"]


# ---------------------------------------------------------------------- what bad input costs


def test_a_body_over_the_limit_is_413_before_it_is_read(server: ServerProcess) -> None:
    """--max-body-mib 1: a larger body is refused with 413 naming the limit, declared
    (Content-Length) or sent in parts (chunked); the server serves on."""
    text = "word " * (300 * 1024)  # 1.5 MiB
    body = {
        "messages": [{"role": "user", "content": "q"}],
        "documents": [{"id": "x", "text": text}],
    }
    with server.client() as http:
        declared = http.post("/v1/chat/completions", json=body)
        assert declared.status_code == 413, declared.text[:300]
        error = declared.json()["error"]
        assert str(2**20) in error["message"] and "--max-body-mib" in error["message"]
        payload = json.dumps(body).encode()
        parts = (payload[i : i + 65536] for i in range(0, len(payload), 65536))
        chunked = http.post(
            "/v1/chat/completions", content=parts, headers={"content-type": "application/json"}
        )
        assert chunked.status_code == 413, chunked.text[:300]
    assert _chat_status(server) == 200


def _chat_status(server: ServerProcess) -> int:
    body = {"prompt": "hello", "max_tokens": 1}
    with server.client() as http:
        return http.post("/v1/completions", json=body).status_code


def test_partial_headers_are_cut_off_at_the_header_timeout(server: ServerProcess) -> None:
    """--header-timeout 2: connections that never finish their headers are answered 408 and
    closed (they used to stay open as long as the client liked)."""
    sockets = []
    for _ in range(20):
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
        sockets.append(sock)
    idle = socket.create_connection(("127.0.0.1", server.port), timeout=30)  # sends nothing
    for sock in [*sockets, idle]:
        with sock:
            answer = b""
            while chunk := sock.recv(4096):  # the server closes: recv returns b""
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
    assert _chat_status(server) == 200


def test_a_huge_document_does_not_hold_up_a_small_request(server: ServerProcess) -> None:
    """Head-of-line blocking, by order: many large documents (each as long as the context can
    hold, tokenized and then refused) are in the server when a small request arrives; the
    small one completes before the large ones are all answered. (One renderer thread served
    them in arrival order.)"""
    count = 40
    alphabet = string.ascii_letters + string.digits + " .,"
    finished: list[str] = []
    refused: list[bool] = []
    lock = threading.Lock()

    def large(i: int) -> None:
        rng = random.Random(i)  # a distinct document each: nothing is memoized twice
        text = "".join(rng.choices(alphabet, k=44000))  # ~0.08 s to tokenize, ~42k tokens
        body = {
            "messages": [{"role": "user", "content": "q"}],
            "documents": [{"id": f"huge-{i}", "text": text}],
            "max_tokens": 1,
        }
        with server.client() as http:
            response = http.post("/v1/chat/completions", json=body)
        with lock:
            finished.append("large")
            refused.append(response.status_code == 400 and "context length" in response.text)

    threads = [threading.Thread(target=large, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while server.stats()["serve"]["in_flight"] < count // 2:  # they are in the server
        assert time.monotonic() < deadline and any(t.is_alive() for t in threads)
        time.sleep(0.01)
    assert _chat_status(server) == 200
    with lock:
        finished.append("small")
    for thread in threads:
        thread.join(120)
    assert len(refused) == count and all(refused)
    after = len(finished) - 1 - finished.index("small")
    assert after >= count // 8, f"only {after} large request(s) finished after the small one"
