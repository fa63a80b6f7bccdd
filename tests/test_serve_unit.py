"""`ragcache serve`'s logic without an engine or a server: the bounded queue, the wire format
and request mapping. The HTTP and process behaviour over a stand-in cache is in
test_serve_http.py; the engine-backed behaviour in test_serve.py (and the modules it names),
test_serve_clients.py and test_serve_load.py.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

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
from ragcache_core.query_result import CacheHits, Candidate, QueryResult, TokenLogprobs
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
from ragcache_core.serve.schemas import ChatRequest, CompletionRequest
from ragcache_core.serve.state import ServeSettings

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


@pytest.mark.parametrize("value", [0, None, 4096])
def test_a_client_ignores_a_setting_it_does_not_know(value: int | None) -> None:
    """A server of another version sends a setting this client lacks (an older server's
    removed `protected_gpu_tokens`, a newer one's new key): the client ignores it, whatever its
    value, rather than failing to read the config."""
    config = CacheConfig(top_k=3)
    other = {**config_to_json(config), "protected_gpu_tokens": value, "newer_setting": value}
    assert config_from_json(json.loads(json.dumps(other))) == config


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
