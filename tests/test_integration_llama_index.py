"""RAGCacheQueryEngine on real LlamaIndex indexes (Faiss IVF, SimpleVectorStore) and a real
vLLM engine: answers match plain vLLM on the same prompt ids, repeats hit the cache, sources
are the index's own top-k, instrumentation fires, bad input fails clearly; LlamaIndex's own
keywords (text_qa_template, node_postprocessors, response_mode, filters), prompt keys and LLM
events behave as on the stock engine."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import pytest
from _integration_helpers import (
    CONFIG,
    GuideCache,
    corpus,
    guide_blocks,
    import_with_version,
    questions,
    reference,
    shared_cache,
)
from llama_index.core import StorageContext, VectorStoreIndex
from llama_index.core.base.response.schema import AsyncStreamingResponse, StreamingResponse
from llama_index.core.callbacks import CallbackManager, CBEventType, EventPayload, LlamaDebugHandler
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.span_handlers import SimpleSpanHandler
from llama_index.core.llms import ChatMessage, MessageRole, MockLLM
from llama_index.core.postprocessor import LongContextReorder, SimilarityPostprocessor
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.prompts import ChatPromptTemplate, PromptTemplate
from llama_index.core.prompts.chat_prompts import CHAT_TEXT_QA_PROMPT
from llama_index.core.prompts.default_prompts import (
    DEFAULT_TEXT_QA_PROMPT,
    DEFAULT_TEXT_QA_PROMPT_TMPL,
)
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle, TextNode
from llama_index.core.vector_stores import FilterOperator, MetadataFilter, MetadataFilters
from llama_index.vector_stores.faiss import FaissVectorStore
from packaging.specifiers import SpecifierSet
from pydantic import Field, PrivateAttr

from ragcache_core.app_prompt import CONTEXT, QUESTION, AppPrompt
from ragcache_core.config import PromptConfig
from ragcache_core.documents import Document
from ragcache_core.errors import ConfigError, InputError
from ragcache_core.retrieval.embedder import TfidfSvdEmbedder
from ragcache_integrations.llama_index import (
    OfflineEmbedding,
    RAGCacheQueryEngine,
    as_chat_engine,
    as_query_engine,
    node_to_document,
    prompt_config,
)
from ragcache_integrations.llama_index._compat import (
    DISTRIBUTION,
    UnsupportedFrameworkError,
    check_version,
)
from ragcache_integrations.llama_index.adapters import search_source
from ragcache_integrations.llama_index.events import formatted
from ragcache_integrations.llama_index.prompt import app_prompt as li_app_prompt

DOCS = corpus()
QUESTIONS = questions()


@pytest.fixture(scope="module")
def embed_model() -> OfflineEmbedding:
    return OfflineEmbedding(TfidfSvdEmbedder.fit([d.text for d in DOCS]))


def _nodes() -> list[TextNode]:
    return [TextNode(id_=d.id, text=d.text, metadata={"title": d.title}) for d in DOCS]


@pytest.fixture(scope="module")
def ivf_index(embed_model: OfflineEmbedding) -> VectorStoreIndex:
    vectors = np.asarray(embed_model.get_text_embedding_batch([d.text for d in DOCS]), "float32")
    dim = vectors.shape[1]
    ivf = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, 4, faiss.METRIC_INNER_PRODUCT)
    ivf.train(vectors)
    ivf.nprobe = 2
    storage = StorageContext.from_defaults(vector_store=FaissVectorStore(faiss_index=ivf))
    return VectorStoreIndex(_nodes(), storage_context=storage, embed_model=embed_model)


@pytest.fixture(scope="module")
def simple_index(embed_model: OfflineEmbedding) -> VectorStoreIndex:
    return VectorStoreIndex(_nodes(), embed_model=embed_model)


@pytest.fixture(scope="module")
def cache(tiny_model: Path, engine_pool: Any) -> Any:
    """The integration modules' shared RAGCache, cold for this module (`shared_cache`)."""
    return shared_cache(engine_pool, tiny_model)


def _source_ids(response: Any) -> list[str]:
    return [n.node.node_id for n in response.source_nodes]


def _documents(response: Any) -> tuple[Any, ...]:
    return tuple(node_to_document(n.node) for n in response.source_nodes)


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
    assert _source_ids(first) == [h.node.node_id for h in own]  # the index's own top-k
    assert [n.score for n in first.source_nodes] == pytest.approx([h.score for h in own])
    expected = reference(cache, question, _documents(first), engine.app_prompt)
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
    ids = cache.prompts.build(question, _documents(first), engine.app_prompt).token_ids
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
    assert _source_ids(response) == [h.node.node_id for h in own]
    expected = reference(cache, question, _documents(response), li_app_prompt(None, chat=True))
    assert response.metadata["token_ids"] == list(expected.token_ids)


@pytest.mark.vllm
def test_simple_vector_store(cache: Any, simple_index: VectorStoreIndex) -> None:
    question = QUESTIONS[2]
    response = as_query_engine(simple_index, cache=cache, similarity_top_k=2).query(question)
    own = simple_index.as_retriever(similarity_top_k=2).retrieve(question)
    assert _source_ids(response) == [h.node.node_id for h in own]
    expected = reference(cache, question, _documents(response), li_app_prompt(None, chat=True))
    assert response.metadata["token_ids"] == list(expected.token_ids)


@pytest.mark.vllm
def test_async_and_streaming_agree_with_sync(cache: Any, ivf_index: VectorStoreIndex) -> None:
    question = QUESTIONS[3]
    sync = as_query_engine(ivf_index, cache=cache).query(question)
    expected = reference(cache, question, _documents(sync), li_app_prompt(None, chat=True))

    async_response = asyncio.run(as_query_engine(ivf_index, cache=cache).aquery(question))
    assert async_response.response == expected.text
    assert _source_ids(async_response) == _source_ids(sync)

    streaming = as_query_engine(ivf_index, cache=cache, streaming=True).query(question)
    assert isinstance(streaming, StreamingResponse)
    assert _source_ids(streaming) == _source_ids(sync)  # known before the text is consumed
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
    assert _source_ids(async_streaming) == _source_ids(sync)


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
    nodes = [*_nodes()[:4], TextNode(id_="blank", text="", metadata={"title": "Blank"})]
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
        expected = reference(cache, question, _documents(first), engine.app_prompt)
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


# ---------------------------------------------------------------------- LlamaIndex's conventions

MY_QA = ChatPromptTemplate.from_messages(
    [
        ChatMessage(role=MessageRole.SYSTEM, content="You answer from the notes only."),
        ChatMessage(role=MessageRole.USER, content="Notes:\n{context_str}\nQ: {query_str}\nA:"),
    ]
)


def _stock(index: VectorStoreIndex, **kwargs: Any) -> Any:
    """LlamaIndex's own engine over `index` (a MockLLM: only its prompts and retrieval used)."""
    return index.as_query_engine(llm=MockLLM(), **kwargs)


@pytest.mark.vllm
def test_text_qa_template_and_the_stock_prompt_keys(
    cache: Any, ivf_index: VectorStoreIndex
) -> None:
    """`text_qa_template=` is rendered like `prompt=`; get_prompts() reports the stock engine's
    keys, and update_prompts() with the stock key changes what is sent (plain vLLM's answer on
    the new ids), refine_template is kept, a template RAGCache cannot fill changes nothing."""
    question = QUESTIONS[1]
    engine = as_query_engine(ivf_index, cache=cache, text_qa_template=MY_QA)
    assert sorted(engine.get_prompts()) == sorted(_stock(ivf_index).get_prompts())
    assert engine.get_prompts()["response_synthesizer:text_qa_template"] == MY_QA
    first = engine.query(question)
    assert engine.app_prompt == li_app_prompt(MY_QA, chat=True)
    expected = reference(cache, question, _documents(first), engine.app_prompt)
    assert first.metadata["token_ids"] == list(expected.token_ids)

    other = PromptTemplate("Context:\n{context_str}\n\nQuestion: {query_str}\nAnswer:")
    refine = PromptTemplate("{query_str} {existing_answer} {context_msg}")
    engine.update_prompts(
        {
            "response_synthesizer:text_qa_template": other,
            "response_synthesizer:refine_template": refine,
        }
    )
    prompts = engine.get_prompts()
    assert prompts["response_synthesizer:text_qa_template"] == other
    assert prompts["response_synthesizer:refine_template"] == refine
    second = engine.query(question)
    assert engine.app_prompt == li_app_prompt(other, chat=True)
    expected = reference(cache, question, _documents(second), engine.app_prompt)
    assert second.metadata["token_ids"] == list(expected.token_ids)
    assert second.metadata["prompt_tokens"] != first.metadata["prompt_tokens"]
    with pytest.raises(ConfigError, match="context_str"):
        engine.update_prompts(
            {"response_synthesizer:text_qa_template": PromptTemplate("{query_str}")}
        )
    assert engine.get_prompts()["response_synthesizer:text_qa_template"] == other
    with pytest.raises(TypeError, match="not both"):
        as_query_engine(ivf_index, cache=cache, text_qa_template=MY_QA, prompt=MY_QA)


class _Counting(BaseNodePostprocessor):
    """A postprocessor that counts its calls (what a reranker would cost)."""

    _calls: int = PrivateAttr(default=0)

    @classmethod
    def class_name(cls) -> str:
        return "Counting"

    def _postprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        self._calls += 1
        return nodes


@pytest.mark.vllm
def test_node_postprocessors_run_once_on_the_final_nodes(
    cache: Any, ivf_index: VectorStoreIndex
) -> None:
    """A similarity cutoff and LlamaIndex's LongContextReorder: the cache answers with the
    postprocessed nodes, as the stock engine's retrieve() gives them (plain vLLM's answer on
    those ids), the postprocessors run once per query (speculation off), and a repeat hits."""
    question = QUESTIONS[2]
    scores = [h.score for h in ivf_index.as_retriever(similarity_top_k=3).retrieve(question)]
    cutoff = SimilarityPostprocessor(similarity_cutoff=(scores[1] + scores[2]) / 2)
    counting = _Counting()
    post = [cutoff, LongContextReorder(), counting]
    engine = as_query_engine(ivf_index, cache=cache, similarity_top_k=3, node_postprocessors=post)
    assert engine.search.can_speculate and not engine.can_speculate
    response = engine.query(question)
    assert counting._calls == 1
    stock = _stock(
        ivf_index, similarity_top_k=3, node_postprocessors=[cutoff, LongContextReorder()]
    )
    own = stock.retrieve(QueryBundle(question))
    assert len(own) == 2
    assert _source_ids(response) == [n.node.node_id for n in own]
    assert [n.score for n in response.source_nodes] == pytest.approx([n.score for n in own])
    expected = reference(cache, question, _documents(response), engine.app_prompt)
    assert response.metadata["token_ids"] == list(expected.token_ids)
    assert response.metadata["can_speculate"] is False
    assert response.metadata["speculative"] is False
    again = engine.query(question)
    assert again.metadata["cache_hits"]["gpu_docs"] == 2
    assert counting._calls == 2


class _Reversed(BaseNodePostprocessor):
    """An app's own reordering step (as LongContextReorder is): the nodes reversed."""

    @classmethod
    def class_name(cls) -> str:
        return "Reversed"

    def _postprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        return list(reversed(nodes))


@pytest.mark.vllm
def test_cache_document_order_serves_the_cached_path_and_its_source_nodes(
    cache: Any, ivf_index: VectorStoreIndex
) -> None:
    """Issue 40: the app's reordering wins unless the engine asks for "cache", which serves
    the cached order (source nodes as served, exact on those ids), streamed too."""
    cache.clear()
    question = QUESTIONS[4]
    stored = _source_ids(as_query_engine(ivf_index, cache=cache).query(question))
    engine = as_query_engine(
        ivf_index, cache=cache, node_postprocessors=[_Reversed()], document_order="cache"
    )
    served = engine.query(question)
    assert _source_ids(served) == stored
    assert served.metadata["cache_hits"]["gpu_docs"] + served.metadata["cache_hits"][
        "host_docs"
    ] == len(stored)
    expected = reference(cache, question, _documents(served), engine.app_prompt)
    assert served.metadata["token_ids"] == list(expected.token_ids)
    streamed = as_query_engine(
        ivf_index,
        cache=cache,
        node_postprocessors=[_Reversed()],
        document_order="cache",
        streaming=True,
    ).query(question)
    assert "".join(streamed.response_gen) == expected.text
    assert _source_ids(streamed) == stored  # in the served order once the answer ended
    flipped = as_query_engine(ivf_index, cache=cache, node_postprocessors=[_Reversed()])
    assert _source_ids(flipped.query(question)) == stored[::-1]  # the app's order wins
    with pytest.raises(InputError, match="unknown document_order"):
        as_query_engine(ivf_index, cache=cache, document_order="best")


@pytest.mark.vllm
def test_filters_go_to_the_store_before_the_top_k(
    cache: Any, simple_index: VectorStoreIndex, ivf_index: VectorStoreIndex
) -> None:
    """SimpleVectorStore filters: the top-k is taken among the matching nodes (as the stock
    retriever with filters=); a FaissVectorStore refuses filters by name."""
    question = QUESTIONS[3]
    unfiltered = {
        h.node.node_id for h in simple_index.as_retriever(similarity_top_k=2).retrieve(question)
    }
    titles = [d.title for d in DOCS if d.id not in unfiltered][:5]
    filters = MetadataFilters(
        filters=[MetadataFilter(key="title", value=titles, operator=FilterOperator.IN)]
    )
    engine = as_query_engine(simple_index, cache=cache, filters=filters)
    response = engine.query(question)
    own = simple_index.as_retriever(similarity_top_k=2, filters=filters).retrieve(question)
    assert _source_ids(response) == [h.node.node_id for h in own]
    assert len(response.source_nodes) == 2  # filtered before the top-k, not after it
    assert all(n.node.metadata["title"] in titles for n in response.source_nodes)
    expected = reference(cache, question, _documents(response), engine.app_prompt)
    assert response.metadata["token_ids"] == list(expected.token_ids)
    with pytest.raises(ConfigError, match="FaissVectorStore does not support metadata filters"):
        as_query_engine(ivf_index, cache=cache, filters=filters)


def test_keywords_and_response_modes_are_checked_by_name(ivf_index: VectorStoreIndex) -> None:
    """An unknown keyword names the public call and lists both sets (never a TypeError from
    an internal function); a response mode RAGCache cannot honour is refused with its reason.
    Both are checked before the cache is looked at."""
    with pytest.raises(TypeError, match=r"as_query_engine\(index, cache=...\)") as wrong:
        as_query_engine(ivf_index, cache=object(), summary_template="x", verbose=True)  # type: ignore[arg-type]
    message = str(wrong.value)
    assert "'summary_template'" in message and "'verbose'" in message
    assert "'text_qa_template'" in message and "'nprobe'" in message  # both sets
    with pytest.raises(TypeError, match="the cache's own model"):
        as_query_engine(ivf_index, cache=object(), llm=MockLLM())  # type: ignore[arg-type]
    for mode, reason in (("refine", "one LLM call per node"), ("tree_summarize", "several")):
        with pytest.raises(NotImplementedError, match=f"'{mode}' is not served.*{reason}"):
            as_query_engine(ivf_index, cache=object(), response_mode=mode)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="not a LlamaIndex ResponseMode"):
        as_query_engine(ivf_index, cache=object(), response_mode="fast")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"node_postprocessors\[1\]"):
        as_query_engine(
            ivf_index, cache=object(), node_postprocessors=[LongContextReorder(), "rerank"]
        )  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="a list of node postprocessors"):
        as_query_engine(ivf_index, cache=object(), node_postprocessors=LongContextReorder())  # type: ignore[arg-type]
    filters = MetadataFilters(filters=[MetadataFilter(key="title", value="x")])
    with pytest.raises(ConfigError, match="FaissVectorStore"):
        search_source(ivf_index, filters=filters)
    with pytest.raises(TypeError, match="MetadataFilters"):
        search_source(ivf_index, filters={"title": "x"})  # type: ignore[arg-type]


def test_formatted_prompt_fills_documents_and_question() -> None:
    """What the LLM events carry: the app's messages (or, for a model without a chat
    template, its text) with the documents and the question in."""
    docs = (Document("a", "alpha", prompt_text="A!"), Document("b", "beta", prompt_text="B!"))
    chat = AppPrompt(
        messages=(
            {"role": "system", "content": "S"},
            {"role": "user", "content": CONTEXT + QUESTION},
        ),
        separator="\n\n",
    )
    messages = formatted(chat, "why?", docs, chat_model=True)
    assert isinstance(messages, list)
    assert [(m.role.value, m.content) for m in messages] == [
        ("system", "S"),
        ("user", "A!\n\nB!why?"),
    ]
    text = AppPrompt(text="ctx: " + CONTEXT + " q: " + QUESTION, separator="|")
    assert formatted(text, "why?", docs, chat_model=False) == "ctx: A!|B! q: why?"
    as_chat = formatted(text, "why?", docs, chat_model=True)
    assert isinstance(as_chat, list) and as_chat[0].role is MessageRole.USER


class _LLMEvents(BaseEventHandler):
    seen: list[Any] = Field(default_factory=list)

    @classmethod
    def class_name(cls) -> str:
        return "RecordLLMEvents"

    def handle(self, event: Any, **kwargs: Any) -> None:
        if event.class_name().startswith("LLMChat"):
            self.seen.append(event)


@pytest.mark.vllm
def test_llm_events_carry_the_prompt_the_answer_and_cached_tokens(
    cache: Any, ivf_index: VectorStoreIndex
) -> None:
    """A plain instrumentation handler and LlamaIndex's LlamaDebugHandler (through the
    engine's callback manager) read the formatted messages, the answer, and the usage with
    cached tokens, for a query and for a stream."""
    question = QUESTIONS[4]
    debug = LlamaDebugHandler()
    engine = as_query_engine(
        ivf_index, cache=cache, text_qa_template=MY_QA, callback_manager=CallbackManager([debug])
    )
    events = _LLMEvents()
    root = get_dispatcher()
    root.add_event_handler(events)
    try:
        engine.query(question)
        response = engine.query(question)  # a repeat: its documents are cached
        streaming = as_query_engine(
            ivf_index, cache=cache, text_qa_template=MY_QA, streaming=True
        ).query(question)
        streamed = "".join(streaming.response_gen)
    finally:
        root.event_handlers.remove(events)
    names = [e.class_name() for e in events.seen]
    assert names[:4] == ["LLMChatStartEvent", "LLMChatEndEvent"] * 2
    assert "LLMChatInProgressEvent" in names[4:]
    assert names[4] == "LLMChatStartEvent" and names[-1] == "LLMChatEndEvent"
    start, end = events.seen[2], events.seen[3]
    nodes = [n.node for n in response.source_nodes]
    context = "\n\n".join(n.get_content(MetadataMode.LLM).strip() for n in nodes)
    wanted = MY_QA.format_messages(context_str=context, query_str=question)
    assert [(m.role, m.content) for m in start.messages] == [(m.role, m.content) for m in wanted]
    assert end.response.message.content == response.response
    usage = end.response.raw["usage"]
    assert usage["prompt_tokens"] == response.metadata["prompt_tokens"]
    assert usage["completion_tokens"] == len(response.metadata["token_ids"])
    cached = response.metadata["cache_hits"]["cached_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == cached > 0
    assert end.response.additional_kwargs["cached_tokens"] == cached
    assert events.seen[-1].response.message.content == streamed == response.response

    pairs = debug.get_llm_inputs_outputs()
    assert len(pairs) == 2
    llm_start, llm_end = pairs[1]
    assert llm_start.event_type is CBEventType.LLM
    sent = llm_start.payload[EventPayload.MESSAGES]
    assert sent[-1].content == wanted[-1].content and question in sent[-1].content
    assert llm_end.payload[EventPayload.RESPONSE].message.content == response.response


def test_postprocessed_nodes_keep_how_they_are_shown() -> None:
    """A node a postprocessor only reorders keeps the searched document (its prompt text, e.g.
    without the metadata its node excluded from the LLM view), even when the node handed to the
    postprocessor was rebuilt from the document (`from_retriever` has no docstore); a node whose
    text a postprocessor changed becomes a new document. One stage, whatever the source's."""
    from ragcache_core.retrieval.source import CallableSource
    from ragcache_integrations.llama_index.sources import RecordingSource

    docs = [
        Document("a", "alpha text", {"title": "A"}, prompt_text="alpha as shown"),
        Document("b", "beta text", {"title": "B"}, prompt_text="beta as shown"),
        Document("c", "gamma text", {"title": "C"}, prompt_text="gamma as shown"),
    ]
    source = CallableSource(lambda q, k: [(d, 1.0 - i / 10) for i, d in enumerate(docs)], "s")

    class _Rewrite(BaseNodePostprocessor):
        @classmethod
        def class_name(cls) -> str:
            return "Rewrite"

        def _postprocess_nodes(
            self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
        ) -> list[NodeWithScore]:
            nodes[0].node.set_content("rewritten")
            return nodes

    def rebuilt(doc: Document) -> TextNode:
        return TextNode(id_=doc.id, text=doc.text, metadata=dict(doc.metadata))

    recording = RecordingSource(source, [LongContextReorder(), _Rewrite()], rebuilt)
    assert not recording.can_speculate
    stages = list(recording.search_stages("why?", 3))
    assert len(stages) == 1 and stages[0].is_last
    shown = [(d.id, d.prompt_text) for d in stages[0].documents]
    assert shown[1:] == [("c", "gamma as shown"), ("b", "beta as shown")]  # reordered, kept
    assert shown[0][0] == "a" and stages[0].documents[0].text == "rewritten"
    assert recording.nodes is not None and [n.node.node_id for n in recording.nodes] == [
        "a",
        "c",
        "b",
    ]


GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guide-llamaindex.md"


NOT_RUN_HERE = {
    "## With a shared server": "a ragcache serve at http://ragcache:8000: test_serve_clients.py",
    "## Trying a real chat template offline": "a new engine on that model: only main() is checked",
}


@pytest.mark.vllm
def test_every_guide_snippet_runs_as_written(
    cache: Any, ivf_index: VectorStoreIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each python block of the LlamaIndex guide runs as written on the real engine, with the
    app's own index (and template) and the guide's model path standing for the module's cache;
    `main()` is called where a block defines one. Every block is run or named in
    NOT_RUN_HERE, so a new block is run too."""
    import ragcache_core

    monkeypatch.setattr(ragcache_core, "RAGCache", GuideCache(cache))
    app: dict[str, Any] = {"index": ivf_index, "cache": cache, "as_query_engine": as_query_engine}
    app["my_chat_qa_template"] = ChatPromptTemplate.from_messages(
        [("system", "Answer from these notes.\n{context_str}"), ("user", "{query_str}")]
    )
    ran, skipped = [], []
    for heading, code in guide_blocks(GUIDE, ("## ", "**")):
        names = {**app, "__name__": "guide"}
        compiled = compile(code, f"guide-llamaindex.md ({heading})", "exec")
        if heading.startswith(tuple(NOT_RUN_HERE)):
            skipped.append(heading)  # compiled, not run here
            continue
        exec(compiled, names)
        if callable(names.get("main")):
            names["main"]()
        if heading.startswith("## Prompts, postprocessors"):
            assert names["response"].metadata["can_speculate"] is False
            prompts = names["engine"].get_prompts()
            assert prompts["response_synthesizer:text_qa_template"] == names["qa"]
        if heading.startswith("**The prompt and the answer**"):
            start, end = names["start"], names["end"]
            assert start.event_type is CBEventType.LLM
            assert end.payload[EventPayload.RESPONSE].message.content
        ran.append(heading)
    assert len(skipped) == len(NOT_RUN_HERE), skipped
    assert len(ran) >= 5, ran
