"""Template fidelity: the ids RAGCache sends for an app's own prompt are the ids of the app's
plain chain (LangChain / LlamaIndex prompt objects rendered through the model's chat template,
tokenized whole, as `vllm serve` does), for the chat templates of Llama 3.1, Qwen 2.5 and
Mistral Nemo (tokenizers and templates without weights, `ragcache_core.models.chat_fixtures`);
the cuts between root, nodes and rest sit on token boundaries of that whole text, and a node's
ids do not depend on what follows it. Tokenizer only: no engine."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

import pytest
from langchain_core.documents import Document as LCDocument
from langchain_core.prompts import ChatPromptTemplate, PromptTemplate
from llama_index.core.prompts.chat_prompts import CHAT_TEXT_QA_PROMPT
from llama_index.core.prompts.default_prompts import DEFAULT_TEXT_QA_PROMPT
from llama_index.core.schema import MetadataMode, TextNode

from ragcache_core.app_prompt import CONTEXT, QUESTION, AppPrompt
from ragcache_core.config import PromptConfig
from ragcache_core.documents import Document, DocumentTemplate
from ragcache_core.models import chat_fixtures
from ragcache_core.runtime.prompt import PromptBuilder
from ragcache_integrations.langchain.prompts import app_prompt as lc_app_prompt
from ragcache_integrations.langchain.prompts import shown_documents
from ragcache_integrations.llama_index.adapters import node_to_document
from ragcache_integrations.llama_index.prompt import app_prompt as li_app_prompt

# The create_retrieval_chain docstring prompt ("Context: {context}": the space seam) and the
# classic stuff-documents CHAT_PROMPT, as LangChain writes them.
LC_RETRIEVAL = ChatPromptTemplate.from_messages(
    [
        (
            "system",
            "Use the given context to answer the question. If you don't know the answer, say "
            "you don't know. Use three sentence maximum and keep the answer concise. "
            "Context: {context}",
        ),
        ("human", "{input}"),
    ]
)
LC_STUFF = ChatPromptTemplate.from_messages(
    [
        (
            "system",
            "Use the following pieces of context to answer the user's question.\nIf you don't "
            "know the answer, just say that you don't know, don't try to make up an answer."
            "\n----------------\n{context}",
        ),
        ("human", "{question}"),
    ]
)
ROLES = {"system": "system", "human": "user", "ai": "assistant"}


def _corpus(n: int) -> list[dict[str, str]]:
    text = (resources.files("ragcache_core") / "data" / "demo_corpus.jsonl").read_text("utf-8")
    return [json.loads(line) for line in text.splitlines()[:n]]


CORPUS = _corpus(12)
QUESTIONS = ["Who wrote it?", "When did it happen?", "Where is it?", "What is it called?"]


@pytest.fixture(scope="module", params=chat_fixtures.NAMES)
def model(request: pytest.FixtureRequest) -> tuple[str, Any, PromptBuilder]:
    tokenizer = chat_fixtures.tokenizer(request.param)
    return request.param, tokenizer, PromptBuilder(tokenizer, PromptConfig(), "m", "float32")


def _whole(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """What `vllm serve` makes of these messages: the chat template, tokenized whole."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _groups() -> list[tuple[str, list[dict[str, str]]]]:
    return [(QUESTIONS[i], CORPUS[3 * i : 3 * i + 3]) for i in range(4)]


def _check_cuts(builder: PromptBuilder, build: Any, docs: list[Any]) -> None:
    """Every node is reused when the prompt loses its last document: a node's ids never
    depend on what follows it; and the nodes cover the documents in order."""
    full = build(docs)
    shorter = build(docs[:-1])
    assert full.unplaced_docs == 0 and full.moved_cuts == 0
    assert len(full.doc_specs) == len(docs)
    assert shorter.root_key == full.root_key
    assert shorter.doc_specs == full.doc_specs[: len(docs) - 1]


def test_langchain_chat_prompts_send_the_plain_chains_ids(model: Any) -> None:
    name, tokenizer, builder = model
    for template, key in ((LC_RETRIEVAL, "input"), (LC_STUFF, "question")):
        roots = set()
        for question, rows in _groups():
            lc_docs = [
                LCDocument(page_content=r["text"], metadata={"title": r["title"]}) for r in rows
            ]
            context = "\n\n".join(d.page_content for d in lc_docs)  # create_stuff_documents_chain
            plain = [
                {"role": ROLES[m.type], "content": str(m.content)}
                for m in template.format_messages(**{key: question, "context": context})
            ]
            prompt = lc_app_prompt(template, {key: question})
            docs = shown_documents(lc_docs)
            built = builder.build(question, docs, prompt)
            assert built.token_ids == _whole(tokenizer, plain), (name, key)
            _check_cuts(builder, lambda d, p=prompt, q=question: builder.build(q, d, p), list(docs))
            roots.add(built.root_key)
        assert len(roots) == 1, "one root for one template and system prompt"


def test_langchain_document_prompt_and_string_template(model: Any) -> None:
    name, tokenizer, builder = model
    template = PromptTemplate.from_template("Context:\n{context}\n\nQuestion: {question}\nAnswer:")
    doc_prompt = PromptTemplate.from_template("[{title}] {page_content}")
    question, rows = _groups()[0]
    lc_docs = [LCDocument(page_content=r["text"], metadata={"title": r["title"]}) for r in rows]
    context = "\n\n".join(f"[{d.metadata['title']}] {d.page_content}" for d in lc_docs)
    text = template.format(context=context, question=question)
    built = builder.build(
        question,
        shown_documents(lc_docs, doc_prompt),
        lc_app_prompt(template, {"question": question}),
    )
    # A string prompt reaches a chat model as one user message.
    assert built.token_ids == _whole(tokenizer, [{"role": "user", "content": text}]), name


def test_llama_index_templates_send_the_plain_engines_ids(model: Any) -> None:
    name, tokenizer, builder = model
    for template in (CHAT_TEXT_QA_PROMPT, DEFAULT_TEXT_QA_PROMPT):
        prompt = li_app_prompt(template, chat=True)
        for question, rows in _groups():
            nodes = [
                TextNode(
                    text=r["text"], metadata={"title": r["title"], "file_name": f"{r['title']}.txt"}
                )
                for r in rows
            ]
            # LlamaIndex's compact mode: each node with its metadata, stripped, blank-line joined.
            context = "\n\n".join(n.get_content(MetadataMode.LLM).strip() for n in nodes)
            plain = [
                {"role": m.role.value, "content": m.content or ""}
                for m in template.format_messages(context_str=context, query_str=question)
            ]
            docs = [node_to_document(n) for n in nodes]
            assert "file_name: " in (docs[0].prompt_text or "")
            built = builder.build(question, docs, prompt)
            assert built.token_ids == _whole(tokenizer, plain), name
            _check_cuts(builder, lambda d, q=question, p=prompt: builder.build(q, d, p), docs)


def test_default_layout_is_one_root_and_matches_the_whole_text(model: Any) -> None:
    """The old one-root configuration: `PromptConfig.system_prompt` is the default root; every
    request shares it, and its ids are the whole rendered text's."""
    name, tokenizer, builder = model
    roots = set()
    for question, rows in _groups():
        docs = [Document(str(i), r["text"], {"title": r["title"]}) for i, r in enumerate(rows)]
        built = builder.build(question, docs)
        text = builder.render(question, docs)
        assert built.token_ids == list(tokenizer.encode(text, add_special_tokens=False)), name
        _check_cuts(builder, lambda d, q=question: builder.build(q, d), docs)
        roots.add(built.root_key)
    assert len(roots) == 1
    other = PromptBuilder(tokenizer, PromptConfig(system_prompt="Another."), "m", "float32")
    assert other.build("q?", docs).root_key not in roots


def test_glued_documents_and_trailing_spaces_still_cut_cleanly(model: Any) -> None:
    """Layouts that defeat piecewise tokenization (documents glued with no separator; a
    context after "Context: "; documents ending in a space) keep the whole text's ids and
    nodes that do not depend on what follows."""
    _, tokenizer, builder = model
    layouts = [
        AppPrompt(
            messages=(
                {"role": "user", "content": "Context:\n" + CONTEXT + "\n\nQuestion: " + QUESTION},
            ),
            document=DocumentTemplate("Title: {title}\n{text}", "{text}"),
        ),
        AppPrompt(
            messages=(
                {"role": "user", "content": "Context: " + CONTEXT + "\nQuestion: " + QUESTION},
            ),
            document=DocumentTemplate("{title}: {text} ", "{text} "),
        ),
    ]
    for prompt in layouts:
        for question, rows in _groups():
            docs = [Document(str(i), r["text"], {"title": r["title"]}) for i, r in enumerate(rows)]
            built = builder.build(question, docs, prompt)
            text = builder.render(question, docs, prompt)
            assert built.token_ids == list(tokenizer.encode(text, add_special_tokens=False))
            _check_cuts(builder, lambda d, q=question, p=prompt: builder.build(q, d, p), docs)
