"""RAGCacheQueryEngine keeps LlamaIndex's conventions, on real LlamaIndex indexes (Faiss IVF,
SimpleVectorStore) and a real vLLM engine: text_qa_template and the stock prompt keys,
node_postprocessors, document_order, filters, checked keywords and response modes, LLM events
with the prompt and cached tokens; the LlamaIndex guide's snippets run as written. The query
and chat engines themselves: test_integration_llama_index.py (the same cache, emptied for each
module)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _integration_helpers
import _llama_index_helpers
import pytest
from _integration_helpers import GuideCache, guide_blocks, reference
from _llama_index_helpers import (
    DOCS,
    QUESTIONS,
    response_documents,
    source_ids,
)
from llama_index.core import VectorStoreIndex
from llama_index.core.callbacks import CallbackManager, CBEventType, EventPayload, LlamaDebugHandler
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.llms import ChatMessage, MessageRole, MockLLM
from llama_index.core.postprocessor import LongContextReorder, SimilarityPostprocessor
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.prompts import ChatPromptTemplate, PromptTemplate
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle, TextNode
from llama_index.core.vector_stores import FilterOperator, MetadataFilter, MetadataFilters
from pydantic import Field, PrivateAttr

from ragcache_core.app_prompt import CONTEXT, QUESTION, AppPrompt
from ragcache_core.documents import Document
from ragcache_core.errors import ConfigError, InputError
from ragcache_integrations.llama_index import as_query_engine
from ragcache_integrations.llama_index.adapters import search_source
from ragcache_integrations.llama_index.events import formatted
from ragcache_integrations.llama_index.prompt import app_prompt as li_app_prompt

# The module-scoped fixtures this module builds for itself (found by their names here).
cache = _integration_helpers.cache
embed_model = _llama_index_helpers.embed_model
ivf_index = _llama_index_helpers.ivf_index
simple_index = _llama_index_helpers.simple_index


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
    expected = reference(cache, question, response_documents(first), engine.app_prompt)
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
    expected = reference(cache, question, response_documents(second), engine.app_prompt)
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
    assert source_ids(response) == [n.node.node_id for n in own]
    assert [n.score for n in response.source_nodes] == pytest.approx([n.score for n in own])
    expected = reference(cache, question, response_documents(response), engine.app_prompt)
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
    stored = source_ids(as_query_engine(ivf_index, cache=cache).query(question))
    engine = as_query_engine(
        ivf_index, cache=cache, node_postprocessors=[_Reversed()], document_order="cache"
    )
    served = engine.query(question)
    assert source_ids(served) == stored
    assert served.metadata["cache_hits"]["gpu_docs"] + served.metadata["cache_hits"][
        "host_docs"
    ] == len(stored)
    expected = reference(cache, question, response_documents(served), engine.app_prompt)
    assert served.metadata["token_ids"] == list(expected.token_ids)
    streamed = as_query_engine(
        ivf_index,
        cache=cache,
        node_postprocessors=[_Reversed()],
        document_order="cache",
        streaming=True,
    ).query(question)
    assert "".join(streamed.response_gen) == expected.text
    assert source_ids(streamed) == stored  # in the served order once the answer ended
    flipped = as_query_engine(ivf_index, cache=cache, node_postprocessors=[_Reversed()])
    assert source_ids(flipped.query(question)) == stored[::-1]  # the app's order wins
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
    assert source_ids(response) == [h.node.node_id for h in own]
    assert len(response.source_nodes) == 2  # filtered before the top-k, not after it
    assert all(n.node.metadata["title"] in titles for n in response.source_nodes)
    expected = reference(cache, question, response_documents(response), engine.app_prompt)
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
