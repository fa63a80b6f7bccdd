"""`ragcache serve` end to end: a real server process (tiny model, real vLLM engine, real HTTP on
127.0.0.1) driven by the OpenAI Python client, LangChain's and LlamaIndex's OpenAI clients and
httpx: its answers equal the in-process cache's and plain vLLM's (`_serve_session`), documents
sent or found in the messages hit on repeat, conversations, streaming, the index searched server
side, disconnects, invalidation, one server per port, and (last) every metric moved.

The server is shared with test_serve_auth.py (keys and roles) and test_serve_bad_input.py (bad
input and what it costs): `_serve_session`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from _serve_helpers import ServerProcess, assert_idle, sse_data
from _serve_session import (
    CASES,
    CONFIG,
    DOCS,
    FOLLOW_UP,
    FOUND,
    FOUND_MESSAGES,
    KEY,
    OTHER_SYSTEM,
    PLAIN_CHAT,
    PLAIN_PROMPT,
    RAG_QUESTION,
    _chat,
    _docs_json,
    _model,
    server_model,
)

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("idle_after")]


# ---------------------------------------------------------------------- surface


def test_port_0_binds_before_the_engine_and_names_the_port_it_got(server: ServerProcess) -> None:
    """Started with --port 0: the port was bound (and logged) before the engine started,
    "ready on" came after the engine, with the same port, and the replica name uses it."""
    log = server.tail(10_000)
    bound = log.index(f"bound {server.url}; starting the engine")
    assert bound < log.index(f"ready on {server.url}")
    engine = [i for i in (log.find("vLLM"), log.find("vllm")) if i >= 0]
    assert engine and bound < min(engine), "the engine started before the port was bound"
    health = httpx.get(f"{server.url}/health")
    assert health.headers["x-ragcache-replica"] == f"127.0.0.1:{server.port}"


def test_health_metrics_open_models_and_v1_guarded(server: ServerProcess, oai: Any) -> None:
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    metrics = httpx.get(f"{server.url}/metrics").text
    assert "ragcache_doc_hits_total" in metrics and "ragcache_serve_in_flight" in metrics
    models = oai.models.list().data
    assert [m.id for m in models] == [str(server_model(server))]


# ---------------------------------------------------------------------- answers


def test_chat_with_documents_equals_in_process_and_repeat_hits(
    oai: openai.OpenAI, references: dict[str, Any]
) -> None:
    first = _chat(oai, "chat")
    assert tuple(first["choices"][0]["token_ids"]) == references["chat"]
    assert references["chat"] == references["chat_plain_vllm"]  # the cache changes nothing
    report = first["ragcache"]
    assert report["cached"] and report["uncached_reason"] is None
    assert report["documents"] == [d.id for d in CASES["chat"][1]]
    assert report["cache_hits"]["computed_docs"] == 2 and report["ttft_s"] > 0
    again = _chat(oai, "chat")
    assert again["ragcache"]["cache_hits"]["gpu_docs"] == 2
    assert again["ragcache"]["cache_hits"]["cached_tokens"] > 0
    assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    assert again["usage"]["completion_tokens"] == 8
    # The standard field (vLLM's --enable-prompt-tokens-details) says what the report says.
    for response in (first, again):
        cached = response["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == response["ragcache"]["cache_hits"]["cached_tokens"]
    read = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (first, again)]
    assert read[1] > read[0]


def test_a_conversation_caches_its_documents_and_computes_its_turns(
    oai: openai.OpenAI, references: dict[str, Any]
) -> None:
    """Documents with earlier turns (no longer a 400): turn 2 carries turn 1's answer; its
    prompt ids hold that history after the documents, its answer is plain vLLM's on them, and
    the documents hit when another conversation asks over them."""
    question, docs = CASES["conversation"]
    refs = references["conversation"]
    first = _chat(oai, "conversation")
    assert tuple(first["choices"][0]["token_ids"]) == refs["first"]
    answer = first["choices"][0]["message"]["content"]
    assert answer == refs["answer"]
    history = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    second = _turn(oai, [*history, {"role": "user", "content": FOLLOW_UP}], docs)
    assert second["ragcache"]["cached"] is True
    assert tuple(second["choices"][0]["token_ids"]) == refs["second"] == refs["second_plain"]
    prompt_ids = second["prompt_token_ids"]
    assert prompt_ids == list(refs["second_ids"])
    # The history is in the computed rest (after the documents), turn 1's answer included.
    assert prompt_ids[-len(refs["rest"]) :] == refs["rest"]
    assert answer in refs["rest_text"] and question in refs["rest_text"]
    assert second["ragcache"]["cache_hits"]["computed_docs"] == 2
    # Another conversation over the same documents: they hit, its own turns are computed.
    other = [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi."}]
    third = _turn(oai, [*other, {"role": "user", "content": FOLLOW_UP}], docs)
    hits = third["ragcache"]["cache_hits"]
    assert hits["gpu_docs"] + hits["host_docs"] == 2
    assert third["prompt_token_ids"] != prompt_ids


def _turn(oai: openai.OpenAI, messages: list[dict[str, str]], docs: Any) -> dict[str, Any]:
    return oai.chat.completions.create(  # type: ignore[no-any-return]
        model=_model(oai),
        messages=messages,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
        extra_body={"documents": _docs_json(docs), "return_token_ids": True},
    ).to_dict()


def test_an_unchanged_openai_client_hits_on_the_index_documents_it_pastes(
    server: ServerProcess, oai: openai.OpenAI, references: dict[str, Any]
) -> None:
    """No documents field: the server finds the --index documents pasted in the messages and
    caches them; the prompt ids are the ones vLLM makes of the same messages and the answer
    is plain vLLM's on them (exact for the ids sent); a repeat hits; the report, the headers
    and the metric say so."""
    reports = []
    for _ in range(2):
        raw = oai.chat.completions.with_raw_response.create(
            model=_model(oai),
            messages=FOUND_MESSAGES,  # type: ignore[arg-type]
            max_tokens=8,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        response = raw.parse().to_dict()
        assert response["prompt_token_ids"] == references["found_ids"]
        assert tuple(response["choices"][0]["token_ids"]) == references["found_plain"]
        report = response["ragcache"]
        assert report["cached"] and report["found_documents"]
        assert report["documents"] == [d.id for d in FOUND]
        reports.append((report["cache_hits"], raw.headers))
    (first, _), (again, headers) = reports
    assert first["computed_docs"] == 2 and again["gpu_docs"] + again["host_docs"] == 2
    assert headers["x-ragcache-found-documents"] == "true"
    assert headers["x-ragcache-hit-documents"] == "2"
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'ragcache_serve_found_documents_total{result="found"}' in metrics


def test_chat_openai_with_response_headers_hits_on_repeat(
    server: ServerProcess, references: dict[str, Any]
) -> None:
    """LangChain's ChatOpenAI pointed at the server with its served name hits on a repeat;
    RAGCache's own counts reach it through the response headers when it asks for them."""
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        base_url=f"{server.url}/v1",
        api_key=KEY,
        model=server_model(server),
        max_tokens=8,
        temperature=0,
        include_response_headers=True,
    )
    messages = [(m["role"], m["content"]) for m in FOUND_MESSAGES]
    llm.invoke(messages)
    again = llm.invoke(messages)
    headers = again.response_metadata["headers"]
    assert headers["x-ragcache-found-documents"] == "true"
    assert headers["x-ragcache-hit-documents"] == "2"


def test_an_unchanged_chat_openai_reads_cache_read_from_invoke_and_stream(
    server: ServerProcess, references: dict[str, Any]
) -> None:
    """An unchanged ChatOpenAI (no response headers asked for) reads the hit where LangChain
    puts OpenAI's `prompt_tokens_details.cached_tokens`: `usage_metadata["input_token_details"]
    ["cache_read"]`, from `invoke` and from `stream(stream_usage=True)` (the usage chunk)."""
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        base_url=f"{server.url}/v1",
        api_key=KEY,
        model=server_model(server),
        max_tokens=8,
        temperature=0,
        stream_usage=True,
    )
    pasted = (DOCS[18], DOCS[19])
    context = "\n\n".join(d.text for d in pasted)
    messages = [
        ("system", "Answer from the context."),
        ("user", f"Context:\n\n{context}\n\nWho is it about?"),
    ]
    first = llm.invoke(messages)
    again = llm.invoke(messages)
    assert again.content == first.content
    read = [m.usage_metadata["input_token_details"]["cache_read"] for m in (first, again)]
    assert read[1] > read[0]  # the first computed the documents, the repeat read them
    assert again.usage_metadata["input_tokens"] == first.usage_metadata["input_tokens"]
    chunks = list(llm.stream(messages))
    streamed = chunks[0]
    for chunk in chunks[1:]:
        streamed += chunk
    assert streamed.content == first.content
    assert streamed.usage_metadata is not None
    assert streamed.usage_metadata["input_token_details"]["cache_read"] == read[1]
    assert streamed.usage_metadata["output_tokens"] == 8


def test_llama_index_openai_like_changed_only_in_api_base_hits_on_repeat(
    server: ServerProcess, references: dict[str, Any]
) -> None:
    """LlamaIndex's OpenAILike pointed at the server (nothing else changed) hits on a repeat;
    the report reaches it in the raw response."""
    openai_like = pytest.importorskip("llama_index.llms.openai_like")
    from llama_index.core.llms import ChatMessage

    llm = openai_like.OpenAILike(
        api_base=f"{server.url}/v1",
        api_key=KEY,
        model=server_model(server),
        is_chat_model=True,
        max_tokens=8,
        temperature=0,
    )
    messages = [ChatMessage(role=m["role"], content=m["content"]) for m in FOUND_MESSAGES]
    first, again = llm.chat(messages), llm.chat(messages)
    reports = [response.raw.model_extra["ragcache"] for response in (first, again)]
    assert all(report["found_documents"] for report in reports)
    assert reports[1]["documents"] == [d.id for d in FOUND]
    hits = reports[1]["cache_hits"]
    assert hits["gpu_docs"] + hits["host_docs"] == 2
    assert again.message.content == first.message.content


def test_completions_with_documents_take_the_prompt_as_question(
    oai: openai.OpenAI, references: dict[str, Any]
) -> None:
    question, docs = CASES["completion"]
    for _ in range(2):
        response = oai.completions.create(
            model=_model(oai),
            prompt=question,
            max_tokens=8,
            temperature=0,
            extra_body={"documents": _docs_json(docs), "return_token_ids": True},
        ).to_dict()
        assert tuple(response["choices"][0]["token_ids"]) == references["completion"]
    assert response["ragcache"]["cache_hits"]["gpu_docs"] == 2


def test_without_documents_it_is_plain_vllm(
    server: ServerProcess, oai: openai.OpenAI, references: dict[str, Any]
) -> None:
    before = server.stats()["requests"]
    completion = oai.completions.create(
        model=_model(oai),
        prompt=PLAIN_PROMPT,
        max_tokens=8,
        temperature=0,
        extra_body={"return_token_ids": True},
    ).to_dict()
    assert tuple(completion["choices"][0]["token_ids"]) == references["completion_plain"]
    assert completion["ragcache"]["cached"] is False
    assert completion["ragcache"]["uncached_reason"] == "no_documents"
    # Plain vLLM here does not read the prefix cache (uncached.py): nothing was served from it.
    assert completion["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    chat = oai.chat.completions.create(
        model=_model(oai),
        messages=PLAIN_CHAT,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
        extra_body={"return_token_ids": True},
    ).to_dict()
    assert tuple(chat["choices"][0]["token_ids"]) == references["chat_plain"]
    assert server.stats()["requests"] == before  # the cache was not involved


def test_another_system_prompt_is_cached_under_its_own_root(
    oai: openai.OpenAI, references: dict[str, Any]
) -> None:
    """Every system prompt is its own root: no request is uncached because its system prompt
    differs, and its answer is plain vLLM's on the same ids; a repeat hits."""
    question, docs = CASES["other_system"]
    reports = []
    for _ in range(2):
        response = _chat_with_system(oai, OTHER_SYSTEM, question, docs)
        assert response["ragcache"]["cached"] is True
        assert response["ragcache"]["uncached_reason"] is None
        assert tuple(response["choices"][0]["token_ids"]) == references["other_system_plain"]
        reports.append(response["ragcache"]["cache_hits"])
    assert reports[1]["gpu_docs"] + reports[1]["host_docs"] == len(docs)
    # The server's own system prompt, sent explicitly, is the default root.
    same = _chat_with_system(oai, CONFIG.prompt.system_prompt, question, docs)
    assert same["ragcache"]["cached"] is True
    assert tuple(same["choices"][0]["token_ids"]) == references["other_system"]


def test_salted_requests_never_hit_another_salts_documents(
    oai: openai.OpenAI, references: dict[str, Any]
) -> None:
    """vLLM's `cache_salt` field: two tenants send the same document; neither hits the other's
    nodes (the response's hit counts say so), and a tenant's repeat hits its own."""
    question, docs = CASES["other_system"]
    hits = {}
    for salt in ("tenant-a", "tenant-b", "tenant-a"):
        response = _chat_with_system(oai, OTHER_SYSTEM, question, docs, cache_salt=salt)
        assert tuple(response["choices"][0]["token_ids"]) == references["other_system_plain"]
        hits.setdefault(salt, []).append(response["ragcache"]["cache_hits"])
    first_a, first_b, again_a = hits["tenant-a"][0], hits["tenant-b"][0], hits["tenant-a"][1]
    for report in (first_a, first_b):
        assert report["gpu_docs"] + report["host_docs"] == 0 and not report["root_cached"]
    assert again_a["gpu_docs"] + again_a["host_docs"] == len(docs)


def _chat_with_system(
    oai: Any, system: str, question: str, docs: Any, **extra: Any
) -> dict[str, Any]:
    return oai.chat.completions.create(  # type: ignore[no-any-return]
        model=_model(oai),
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=8,
        temperature=0,
        extra_body={"documents": _docs_json(docs), "return_token_ids": True, **extra},
    ).to_dict()


def test_streaming_chat_and_completion(oai: openai.OpenAI, references: dict[str, Any]) -> None:
    question, docs = CASES["stream"]
    whole = _chat(oai, "stream")
    chunks = list(
        oai.chat.completions.create(
            model=_model(oai),
            messages=[{"role": "user", "content": question}],
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"documents": _docs_json(docs), "return_token_ids": True},
        )
    )
    dicts = [c.to_dict() for c in chunks]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in dicts if c["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    last = [c for c in dicts if c["choices"]][-1]
    assert last["choices"][0]["finish_reason"] == "length"
    ids = [t for c in dicts if c["choices"] for t in c["choices"][0].get("token_ids") or ()]
    assert tuple(ids) == references["stream"]  # each chunk carries its own, as vLLM's
    assert last["ragcache"]["cache_hits"]["gpu_docs"] == 2
    assert dicts[-1]["usage"]["completion_tokens"] == 8  # include_usage: the last chunk
    cached = dicts[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == last["ragcache"]["cache_hits"]["cached_tokens"] > 0
    pieces = oai.completions.create(
        model=_model(oai), prompt=PLAIN_PROMPT, max_tokens=8, temperature=0, stream=True
    )
    streamed = "".join(p.choices[0].text for p in pieces)
    plain = oai.completions.create(
        model=_model(oai), prompt=PLAIN_PROMPT, max_tokens=8, temperature=0
    )
    assert streamed == plain.choices[0].text


def test_rag_query_searches_the_index_server_side(
    server: ServerProcess, references: dict[str, Any]
) -> None:
    tokens, source_ids = references["rag"]
    body = {"question": RAG_QUESTION, "sampling": {"temperature": 0}}
    with server.client() as http:
        first = http.post("/v1/rag/query", json=body).json()
        assert [s["id"] for s in first["sources"]] == source_ids
        assert tuple(first["token_ids"]) == tokens
        assert first["retrieval_s"] > 0 and first["ttft_s"] >= first["retrieval_s"]
        assert len(first["scores"]) == 2
        with http.stream("POST", "/v1/rag/query", json={**body, "stream": True}) as response:
            events = list(sse_data(response.iter_lines()))
    text = "".join(e["delta"] for e in events)
    final = events[-1]["result"]
    assert text == final["answer"] == first["answer"]
    assert tuple(final["token_ids"]) == tokens
    assert final["cache_hits"]["gpu_docs"] == 2  # the second time: hits


# ---------------------------------------------------------------------- disconnects, invalidation


def _disconnects(server: ServerProcess, route: str) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith(f'ragcache_serve_disconnects_total{{route="{route}"}}'):
            return float(line.split()[-1])
    return 0.0


def _long_chat(stream: bool) -> dict[str, Any]:
    """A chat request whose answer runs long (3,000 tokens, EOS ignored): time to leave."""
    question, docs = CASES["chat"]
    return {
        "messages": [{"role": "user", "content": question}],
        "documents": _docs_json(docs),
        "max_tokens": 3000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def test_a_client_gone_mid_stream_aborts_its_request(server: ServerProcess) -> None:
    body = _long_chat(stream=True)
    before = server.stats()["requests"]
    gone = _disconnects(server, "/v1/chat/completions")
    with server.client() as http, http.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        first = [next(lines) for _ in range(4)]  # the role chunk and a delta (with blanks)
    assert any('"content"' in line for line in first)
    stats = assert_idle(server)  # vLLM, the tree and the queue let go of it
    assert stats["requests"] == before  # never answered: aborted, not run to its end
    assert _disconnects(server, "/v1/chat/completions") == gone + 1


def test_a_client_gone_before_a_whole_answer_aborts_its_request(server: ServerProcess) -> None:
    body = _long_chat(stream=False)
    before = server.stats()["requests"]
    with server.client(timeout=1.0) as http, pytest.raises(httpx.ReadTimeout):
        http.post("/v1/chat/completions", json=body)
    stats = assert_idle(server)
    assert stats["requests"] == before


def test_invalidate_drops_a_document(server: ServerProcess, oai: openai.OpenAI) -> None:
    _chat(oai, "invalidate")
    doc = CASES["invalidate"][1][1].id  # the second document (its node is under the first)
    with server.admin_client() as http:
        removed = http.post("/v1/cache/invalidate", json={"doc_id": doc}).json()
        assert removed == {"doc_id": doc, "removed": 1}
        assert http.post("/v1/cache/invalidate", json={"doc_id": doc}).json()["removed"] == 0
    # The tree's copies are gone; vLLM's prefix cache (the GPU tier) keeps blocks keyed by the
    # same token ids, which are exact for the same text and never match a changed one.
    hits = _chat(oai, "invalidate")["ragcache"]["cache_hits"]
    assert hits["host_docs"] == 0 and hits["gpu_docs"] + hits["computed_docs"] == 2


# ---------------------------------------------------------------------- one server per port


def test_a_second_server_on_the_same_port_is_refused(
    server: ServerProcess, tiny_model: Path
) -> None:
    import subprocess
    import sys

    from _serve_helpers import REPO

    command = [sys.executable, "-m", "ragcache_core", "serve", "--model", str(tiny_model)]
    command += ["--port", str(server.port)]
    done = subprocess.run(
        command,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(Path.home())},
    )
    # Refused at the bind, before any engine: one line that names the port.
    assert done.returncode == 2, done.stderr
    message = done.stderr.strip().splitlines()
    assert message == [
        f"ragcache serve: error: cannot bind --port {server.port} on 127.0.0.1: another program "
        "holds it ([Errno 98]); choose another --port, or 0 for any free port"
    ], done.stderr


def test_every_serve_metric_moved(server: ServerProcess) -> None:
    """Runs last: the module's requests moved every collector of the server's registry."""
    samples = {}
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    chat = 'route="/v1/chat/completions"'
    assert samples[f'ragcache_serve_requests_total{{{chat},status="200"}}'] > 0
    assert samples[f'ragcache_serve_requests_total{{{chat},status="499"}}'] >= 2
    assert samples['ragcache_serve_uncached_total{reason="no_documents"}'] > 0
    assert samples['ragcache_serve_found_documents_total{result="found"}'] >= 2
    assert samples['ragcache_serve_found_documents_total{result="none"}'] > 0
    assert samples["ragcache_roots"] >= 3  # the server's, another system prompt's, salted ones
    assert samples[f"ragcache_serve_disconnects_total{{{chat}}}"] >= 2
    assert samples[f"ragcache_serve_request_seconds_count{{{chat}}}"] > 0
    assert samples["ragcache_serve_in_flight"] == 0 and samples["ragcache_serve_waiting"] == 0
    assert samples['ragcache_doc_hits_total{tier="gpu"}'] > 0
