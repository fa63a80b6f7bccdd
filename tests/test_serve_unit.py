"""`ragcache serve`'s logic without an engine: the bounded queue, request mapping, the wire
format, and the HTTP behaviour that needs a controllable cache (429 with Retry-After, 503
while draining, the engine lock, `--workers`). The engine-backed behaviour is in
test_serve.py, test_serve_clients.py and test_serve_load.py.

The HTTP tests run the real app under real uvicorn on 127.0.0.1, over `HeldCache`: a stand-in
cache whose answers wait until the test releases them, so that requests are provably in
flight (a mock isolating the queue from the engine; it is not what is under test).
"""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from _serve_helpers import REPO, free_port
from fastapi.testclient import TestClient

from ragcache_core.client.wire import (
    config_from_json,
    config_to_json,
    result_from_json,
    result_to_json,
)
from ragcache_core.config import CacheConfig, SamplingConfig
from ragcache_core.documents import Document
from ragcache_core.errors import ConfigError
from ragcache_core.metrics import Metrics
from ragcache_core.results import CacheHits, QueryResult, StreamChunk
from ragcache_core.serve.app import create_app, sole_owner
from ragcache_core.serve.errors import ServeError
from ragcache_core.serve.jobs import (
    COMPLETION_MAX_TOKENS,
    CachedJob,
    GenerationDefaults,
    PromptRenderer,
    UncachedJob,
    chat_job,
    completion_job,
    sampling_for,
)
from ragcache_core.serve.keys import read_key_file
from ragcache_core.serve.queue import BoundedQueue, Place, Refusal
from ragcache_core.serve.schemas import ChatRequest, CompletionRequest
from ragcache_core.serve.state import ServeSettings
from ragcache_core.storage.host_pool import shm_folder

DOCS = (Document("a", "Paris is in France.", {"title": "Paris"}), Document("b", "Rome."))


# ---------------------------------------------------------------------- the bounded queue


def test_the_queue_bounds_what_is_in_flight_and_says_when_to_retry() -> None:
    queue = BoundedQueue(capacity=3, running=2)
    places = [queue.try_enter() for _ in range(3)]
    assert all(isinstance(p, Place) for p in places)
    assert queue.in_flight == 3 and queue.waiting == 1
    refused = queue.try_enter()
    assert isinstance(refused, Refusal) and refused.reason == "full"
    assert refused.retry_after_s == 1  # 1 s mean (the prior), one round ahead
    queue.mean_request_s = 10.0
    assert queue.retry_after_s() == 10  # (1 waiting + 1) / 2 running rounds of 10 s
    first = places[0]
    assert isinstance(first, Place)
    first.release()
    first.release()  # idempotent
    assert queue.in_flight == 2 and queue.refused == 1
    assert isinstance(queue.try_enter(), Place)
    queue.close()
    draining = queue.try_enter()
    assert isinstance(draining, Refusal) and draining.reason == "draining"


def test_the_queue_refuses_nonsense_sizes() -> None:
    with pytest.raises(ValueError):
        BoundedQueue(capacity=1, running=2)
    with pytest.raises(ConfigError):
        ServeSettings(model="m", max_waiting=-1)


# ---------------------------------------------------------------------- wire format


def test_results_and_configs_survive_the_wire() -> None:
    result = QueryResult(
        answer="yes",
        token_ids=(1, 2),
        sources=DOCS,
        ttft_s=0.1,
        retrieval_s=0.05,
        queue_wait_s=0.0,
        hits=CacheHits(gpu_docs=1, computed_docs=1, root_cached=True, cached_tokens=9),
        prompt_tokens=20,
        finish_reason="length",
        scores=(0.9, 0.8),
        timings={"plan": 0.001},
    )
    back = result_from_json(result_to_json(result))
    assert back == result and back.sources[0].title == "Paris"
    config = CacheConfig(top_k=3, sampling=SamplingConfig(stop=("\n",)), dtype="float32")
    assert config_from_json(config_to_json(config)) == config


# ---------------------------------------------------------------------- request mapping


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def renderer(tokenizer: Any, tiny_model: Path) -> PromptRenderer:
    return PromptRenderer(tokenizer, CacheConfig().prompt, str(tiny_model), "float32")


def _chat(messages: list[dict[str, Any]], **extra: Any) -> ChatRequest:
    return ChatRequest.model_validate({"messages": messages, **extra})


def _documents() -> list[dict[str, str]]:
    return [{"id": d.id, "text": d.text, "title": d.title} for d in DOCS]


def test_chat_maps_system_and_last_user_message(renderer: PromptRenderer, tokenizer: Any) -> None:
    from ragcache_core.runtime.prompt import PromptBuilder

    prompt = CacheConfig().prompt
    question = [{"role": "user", "content": "Where is Paris?"}]
    cached = chat_job(_chat(question, documents=_documents()), renderer)
    assert isinstance(cached, CachedJob) and cached.question == "Where is Paris?"
    assert cached.documents == DOCS and cached.documents[0].title == "Paris"
    builder = PromptBuilder(tokenizer, prompt, "m", "float32")
    assert cached.prompt_tokens == builder.build("Where is Paris?", DOCS).num_tokens
    same = [{"role": "system", "content": prompt.system_prompt}, *question]
    assert isinstance(chat_job(_chat(same, documents=_documents()), renderer), CachedJob)

    # Another system prompt is cached too, under its own root (the same layout).
    other = [{"role": "system", "content": "Be brief."}, *question]
    own = chat_job(_chat(other, documents=_documents()), renderer, "tenant-x")
    assert isinstance(own, CachedJob) and own.framing.cache_salt == "tenant-x"
    brief = PromptBuilder(
        tokenizer, dataclasses.replace(prompt, system_prompt="Be brief."), "m", "x"
    )
    ids = builder.build("Where is Paris?", DOCS, own.framing.prompt).token_ids
    assert ids == brief.build("Where is Paris?", DOCS).token_ids
    assert own.prompt_tokens == len(ids)
    roots = {builder.build("q?", DOCS, f.prompt).root_key for f in (cached.framing, own.framing)}
    assert len(roots) == 2

    plain = chat_job(_chat(question), renderer)
    assert isinstance(plain, UncachedJob) and plain.reason == "no_documents"
    text = tokenizer.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    assert list(plain.prompt_ids) == tokenizer.encode(text, add_special_tokens=False)


def test_chat_with_documents_refuses_earlier_turns(renderer: PromptRenderer) -> None:
    turns = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "Where is Paris?"},
    ]
    with pytest.raises(ServeError) as refused:
        chat_job(_chat(turns, documents=_documents()), renderer)
    assert refused.value.status == 400 and refused.value.param == "messages"


def test_text_parts_are_joined_and_other_parts_refused(renderer: PromptRenderer) -> None:
    parts = [{"type": "text", "text": "Where "}, {"type": "text", "text": "is Paris?"}]
    job = chat_job(_chat([{"role": "user", "content": parts}], documents=_documents()), renderer)
    assert isinstance(job, CachedJob) and job.question == "Where is Paris?"
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ServeError, match="text content"):
        chat_job(_chat(image), renderer)


def test_completions_map_prompt_forms(renderer: PromptRenderer, tokenizer: Any) -> None:
    job = completion_job(CompletionRequest(prompt="Hello"), renderer)
    assert isinstance(job, UncachedJob) and list(job.prompt_ids) == tokenizer.encode("Hello")
    ids = completion_job(CompletionRequest(prompt=[5, 6, 7]), renderer)
    assert isinstance(ids, UncachedJob) and ids.prompt_ids == (5, 6, 7)
    one = completion_job(CompletionRequest(prompt=["Hello"]), renderer)
    assert isinstance(one, UncachedJob) and one.prompt_ids == job.prompt_ids
    request = CompletionRequest.model_validate({"prompt": "Where?", "documents": _documents()})
    assert isinstance(completion_job(request, renderer), CachedJob)


def test_sampling_follows_vllm_defaults_and_checks_the_context(
    renderer: PromptRenderer,
) -> None:
    defaults = GenerationDefaults()
    chat = _chat([{"role": "user", "content": "hi"}])
    job = chat_job(chat, renderer)
    sampling = sampling_for(chat, job, defaults, max_model_len=100)
    assert sampling.max_tokens == 100 - job.prompt_tokens  # chat: the rest of the context
    assert sampling.temperature == 1.0 and sampling.top_p == 1.0  # no generation config
    completion = CompletionRequest(prompt="Hello", temperature=0, stop="\n")
    sampling = sampling_for(completion, completion_job(completion, renderer), defaults, 100)
    assert sampling.max_tokens == COMPLETION_MAX_TOKENS and sampling.temperature == 0
    assert sampling.stop == ("\n",)
    too_long = CompletionRequest(prompt="Hello", max_tokens=99)
    with pytest.raises(ServeError, match="maximum context length") as error:
        sampling_for(too_long, completion_job(too_long, renderer), defaults, 100)
    assert error.value.param == "prompt"


def test_generation_defaults_come_from_the_model_folder(tmp_path: Path) -> None:
    assert GenerationDefaults.of_model(str(tmp_path)) == GenerationDefaults()
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6, "top_p": 0.9}')
    assert GenerationDefaults.of_model(str(tmp_path)) == GenerationDefaults(0.6, 0.9)


# ---------------------------------------------------------------------- HTTP over HeldCache


class HeldCache:
    """Answers every request with a fixed result once `release` is set (see the module
    docstring). Counts what it was asked."""

    def __init__(self, model: Path) -> None:
        self.config = CacheConfig(dtype="float32", max_num_seqs=1)
        self.model = str(model)
        self.metrics = Metrics()
        self.release = threading.Event()
        self.started = 0
        self.closed = False
        self.calls: list[dict[str, Any]] = []

    async def _answer(self) -> AsyncIterator[StreamChunk]:
        self.started += 1
        await asyncio.to_thread(self.release.wait, 60)
        hits = CacheHits(computed_docs=1)
        result = QueryResult("ok", (1,), (), 0.01, 0.0, 0.0, hits, 10, "length")
        yield StreamChunk("ok")
        yield StreamChunk("", result)

    def astream(self, question: str, **kwargs: Any) -> AsyncIterator[StreamChunk]:
        self.calls.append(kwargs)
        return self._answer()

    def astream_uncached(self, prompt_ids: Sequence[int], **kwargs: Any) -> Any:
        return self._answer()

    async def aquery(self, question: str, **kwargs: Any) -> QueryResult:
        raise NotImplementedError("the server streams every request")

    async def agenerate(self, question: str, documents: Any, **kwargs: Any) -> QueryResult:
        raise NotImplementedError("the server streams every request")

    def query(self, question: str, **kwargs: Any) -> QueryResult:
        raise NotImplementedError("the server streams every request")

    def generate(self, question: str, documents: Any, **kwargs: Any) -> QueryResult:
        raise NotImplementedError("the server streams every request")

    def stream(self, question: str, **kwargs: Any) -> Any:
        raise NotImplementedError("the server streams every request")

    def stats(self) -> dict[str, Any]:
        return {"requests": self.started}

    def invalidate(self, doc_id: str) -> int:
        return 0

    def check_integrity(self) -> None:
        return None

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def held_server(tiny_model: Path) -> Iterator[tuple[str, HeldCache, Any]]:
    """The real app (capacity 1 running + 1 waiting) under real uvicorn, in a thread."""
    cache = HeldCache(tiny_model)
    port = free_port()
    settings = ServeSettings(model=str(tiny_model), port=port, max_waiting=1, api_key="k")
    app = create_app(settings, cache_factory=lambda s: cache)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the app did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", cache, app
    finally:
        cache.release.set()
        server.should_exit = True
        thread.join(30)
    assert cache.closed  # the lifespan closed the cache


def _post(url: str) -> httpx.Response:
    body = {"prompt": "hi", "max_tokens": 2}
    headers = {"Authorization": "Bearer k"}
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)


def test_past_the_queue_a_request_gets_429_with_retry_after(
    held_server: tuple[str, HeldCache, Any],
) -> None:
    url, cache, _ = held_server
    with ThreadPoolExecutor(2) as pool:
        held = [pool.submit(_post, url) for _ in range(2)]
        deadline = time.monotonic() + 30
        while cache.started < 2:  # both are in flight (one "running", one waiting)
            assert time.monotonic() < deadline
            time.sleep(0.05)
        refused = _post(url)
        assert refused.status_code == 429
        assert int(refused.headers["Retry-After"]) >= 1
        assert refused.json()["error"]["type"] == "RateLimitError"
        assert cache.started == 2  # the refused request never reached the cache
        cache.release.set()
        assert [f.result().status_code for f in held] == [200, 200]
    assert _post(url).status_code == 200  # room again
    metrics = httpx.get(f"{url}/metrics").text
    assert 'ragcache_serve_requests_total{route="/v1/completions",status="429"} 1.0' in metrics


def test_while_draining_requests_get_503_and_health_says_so(
    held_server: tuple[str, HeldCache, Any],
) -> None:
    url, cache, app = held_server
    app.state.serve.queue.close()  # what the runner does on SIGTERM
    refused = _post(url)
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
    assert httpx.get(f"{url}/health").status_code == 503
    assert cache.started == 0


# ---------------------------------------------------------------------- one engine owner


def test_one_process_owns_a_port() -> None:
    port = free_port()
    refused = pytest.raises(ConfigError, match="one process owns the engine")
    with sole_owner("127.0.0.1", port), refused, sole_owner("127.0.0.1", port):
        pass
    with sole_owner("127.0.0.1", port), refused, sole_owner("0.0.0.0", port):
        pass  # another address, the same port: it could not bind either
    with sole_owner("127.0.0.1", port):  # released when the owner ended
        pass
    assert not list(shm_folder().glob(f"ragcache-serve-port-{port}.lock"))  # removed


def test_the_cli_refuses_more_than_one_worker(tiny_model: Path) -> None:
    command = [sys.executable, "-m", "ragcache_core", "serve", "--model", str(tiny_model)]
    done = subprocess.run(
        [*command, "--workers", "2"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert "one server process owns the engine" in done.stderr
    missing = subprocess.run(
        [sys.executable, "-m", "ragcache_core", "serve", "--model", "/nonexistent"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_key_file_format(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# key tenant\nsk-a1 team-a\n\nsk-a2 team-a\nsk-b team-b\nsk-lone\n")
    keys = read_key_file(path)
    assert [k.tenant for k in keys[:3]] == ["team-a", "team-a", "team-b"]
    assert keys[3].tenant.startswith("key-") and "sk-lone" not in repr(keys[3])
    for bad, match in (("sk-a x y\n", "fields"), ("sk-a\nsk-a\n", "twice"), ("# none\n", "no key")):
        path.write_text(bad)
        with pytest.raises(ConfigError, match=match):
            read_key_file(path)
    with pytest.raises(ConfigError, match="needs API keys"):
        ServeSettings(model="m", salt_per_key=True)


def test_salt_per_key_salts_every_request_with_its_tenant(tiny_model: Path, tmp_path: Path) -> None:
    """Through the real app: the key a request presents decides its tenant, and with
    --salt-per-key the tenant is the request's cache salt (its own salt then separates within
    the tenant); an unknown key is 401."""
    path = tmp_path / "keys"
    path.write_text("sk-a team-a\nsk-b team-b\n")
    cache = HeldCache(tiny_model)
    cache.release.set()
    settings = ServeSettings(
        model=str(tiny_model), port=0, api_keys=read_key_file(path), salt_per_key=True
    )
    app = create_app(settings, cache_factory=lambda s: cache)
    body = {"messages": [{"role": "user", "content": "Where?"}], "documents": _documents()}
    with TestClient(app) as client:
        for key, extra, salt in (
            ("sk-a", {}, "tenant:team-a"),
            ("sk-b", {}, "tenant:team-b"),
            ("sk-a", {"cache_salt": "x"}, "tenant:team-a\0x"),
        ):
            answer = client.post(
                "/v1/chat/completions",
                json={**body, **extra},
                headers={"Authorization": f"Bearer {key}"},
            )
            assert answer.status_code == 200, answer.text
            assert cache.calls[-1]["cache_salt"] == salt
        refused = client.post(
            "/v1/chat/completions", json=body, headers={"Authorization": "Bearer no"}
        )
        assert refused.status_code == 401
