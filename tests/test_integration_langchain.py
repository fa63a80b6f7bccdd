"""RAGCacheRunnable / RAGCacheLLM in real LCEL chains over real langchain-community FAISS
stores and a real vLLM engine: answers match plain vLLM on the same prompt ids, repeats hit the
cache, sources are the store's own top-k, callbacks fire like LangChain's own, bad input fails
clearly."""

from __future__ import annotations

import asyncio
import logging
import warnings
from operator import itemgetter
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import pytest
from _integration_helpers import (
    REPO,
    GuideCache,
    corpus,
    guide_blocks,
    import_with_version,
    questions,
    reference,
    shared_cache,
)
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.chat_history import InMemoryChatMessageHistory
from langchain_core.documents import Document as LCDocument
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder, PromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_core.runnables.history import RunnableWithMessageHistory
from packaging.specifiers import SpecifierSet

from ragcache_core.app_prompt import AppPrompt
from ragcache_core.documents import Document
from ragcache_core.errors import InputError
from ragcache_core.retrieval.embedder import TfidfSvdEmbedder
from ragcache_integrations.langchain import (
    EVENT_NAME,
    OfflineEmbeddings,
    RAGCacheChatModel,
    RAGCacheLLM,
    RAGCacheRunnable,
    document_id,
    to_ragcache,
)
from ragcache_integrations.langchain._compat import (
    DISTRIBUTION,
    UnsupportedFrameworkError,
    check_version,
)

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # "langchain-community is being sunset"
    from langchain_community.docstore.in_memory import InMemoryDocstore
    from langchain_community.vectorstores import FAISS
    from langchain_community.vectorstores.utils import DistanceStrategy

DOCS = corpus()
QUESTIONS = questions()
LC_DOCS = [LCDocument(page_content=d.text, metadata={"title": d.title}) for d in DOCS]
IDS = [d.id for d in DOCS]


@pytest.fixture(scope="module")
def embeddings() -> OfflineEmbeddings:
    return OfflineEmbeddings(TfidfSvdEmbedder.fit([d.text for d in DOCS]))


@pytest.fixture(scope="module")
def flat_store(embeddings: OfflineEmbeddings) -> FAISS:
    return FAISS.from_documents(LC_DOCS, embeddings, ids=IDS)


@pytest.fixture(scope="module")
def ivf_store(embeddings: OfflineEmbeddings) -> FAISS:
    vectors = np.asarray(embeddings.embed_documents([d.text for d in DOCS]), dtype=np.float32)
    dim = vectors.shape[1]
    ivf = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, 4, faiss.METRIC_INNER_PRODUCT)
    ivf.train(vectors)
    ivf.nprobe = 2
    store = FAISS(
        embeddings,
        ivf,
        InMemoryDocstore(),
        {},
        distance_strategy=DistanceStrategy.MAX_INNER_PRODUCT,
    )
    store.add_documents(LC_DOCS, ids=IDS)
    return store


@pytest.fixture(scope="module")
def cache(tiny_model: Path, engine_pool: Any) -> Any:
    """The integration modules' shared RAGCache, cold for this module (`shared_cache`)."""
    return shared_cache(engine_pool, tiny_model)


class Record(BaseCallbackHandler):
    """Collects what LangChain reports to a callback handler."""

    def __init__(self) -> None:
        self.starts: list[str] = []
        self.ends = 0
        self.reports: list[dict[str, Any]] = []

    def on_chain_start(self, serialized: Any, inputs: Any, **kwargs: Any) -> None:
        self.starts.append(str(kwargs.get("name")))

    def on_chain_end(self, outputs: Any, **kwargs: Any) -> None:
        self.ends += 1

    def on_custom_event(self, name: str, data: Any, **kwargs: Any) -> None:
        if name == EVENT_NAME:
            self.reports.append(data)


def _chain(retriever: Any, cache: Any) -> Any:
    return (
        {"context": retriever, "question": RunnablePassthrough()}
        | RAGCacheRunnable(cache=cache)
        | StrOutputParser()
    )


def _expected(cache: Any, store: FAISS, question: str, k: int = 2) -> tuple[Any, list[str]]:
    docs = store.similarity_search(question, k=k)
    return reference(cache, question, tuple(to_ragcache(d) for d in docs)), [d.id for d in docs]


# ---------------------------------------------------------------------- with the engine


@pytest.mark.vllm
def test_lcel_chain_matches_vllm_hits_cache_and_reports(cache: Any, flat_store: FAISS) -> None:
    chain = _chain(flat_store.as_retriever(search_kwargs={"k": 2}), cache)
    question = QUESTIONS[0]
    expected, source_ids = _expected(cache, flat_store, question)
    record = Record()
    assert chain.invoke(question, config={"callbacks": [record]}) == expected.text
    assert "RAGCacheRunnable" in record.starts and record.ends == len(record.starts)
    (report,) = record.reports
    assert report["token_ids"] == list(expected.token_ids)
    assert [d.id for d in report["sources"]] == source_ids

    again = Record()
    assert chain.invoke(question, config={"callbacks": [again]}) == expected.text
    assert again.reports[0]["cache_hits"]["gpu_docs"] == 2


@pytest.mark.vllm
def test_the_runnable_serves_the_cached_order_when_asked(cache: Any, flat_store: FAISS) -> None:
    """Issue 40: the chain's order wins unless the runnable asks for "cache", which serves
    the cached path (exact on those ids) and reports its sources as served."""
    cache.clear()
    question = QUESTIONS[1]
    docs = flat_store.similarity_search(question, k=2)
    RAGCacheRunnable(cache=cache).invoke({"context": docs, "question": question})
    flipped = {"context": docs[::-1], "question": question}
    record = Record()
    ordered = RAGCacheRunnable(cache=cache, document_order="cache")
    answer = ordered.invoke(flipped, config={"callbacks": [record]})
    (report,) = record.reports
    assert [d.id for d in report["sources"]] == [d.id for d in docs]
    assert report["retrieval_ranks"] == [1, 0]
    assert report["cache_hits"]["gpu_docs"] + report["cache_hits"]["host_docs"] == 2
    expected = reference(cache, question, tuple(to_ragcache(d) for d in docs))
    assert answer == expected.text and report["token_ids"] == list(expected.token_ids)
    kept = Record()
    RAGCacheRunnable(cache=cache).invoke(flipped, config={"callbacks": [kept]})
    assert [d.id for d in kept.reports[0]["sources"]] == [d.id for d in docs[::-1]]
    with pytest.raises(ValueError, match="unknown document_order"):
        RAGCacheRunnable(cache=cache, document_order="best")


RETRIEVAL_PROMPT = ChatPromptTemplate.from_messages(
    [
        ("system", "Use the given context to answer the question. Context: {context}"),
        ("human", "{input}"),
    ]
)


@pytest.mark.vllm
def test_the_chains_own_chat_prompt_is_sent_as_the_plain_chain_would(
    cache: Any, flat_store: FAISS
) -> None:
    """`RAGCacheRunnable(prompt=...)` renders the chain's ChatPromptTemplate (roles kept, other
    inputs filled in) through the model's chat template: the ids are the plain
    `prompt | chat model` chain's, the answer plain vLLM's on them, and a repeat hits."""
    retriever = flat_store.as_retriever(search_kwargs={"k": 2})
    runnable = RAGCacheRunnable(cache=cache, prompt=RETRIEVAL_PROMPT, question_key="input")
    chain = {"context": retriever, "input": RunnablePassthrough()} | runnable | StrOutputParser()
    question = QUESTIONS[4]
    docs = flat_store.similarity_search(question, k=2)
    # The plain chain: the same prompt, the documents joined as create_stuff_documents_chain does.
    context = "\n\n".join(d.page_content for d in docs)
    roles = {"system": "system", "human": "user"}
    messages = [
        {"role": roles[m.type], "content": str(m.content)}
        for m in RETRIEVAL_PROMPT.format_messages(context=context, input=question)
    ]
    tokenizer = cache.prompts._tokenizer
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    plain_ids = tokenizer.encode(text, add_special_tokens=False)
    app = runnable._framing({"input": question}).prompt
    shown = tuple(
        Document(d.id, d.text, d.metadata, prompt_text=d.text)
        for d in (to_ragcache(x) for x in docs)
    )
    assert cache.prompts.build(question, shown, app).token_ids == plain_ids
    expected = reference(cache, question, shown, app)
    record = Record()
    assert chain.invoke(question, config={"callbacks": [record]}) == expected.text
    assert record.reports[0]["token_ids"] == list(expected.token_ids)
    assert record.reports[0]["prompt_tokens"] == len(plain_ids)
    again = Record()
    chain.invoke(question, config={"callbacks": [again]})
    assert again.reports[0]["cache_hits"]["gpu_docs"] == 2
    # Another tenant's salt: the same chain, no hit on the first tenant's documents.
    salted = {"context": retriever, "input": RunnablePassthrough()} | runnable.model_copy(
        update={"cache_salt": "tenant-b"}
    )
    other = Record()
    salted.invoke(question, config={"callbacks": [other]})
    assert other.reports[0]["cache_hits"]["gpu_docs"] == 0


@pytest.mark.vllm
def test_async_batch_and_streaming(cache: Any, flat_store: FAISS) -> None:
    chain = _chain(flat_store.as_retriever(search_kwargs={"k": 2}), cache)
    asked = QUESTIONS[1:4]
    expected = [_expected(cache, flat_store, q)[0].text for q in asked]
    assert chain.batch(asked) == expected
    assert asyncio.run(chain.ainvoke(asked[0])) == expected[0]
    assert asyncio.run(chain.abatch(asked)) == expected

    record = Record()
    pieces = list(chain.stream(asked[1], config={"callbacks": [record]}))
    assert "".join(pieces) == expected[1]
    assert len(record.reports) == 1  # the streamed call reports too

    async def astream() -> list[str]:
        return [piece async for piece in chain.astream(asked[2])]

    assert "".join(asyncio.run(astream())) == expected[2]


@pytest.mark.vllm
def test_from_vectorstore_retrieves_in_stages(cache: Any, ivf_store: FAISS) -> None:
    runnable = RAGCacheRunnable.from_vectorstore(ivf_store, cache=cache, k=3)
    assert runnable.search.can_speculate  # the IVF index is searched in stages
    question = QUESTIONS[4]
    expected, source_ids = _expected(cache, ivf_store, question, k=3)
    record = Record()
    assert runnable.invoke(question, config={"callbacks": [record]}) == expected.text
    assert [d.id for d in record.reports[0]["sources"]] == source_ids
    assert record.reports[0]["token_ids"] == list(expected.token_ids)
    assert runnable.invoke({"question": question}) == expected.text


@pytest.mark.vllm
def test_llm_wrapper_finds_documents_in_the_prompt(cache: Any, flat_store: FAISS) -> None:
    llm = RAGCacheLLM(cache=cache)
    retriever = flat_store.as_retriever(search_kwargs={"k": 2})
    prompt = PromptTemplate.from_template(
        "Answer from the context.\n\n{context}\n\nQuestion: {question}\nAnswer:"
    )

    def format_docs(docs: list[LCDocument]) -> str:
        return "\n\n".join(d.page_content for d in docs)

    context = {"context": llm.watch(retriever) | format_docs, "question": RunnablePassthrough()}
    question = QUESTIONS[5]
    answer = (context | prompt | llm | StrOutputParser()).invoke(question)

    rendered = (context | prompt).invoke(question).to_string()
    found = llm.memory.find(rendered)
    assert [d.id for d in found] == [d.id for d in retriever.invoke(question)]
    # The prompt goes out exactly as LangChain rendered it: the ids of a completions LLM on
    # `vllm serve` (the text tokenized whole with the tokenizer's special tokens).
    exact = AppPrompt(text=rendered, chat=False)
    tokenizer = cache.prompts._tokenizer
    assert cache.prompts.build(question, found, exact).token_ids == tokenizer.encode(rendered)
    expected = reference(cache, question, found, exact)
    assert answer == expected.text

    info = llm.generate([rendered]).generations[0][0].generation_info
    assert info is not None
    assert info["token_ids"] == list(expected.token_ids)
    assert info["cache_hits"]["gpu_docs"] == 2  # the chain's call cached both documents


@pytest.mark.vllm
def test_llm_wrapper_answers_uncached_when_it_finds_nothing(
    cache: Any, caplog: pytest.LogCaptureFixture
) -> None:
    llm = RAGCacheLLM(cache=cache)
    prompt = "Context: something no retriever returned.\nQuestion: why?\nAnswer:"
    with caplog.at_level(logging.WARNING):
        first = llm.invoke(prompt)
        llm.invoke(prompt)
    assert first == reference(cache, prompt, (), AppPrompt(text=prompt, chat=False)).text
    assert caplog.text.count("llm.watch(retriever)") == 2  # said whenever it applies


@pytest.mark.vllm
def test_empty_retrieval_answers_without_context(
    cache: Any, flat_store: FAISS, caplog: pytest.LogCaptureFixture
) -> None:
    retriever = flat_store.as_retriever(
        search_type="similarity_score_threshold", search_kwargs={"score_threshold": 0.999}
    )
    question = "zzqx vvbn"
    assert retriever.invoke(question) == []  # a real retriever with nothing to return
    record = Record()
    with caplog.at_level(logging.WARNING):
        answer = _chain(retriever, cache).invoke(question, config={"callbacks": [record]})
    assert answer == reference(cache, question, ()).text
    assert record.reports[0]["no_context"] is True
    assert "no documents" in caplog.text


@pytest.mark.vllm
def test_bad_input(cache: Any) -> None:
    runnable = RAGCacheRunnable(cache=cache)
    doc = LC_DOCS[0]
    for bad in (42, None, "  "):
        with pytest.raises(InputError, match="non-empty string"):
            runnable.invoke({"context": [doc], "question": bad})
    with pytest.raises(InputError, match="has no text"):
        runnable.invoke({"context": [LCDocument(page_content=" ", id="x")], "question": "q"})
    with pytest.raises(InputError, match="LangChain Documents"):
        runnable.invoke({"context": [{"page_content": "x"}], "question": "q"})
    with pytest.raises(InputError, match="no search"):
        runnable.invoke("a question with no context")  # no store to retrieve from
    with pytest.raises(InputError, match="input must be"):
        runnable.invoke(42)  # type: ignore[arg-type]
    # The core refuses an empty document as the integrations do ("has no text").
    for blank in ("", "  \n"):
        with pytest.raises(InputError, match="document 'e' has no text"):
            cache.generate("q", documents=[Document("e", blank)])


# ---------------------------------------------------------------------- framework side only


def test_document_ids() -> None:
    text = "some text"
    assert document_id(LCDocument(page_content=text, id="a", metadata={"id": "b"})) == "a"
    assert document_id(LCDocument(page_content=text, metadata={"id": 7, "source": "s"})) == "7"
    assert document_id(LCDocument(page_content=text, metadata={"source": "f.md"})) == "f.md"
    hashed = document_id(LCDocument(page_content=text))
    assert hashed.startswith("sha1:") and hashed == document_id(LCDocument(page_content=text))
    assert hashed != document_id(LCDocument(page_content="other text"))


def test_unsupported_langchain_version_fails_at_import(tmp_path: Path) -> None:
    done = import_with_version("ragcache_integrations.langchain", DISTRIBUTION, "0.3.9", tmp_path)
    assert done.returncode != 0
    assert "UnsupportedFrameworkError" in done.stderr
    assert "0.3.9 is installed" in done.stderr
    with pytest.raises(UnsupportedFrameworkError, match="supports"):
        check_version(DISTRIBUTION, SpecifierSet("<1"))


# ---------------------------------------------------------------------- chat (issue 23)

CHAT_PROMPT = ChatPromptTemplate.from_messages(
    [
        ("system", "Use the given context to answer the question. Context: {context}"),
        MessagesPlaceholder("chat_history"),
        ("human", "{input}"),
    ]
)


class LLMRecord(BaseCallbackHandler):
    """What an LLM was sent and what it reported."""

    def __init__(self) -> None:
        self.prompts: list[str] = []
        self.infos: list[dict[str, Any]] = []

    def on_llm_start(self, serialized: Any, prompts: list[str], **kwargs: Any) -> None:
        self.prompts.extend(prompts)

    def on_llm_end(self, response: Any, **kwargs: Any) -> None:
        self.infos.extend(g[0].generation_info for g in response.generations)


def _shown(docs: list[LCDocument]) -> tuple[Document, ...]:
    return tuple(
        Document(d.id, d.text, d.metadata, prompt_text=d.text)
        for d in (to_ragcache(x) for x in docs)
    )


@pytest.mark.vllm
def test_retrieval_chain_with_message_history_sends_the_history_and_hits(
    cache: Any, flat_store: FAISS
) -> None:
    """create_retrieval_chain (keys input, chat_history, context) around RAGCacheRunnable, in
    RunnableWithMessageHistory: turn 2 carries turn 1's answer in its prompt ids (after the
    documents, computed), its answer is plain vLLM's on those ids, and its documents (the
    same as turn 1's) hit."""
    chains = pytest.importorskip("langchain_classic.chains")
    retriever = flat_store.as_retriever(search_kwargs={"k": 2})
    runnable = RAGCacheRunnable(cache=cache, prompt=CHAT_PROMPT)
    chain = chains.create_retrieval_chain(retriever, runnable)
    histories: dict[str, InMemoryChatMessageHistory] = {}
    chat = RunnableWithMessageHistory(
        chain,
        lambda session: histories.setdefault(session, InMemoryChatMessageHistory()),
        input_messages_key="input",
        history_messages_key="chat_history",
        output_messages_key="answer",
    )
    session = {"configurable": {"session_id": "s1"}}
    question = QUESTIONS[2]
    follow = question + " Tell me more."
    docs = flat_store.similarity_search(question, k=2)
    assert [d.id for d in flat_store.similarity_search(follow, k=2)] == [d.id for d in docs]
    first, second = Record(), Record()
    one = chat.invoke({"input": question}, config={**session, "callbacks": [first]})
    two = chat.invoke({"input": follow}, config={**session, "callbacks": [second]})
    history = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": one["answer"]},
    ]
    app = runnable._framing({"input": follow, "chat_history": history}).prompt
    built = cache.prompts.build(follow, _shown(docs), app)
    rest = cache.prompts._tokenizer.decode(built.question_ids)
    assert question in rest and one["answer"].strip() in rest  # the history, computed
    expected = reference(cache, follow, _shown(docs), app)
    assert two["answer"] == expected.text
    assert second.reports[0]["token_ids"] == list(expected.token_ids)
    assert second.reports[0]["prompt_tokens"] == built.num_tokens
    assert (
        first.reports[0]["cache_hits"]["computed_docs"] + first.reports[0]["cache_hits"]["gpu_docs"]
        == 2
    )
    hits = second.reports[0]["cache_hits"]
    assert hits["gpu_docs"] + hits["host_docs"] == 2  # turn 1's documents hit
    assert len(histories["s1"].messages) == 4


@pytest.mark.vllm
def test_message_history_in_the_caches_own_layout(cache: Any, flat_store: FAISS) -> None:
    """Without prompt=, a chain's chat_history takes the cache's conversation layout (it was
    silently dropped): the turns follow the documents, the documents hit in a second
    conversation."""
    retriever = flat_store.as_retriever(search_kwargs={"k": 2})
    chain = RunnablePassthrough.assign(context=itemgetter("input") | retriever) | RAGCacheRunnable(
        cache=cache
    )
    histories: dict[str, InMemoryChatMessageHistory] = {}
    chat = RunnableWithMessageHistory(
        chain,
        lambda session: histories.setdefault(session, InMemoryChatMessageHistory()),
        input_messages_key="input",
        history_messages_key="chat_history",
    )
    question = QUESTIONS[3]
    follow = question + " Tell me more."
    docs = tuple(to_ragcache(d) for d in flat_store.similarity_search(follow, k=2))
    one = chat.invoke({"input": question}, config={"configurable": {"session_id": "a"}})
    record = Record()
    two = chat.invoke(
        {"input": follow}, config={"configurable": {"session_id": "a"}, "callbacks": [record]}
    )
    history = [{"role": "user", "content": question}, {"role": "assistant", "content": one}]
    app = cache.prompts.conversation(history)
    assert two == reference(cache, follow, docs, app).text
    rest = cache.prompts._tokenizer.decode(cache.prompts.build(follow, docs, app).question_ids)
    assert one.strip() in rest
    histories["b"] = InMemoryChatMessageHistory(messages=[HumanMessage("Hello."), AIMessage("Hi.")])
    other = Record()
    chat.invoke(
        {"input": follow}, config={"configurable": {"session_id": "b"}, "callbacks": [other]}
    )
    hits = other.reports[0]["cache_hits"]
    assert hits["gpu_docs"] + hits["host_docs"] == 2  # another conversation, the same nodes


@pytest.mark.vllm
def test_history_aware_retriever_with_the_llm_wrapper(
    cache: Any, flat_store: FAISS, caplog: pytest.LogCaptureFixture
) -> None:
    """create_history_aware_retriever + create_stuff_documents_chain on RAGCacheLLM: the
    rephrase step (no documents) is answered uncached and logged truly (no "attach the
    retriever" warning: it is attached), the answer step finds the documents, turn 2's
    prompt holds turn 1's answer, and a repeat hits."""
    chains = pytest.importorskip("langchain_classic.chains")
    combine = pytest.importorskip("langchain_classic.chains.combine_documents")
    llm = RAGCacheLLM(cache=cache)
    retriever = llm.watch(flat_store.as_retriever(search_kwargs={"k": 2}))
    rephrase = ChatPromptTemplate.from_messages(
        [MessagesPlaceholder("chat_history"), ("human", "{input}"), ("human", "Rephrase:")]
    )
    aware = chains.create_history_aware_retriever(llm, retriever, rephrase)
    chain = chains.create_retrieval_chain(
        aware, combine.create_stuff_documents_chain(llm, CHAT_PROMPT)
    )
    question = QUESTIONS[1]
    one = chain.invoke({"input": question, "chat_history": []})
    history = [("human", question), ("ai", one["answer"])]
    asked = {"input": "And then?", "chat_history": history}
    record = LLMRecord()
    with caplog.at_level(logging.INFO):
        two = chain.invoke(asked, config={"callbacks": [record]})
    assert "attach the retriever" not in caplog.text
    assert caplog.text.count("a step without documents") == 1  # the rephrase, said truly
    rephrased, answered = record.prompts
    assert one["answer"] in rephrased and one["answer"] in answered  # the history reaches both
    found = llm.memory.find(answered)
    assert [d.id for d in found] == [d.id for d in two["context"]]
    assert record.infos[1]["documents"] == [d.id for d in two["context"]]
    again = LLMRecord()
    chain.invoke(asked, config={"callbacks": [again]})
    hits = again.infos[1]["cache_hits"]
    assert hits["gpu_docs"] + hits["host_docs"] == len(two["context"]) > 0


@pytest.mark.vllm
def test_chain_keys_and_pre_joined_context_are_named(cache: Any) -> None:
    runnable = RAGCacheRunnable(cache=cache)
    doc = LC_DOCS[0]
    with pytest.raises(InputError, match=r"'question' or 'input'.*\['context', 'query'\]"):
        runnable.invoke({"context": [doc], "query": "q"})
    with pytest.raises(InputError, match="format_docs"):
        runnable.invoke({"context": "one joined string", "question": "q"})
    with pytest.raises(InputError, match="no such variable: the history would be dropped"):
        RAGCacheRunnable(cache=cache, prompt=RETRIEVAL_PROMPT).invoke(
            {"context": [doc], "input": "q", "chat_history": [("human", "hi")]}
        )
    with pytest.raises(InputError, match="role 'system'"):
        runnable.invoke({"context": [doc], "input": "q", "chat_history": [("system", "x")]})


# ---------------------------------------------------------------------- chat model (issue 41)


def _format_docs(docs: list[LCDocument]) -> str:
    return "\n\n".join(d.page_content for d in docs)


def _plain_chat_ids(cache: Any, messages: list[BaseMessage]) -> list[int]:
    """The ids `vllm serve` makes of `messages` (ChatOpenAI's request): the chat template,
    tokenized without the tokenizer's special tokens."""
    roles = {"system": "system", "human": "user", "ai": "assistant"}
    dicts = [{"role": roles[m.type], "content": str(m.content)} for m in messages]
    tokenizer = cache.prompts._tokenizer
    text = tokenizer.apply_chat_template(dicts, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


class ChatRecord(BaseCallbackHandler):
    """What LangChain's LLM callbacks report: the messages or prompts a model was sent, and
    each answer with its usage."""

    def __init__(self) -> None:
        self.messages: list[list[BaseMessage]] = []
        self.prompts: list[str] = []
        self.answers: list[Any] = []  # the ChatGeneration / Generation of each on_llm_end
        self.llm_output: list[Any] = []

    def on_chat_model_start(
        self, serialized: Any, messages: list[list[BaseMessage]], **kwargs: Any
    ) -> None:
        self.messages.extend(messages)

    def on_llm_start(self, serialized: Any, prompts: list[str], **kwargs: Any) -> None:
        self.prompts.extend(prompts)

    def on_llm_end(self, response: Any, **kwargs: Any) -> None:
        self.answers.extend(g[0] for g in response.generations)
        self.llm_output.append(response.llm_output)


@pytest.mark.vllm
def test_chat_model_keeps_the_roles_matches_vllm_hits_and_streams(
    cache: Any, flat_store: FAISS
) -> None:
    """`prompt | RAGCacheChatModel` where `prompt | ChatOpenAI` sat: the messages go through
    the chat template (the ids `vllm serve` makes of them), the answer is plain vLLM's on those
    ids, the documents the watched retriever returned are cached and hit on a repeat, and the
    AIMessage carries LangChain's usage (cache_read) and RAGCache's report; streamed, the
    usage comes on the last chunk."""
    llm = RAGCacheChatModel(cache=cache)
    retriever = llm.watch(flat_store.as_retriever(search_kwargs={"k": 2}))
    context = {"context": retriever | _format_docs, "input": RunnablePassthrough()}
    chain = context | RETRIEVAL_PROMPT | llm
    question = QUESTIONS[5]
    docs = flat_store.similarity_search(question, k=2)
    messages = RETRIEVAL_PROMPT.format_messages(context=_format_docs(docs), input=question)
    plain_ids = _plain_chat_ids(cache, messages)
    app = AppPrompt(messages=tuple({"role": r, "content": c} for r, c in _roles(messages)))
    assert cache.prompts.build(question, _shown(docs), app).token_ids == plain_ids
    expected = reference(cache, question, _shown(docs), app)

    first = chain.invoke(question)
    assert isinstance(first, AIMessage) and first.content == expected.text
    report = first.response_metadata["ragcache"]
    assert report["token_ids"] == list(expected.token_ids)
    assert report["documents"] == [d.id for d in docs]
    assert first.response_metadata["finish_reason"] == expected.finish_reason
    usage = first.usage_metadata
    assert usage is not None and usage["input_tokens"] == len(plain_ids)
    assert usage["output_tokens"] == 8 and usage["total_tokens"] == len(plain_ids) + 8
    again = chain.invoke(question)
    assert again.content == first.content
    assert again.response_metadata["ragcache"]["cache_hits"]["gpu_docs"] == 2
    read = again.usage_metadata["input_token_details"]["cache_read"]  # type: ignore[index]
    assert read == again.response_metadata["ragcache"]["cache_hits"]["cached_tokens"] > 0

    chunks = list(chain.stream(question))
    assert [c.usage_metadata is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
    total = chunks[0]
    for chunk in chunks[1:]:
        total += chunk
    assert total.content == expected.text
    assert total.usage_metadata["input_token_details"]["cache_read"] > 0  # type: ignore[index]
    assert total.response_metadata["ragcache"]["token_ids"] == list(expected.token_ids)

    async def both() -> tuple[Any, str]:
        whole = await chain.ainvoke(question)
        text = "".join([str(c.content) async for c in chain.astream(question)])
        return whole, text

    whole, streamed = asyncio.run(both())
    assert whole.content == streamed == expected.text


def _roles(messages: list[BaseMessage]) -> list[tuple[str, str]]:
    roles = {"system": "system", "human": "user", "ai": "assistant"}
    return [(roles[m.type], str(m.content)) for m in messages]


@pytest.mark.vllm
def test_chat_model_in_create_retrieval_chain_with_history_and_callbacks(
    cache: Any, flat_store: FAISS
) -> None:
    """create_retrieval_chain + create_stuff_documents_chain with RAGCacheChatModel in place of
    ChatOpenAI: the history keeps its roles, the answer is plain vLLM's on the ids of the same
    messages, a plain handler sees on_chat_model_start with the messages and on_llm_end with
    the answer and its usage, and a repeat reads its documents from the cache."""
    chains = pytest.importorskip("langchain_classic.chains")
    combine = pytest.importorskip("langchain_classic.chains.combine_documents")
    llm = RAGCacheChatModel(cache=cache)
    retriever = llm.watch(flat_store.as_retriever(search_kwargs={"k": 2}))
    chain = chains.create_retrieval_chain(
        retriever, combine.create_stuff_documents_chain(llm, CHAT_PROMPT)
    )
    question = QUESTIONS[0] + " Briefly."
    history = [HumanMessage("Hello."), AIMessage("Hi. Ask away.")]
    asked = {"input": question, "chat_history": history}
    record = ChatRecord()
    out = chain.invoke(asked, config={"callbacks": [record]})
    docs = out["context"]
    messages = CHAT_PROMPT.format_messages(
        context=_format_docs(docs), input=question, chat_history=history
    )
    app = AppPrompt(messages=tuple({"role": r, "content": c} for r, c in _roles(messages)))
    built = cache.prompts.build(question, _shown(docs), app)
    assert built.token_ids == _plain_chat_ids(cache, messages)
    expected = reference(cache, question, _shown(docs), app)
    assert out["answer"] == expected.text
    (sent,) = record.messages
    assert [(m.type, m.content) for m in sent] == [(m.type, m.content) for m in messages]
    (answer,) = record.answers
    assert answer.message.content == expected.text
    assert answer.message.usage_metadata["input_tokens"] == built.num_tokens
    again = ChatRecord()
    chain.invoke(asked, config={"callbacks": [again]})
    message = again.answers[0].message
    assert message.usage_metadata["input_token_details"]["cache_read"] > 0
    hits = message.response_metadata["ragcache"]["cache_hits"]
    assert hits["gpu_docs"] + hits["host_docs"] == len(docs) == 2


def test_chat_model_refuses_what_it_cannot_take() -> None:
    """Bad arguments are named before anything runs (no engine needed: the checks come first)."""
    with pytest.raises(TypeError, match=r"RAGCacheChatModel\(cache=\.\.\.\)"):
        RAGCacheChatModel(cache="not a cache")
    with pytest.raises(TypeError, match=r"RAGCacheChatModel\(cache=\.\.\.\)"):
        RAGCacheChatModel()


@pytest.mark.vllm
def test_the_runnable_reports_an_llm_run_with_the_prompt_and_usage(
    cache: Any, flat_store: FAISS
) -> None:
    """A plain handler on a RAGCacheRunnable chain sees one LLM run per call: on_llm_start with
    the prompt as the model saw it (the chat template rendered, documents and question in:
    `QueryResult.prompt_text`, asked for only when someone listens), on_llm_end with the answer
    and its usage (cache_read on a repeat); streamed calls report it too."""
    retriever = flat_store.as_retriever(search_kwargs={"k": 2})
    runnable = RAGCacheRunnable(cache=cache, prompt=RETRIEVAL_PROMPT, question_key="input")
    chain = {"context": retriever, "input": RunnablePassthrough()} | runnable
    question = QUESTIONS[3] + " In short."
    docs = flat_store.similarity_search(question, k=2)
    messages = RETRIEVAL_PROMPT.format_messages(context=_format_docs(docs), input=question)
    tokenizer = cache.prompts._tokenizer
    roles = [{"role": r, "content": c} for r, c in _roles(messages)]
    text = tokenizer.apply_chat_template(roles, tokenize=False, add_generation_prompt=True)
    record = ChatRecord()
    answer = chain.invoke(question, config={"callbacks": [record]})
    assert record.prompts == [text] and record.messages == []
    (generation,) = record.answers
    assert generation.message.content == answer
    usage = generation.message.usage_metadata
    assert usage["input_tokens"] == len(tokenizer.encode(text, add_special_tokens=False))
    assert record.llm_output[0]["token_usage"]["completion_tokens"] == usage["output_tokens"] == 8
    streamed = ChatRecord()
    assert "".join(chain.stream(question, config={"callbacks": [streamed]})) == answer
    assert streamed.prompts == [text]
    message = streamed.answers[0].message
    assert message.usage_metadata["input_token_details"]["cache_read"] > 0  # a repeat
    assert message.response_metadata["ragcache"]["cache_hits"]["gpu_docs"] == 2
    # QueryResult.prompt_text: on request only, the same text.
    shown = _shown(docs)
    app = runnable._framing({"input": question}).prompt
    assert cache.generate(question, shown, prompt=app, return_prompt=True).prompt_text == text
    assert cache.generate(question, shown, prompt=app).prompt_text is None


def _guide_block(heading: str) -> str:
    """The first Python block after `heading` in docs/guide-langchain.md, as written there."""
    text = (REPO / "docs" / "guide-langchain.md").read_text(encoding="utf-8")
    after = text[text.index(heading) :]
    start = after.index("```python\n") + len("```python\n")
    return after[start : after.index("```\n", start)]


@pytest.mark.vllm
def test_the_guides_chat_model_snippet_runs_as_written(
    cache: Any, flat_store: FAISS, capsys: pytest.CaptureFixture[str]
) -> None:
    """The guide's RAGCacheChatModel snippet, run as written on a real cache and store: the
    retrieval chain answers, and the LCEL chain's repeat of its documents reads them from the
    cache."""
    namespace: dict[str, Any] = {"cache": cache, "store": flat_store}
    exec(
        compile(_guide_block("## Where a chat model sat"), "guide-langchain.md", "exec"), namespace
    )
    message = namespace["message"]
    assert isinstance(message, AIMessage)
    assert message.usage_metadata["input_token_details"]["cache_read"] > 0  # type: ignore[index]
    hits = message.response_metadata["ragcache"]["cache_hits"]
    assert hits["gpu_docs"] + hits["host_docs"] == 4  # as_retriever's k: the chain's documents
    assert str(hits) in capsys.readouterr().out


SERVER_SNIPPETS = ("## Keeping ChatOpenAI", "## With a shared server")
"""The guide's blocks that talk to a `ragcache serve` at http://ragcache:8000: run against a
real server by tests/test_serve.py (an unchanged ChatOpenAI) and tests/test_serve_clients.py
(RAGCacheClient), not here."""


@pytest.mark.vllm
def test_every_guide_snippet_runs_as_written(
    cache: Any,
    flat_store: FAISS,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each Python block of the LangChain guide runs as written on the real engine, with the
    names an app already has (its retriever, prompt and store) and with the guide's model path
    standing for the module's cache; `main()` is called where a block defines one. Every block
    is run or named in SERVER_SNIPPETS, so a new block is run too."""
    import ragcache_core
    import ragcache_integrations.langchain as integration

    retriever = flat_store.as_retriever(search_kwargs={"k": 2})
    prompt = ChatPromptTemplate.from_messages(
        [("system", "Answer from the context.\n\n{context}"), ("human", "{question}")]
    )
    app = {
        "cache": cache,
        "store": flat_store,
        "faiss_store": flat_store,
        "retriever": retriever,
        "prompt": prompt,
        "format_docs": _format_docs,
        "question": "Who wrote A Doll's House?",
        "RunnablePassthrough": RunnablePassthrough,
        "StrOutputParser": StrOutputParser,
        "BaseCallbackHandler": BaseCallbackHandler,
        **{name: getattr(integration, name) for name in integration.__all__},
    }
    # The app's chain, for the blocks that use one before the guide builds its own.
    app["chain"] = (
        {"context": retriever, "question": RunnablePassthrough()}
        | integration.RAGCacheRunnable(cache=cache, prompt=prompt)
        | StrOutputParser()
    )
    ran, skipped = [], []
    monkeypatch.setattr(ragcache_core, "RAGCache", GuideCache(cache))
    for heading, code in guide_blocks(REPO / "docs" / "guide-langchain.md"):
        if heading.startswith(SERVER_SNIPPETS):
            skipped.append(heading)
            continue
        namespace = {**app, "__name__": "guide"}
        exec(compile(code, f"guide-langchain.md ({heading})", "exec"), namespace)
        if callable(namespace.get("main")):
            namespace["main"]()
        app.update({k: v for k, v in namespace.items() if k in ("chain",)})
        ran.append(heading)
    assert [h for p in SERVER_SNIPPETS for h in skipped if h.startswith(p)] == skipped
    assert len(skipped) == len(SERVER_SNIPPETS), skipped
    assert len(ran) >= 6, ran
    out = capsys.readouterr().out
    assert out.count("\n") >= 4, out  # each main() and the callback printed its answers
