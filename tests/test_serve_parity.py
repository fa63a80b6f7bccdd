"""Issue 20 end to end: a request to `ragcache serve` means what it means to `vllm serve`.

One in-process `RAGCache` first (closed before the server starts: one engine at a time) gives
the references: vLLM's own engine (`AsyncLLM.generate`) on the request's prompt ids with the
`SamplingParams` vLLM's own `ChatCompletionRequest.to_sampling_params` makes from the same
body, and RAGCache's Python API with the same `SamplingConfig`. Then one real server (tiny
model, real vLLM, real HTTP), shared by the module. For every field passed to `SamplingParams`:

- it changes the answer against the same request without it (a value chosen, from the answer
  without it, so that it must: sampling knobs at temperature > 0 with a fixed seed; logprobs
  must come back), so a dropped field fails;
- the server's answer equals vLLM's engine given the same `SamplingParams`, on the cached
  path (documents) and the uncached one (the same ids as a completion prompt), and equals
  `RAGCache.generate` and `RAGCacheClient.generate` with the same `SamplingConfig`.

Also: the field table equals vLLM's models (every field classified), the `SamplingParams` the
server builds equal vLLM's for the same bodies, refused fields at their defaults pass on the
real engine, the issue's repro, the max_tokens clamp, and vLLM-shaped documents.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from _parity_cases import CASES, FAKE, GREEDY, IDS, Answer, Case
from _serve_helpers import ServerProcess, assert_idle, sse_data, started

from ragcache_core.config import (
    CacheConfig,
    SamplingConfig,
)
from ragcache_core.documents import Document

pytestmark = pytest.mark.vllm

QUESTION = "Where is the tower?"
DOCS = (
    Document("o1", "The Eiffel tower is in Paris and was built in 1889."),
    Document("o2", "The Colosseum is in Rome."),
)
CONFIG = CacheConfig(host_pool_tokens=2048)
SERVER_ARGS = ["--host-pool-tokens", "2048"]


def _messages() -> list[dict[str, Any]]:
    return [{"role": "user", "content": QUESTION}]


def _docs_json() -> list[dict[str, Any]]:
    return [{"id": d.id, "text": d.text} for d in DOCS]


def _vllm_params(body: dict[str, Any]) -> Any:
    """vLLM's own SamplingParams for a chat body (its request model and its mapping)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    request = ChatCompletionRequest.model_validate({"messages": _messages(), **body})
    return request.to_sampling_params(int(body["max_tokens"]), {})


_ref_ids = itertools.count()


def _engine_answer(cache: Any, ids: list[int], params: Any) -> Answer:
    """vLLM's engine (the RAGCache's AsyncLLM, no plan: plain vLLM) on `ids` with `params`."""
    from ragcache_core.engine.compat import token_prompt

    async def run() -> Any:
        last = None
        engine = cache.engine._engine
        async for output in engine.generate(token_prompt(ids), params, f"ref-{next(_ref_ids)}"):
            last = output.outputs[0]
        return last

    out = cache._loop.run(run())
    logprobs = ()
    if out.logprobs:
        logprobs = tuple(
            float(step[t].logprob) for step, t in zip(out.logprobs, out.token_ids, strict=True)
        )
    return Answer(tuple(out.token_ids), out.text, logprobs)


@dataclass(frozen=True)
class Reference:
    field: dict[str, Any]
    config: dict[str, Any]
    without: Answer
    vllm: Answer
    api: Answer


@pytest.fixture(scope="module")
def booting(
    tiny_model: Path, engine_pool: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """The server, started before the references are computed: it boots meanwhile."""
    engine_pool.close()  # no test engine beside these two
    log = tmp_path_factory.mktemp("parity-log") / "server.log"
    yield from started(tiny_model, SERVER_ARGS, log, wait=False)


@pytest.fixture(scope="module")
def refs(tiny_model: Path, booting: ServerProcess) -> dict[str, Any]:
    """Every case's references from one in-process RAGCache, closed after (module docstring)."""
    from ragcache_core.runtime.ragcache import RAGCache

    out: dict[str, Any] = {}
    with RAGCache(tiny_model, CONFIG) as cache:
        tokenizer = cache.engine.tokenizer()
        ids = list(cache.prompts.build(QUESTION, DOCS).token_ids)
        out["ids"] = ids
        for case in CASES:
            without = _engine_answer(cache, ids, _vllm_params(case.base))
            field = case.field(without, tokenizer)
            config = case.config(without, tokenizer)
            vllm = _engine_answer(cache, ids, _vllm_params({**case.base, **field}))
            sampling = SamplingConfig(**{**case.base_config, **config})
            api = cache.generate(QUESTION, DOCS, sampling=sampling)
            api_lp = tuple(t.logprob for t in api.logprobs if t.logprob is not None)
            out[case.name] = Reference(
                field, config, without, vllm, Answer(api.token_ids, api.answer, api_lp)
            )
        plain = tokenizer.apply_chat_template(
            _messages(), tokenize=False, add_generation_prompt=True
        )
        plain_ids = tokenizer.encode(plain, add_special_tokens=False)
        out["plain_ids"] = plain_ids
        out["plain"] = _engine_answer(cache, plain_ids, _vllm_params(GREEDY))
        out["completion_logprobs"] = _engine_answer(
            cache, ids, _completion_params({"prompt": ids, **GREEDY, "logprobs": 0})
        )
    return out


def _completion_params(body: dict[str, Any]) -> Any:
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    request = CompletionRequest.model_validate(body)
    return request.to_sampling_params(int(body["max_tokens"]), {})


@pytest.fixture(scope="module")
def server(booting: ServerProcess, refs: dict[str, Any]) -> ServerProcess:
    booting.wait_ready()
    return booting


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with server.client() as client:
        yield client


def _post(http: httpx.Client, route: str, body: dict[str, Any]) -> dict[str, Any]:
    response = http.post(route, json=body)
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


def _chat(http: httpx.Client, **body: Any) -> dict[str, Any]:
    full = {"messages": _messages(), "documents": _docs_json(), "return_token_ids": True}
    return _post(http, "/v1/chat/completions", {**full, **body})


def _answer(data: dict[str, Any]) -> Answer:
    choice = data["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    logprobs: tuple[float, ...] = ()
    if choice.get("logprobs"):
        content = choice["logprobs"].get("content")
        values = (
            [e["logprob"] for e in content] if content else choice["logprobs"]["token_logprobs"]
        )
        logprobs = tuple(values)
    return Answer(tuple(choice["token_ids"]), text, logprobs)


def _differs(case: Case, a: Answer, b: Answer) -> bool:
    if case.changes == "tokens":
        return a.token_ids != b.token_ids
    if case.changes == "text":
        return a.text != b.text
    return bool(a.logprobs) != bool(b.logprobs)


def _same(a: Answer, b: Answer) -> None:
    assert a.token_ids == b.token_ids and a.text == b.text
    assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_each_sampling_field_changes_the_answer_and_equals_vllm(
    http: httpx.Client, refs: dict[str, Any], case: Case
) -> None:
    """Finding 1: logit_bias, the penalties, min_tokens, response_format, top_k, ... left the
    output token for token unchanged (accepted, then dropped)."""
    ref: Reference = refs[case.name]
    without = _answer(_chat(http, **case.base))
    given = _chat(http, **{**case.base, **ref.field})
    answer = _answer(given)
    assert given["ragcache"]["cached"] is True
    if case.changes != "nothing here":
        assert _differs(case, answer, without), (case.name, answer, without)
    _same(answer, ref.vllm)  # vLLM's engine, the same SamplingParams, the same ids
    _same(without, ref.without)
    _same(ref.api, ref.vllm)  # RAGCache's Python API with the same SamplingConfig
    body = {"prompt": refs["ids"], "return_token_ids": True, **_as_completion(ref.field)}
    _same(_answer(_post(http, "/v1/completions", {**case.base, **body})), ref.vllm)


def test_the_client_and_rag_query_take_every_sampling_field(
    server: ServerProcess, refs: dict[str, Any]
) -> None:
    """RAGCacheClient (over /v1/rag/query) sends SamplingConfig whole: the same answers."""
    from ragcache_core.client.client import RAGCacheClient

    with RAGCacheClient(server.url) as client:
        for case in CASES:
            ref: Reference = refs[case.name]
            sampling = SamplingConfig(**{**case.base_config, **ref.config})
            result = client.generate(QUESTION, DOCS, sampling=sampling)
            logprobs = tuple(t.logprob for t in result.logprobs if t.logprob is not None)
            _same(Answer(result.token_ids, result.answer, logprobs), ref.vllm)


def test_the_issue_repro_logit_bias_changes_the_tokens(http: httpx.Client) -> None:
    body = {
        "messages": [{"role": "user", "content": "Where is the tower?"}],
        "documents": [{"id": "o1", "text": DOCS[0].text}],
        "temperature": 0,
        "max_tokens": 24,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    plain = _post(http, "/v1/chat/completions", body)["choices"][0]["token_ids"]
    biased = _post(http, "/v1/chat/completions", {**body, "logit_bias": {"5": 100}})
    assert biased["choices"][0]["token_ids"] == [5] * 24 != plain


def test_logprobs_come_back_in_vllms_shapes(http: httpx.Client, refs: dict[str, Any]) -> None:
    """Finding 1: `logprobs: 0` (completions) and `top_logprobs` returned 200 with nothing."""
    chat = _chat(http, **GREEDY, logprobs=True, top_logprobs=2)["choices"][0]["logprobs"]
    entry = chat["content"][0]
    assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
    assert len(entry["top_logprobs"]) == 2 and entry["top_logprobs"][0]["token"] == entry["token"]
    zero = _chat(http, **GREEDY, logprobs=True)["choices"][0]["logprobs"]["content"]
    assert len(zero) == 12 and all(e["top_logprobs"] == [] for e in zero)
    body = {"prompt": refs["ids"], **GREEDY, "logprobs": 0, "return_token_ids": True}
    completion = _post(http, "/v1/completions", body)["choices"][0]
    logprobs = completion["logprobs"]
    assert set(logprobs) == {"text_offset", "token_logprobs", "tokens", "top_logprobs"}
    assert [len(t) for t in logprobs["top_logprobs"]] == [1] * 12  # logprobs + 1 per token
    assert logprobs["text_offset"][0] == 0
    assert tuple(logprobs["token_logprobs"]) == pytest.approx(
        refs["completion_logprobs"].logprobs, abs=1e-4
    )
    assert completion["text"] == refs["completion_logprobs"].text  # vLLM's own text
    # Per-token decodes: a character split over two tokens decodes to nothing or U+FFFD alone.
    assert "".join(logprobs["tokens"]).replace("\ufffd", "") == completion["text"].replace(
        "\ufffd", ""
    )


def test_a_stream_carries_token_ids_and_logprobs_per_chunk(http: httpx.Client) -> None:
    body = {
        "messages": _messages(),
        "documents": _docs_json(),
        **GREEDY,
        "logprobs": True,
        "top_logprobs": 1,
        "return_token_ids": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    whole = _chat(http, **{k: v for k, v in body.items() if k not in ("stream", "stream_options")})
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        chunks = list(sse_data(response.iter_lines()))
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    tokens = [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids", [])]
    assert tokens == whole["choices"][0]["token_ids"]
    content = [
        e["logprob"]
        for c in chunks
        if c["choices"] and c["choices"][0].get("logprobs")
        for e in c["choices"][0]["logprobs"]["content"]
    ]
    assert content == [e["logprob"] for e in whole["choices"][0]["logprobs"]["content"]]
    assert all("usage" in c for c in chunks)  # continuous_usage_stats
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12


def test_stream_interval_sends_fewer_chunks(http: httpx.Client) -> None:
    def deltas(**extra: Any) -> int:
        body = {"messages": _messages(), "documents": _docs_json(), **GREEDY, "stream": True}
        with http.stream("POST", "/v1/chat/completions", json={**body, **extra}) as response:
            return sum(1 for c in sse_data(response.iter_lines()) if c["choices"][0]["delta"])

    assert deltas(stream_interval=6) < deltas()


def test_refused_fields_at_their_defaults_pass_on_the_engine(
    http: httpx.Client, refs: dict[str, Any]
) -> None:
    from test_serve_errors import ROUTER_DEFAULTS

    with_defaults = _chat(http, **GREEDY, **ROUTER_DEFAULTS)
    assert _answer(with_defaults).token_ids == refs["logit_bias"].without.token_ids
    refused = http.post(
        "/v1/chat/completions",
        json={"messages": _messages(), **GREEDY, "kv_transfer_params": {"ragcache_plan": {}}},
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "kv_transfer_params"


def test_max_tokens_over_the_room_left_is_clamped_as_vllm_does(http: httpx.Client) -> None:
    """A client sending max_tokens = max_model_len (4096) works as with vllm serve: the answer
    gets the room left after the prompt."""
    prompt = [5] * 4090
    data = _post(
        http,
        "/v1/completions",
        {"prompt": prompt, "max_tokens": 4096, "temperature": 0, "ignore_eos": True},
    )
    assert (
        data["usage"]["completion_tokens"] == 6 and data["choices"][0]["finish_reason"] == "length"
    )


def test_vllm_shaped_documents_go_to_the_chat_template(
    http: httpx.Client, refs: dict[str, Any]
) -> None:
    """vLLM's own `documents` (no ids: title/text for the chat template) are rendered by the
    template, as vllm serve renders them, and served uncached (the tiny template ignores
    them, as vLLM's would)."""
    body = {
        "messages": _messages(),
        "documents": [{"title": "Tower", "text": DOCS[0].text}],
        "return_token_ids": True,
        **GREEDY,
    }
    data = _post(http, "/v1/chat/completions", body)
    assert data["ragcache"]["cached"] is False
    assert data["ragcache"]["uncached_reason"] == "template_documents"
    assert data["prompt_token_ids"] == refs["plain_ids"]
    _same(_answer(data), refs["plain"])


def test_sampling_params_equal_vllms_for_the_same_bodies(tiny_model: Path) -> None:
    """The server's mapping (request -> SamplingConfig -> SamplingParams) against vLLM's
    `to_sampling_params`, attribute by attribute (no engine)."""
    from transformers import AutoTokenizer
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VChat
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest as VCompletion
    from vllm.exceptions import VLLMValidationError

    from ragcache_core.engine.sampling import sampling_params
    from ragcache_core.serve.errors import ServeError
    from ragcache_core.serve.jobs import (
        GenerationDefaults,
        PromptRenderer,
        chat_job,
        completion_job,
        sampling_for,
    )
    from ragcache_core.serve.schemas import ChatRequest, CompletionRequest

    renderer = PromptRenderer(
        AutoTokenizer.from_pretrained(tiny_model), CONFIG.prompt, str(tiny_model), "float32"
    )
    fixed = {"bad_words", "stop", "include_stop_str_in_output"}  # these pick from an answer
    bodies: list[dict[str, Any]] = [{}, {"max_tokens": 7}, {"seed": -1}, {"temperature": 0}]
    bodies += [c.base for c in CASES]
    bodies += [{**c.base, **c.field(FAKE, None)} for c in CASES if c.name not in fixed]
    bodies += [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {}}}},
        {"structured_outputs": {"regex": "a+"}, "response_format": {"type": "text"}},
        {"structured_outputs": {"regex": "a+"}, "response_format": {"type": "json_object"}},
        {"logprobs": True, "logprob_token_ids": [4, 5]},
        {"stop_token_ids": [9, 9, 4], "bad_words": ["x", "x"], "stream_interval": 3},
        {"stop": "zz", "include_stop_str_in_output": True, "spaces_between_special_tokens": False},
    ]
    attrs = [
        "n",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "stop_token_ids",
        "bad_words",
        "include_stop_str_in_output",
        "ignore_eos",
        "max_tokens",
        "min_tokens",
        "logprobs",
        "prompt_logprobs",
        "logprob_token_ids",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "structured_outputs",
        "logit_bias",
        "allowed_token_ids",
        "extra_args",
        "repetition_detection",
        "stream_interval",
        "thinking_token_budget",
    ]
    for body in bodies:
        for kind in ("chat", "completion"):
            if kind == "chat":
                full = {"messages": _messages(), **body}
                mine: Any = ChatRequest.model_validate(full)
                theirs: Any = VChat.model_validate(full)
                job = chat_job(mine, renderer)
            else:
                full = {"prompt": "hi", **_as_completion(body)}
                mine, theirs = (
                    CompletionRequest.model_validate(full),
                    VCompletion.model_validate(full),
                )
                job = completion_job(mine, renderer)
            try:
                sampling = sampling_for(mine, job, GenerationDefaults(), 100)
            except ServeError:  # then vLLM refuses it too
                with pytest.raises(VLLMValidationError):
                    theirs.to_sampling_params(16, {})
                continue
            ours = sampling_params(sampling)
            vllm = theirs.to_sampling_params(sampling.max_tokens, {})
            diff = {
                a: (getattr(ours, a), getattr(vllm, a))
                for a in attrs
                if getattr(ours, a) != getattr(vllm, a)
            }
            assert not diff, (kind, body, diff)


def _as_completion(body: dict[str, Any]) -> dict[str, Any]:
    """A chat body's fields as /v1/completions takes them (logprobs: a count)."""
    out = dict(body)
    if out.pop("logprobs", None):
        out["logprobs"] = out.pop("top_logprobs", 0)
    out.pop("top_logprobs", None)
    return out


def test_every_vllm_field_is_classified() -> None:
    """The field table (docs/deploy.md) against vLLM's request models: a field vLLM adds
    fails here until it is classified; every refused field's vLLM default passes."""
    from pydantic_core import PydanticUndefined
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VChat
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest as VCompletion

    from ragcache_core.serve.fields import (
        CHAT_FIELDS,
        COMPLETION_FIELDS,
        EXTENSIONS,
        is_allowed,
    )

    routes = (("chat", CHAT_FIELDS, VChat), ("completion", COMPLETION_FIELDS, VCompletion))
    for route, ours, theirs in routes:
        mine = set(ours) - set(EXTENSIONS[route])
        assert mine == set(theirs.model_fields), mine ^ set(theirs.model_fields)
        for name, treatment in ours.items():
            if treatment.kind != "refused":
                continue
            info = theirs.model_fields[name]
            default = info.default if info.default is not PydanticUndefined else None
            assert is_allowed(default, treatment.allowed), (name, default)
    deploy = (Path(__file__).resolve().parents[1] / "docs" / "deploy.md").read_text()
    for name in {**CHAT_FIELDS, **COMPLETION_FIELDS}:
        assert f"| `{name}` |" in deploy, name


@pytest.fixture(autouse=True)
def nothing_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "server" in request.fixturenames or "http" in request.fixturenames:
        assert_idle(request.getfixturevalue("server"))
