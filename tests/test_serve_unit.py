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
import json
import os
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
from _serve_helpers import REPO, held_socket, serve_in_thread
from fastapi.testclient import TestClient

from ragcache_core.cli.replicas import hold_ports
from ragcache_core.client.wire import (
    config_from_json,
    config_to_json,
    result_from_json,
    result_to_json,
    sampling_from_json,
    sampling_to_json,
)
from ragcache_core.config import (
    CacheConfig,
    RepetitionDetection,
    SamplingConfig,
    StructuredOutputs,
)
from ragcache_core.documents import Document
from ragcache_core.errors import ConfigError, InputError, SamplingError
from ragcache_core.metrics import Metrics
from ragcache_core.results import CacheHits, Candidate, QueryResult, StreamChunk, TokenLogprobs
from ragcache_core.serve.app import create_app, sole_owner
from ragcache_core.serve.auth import read_key_file
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
from ragcache_core.serve.limits import BoundedQueue, Place, Refusal
from ragcache_core.serve.listen import adopt_socket, bind_socket
from ragcache_core.serve.schemas import ChatRequest, CompletionRequest
from ragcache_core.serve.state import ServeSettings
from ragcache_core.storage.host_pool import shm_folder

DOCS = (Document("a", "Paris is in France.", {"title": "Paris"}), Document("b", "Rome."))


# ---------------------------------------------------------------------- the bounded queue


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_queue_bounds_what_is_in_flight_and_says_when_to_retry() -> None:
    clock = Clock()
    queue = BoundedQueue(capacity=3, running=2, clock=clock)
    places = [queue.try_enter() for _ in range(3)]
    assert all(isinstance(p, Place) for p in places)
    assert queue.in_flight == 3 and queue.waiting == 1
    clock.now += 10.0  # nothing finished in 10 s: at most 2 running per 10 s drain
    refused = queue.try_enter()
    assert isinstance(refused, Refusal) and refused.reason == "full"
    assert refused.retry_after_s == 5  # one completion: 10 s / 2 running
    first = places[0]
    assert isinstance(first, Place)
    first.release()
    first.release()  # idempotent
    assert queue.in_flight == 2 and queue.refused == 1
    assert isinstance(queue.try_enter(), Place)
    queue.close()
    draining = queue.try_enter()
    assert isinstance(draining, Refusal) and draining.reason == "draining"


def test_retry_after_spreads_a_burst_over_the_measured_drain_rate() -> None:
    """Finding 3 of issue 20: a burst of refused clients was told the same 1-2 s (a mean that
    starts at 1 s, the queue ahead ignored), so they came back as a herd. Each refused client
    now gets its own turn, one completion (at the measured rate) after the one before."""
    clock = Clock()
    queue = BoundedQueue(capacity=20, running=4, clock=clock)
    held = [queue.try_enter() for _ in range(20)]
    for place in held[:10]:  # 10 completions, one every 0.5 s: 2 per second
        clock.now += 0.5
        assert isinstance(place, Place)
        place.release()
        assert isinstance(queue.try_enter(), Place)
    assert queue.drain_rate() == pytest.approx(2.0, rel=0.15)
    turns = []
    for _ in range(30):  # a burst against a full queue
        refusal = queue.try_enter()
        assert isinstance(refusal, Refusal)
        turns.append(refusal.retry_after_s)
    assert turns == sorted(turns)  # later clients are told to come later
    assert turns[0] == 1 and turns[-1] >= 14  # 30 turns at 2 per second: ~15 s for the last
    assert max(turns.count(t) for t in set(turns)) <= 3  # about 2 per second, not a herd


def _herd(busy_for_s: float) -> list[int]:
    """Tries per client: 150 clients at once against 20 places (already busy for
    `busy_for_s`), draining one per 0.1 s, each client back exactly at its Retry-After."""
    clock = Clock()
    queue = BoundedQueue(capacity=20, running=20, clock=clock)
    inside: list[Place] = []
    if busy_for_s:
        clock.now -= busy_for_s
        inside = [p for p in (queue.try_enter() for _ in range(20)) if isinstance(p, Place)]
        clock.now += busy_for_s
    due: dict[int, float] = {client: clock.now for client in range(150)}
    tries = dict.fromkeys(due, 0)
    while due or inside:
        for client in sorted(c for c, at in due.items() if at <= clock.now + 1e-9):
            tries[client] += 1
            verdict = queue.try_enter()
            if isinstance(verdict, Place):
                inside.append(verdict)
                del due[client]
            else:
                due[client] = clock.now + verdict.retry_after_s
        clock.now += 0.1
        if inside:
            inside.pop(0).release()
    return sorted(tries.values())


def test_a_herd_needs_few_retries_when_told_its_turn() -> None:
    """Before the change, every refused client of such a burst was told 1 s: the last ones
    tried 13 times. A burst on a busy queue (its drain known from the requests' age) gets in
    on the first retry; a cold one (nothing finished yet: the first turns are a guess) needs
    at most three tries for nearly everyone."""
    busy = _herd(busy_for_s=2.0)
    assert max(busy) == 2, busy[-10:]
    cold = _herd(busy_for_s=0.0)
    assert sum(cold) / len(cold) <= 2.5 and max(cold) <= 4, cold[-10:]
    assert sum(t > 3 for t in cold) <= len(cold) // 20


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
    assert "prompt_text" not in result_to_json(result)  # sent only when asked for
    shown = dataclasses.replace(result, prompt_text="<s>system ...")
    assert result_from_json(result_to_json(shown)) == shown
    config = CacheConfig(top_k=3, sampling=SamplingConfig(stop=("\n",)), dtype="float32")
    assert config_from_json(config_to_json(config)) == config
    every = SamplingConfig(**EVERY_FIELD)
    assert sampling_from_json(json.loads(json.dumps(sampling_to_json(every)))) == every
    assert config_from_json(config_to_json(config.with_(sampling=every))).sampling == every
    with_logprobs = dataclasses.replace(result, logprobs=LOGPROBS)
    assert result_from_json(json.loads(json.dumps(result_to_json(with_logprobs)))) == with_logprobs


EVERY_FIELD: dict[str, Any] = {
    "max_tokens": 9,
    "temperature": 0.7,
    "top_p": 0.9,
    "stop": ("a", "b"),
    "seed": -(2**63),
    "ignore_eos": True,
    "top_k": 4,
    "min_p": 0.1,
    "presence_penalty": 1.0,
    "frequency_penalty": -1.0,
    "repetition_penalty": 1.2,
    "logit_bias": {5: 100.0, 7: -2.5},
    "min_tokens": 2,
    "stop_token_ids": (3, 4),
    "include_stop_str_in_output": True,
    "bad_words": ("x",),
    "allowed_token_ids": (5, 6, 7),
    "logprobs": 2,
    "logprob_token_ids": (5, 6),
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "structured_outputs": StructuredOutputs(json={"type": "object"}),
    "repetition_detection": RepetitionDetection(4, 1, 2),
    "stream_interval": 3,
}
LOGPROBS = (
    TokenLogprobs(5, -0.1, "a", (Candidate(5, -0.1, 1, "a"), Candidate(6, -2.0, 2, "b"))),
    TokenLogprobs(9, None, None, (Candidate(5, -3.0, None, None),)),
)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": 1e308}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 65}, "min_tokens"),
        ({"seed": 2**63}, "seed"),
        ({"stop": ("",)}, "stop"),
        ({"stop": "a"}, "stop"),
        ({"bad_words": ("",)}, "bad_words"),
        ({"logprobs": -2}, "logprobs"),
        ({"stream_interval": 0}, "stream_interval"),
        ({"allowed_token_ids": ()}, "allowed_token_ids"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": float("nan")}}, "logit_bias.5"),
    ],
)
def test_sampling_config_refuses_what_vllm_refuses_naming_the_field(
    fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(SamplingError) as error:
        SamplingConfig(**fields)
    assert error.value.param == param
    assert isinstance(error.value, InputError) and isinstance(error.value, ConfigError)


def test_sampling_config_takes_vllms_forms() -> None:
    sampling = SamplingConfig(logit_bias={"5": 1e9, 6: -1e9}, stop=["a"], seed=-1)  # type: ignore[arg-type]
    assert sampling.logit_bias == {5: 100.0, 6: -100.0} and sampling.stop == ("a",)
    with pytest.raises(SamplingError, match="exactly one"):
        StructuredOutputs(regex="a", choice=("b",))
    with pytest.raises(SamplingError):
        RepetitionDetection(max_pattern_size=2, min_count=1)


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


def test_chat_with_documents_and_earlier_turns_takes_the_conversation_layout(
    renderer: PromptRenderer, tokenizer: Any
) -> None:
    """Issue 23: earlier turns with documents are no longer a 400: system prompt, documents,
    the turns, the question; only a last message that is not the user's is refused."""
    turns = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "Where is Paris?"},
    ]
    job = chat_job(_chat(turns, documents=_documents()), renderer)
    assert isinstance(job, CachedJob) and job.question == "Where is Paris?"
    assert job.framing.prompt is not None
    assert [m["role"] for m in job.framing.prompt.messages] == [
        "system",
        "user",
        "assistant",
        "user",
    ]
    text = tokenizer.decode(list(job.prompt_ids))
    assert text.index("Paris is in France.") < text.index("hi") < text.index("Where is Paris?")
    with pytest.raises(ServeError) as refused:
        chat_job(_chat(turns[:2], documents=_documents()), renderer)
    assert refused.value.status == 400 and refused.value.param == "messages"


def test_known_documents_are_found_in_plain_requests(tokenizer: Any, tiny_model: Path) -> None:
    """A plain request (no documents field) with known documents pasted in: a cached job
    whose ids are exactly the uncached ones (vLLM's), documents found in order, as shown;
    a tenant's sent documents are found for that tenant only; nothing found: uncached."""
    from ragcache_core.serve.known import KnownDocuments

    long = [
        Document(f"k{i}", f"Document {i} tells a long story about the river number {i}, " * 2)
        for i in range(3)
    ]
    known = KnownDocuments()
    known.add_index(long[:2])
    renderer = PromptRenderer(
        tokenizer, CacheConfig().prompt, str(tiny_model), "float32", known=known
    )
    body = "Context:\n" + long[1].text + "\n\n" + long[0].text + "\nQuestion: which river?"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": body}]
    job = chat_job(_chat(messages), renderer)
    assert isinstance(job, CachedJob) and job.found and job.doc_ids == ("k1", "k0")
    assert job.documents[0].prompt_text == long[1].text.strip()
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert list(job.prompt_ids) == tokenizer.encode(text, add_special_tokens=False)
    completion = completion_job(CompletionRequest.model_validate({"prompt": body}), renderer)
    assert isinstance(completion, CachedJob) and completion.doc_ids == ("k1", "k0")
    assert list(completion.prompt_ids) == tokenizer.encode(body, add_special_tokens=True)
    # A document a tenant sent is known to that tenant only.
    sent = [{"id": "k2", "text": long[2].text}]
    chat_job(_chat([{"role": "user", "content": "q"}], documents=sent), renderer, "tenant-a")
    pasted = [{"role": "user", "content": "See: " + long[2].text}]
    assert isinstance(chat_job(_chat(pasted), renderer, "tenant-a"), CachedJob)
    other = chat_job(_chat(pasted), renderer, "tenant-b")
    assert isinstance(other, UncachedJob) and other.reason == "no_documents"
    # Edited text is not the document; short documents are never looked for.
    edited = [{"role": "user", "content": long[0].text.replace("river", "lake")}]
    assert isinstance(chat_job(_chat(edited), renderer), UncachedJob)
    known.add_index([Document("short", "Paris is the capital of France.")])
    short = [{"role": "user", "content": "Paris is the capital of France."}]
    assert isinstance(chat_job(_chat(short), renderer), UncachedJob)


def test_text_parts_are_joined_and_other_parts_refused(
    renderer: PromptRenderer, tokenizer: Any
) -> None:
    """Text parts are joined by newlines, as vLLM joins them for a string-content chat
    template (they were joined with nothing, so the tokens differed from vllm serve's)."""
    parts = [{"type": "text", "text": "Where"}, {"type": "text", "text": "is Paris?"}]
    job = chat_job(_chat([{"role": "user", "content": parts}], documents=_documents()), renderer)
    assert isinstance(job, CachedJob) and job.question == "Where\nis Paris?"
    plain = chat_job(_chat([{"role": "user", "content": parts}]), renderer)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Where\nis Paris?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert list(plain.prompt_ids) == tokenizer.encode(text, add_special_tokens=False)
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
    # More than the room left after the prompt is clamped to it, as vllm serve does ...
    clamped = CompletionRequest(prompt="Hello", max_tokens=99)
    job = completion_job(clamped, renderer)
    assert sampling_for(clamped, job, defaults, 100).max_tokens == 100 - job.prompt_tokens
    # ... more than the whole context is a 400 naming max_tokens (vLLM's words) ...
    too_many = CompletionRequest(prompt="Hello", max_tokens=101)
    with pytest.raises(ServeError, match="cannot be greater than max_model_len=100") as error:
        sampling_for(too_many, completion_job(too_many, renderer), defaults, 100)
    assert error.value.param == "max_tokens"
    chat = _chat([{"role": "user", "content": "hi"}], max_completion_tokens=500)
    with pytest.raises(ServeError) as error:
        sampling_for(chat, chat_job(chat, renderer), defaults, 100)
    assert error.value.param == "max_completion_tokens"
    # ... and a prompt that fills the context names the prompt.
    long = CompletionRequest(prompt="word " * 200)
    with pytest.raises(ServeError, match="maximum context length is 100") as error:
        sampling_for(long, completion_job(long, renderer), defaults, 100)
    assert error.value.param == "prompt"


def test_generation_defaults_come_from_the_model_folder(tmp_path: Path) -> None:
    assert GenerationDefaults.of_model(str(tmp_path)) == GenerationDefaults()
    config = '{"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 33}'
    (tmp_path / "generation_config.json").write_text(config)
    defaults = GenerationDefaults.of_model(str(tmp_path))
    assert defaults.pick("temperature", None) == 0.6 and defaults.pick("top_k", None) == 20
    assert defaults.pick("temperature", 0.1) == 0.1 and defaults.pick("min_p", None) == 0.0
    assert defaults.max_tokens == 33
    chat = ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    job = UncachedJob((1, 2, 3), "no_documents")
    assert sampling_for(chat, job, defaults, 100).max_tokens == 33


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

    engine_state = "running"

    def astream(self, question: str, **kwargs: Any) -> AsyncIterator[StreamChunk]:
        self.calls.append(kwargs)
        return self._answer()

    def astream_uncached(self, prompt_ids: Sequence[int], **kwargs: Any) -> Any:
        return self._answer()

    async def _whole(self) -> QueryResult:
        async for chunk in self._answer():
            if chunk.result is not None:
                return chunk.result
        raise AssertionError("no result")

    async def aquery(self, question: str, **kwargs: Any) -> QueryResult:
        self.calls.append(kwargs)
        return await self._whole()

    async def agenerate(self, question: str, documents: Any, **kwargs: Any) -> QueryResult:
        self.calls.append(kwargs)
        return await self._whole()

    async def agenerate_uncached(self, prompt_ids: Sequence[int], **kwargs: Any) -> QueryResult:
        return await self._whole()

    def query(self, question: str, **kwargs: Any) -> QueryResult:
        raise NotImplementedError("the server calls the async API only")

    def generate(self, question: str, documents: Any, **kwargs: Any) -> QueryResult:
        raise NotImplementedError("the server calls the async API only")

    def stream(self, question: str, **kwargs: Any) -> Any:
        raise NotImplementedError("the server calls the async API only")

    def stats(self) -> dict[str, Any]:
        return {"requests": self.started}

    def invalidate(self, doc_id: str) -> int:
        return 0

    def check_integrity(self) -> None:
        return None

    def check_sampling(self, sampling: SamplingConfig) -> None:
        return None

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def held_server(tiny_model: Path) -> Iterator[tuple[str, HeldCache, Any]]:
    """The real app (capacity 1 running + 1 waiting) under real uvicorn, in a thread."""
    cache = HeldCache(tiny_model)
    with held_socket() as sock:
        port = sock.getsockname()[1]
        settings = ServeSettings(model=str(tiny_model), port=port, max_waiting=1, api_key="k")
        app = create_app(settings, cache_factory=lambda s: cache)
        with serve_in_thread(app, sock) as url:
            try:
                yield url, cache, app
            finally:
                cache.release.set()
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
    with held_socket() as sock:  # (held: no server can take the port meanwhile)
        _one_owner(sock.getsockname()[1])


def _one_owner(port: int) -> None:
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


def test_a_taken_port_is_one_line_that_names_it() -> None:
    """The bind comes first (serve/listen.py), so a taken port is refused before any engine,
    for `ragcache serve` and for each port `ragcache replicas` needs, with nothing left bound."""
    with held_socket() as sock:
        port = sock.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"cannot bind --port {port} on 127.0.0.1: another"):
            bind_socket("127.0.0.1", port)
        for ports in ((port, 0, 0), (0, port, 0), (0, 0, port)):
            with pytest.raises(ConfigError, match=f" {port} on 127.0.0.1: another program"):
                hold_ports("127.0.0.1", ports[0], ports[1], 2, ports[2])
    with pytest.raises(ConfigError, match="not an address of this machine"):
        bind_socket("192.0.2.123", 0)  # (TEST-NET-1: never this machine's; nothing is sent)
    with pytest.raises(ConfigError, match="--port 70000: a port is 0-65535"):
        bind_socket("127.0.0.1", 70000)
    with pytest.raises(ConfigError, match="port 8001 is asked for twice"):
        hold_ports("127.0.0.1", 8001, 8001, 2, 0)  # (refused before anything is bound)
    held = hold_ports("127.0.0.1", 0, 0, 2, 0)  # all free: distinct ports, all held
    try:
        ports = [held.layout.port, held.prometheus_port, *held.layout.replica_ports]
        assert len(set(ports)) == 4 and 0 not in ports
        for taken in ports:
            with pytest.raises(ConfigError, match=f"cannot bind --port {taken} "):
                bind_socket("127.0.0.1", taken)
        held.release_router()  # the router binds its two itself
        bind_socket("127.0.0.1", held.layout.port).close()
    finally:
        held.close()


def test_serve_adopts_an_inherited_socket_or_says_what_the_fd_is() -> None:
    with held_socket() as sock:
        adopted = adopt_socket(os.dup(sock.fileno()))
        assert adopted.getsockname() == sock.getsockname() and not adopted.get_inheritable()
        adopted.close()
    with pytest.raises(ConfigError, match="--fd 987: not an open socket"):
        adopt_socket(987)
    read_end, write_end = os.pipe()
    try:
        with pytest.raises(ConfigError, match=f"--fd {read_end}: not an open socket"):
            adopt_socket(read_end)
    finally:
        os.close(read_end)
        os.close(write_end)


def test_the_cli_refuses_a_taken_port_before_the_engine(tiny_model: Path) -> None:
    command = [sys.executable, "-m", "ragcache_core", "serve", "--model", str(tiny_model)]
    with held_socket() as sock:
        port = sock.getsockname()[1]
        done = subprocess.run(
            [*command, "--port", str(port)], cwd=REPO, capture_output=True, text=True, timeout=120
        )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"ragcache serve: error: cannot bind --port {port} on 127.0.0.1: another program holds "
        "it ([Errno 98]); choose another --port, or 0 for any free port"
    ]
    assert "vllm" not in done.stdout.lower()  # no engine was started


# ---------------------------------------------------------------------- crash hygiene


def _dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(done.stdout)


def test_reclaim_removes_what_processes_that_are_gone_left(tmp_path: Path) -> None:
    from ragcache_core.storage.reclaim import reclaim_shared_memory

    dead, alive = _dead_pid(), os.getpid()
    orphan = [tmp_path / f"ragcache-{dead}-0123abcd", tmp_path / f"ragcache-{dead}-0123abcd.json"]
    kept = [tmp_path / f"ragcache-{alive}-89abcdef", tmp_path / "ragcache-named-pool"]
    unused, used = tmp_path / "psm_0badf00d", tmp_path / "psm_c0ffee00"
    for path in [*orphan, *kept, unused, used]:
        path.write_bytes(b"x" * 1000)
    with used.open("rb"):  # open in this process: in use
        reclaimed = reclaim_shared_memory(tmp_path)
    assert sorted(reclaimed.pools) == sorted(orphan) and reclaimed.segments == (unused,)
    assert reclaimed.nbytes == 3000
    assert all(p.exists() for p in [*kept, used]) and not any(p.exists() for p in orphan)
    import mmap

    with used.open("r+b") as f:
        mapped = mmap.mmap(f.fileno(), 0)
    try:  # mapped, no fd open: still in use
        assert not reclaim_shared_memory(tmp_path) and used.exists()
    finally:
        mapped.close()
    assert reclaim_shared_memory(tmp_path).segments == (used,)  # now no one uses it


def test_reclaim_locks_removes_only_locks_nobody_holds(tmp_path: Path) -> None:
    import fcntl

    from ragcache_core.serve.watchdog import lock_path, reclaim_locks

    stale, held = lock_path(1, tmp_path), lock_path(2, tmp_path)
    stale.write_text(str(_dead_pid()))
    fd = os.open(held, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert reclaim_locks(tmp_path) == [stale]
        assert held.exists() and not stale.exists()
    finally:
        os.close(fd)


_FAKE_SERVER = """
import os, subprocess, sys, time
from ragcache_core.serve.watchdog import Watchdog
Watchdog.start()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
pool = "/dev/shm/ragcache-%d-0123abcd" % os.getpid()
open(pool, "w").write("x")
open(pool + ".json", "w").write("{}")
print(child.pid, pool, flush=True)
time.sleep(300)
"""


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="the watchdog needs /proc")
def test_the_watchdog_stops_a_killed_servers_children_and_removes_its_pool() -> None:
    """A stand-in server (a process with a child, its watchdog and a host pool file) is
    killed with SIGKILL: its watchdog kills the child and removes the pool."""
    import psutil

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    fake = subprocess.Popen(
        [sys.executable, "-c", _FAKE_SERVER],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert fake.stdout is not None and fake.stderr is not None
    pid, pool = fake.stdout.readline().split()
    child = psutil.Process(int(pid))
    time.sleep(1.5)  # the watchdog notes the server's descendants every 0.5 s
    fake.kill()
    fake.wait(10)
    _, alive = psutil.wait_procs([child], timeout=20)
    assert not alive, "the child outlived the killed server"
    assert not Path(pool).exists() and not Path(pool + ".json").exists()
    assert "ragcache serve watchdog: stopped 1 engine process(es)" in fake.stderr.read()


# ---------------------------------------------------------------------- roles and limits


def test_the_keys_guard_the_routes_by_role() -> None:
    from ragcache_core.serve.auth import ApiKey, KeyMiddleware

    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("not called")

    both = KeyMiddleware(app, keys=(ApiKey("k", "default"),), admin_key="a")
    assert both.needs("/v1/cache/invalidate") == "admin" == both.needs("/v1/cache/integrity")
    assert both.needs("/v1/chat/completions") == "user" == both.needs("/openapi.json")
    assert both.needs("/health") is None and both.needs("/metrics") is None
    only_api = KeyMiddleware(app, keys=(ApiKey("k", "default"),), admin_key=None)
    assert only_api.needs("/v1/cache/invalidate") == "user"  # the documented default
    only_admin = KeyMiddleware(app, admin_key="a")
    assert only_admin.needs("/v1/chat/completions") is None
    assert only_admin.needs("/v1/cache/invalidate") == "admin" == only_admin.needs("/docs")
    with pytest.raises(ConfigError, match="differ"):
        ServeSettings(model="m", api_key="same", admin_key="same")
    assert ServeSettings(model="m").max_body_bytes == 8 * 2**20  # docs/deploy.md's default


@pytest.fixture(params=["httptools", "h11"])
def guarded_server(
    request: pytest.FixtureRequest, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[str, HeldCache]]:
    """The real app under real uvicorn with the server's guarded HTTP protocol (both of
    uvicorn's HTTP/1.1 implementations), a 1 s header timeout and a 1 KiB body limit."""
    from ragcache_core.serve.limits import guarded_protocol

    if request.param == "h11":  # as where httptools is not installed
        import uvicorn.protocols.http.httptools_impl as impl

        monkeypatch.delattr(impl, "HttpToolsProtocol")
    protocol = guarded_protocol(1.0)
    assert request.param.replace("httptools", "HttpTools").lower() in protocol.__name__.lower()
    cache = HeldCache(tiny_model)
    cache.release.set()
    with held_socket() as sock:
        settings = ServeSettings(
            model=str(tiny_model),
            port=sock.getsockname()[1],
            max_body_bytes=1024,
            read_timeout_s=1.0,
        )
        app = create_app(settings, cache_factory=lambda s: cache)
        with serve_in_thread(app, sock, http=protocol) as url:
            yield url, cache


def test_headers_and_bodies_are_bounded_in_size_and_time(
    guarded_server: tuple[str, HeldCache],
) -> None:
    import socket

    url, _ = guarded_server
    port = int(url.rsplit(":", 1)[1])
    partial = socket.create_connection(("127.0.0.1", port), timeout=20)
    partial.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never finished
    huge = socket.create_connection(("127.0.0.1", port), timeout=20)
    huge.sendall(b"GET /health HTTP/1.1\r\nX-Pad: " + b"x" * 70_000)
    slow = socket.create_connection(("127.0.0.1", port), timeout=20)
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    # (h11 refuses large headers itself, with 400, before the guard's 431.)
    for sock, statuses in [(partial, [b"408"]), (huge, [b"431", b"400"]), (slow, [b"408"])]:
        with sock:
            answer = b""
            while chunk := sock.recv(4096):  # until the server closes the connection
                answer += chunk
            assert answer[9:12] in statuses, answer[:200]
    body = {"prompt": "x" * 2000, "max_tokens": 2}
    too_big = httpx.post(f"{url}/v1/completions", json=body, timeout=10)
    assert too_big.status_code == 413 and "1024 bytes" in too_big.json()["error"]["message"]
    with httpx.Client(base_url=url, timeout=10) as http:  # keep-alive: the next requests
        for _ in range(3):
            assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).json()
            time.sleep(0.6)  # idle between requests is not a header timeout
        assert http.get("/health").status_code == 200


def test_health_is_503_while_the_engine_is_not_running(
    held_server: tuple[str, HeldCache, Any],
) -> None:
    url, cache, _ = held_server
    for state in ("dead", "restarting"):
        cache.engine_state = state
        response = httpx.get(f"{url}/health")
        assert response.status_code == 503 and response.json() == {"status": f"engine_{state}"}
    cache.engine_state = "running"
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}


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


def test_usage_carries_the_cached_tokens_as_openai_and_vllm() -> None:
    """`usage.prompt_tokens_details.cached_tokens` is the prompt tokens the cache served."""
    result = QueryResult(
        answer="a",
        token_ids=(1, 2, 3),
        sources=(),
        ttft_s=0.1,
        retrieval_s=0.0,
        queue_wait_s=0.0,
        hits=CacheHits(cached_tokens=12, computed_tokens=8),
        prompt_tokens=20,
    )
    assert result.openai_usage() == {
        "prompt_tokens": 20,
        "completion_tokens": 3,
        "total_tokens": 23,
        "prompt_tokens_details": {"cached_tokens": 12},
    }
