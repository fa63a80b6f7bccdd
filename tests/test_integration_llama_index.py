"""RAGCacheQueryEngine on real LlamaIndex indexes (Faiss IVF, SimpleVectorStore) and a real
vLLM engine: answers match plain vLLM on the same prompt ids, repeats hit the cache, sources
are the index's own top-k, instrumentation fires, bad input fails clearly, and the chat engines
send the history. LlamaIndex's own keywords, prompt keys, postprocessors, filters, LLM events
and the guide's snippets: test_integration_llama_index_conventions.py (the same cache, emptied
for each module)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import _integration_helpers
import _llama_index_helpers
import faiss
import pytest
from _integration_helpers import CONFIG, import_with_version, reference
from _llama_index_helpers import (
    QUESTIONS,
    response_documents,
    source_ids,
    text_nodes,
)
from llama_index.core import StorageContext, VectorStoreIndex
from llama_index.core.base.response.schema import AsyncStreamingResponse, StreamingResponse
from llama_index.core.callbacks import CallbackManager, EventPayload, LlamaDebugHandler
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.span_handlers import SimpleSpanHandler
from llama_index.core.llms import MockLLM
from llama_index.core.prompts.chat_prompts import CHAT_TEXT_QA_PROMPT
from llama_index.core.prompts.default_prompts import (
    DEFAULT_TEXT_QA_PROMPT,
    DEFAULT_TEXT_QA_PROMPT_TMPL,
)
from llama_index.core.schema import MetadataMode, TextNode
from llama_index.core.vector_stores import MetadataFilter, MetadataFilters
from llama_index.vector_stores.faiss import FaissVectorStore
from packaging.specifiers import SpecifierSet
from pydantic import Field

from ragcache_core.config import PromptConfig
from ragcache_core.errors import ConfigError, InputError
from ragcache_integrations.llama_index import (
    OfflineEmbedding,
    RAGCacheQueryEngine,
    as_chat_engine,
    as_query_engine,
    prompt_config,
)
from ragcache_integrations.llama_index._compat import (
    DISTRIBUTION,
    UnsupportedFrameworkError,
    check_version,
)
from ragcache_integrations.llama_index.prompt import app_prompt as li_app_prompt

# The module-scoped fixtures this module builds for itself (found by their names here).
cache = _integration_helpers.cache
embed_model = _llama_index_helpers.embed_model
ivf_index = _llama_index_helpers.ivf_index
simple_index = _llama_index_helpers.simple_index


# ---------------------------------------------------------------------- with the engine


@pytest.mark.vllm
def test_faiss_query_matches_vllm_and_hits_cache_on_repeat(
    cache: Any, ivf_index: VectorStoreIndex
) -> None:
    engine = as_query_engine(ivf_index, cache=cache)
    assert engine.search.can_speculate  # the IVF store is searched in stages
    question = QUESTIONS[0]
    first = engine.query(question)
    own = ivf_index.as_retriever(similarity_top_k=CONFIG.top_k).retrieve(question)
    assert source_ids(first) == [h.node.node_id for h in own]  # the index's own top-k
    assert [n.score for n in first.source_nodes] == pytest.approx([h.score for h in own])
    expected = reference(cache, question, response_documents(first), engine.app_prompt)
    assert first.metadata["token_ids"] == list(expected.token_ids)
    assert first.response == expected.text
    assert first.metadata["ttft_s"] > 0
    # The ids are those of LlamaIndex's own engine over the same nodes: its default chat QA
    # prompt (roles kept) with each node's metadata, through the model's chat template.
    nodes = [n.node for n in first.source_nodes]
    context = "\n\n".join(n.get_content(MetadataMode.LLM).strip() for n in nodes)
    messages = [
        {"role": m.role.value, "content": m.content or ""}
        for m in CHAT_TEXT_QA_PROMPT.format_messages(context_str=context, query_str=question)
    ]
    tokenizer = cache.prompts._tokenizer
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "title: " in context  # node metadata, as LlamaIndex shows it to the LLM
    assert first.metadata["prompt_tokens"] == len(tokenizer.encode(text, add_special_tokens=False))
    ids = cache.prompts.build(question, response_documents(first), engine.app_prompt).token_ids
    assert ids == tokenizer.encode(text, add_special_tokens=False)

    again = engine.query(question)
    assert again.metadata["cache_hits"]["gpu_docs"] == CONFIG.top_k
    assert again.metadata["token_ids"] == list(expected.token_ids)


@pytest.mark.vllm
def test_similarity_top_k_wins_over_the_cache_default(
    cache: Any, ivf_index: VectorStoreIndex
) -> None:
    question = QUESTIONS[1]
    assert len(as_query_engine(ivf_index, cache=cache).query(question).source_nodes) == 2
    response = RAGCacheQueryEngine.from_index(ivf_index, cache=cache, similarity_top_k=3).query(
        question
    )
    own = ivf_index.as_retriever(similarity_top_k=3).retrieve(question)
    assert source_ids(response) == [h.node.node_id for h in own]
    expected = reference(
        cache, question, response_documents(response), li_app_prompt(None, chat=True)
    )
    assert response.metadata["token_ids"] == list(expected.token_ids)


@pytest.mark.vllm
def test_simple_vector_store(cache: Any, simple_index: VectorStoreIndex) -> None:
    question = QUESTIONS[2]
    response = as_query_engine(simple_index, cache=cache, similarity_top_k=2).query(question)
    own = simple_index.as_retriever(similarity_top_k=2).retrieve(question)
    assert source_ids(response) == [h.node.node_id for h in own]
    expected = reference(
        cache, question, response_documents(response), li_app_prompt(None, chat=True)
    )
    assert response.metadata["token_ids"] == list(expected.token_ids)


@pytest.mark.vllm
def test_async_and_streaming_agree_with_sync(cache: Any, ivf_index: VectorStoreIndex) -> None:
    question = QUESTIONS[3]
    sync = as_query_engine(ivf_index, cache=cache).query(question)
    expected = reference(cache, question, response_documents(sync), li_app_prompt(None, chat=True))

    async_response = asyncio.run(as_query_engine(ivf_index, cache=cache).aquery(question))
    assert async_response.response == expected.text
    assert source_ids(async_response) == source_ids(sync)

    streaming = as_query_engine(ivf_index, cache=cache, streaming=True).query(question)
    assert isinstance(streaming, StreamingResponse)
    assert source_ids(streaming) == source_ids(sync)  # known before the text is consumed
    assert "".join(streaming.response_gen) == expected.text
    assert streaming.metadata is not None
    assert streaming.metadata["token_ids"] == list(expected.token_ids)

    async def consume() -> tuple[str, Any]:
        engine = as_query_engine(ivf_index, cache=cache, streaming=True)
        response = await engine.aquery(question)
        assert isinstance(response, AsyncStreamingResponse)
        text = "".join([piece async for piece in response.async_response_gen()])
        return text, response

    text, async_streaming = asyncio.run(consume())
    assert text == expected.text
    assert source_ids(async_streaming) == source_ids(sync)


class _Events(BaseEventHandler):
    seen: list[Any] = Field(default_factory=list)

    @classmethod
    def class_name(cls) -> str:
        return "RecordEvents"

    def handle(self, event: Any, **kwargs: Any) -> None:
        self.seen.append(event)


@pytest.mark.vllm
def test_emits_llama_index_instrumentation(cache: Any, ivf_index: VectorStoreIndex) -> None:
    root = get_dispatcher()
    events, spans = _Events(), SimpleSpanHandler()
    root.add_event_handler(events)
    root.add_span_handler(spans)
    try:
        as_query_engine(ivf_index, cache=cache).query(QUESTIONS[0])
    finally:
        root.event_handlers.remove(events)
        root.span_handlers.remove(spans)
    names = [e.class_name() for e in events.seen]
    wanted = ["QueryStartEvent", "RetrievalStartEvent", "RetrievalEndEvent", "QueryEndEvent"]
    assert [n for n in names if n in wanted] == wanted
    query_start = next(e for e in events.seen if e.class_name() == "QueryStartEvent")
    assert str(query_start.span_id).startswith("RAGCacheQueryEngine.query-")
    retrieval_end = next(e for e in events.seen if e.class_name() == "RetrievalEndEvent")
    assert len(retrieval_end.nodes) == CONFIG.top_k
    assert any(s.id_.startswith("RAGCacheQueryEngine.query-") for s in spans.completed_spans)


@pytest.mark.vllm
def test_empty_retrieval_answers_without_context(
    cache: Any, simple_index: VectorStoreIndex, caplog: pytest.LogCaptureFixture
) -> None:
    nothing = MetadataFilters(filters=[MetadataFilter(key="title", value="no such title")])
    retriever = simple_index.as_retriever(filters=nothing)
    engine = RAGCacheQueryEngine.from_retriever(retriever, cache=cache)
    with caplog.at_level(logging.WARNING):
        response = engine.query(QUESTIONS[4])
    assert response.source_nodes == []
    assert response.metadata["no_context"] is True
    assert "no documents" in caplog.text
    expected = reference(cache, QUESTIONS[4], (), engine.app_prompt)
    assert response.metadata["token_ids"] == list(expected.token_ids)


@pytest.mark.vllm
def test_bad_input(cache: Any, ivf_index: VectorStoreIndex, embed_model: OfflineEmbedding) -> None:
    engine = as_query_engine(ivf_index, cache=cache)
    for bad in (42, "   ", None):
        with pytest.raises(InputError, match="non-empty string"):
            engine.query(bad)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="similarity_top_k"):
        as_query_engine(ivf_index, cache=cache, similarity_top_k=0)

    # A node with metadata but no text: LlamaIndex indexes it (its embedding text is the
    # metadata), RAGCache has nothing to put in the prompt.
    nodes = [*text_nodes()[:4], TextNode(id_="blank", text="", metadata={"title": "Blank"})]
    flat = faiss.IndexFlatIP(len(embed_model.get_query_embedding("x")))
    storage = StorageContext.from_defaults(vector_store=FaissVectorStore(faiss_index=flat))
    index = VectorStoreIndex(nodes, storage_context=storage, embed_model=embed_model)
    with pytest.raises(InputError, match="has no text"):
        as_query_engine(index, cache=cache, similarity_top_k=5).query(QUESTIONS[0])


@pytest.mark.vllm
def test_engines_with_other_prompts_share_the_cache(
    cache: Any, ivf_index: VectorStoreIndex
) -> None:
    """Each prompt is its own root: engines with LlamaIndex's text QA prompt and with RAGCache's
    own layout both answer like plain vLLM on their ids, and both hit on a repeat."""
    question = QUESTIONS[5]
    for prompt in (DEFAULT_TEXT_QA_PROMPT, cache.config.prompt):
        engine = as_query_engine(ivf_index, cache=cache, prompt=prompt)
        first = engine.query(question)
        expected = reference(cache, question, response_documents(first), engine.app_prompt)
        assert first.metadata["token_ids"] == list(expected.token_ids)
        again = engine.query(question)
        assert again.metadata["cache_hits"]["gpu_docs"] == CONFIG.top_k
    with pytest.raises(ConfigError, match="context_str"):
        as_query_engine(ivf_index, cache=cache, prompt="no context here {query_str}")


# ---------------------------------------------------------------------- framework side only


def test_index_as_query_engine_drops_the_cache_keyword(ivf_index: VectorStoreIndex) -> None:
    """Why the guide says `as_query_engine(index, cache=...)`: LlamaIndex ignores `cache=`."""
    engine = ivf_index.as_query_engine(llm=MockLLM(), cache=object())
    assert not isinstance(engine, RAGCacheQueryEngine)
    assert "cache" not in vars(engine)


def test_prompt_config_from_a_llama_index_template() -> None:
    config = prompt_config(DEFAULT_TEXT_QA_PROMPT)
    pre, post = DEFAULT_TEXT_QA_PROMPT_TMPL.split("{context_str}")
    assert config.system_prompt == pre
    assert config.head == "{system}"
    assert config.question == post.replace("{query_str}", "{question}")
    assert prompt_config("{{a}} {context_str} Q: {query_str}").system_prompt == "{a} "
    with pytest.raises(ConfigError, match="query_str"):
        prompt_config("{query_str} {context_str}")
    with pytest.raises(ConfigError, match="cannot fill"):
        prompt_config("{context_str} {query_str} {other}")
    assert prompt_config("{context_str}{query_str}", PromptConfig(add_bos=False)).add_bos is False


def test_unsupported_llama_index_version_fails_at_import(tmp_path: Path) -> None:
    done = import_with_version(
        "ragcache_integrations.llama_index", DISTRIBUTION, "0.10.3", tmp_path
    )
    assert done.returncode != 0
    assert "UnsupportedFrameworkError" in done.stderr
    assert "0.10.3 is installed" in done.stderr
    with pytest.raises(UnsupportedFrameworkError, match="supports"):
        check_version(DISTRIBUTION, SpecifierSet(">=99"))
    with pytest.raises(UnsupportedFrameworkError, match="not installed"):
        check_version("no-such-distribution-ragcache", SpecifierSet(">=0"))


# ---------------------------------------------------------------------- chat (issue 23)


@pytest.mark.vllm
@pytest.mark.parametrize("mode", ["context", "condense_plus_context"])
def test_chat_engine_two_turns_send_the_history_and_hit(
    cache: Any, simple_index: VectorStoreIndex, mode: str
) -> None:
    """as_chat_engine(index, cache=): turn 2's prompt holds turn 1 (after the documents,
    computed), its answer is plain vLLM's on those ids, and another conversation with the same
    turns hits its documents. condense_plus_context searches the rephrased question. Each LLM
    call (the rephrasing too) is an LLM event of the callback manager, with the messages sent."""
    debug = LlamaDebugHandler()
    engine = as_chat_engine(
        simple_index,
        cache=cache,
        chat_mode=mode,
        similarity_top_k=2,
        callback_manager=CallbackManager([debug]),
    )
    question = QUESTIONS[0]
    follow = question + " Tell me more."
    one = engine.chat(question)
    two = engine.chat(follow)
    history = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": one.response},
    ]
    app, docs = engine._prompt(history, two.source_nodes)
    built = cache.prompts.build(follow, docs, app)
    rest = cache.prompts._tokenizer.decode(built.question_ids)
    assert question in rest and one.response.strip() in rest
    expected = reference(cache, follow, docs, app)
    assert two.response == expected.text
    assert two.metadata["token_ids"] == list(expected.token_ids)
    assert two.metadata["prompt_tokens"] == built.num_tokens
    if mode == "condense_plus_context":
        assert two.metadata["searched"] != follow  # the standalone question was searched
    else:
        assert two.metadata["searched"] == follow
    assert len(engine.chat_history) == 4
    pairs = debug.get_llm_inputs_outputs()
    assert len(pairs) == (3 if mode == "condense_plus_context" else 2)  # + the rephrasing
    sent = pairs[-1][0].payload[EventPayload.MESSAGES]
    assert [m.role.value for m in sent] == ["system", "user", "assistant", "user"]
    assert sent[1].content == question and sent[-1].content == follow
    assert sent[2].content == one.response
    assert all(n.node.get_content(MetadataMode.LLM) in sent[0].content for n in two.source_nodes)
    assert pairs[-1][1].payload[EventPayload.RESPONSE].message.content == two.response
    if mode == "condense_plus_context":
        condensed = pairs[1][0].payload[EventPayload.MESSAGES]
        assert len(condensed) == 1 and follow in condensed[0].content
        assert (
            pairs[1][1].payload[EventPayload.RESPONSE].message.content.strip()
            == two.metadata["searched"]
        )
    other = as_chat_engine(simple_index, cache=cache, chat_mode=mode, similarity_top_k=2)
    again = other.chat(follow, chat_history=engine.chat_history[:2])
    assert again.response == two.response
    hits = again.metadata["cache_hits"]
    assert hits["gpu_docs"] + hits["host_docs"] == len(docs) > 0
    assert other.chat_history == []  # a given history is used, not kept
    with pytest.raises(TypeError, match="streaming"):
        as_chat_engine(simple_index, cache=cache, streaming=True)
    with pytest.raises(NotImplementedError, match="condense_question"):
        as_chat_engine(simple_index, cache=cache, chat_mode="condense_question")  # type: ignore[arg-type]
