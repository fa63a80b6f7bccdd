"""The `ragcache serve` process that test_serve.py, test_serve_auth.py and
test_serve_bad_input.py drive (tiny model, real vLLM engine, real HTTP on 127.0.0.1), its
settings, and the references its answers must equal: started once for the three (a pytest
plugin, `pytest_plugins` in conftest.py; held by `engine_pool`, so the modules share it while
they run one after another, and it is stopped when another module starts an engine).

The references come first, from an in-process `RAGCache` with the same settings, computed while
the server boots (two engines at once for a while: the boot is mostly imports) and closed
before the tests: the server's answers must equal the in-process cache's for the same documents,
and its uncached answers must equal plain vLLM's (the engine with no plan) on the same token ids.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from _integration_helpers import corpus, plain_tokens, questions
from _serve_helpers import ServerProcess, assert_idle, started

from ragcache_core.config import CacheConfig, SamplingConfig
from ragcache_core.documents import Document

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


@dataclasses.dataclass(frozen=True)
class Serving:
    """The started server and its references (token ids by case name)."""

    server: ServerProcess
    references: dict[str, Any]


HELD_AS = ("ragcache serve", *SERVER_ARGS, KEY, ADMIN)
"""The key `engine_pool` holds the server under: its settings."""


@contextlib.contextmanager
def _serving(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serving]:
    """The server, started before the references are computed: it boots meanwhile."""
    from ragcache_core.retrieval.index_store import IndexSettings, build_index

    index_dir = tmp_path_factory.mktemp("serve-index")
    settings = IndexSettings(kind="ivf", nlist=8, nprobe=4, lists_per_stage=2)
    build_index(list(DOCS), settings, progress=False).save(index_dir)
    log = tmp_path_factory.mktemp("serve-log") / "server.log"
    args = [*SERVER_ARGS, "--index", str(index_dir)]
    booting = contextlib.contextmanager(started)
    with booting(model, args, log, api_key=KEY, admin_key=ADMIN, wait=False) as server:
        refs = _references(model, index_dir)
        server.wait_ready()
        yield Serving(server, refs)


def _references(model: Path, index_dir: Path) -> dict[str, Any]:
    """Token ids from an in-process RAGCache (cached) and plain vLLM (no plan), closed after."""
    from ragcache_core.retrieval.index_store import LocalIndex
    from ragcache_core.runtime.prompt import PromptBuilder
    from ragcache_core.runtime.ragcache import RAGCache

    refs: dict[str, Any] = {}
    with RAGCache(model, CONFIG) as cache:
        greedy = dataclasses.replace(SAMPLING, temperature=0.0)
        for name, (question, docs) in CASES.items():
            refs[name] = cache.generate(question, docs, sampling=greedy).token_ids
        refs["chat_plain_vllm"] = _plain(cache, cache.prompts.build(*CASES["chat"]).token_ids)
        tokenizer = cache.engine.tokenizer()
        refs["completion_plain"] = _plain(cache, tokenizer.encode(PLAIN_PROMPT))
        text = tokenizer.apply_chat_template(PLAIN_CHAT, tokenize=False, add_generation_prompt=True)
        refs["chat_plain"] = _plain(cache, tokenizer.encode(text, add_special_tokens=False))
        other = dataclasses.replace(CONFIG.prompt, system_prompt=OTHER_SYSTEM)
        builder = PromptBuilder(tokenizer, other, str(model), cache.config.dtype or "")
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


@pytest.fixture(scope="module")
def serving(
    engine_pool: Any, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Serving:
    """Started by the first module that asks, and kept by `engine_pool` for the next (module
    scope: it outlives each test's `idle_after`)."""
    served: Serving = engine_pool.hold(HELD_AS, lambda: _serving(tiny_model, tmp_path_factory))
    return served


@pytest.fixture(scope="module")
def server(serving: Serving) -> ServerProcess:
    return serving.server


@pytest.fixture(scope="module")
def references(serving: Serving) -> dict[str, Any]:
    return serving.references


@pytest.fixture(scope="module")
def oai(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture
def idle_after(request: pytest.FixtureRequest) -> Iterator[None]:
    """After every test that used the server: nothing in flight, the tree consistent (the
    modules that drive the server use it: `pytest.mark.usefixtures("idle_after")`)."""
    yield
    if "server" in request.fixturenames:
        assert_idle(request.getfixturevalue("server"))


def _docs_json(docs: tuple[Document, ...]) -> list[dict[str, Any]]:
    return [{"id": d.id, "text": d.text, "title": d.title} for d in docs]


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
    """Plain vLLM on `ids` (the engine with no plan: no cache involved), greedy."""
    return plain_tokens(cache, ids, dataclasses.replace(SAMPLING, temperature=0.0))


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


def server_model(server: ServerProcess) -> str:
    with server.client() as http:
        return str(http.get("/v1/models").json()["data"][0]["id"])
