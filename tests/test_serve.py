"""`ragcache serve` end to end: a real server process (tiny model, real vLLM engine, real HTTP on
127.0.0.1) driven by the OpenAI Python client and httpx.

The references come first, from an in-process `RAGCache` with the same settings (closed before
the server starts: one engine at a time on this machine): the server's answers must equal the
in-process cache's for the same documents, and its uncached answers must equal plain vLLM's
(the engine with no plan) on the same token ids.
"""

from __future__ import annotations

import dataclasses
import json
import random
import socket
import string
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from _integration_helpers import corpus, questions
from _serve_helpers import ServerProcess, assert_idle, sse_data, started

from ragcache_core.config import CacheConfig, SamplingConfig
from ragcache_core.documents import Document

pytestmark = pytest.mark.vllm

KEY = "test-key"
ADMIN = "test-admin-key"
SAMPLING = SamplingConfig(max_tokens=8)
# Pools big enough that nothing this module caches is evicted (hits are asserted per tier).
CONFIG = CacheConfig(host_pool_tokens=8192, top_k=2, sampling=SAMPLING)
SERVER_ARGS = ["--host-pool-tokens", "8192", "--top-k", "2"]
SERVER_ARGS += ["--max-tokens", "8", "--header-timeout", "2", "--max-body-mib", "1"]
OTHER_SYSTEM = "You answer in one word."
DOCS = corpus(40)
QUESTIONS = questions(8)

# (question, documents) per test, disjoint so the tests' cache hits do not depend on order.
CASES: dict[str, tuple[str, tuple[Document, ...]]] = {
    "chat": (QUESTIONS[0], (DOCS[0], DOCS[1])),
    "completion": (QUESTIONS[1], (DOCS[2], DOCS[3])),
    "stream": (QUESTIONS[2], (DOCS[4], DOCS[5])),
    "other_system": (QUESTIONS[3], (DOCS[6], DOCS[7])),
    "harmless": (QUESTIONS[4], (DOCS[8], DOCS[9])),
    "invalidate": (QUESTIONS[5], (DOCS[10], DOCS[11])),
    "conversation": (QUESTIONS[7], (DOCS[12], DOCS[13])),
}
FOLLOW_UP = "And why?"
FOUND = (DOCS[16], DOCS[17])
FOUND_MESSAGES = [
    {"role": "system", "content": "Answer from the context."},
    {
        "role": "user",
        "content": "Context:\n\n" + "\n\n".join(d.text for d in FOUND) + "\n\nWho is it about?",
    },
]
PLAIN_PROMPT = "The capital of France is"
PLAIN_CHAT = [{"role": "user", "content": "Say something."}]
RAG_QUESTION = QUESTIONS[6]


def _docs_json(docs: tuple[Document, ...]) -> list[dict[str, Any]]:
    return [{"id": d.id, "text": d.text, "title": d.title} for d in docs]


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ragcache_core.retrieval.index_store import IndexSettings, build_index

    folder = tmp_path_factory.mktemp("serve-index")
    settings = IndexSettings(kind="ivf", nlist=8, nprobe=4, lists_per_stage=2)
    build_index(list(DOCS), settings, progress=False).save(folder)
    return folder


@pytest.fixture(scope="module")
def booting(
    tiny_model: Path, index_dir: Path, engine_pool: Any, tmp_path_factory: Any
) -> Iterator[ServerProcess]:
    """The server, started before the references are computed: it boots meanwhile."""
    engine_pool.close()  # no test engine beside these two
    log = tmp_path_factory.mktemp("serve-log") / "server.log"
    args = [*SERVER_ARGS, "--index", str(index_dir)]
    yield from started(tiny_model, args, log, api_key=KEY, admin_key=ADMIN, wait=False)


@pytest.fixture(scope="module")
def references(tiny_model: Path, index_dir: Path, booting: ServerProcess) -> dict[str, Any]:
    """Token ids from an in-process RAGCache (cached) and plain vLLM (no plan), closed after."""
    from ragcache_core.retrieval.index_store import LocalIndex
    from ragcache_core.runtime.prompt import PromptBuilder
    from ragcache_core.runtime.ragcache import RAGCache

    refs: dict[str, Any] = {}
    with RAGCache(tiny_model, CONFIG) as cache:
        greedy = dataclasses.replace(SAMPLING, temperature=0.0)
        for name, (question, docs) in CASES.items():
            refs[name] = cache.generate(question, docs, sampling=greedy).token_ids
        refs["chat_plain_vllm"] = _plain(cache, cache.prompts.build(*CASES["chat"]).token_ids)
        tokenizer = cache.engine.tokenizer()
        refs["completion_plain"] = _plain(cache, tokenizer.encode(PLAIN_PROMPT))
        text = tokenizer.apply_chat_template(PLAIN_CHAT, tokenize=False, add_generation_prompt=True)
        refs["chat_plain"] = _plain(cache, tokenizer.encode(text, add_special_tokens=False))
        other = dataclasses.replace(CONFIG.prompt, system_prompt=OTHER_SYSTEM)
        builder = PromptBuilder(tokenizer, other, str(tiny_model), cache.config.dtype or "")
        refs["other_system_plain"] = _plain(cache, builder.build(*CASES["other_system"]).token_ids)
        refs["conversation"] = _conversation_refs(cache, greedy)
        found_text = tokenizer.apply_chat_template(
            FOUND_MESSAGES, tokenize=False, add_generation_prompt=True
        )
        refs["found_ids"] = tokenizer.encode(found_text, add_special_tokens=False)
        refs["found_plain"] = _plain(cache, refs["found_ids"])
        rag = cache.query(RAG_QUESTION, search=LocalIndex.load(index_dir).source(), sampling=greedy)
        refs["rag"] = (rag.token_ids, [d.id for d in rag.sources])
    return refs


def _conversation_refs(cache: Any, greedy: SamplingConfig) -> dict[str, Any]:
    """Turn 1 (no history: the server's layout), then turn 2 over turn 1's answer, in
    process, with plain vLLM on turn 2's ids."""
    question, docs = CASES["conversation"]
    first = cache.generate(question, docs, sampling=greedy)
    history = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": first.answer},
    ]
    app = cache.prompts.conversation(history)
    built = cache.prompts.build(FOLLOW_UP, docs, app)
    ids = built.token_ids
    second = cache.generate(FOLLOW_UP, docs, sampling=greedy, prompt=app)
    return {
        "first": first.token_ids,
        "answer": first.answer,
        "second": second.token_ids,
        "second_plain": _plain(cache, ids),
        "second_ids": ids,
        "rest": list(built.question_ids),
        "rest_text": cache.engine.tokenizer().decode(list(built.question_ids)),
    }


def _plain(cache: Any, ids: list[int]) -> tuple[int, ...]:
    """Plain vLLM on `ids` (the engine with no plan: no cache involved)."""
    greedy = dataclasses.replace(SAMPLING, temperature=0.0)

    async def run() -> tuple[int, ...]:
        tokens: tuple[int, ...] = ()
        async for event in cache.engine.stream(
            f"plain-{time.monotonic_ns()}", ids, greedy, read_prefix_cache=False
        ):
            tokens = event.token_ids
        return tokens

    return cache._loop.run(run())  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def server(booting: ServerProcess, references: dict[str, Any]) -> ServerProcess:
    booting.wait_ready()
    return booting


@pytest.fixture(scope="module")
def oai(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(autouse=True)
def nothing_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """After every test that used the server: nothing in flight, the tree consistent."""
    yield
    if "server" in request.fixturenames:
        assert_idle(request.getfixturevalue("server"))


def _chat(oai: openai.OpenAI, name: str, **extra: Any) -> dict[str, Any]:
    question, docs = CASES[name]
    body = {"documents": _docs_json(docs), "return_token_ids": True, **extra}
    response = oai.chat.completions.create(
        model=_model(oai),
        messages=[{"role": "user", "content": question}],
        max_tokens=8,
        temperature=0,
        extra_body=body,
    )
    return response.to_dict()


def _model(oai: openai.OpenAI) -> str:
    return oai.models.list().data[0].id


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


def server_model(server: ServerProcess) -> str:
    with server.client() as http:
        return str(http.get("/v1/models").json()["data"][0]["id"])


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}],
    ids=["missing", "wrong", "not-bearer"],
)
def test_without_the_key_every_v1_route_is_401(server: ServerProcess, headers: Any) -> None:
    for method, path in [
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/rag/query"),
        ("GET", "/v1/models"),
        ("GET", "/v1/cache/stats"),
        ("POST", "/v1/cache/invalidate"),
    ]:
        response = httpx.request(method, f"{server.url}{path}", headers=headers, json={})
        assert response.status_code == 401, (path, response.text)
        wanted = "--admin-key" if path == "/v1/cache/invalidate" else "API key"
        assert wanted in response.json()["error"]["message"]


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


# ---------------------------------------------------------------------- roles


def test_the_admin_routes_open_with_the_admin_key_only(server: ServerProcess) -> None:
    """--admin-key: the API key still generates and reads the config (RAGCacheClient needs
    it), but only the admin key invalidates or checks integrity; the admin key opens the
    ordinary routes too."""
    admin = {"Authorization": f"Bearer {ADMIN}"}
    user = {"Authorization": f"Bearer {KEY}"}
    body = {"doc_id": "nobody-cached-this"}
    for method, path, payload in [
        ("POST", "/v1/cache/invalidate", body),
        ("GET", "/v1/cache/integrity", None),
    ]:
        refused = httpx.request(method, f"{server.url}{path}", headers=user, json=payload)
        assert refused.status_code == 403, refused.text
        assert "--admin-key" in refused.json()["error"]["message"]
        missing = httpx.request(method, f"{server.url}{path}", json=payload)
        assert missing.status_code == 401 and "--admin-key" in missing.text
        allowed = httpx.request(method, f"{server.url}{path}", headers=admin, json=payload)
        assert allowed.status_code == 200, allowed.text
    config = httpx.get(f"{server.url}/v1/rag/config", headers=user).json()
    assert config["admin_key"] is True and config["config"]["top_k"] == 2
    assert httpx.get(f"{server.url}/v1/cache/stats", headers=admin).status_code == 200


def test_the_client_invalidates_with_its_admin_key_only(server: ServerProcess) -> None:
    from ragcache_core.client import RAGCacheClient, RemoteError

    with RAGCacheClient(server.url, api_key=KEY) as user:
        with pytest.raises(RemoteError, match="--admin-key") as refused:
            user.invalidate("nobody-cached-this")
        assert refused.value.status == 403
        with pytest.raises(RemoteError, match="admin_key="):
            user.check_integrity()
    with RAGCacheClient(server.url, api_key=KEY, admin_key=ADMIN) as admin:
        assert admin.invalidate("nobody-cached-this") == 0
        admin.check_integrity()
    with RAGCacheClient(server.url, api_key=KEY, admin_key="wrong") as wrong:
        with pytest.raises(RemoteError) as denied:
            wrong.invalidate("nobody-cached-this")
        assert denied.value.status == 401


@pytest.mark.parametrize("path", ["/openapi.json", "/docs", "/redoc"])
def test_the_openapi_pages_need_a_key(server: ServerProcess, path: str) -> None:
    assert httpx.get(f"{server.url}{path}").status_code == 401
    opened = httpx.get(f"{server.url}{path}", headers={"Authorization": f"Bearer {KEY}"})
    assert opened.status_code == 200
    assert httpx.get(f"{server.url}/health").status_code == 200  # probes stay open
    assert httpx.get(f"{server.url}/metrics").status_code == 200


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
