"""LangChain conversations, chat models and the guide on a real FAISS store and a real vLLM
engine: a chain's message history reaches the prompt ids (after the documents) and the
documents still hit; RAGCacheChatModel stands where ChatOpenAI sat (the roles kept, the ids
`vllm serve` makes, LangChain's usage and callbacks); the LangChain guide's snippets run as
written. The runnable and the LLM wrapper themselves: test_integration_langchain.py (the same
cache, emptied for each module)."""

from __future__ import annotations

import asyncio
import logging
from operator import itemgetter
from typing import Any

import _integration_helpers
import _langchain_helpers
import pytest
from _integration_helpers import REPO, GuideCache, guide_blocks, reference
from _langchain_helpers import (
    FAISS,
    LC_DOCS,
    QUESTIONS,
    RETRIEVAL_PROMPT,
    Record,
)
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.chat_history import InMemoryChatMessageHistory
from langchain_core.documents import Document as LCDocument
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder
from langchain_core.runnables import RunnablePassthrough
from langchain_core.runnables.history import RunnableWithMessageHistory

from ragcache_core.app_prompt import AppPrompt
from ragcache_core.documents import Document
from ragcache_core.errors import InputError
from ragcache_integrations.langchain import (
    RAGCacheChatModel,
    RAGCacheLLM,
    RAGCacheRunnable,
    to_ragcache,
)

# The module-scoped fixtures this module builds for itself (found by their names here).
cache = _integration_helpers.cache
embeddings = _langchain_helpers.embeddings
flat_store = _langchain_helpers.flat_store


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
