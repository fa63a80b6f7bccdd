"""Prompt assembly at token level with the offline tokenizer (no engine)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ragcache_core.config import PromptConfig
from ragcache_core.documents import Document
from ragcache_core.errors import InputError
from ragcache_core.runtime.prompt import PromptBuilder


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def _docs() -> list[Document]:
    return [
        Document("a", "Paris is the capital of France.", {"title": "Paris"}),
        Document("b", "The Seine flows through Paris."),
    ]


def test_the_prompt_is_the_rendered_text_piece_by_piece(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The ids are, in order: BOS, the head with the system prompt, each document rendered
    and tokenized on its own, the question in its template; each document's span sits at
    the offset its spec implies. Expectations are written from the config, not the builder."""
    config = PromptConfig(chat_template=False)
    builder = PromptBuilder(tokenizer, config, "m", "float32")
    question = "What is the capital of France?"
    built = builder.build(question, _docs())
    rendered = [
        "Title: Paris\nParis is the capital of France.\n\n",
        "The Seine flows through Paris.\n\n",
    ]
    head = f"{config.system_prompt}\n\n"
    tail = f"Question: {question}\nAnswer:"
    ids = built.token_ids
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.decode(ids[1:]) == head + "".join(rendered) + tail
    offset = len(built.root_ids)
    assert tokenizer.decode(built.root_ids[1:]) == head
    for spec, text in zip(built.doc_specs, rendered, strict=True):
        alone = tokenizer.encode(text, add_special_tokens=False)
        assert ids[offset : offset + spec.num_tokens] == alone
        offset += spec.num_tokens
    assert tokenizer.decode(ids[offset:]) == tail
    # A document's tokens do not depend on its position, its neighbours or the question.
    swapped = builder.build("Another question?", list(reversed(_docs())))
    assert swapped.doc_ids == tuple(reversed(built.doc_ids))
    assert [s.key for s in swapped.doc_specs] == [s.key for s in reversed(built.doc_specs)]


def test_content_hash_changes_with_text(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Same document id, new text: a new key and the new text's tokens (never the
    memoized tokens of the old text)."""
    builder = PromptBuilder(tokenizer, PromptConfig(chat_template=False), "m", "float32")
    old = builder.build("q?", [Document("a", "old text")])
    new = builder.build("q?", [Document("a", "new text")])
    a, b = old.doc_specs[0].key, new.doc_specs[0].key
    assert a.doc_id == b.doc_id and a.content_hash != b.content_hash
    assert tokenizer.decode(old.doc_ids[0]) == "old text\n\n"
    assert tokenizer.decode(new.doc_ids[0]) == "new text\n\n"


def test_root_key_depends_on_system_prompt(tokenizer) -> None:  # type: ignore[no-untyped-def]
    one = PromptBuilder(tokenizer, PromptConfig(system_prompt="A"), "m", "float32")
    two = PromptBuilder(tokenizer, PromptConfig(system_prompt="B"), "m", "float32")
    assert one.root_key != two.root_key


def test_chat_template_wraps_documents_in_the_user_turn(tokenizer) -> None:  # type: ignore[no-untyped-def]
    builder = PromptBuilder(tokenizer, PromptConfig(chat_template=True), "m", "float32")
    built = builder.build("Where?", _docs())
    text = tokenizer.decode(built.token_ids)
    assert text.index("system:") < text.index("Title: Paris") < text.index("Where?")
    assert text.rstrip().endswith("assistant:")


def test_bad_questions_are_refused(tokenizer) -> None:  # type: ignore[no-untyped-def]
    builder = PromptBuilder(tokenizer, PromptConfig(), "m", "float32")
    with pytest.raises(InputError, match="empty"):
        builder.build("   ", _docs())
    with pytest.raises(InputError, match="must be a string"):
        builder.build(42, _docs())  # type: ignore[arg-type]


# ---------------------------------------------------------------------- what bad input costs


class _CountingTokenizer:
    """The real tokenizer, counting the characters it was asked to encode (a spy: what is
    under test is whether the builder tokenizes, not the tokenizer)."""

    def __init__(self, tokenizer) -> None:  # type: ignore[no-untyped-def]
        self._tokenizer = tokenizer
        self.encoded_chars = 0

    def encode(self, text: str, **kwargs):  # type: ignore[no-untyped-def]
        self.encoded_chars += len(text)
        return self._tokenizer.encode(text, **kwargs)

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._tokenizer, name)

    def __len__(self) -> int:
        return len(self._tokenizer)


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_memoized(tokenizer) -> None:  # type: ignore[no-untyped-def]
    from ragcache_core.errors import PromptTooLong

    spy = _CountingTokenizer(tokenizer)
    builder = PromptBuilder(spy, PromptConfig(chat_template=False), "m", "float32")
    fits = builder.build("q?", _docs(), max_tokens=4095)
    assert len(builder.memo) == 2 and fits.num_tokens < 100
    long_doc = Document("long", "word " * 2000)  # ~2,000 tokens: tokenized, then refused
    with pytest.raises(PromptTooLong, match="at most 1000 fit") as refused:
        builder.build("q?", [*_docs(), long_doc], max_tokens=1000)
    assert refused.value.tokens > 1000 and len(builder.memo) == 2  # nothing memoized
    spy.encoded_chars = 0
    huge = Document("huge", "x" * 5_000_000)  # cannot fit at any tokenization
    with pytest.raises(PromptTooLong, match="characters of text"):
        builder.build("q?", [huge], max_tokens=4095)
    assert spy.encoded_chars == 0 and len(builder.memo) == 2  # not even tokenized
    assert builder.build("q?", [long_doc], max_tokens=4095).num_tokens > 1000  # fits now


def test_the_token_memo_is_bounded_in_bytes(tokenizer) -> None:  # type: ignore[no-untyped-def]
    from ragcache_core.runtime.prompt import TokenMemo, memo_entry_bytes

    memo = TokenMemo(max_bytes=50_000)
    builder = PromptBuilder(tokenizer, PromptConfig(chat_template=False), "m", "f", memo=memo)
    docs = [Document(f"d{i}", f"document number {i} " * 40) for i in range(100)]
    for doc in docs:
        builder.build("q?", [doc])
        assert memo.nbytes <= memo.max_bytes
    kept = len(memo)
    assert 0 < kept < len(docs)  # the oldest were dropped
    from ragcache_core.documents import render_document
    from ragcache_core.runtime.prompt import content_hash

    hashes = [content_hash(render_document(d, builder.config.document)) for d in docs]
    assert memo.get(hashes[0]) is None and memo.get(hashes[-1]) is not None  # LRU
    kept_ids = [memo.get(h) for h in hashes[-kept:]]
    assert memo.nbytes == sum(memo_entry_bytes(ids) for ids in kept_ids if ids is not None)
    other = PromptBuilder(tokenizer, PromptConfig(system_prompt="B"), "m", "f", memo=memo)
    assert other.document_ids(docs[-1])[1] == memo.get(hashes[-1])  # one memo, shared
    small = TokenMemo(max_bytes=10)
    small.put("big", tuple(range(100)))  # larger than the whole bound: not kept
    assert len(small) == 0 and small.nbytes == 0
