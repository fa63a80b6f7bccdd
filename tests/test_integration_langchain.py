"""RAGCacheRunnable / RAGCacheLLM in real LCEL chains over real langchain-community FAISS
stores and a real vLLM engine: answers match plain vLLM on the same prompt ids, repeats hit the
cache, sources are the store's own top-k, callbacks fire like LangChain's own, bad input fails
clearly. Conversations, the chat model and the guide's snippets: test_integration_langchain_chat.py
(the same cache, emptied for each module)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import _integration_helpers
import _langchain_helpers
import pytest
from _integration_helpers import import_with_version, reference
from _langchain_helpers import (
    FAISS,
    LC_DOCS,
    QUESTIONS,
    RETRIEVAL_PROMPT,
    Record,
)
from langchain_core.documents import Document as LCDocument
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import PromptTemplate
from langchain_core.runnables import RunnablePassthrough
from packaging.specifiers import SpecifierSet

from ragcache_core.app_prompt import AppPrompt
from ragcache_core.documents import Document
from ragcache_core.errors import InputError
from ragcache_integrations.langchain import (
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

# The module-scoped fixtures this module builds for itself (found by their names here).
cache = _integration_helpers.cache
embeddings = _langchain_helpers.embeddings
flat_store = _langchain_helpers.flat_store
ivf_store = _langchain_helpers.ivf_store


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
